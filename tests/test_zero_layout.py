"""DeepSpeed's ZeRO-1/2 gradient layout (dpkit.engines.deepspeed.layout), on layouts worked by hand.

The real-run check (plan against measurement, every category) is in
tests/test_memory_multiprocess.py; these pin the arithmetic it rests on.
"""

from __future__ import annotations

import pytest

from dpkit.engines.deepspeed.layout import (
    gradient_high_water,
    partition_group,
    stage1_contiguous_reduction,
)

MIB = 2**20


def test_partitions_are_equal_cuts_of_the_padded_group():
    # 20 elements, N=2: alignment 4, partitions [0, 10) and [10, 20).
    first, second = (partition_group([10, 6, 4], 2, r) for r in (0, 1))
    assert (first.partition_numel, first.whole_numel, first.tensors_in_partition) == (10, 10, 1)
    assert (second.partition_numel, second.whole_numel, second.tensors_in_partition) == (10, 10, 2)
    # 21 elements pad to 24 (a multiple of 2N = 4): partitions of 12.
    assert partition_group([21], 2, 0).partition_numel == 12


def test_a_parameter_straddling_a_boundary_is_held_whole_by_both_ranks():
    # [12, 8], N=2: the first parameter covers [0, 12) and crosses the cut at 10.
    first, second = (partition_group([12, 8], 2, r) for r in (0, 1))
    assert first.whole_numel == 12
    assert second.whole_numel == 12 + 8  # its 2 elements past the cut bring all 12


def test_zero2_high_water_is_the_step_flat_copy_beside_the_whole_gradients():
    # fp32, N=2, one group [12, 8]; the bucket (100) is larger than any parameter.
    ranks = gradient_high_water(
        [[12, 8]],
        stage=2,
        world_size=2,
        module_bytes=4,
        reduce_bucket_size=100,
        contiguous_gradients=True,
    )
    # Rank 0: whole 12, partition inside one parameter: the flat copy is a view.
    assert (ranks[0].backward, ranks[0].step) == (4 * 12, 4 * 12)
    # Rank 1 (last, padded flatten: always a copy): whole 20 + a flat copy of 10.
    assert (ranks[1].backward, ranks[1].step) == (4 * 20, 4 * (20 + 10))
    assert ranks[1].bytes == 4 * 30 and ranks[1].moment.startswith("step, group 0")
    assert [r.partition_bytes for r in ranks] == [40, 40]


def test_a_parameter_larger_than_the_bucket_adds_its_full_gradient_in_backward():
    common = dict(stage=2, world_size=2, module_bytes=4, reduce_bucket_size=13)
    # [12, 4, 16], partitions of 16: the 16-element parameter is rank 1's alone.
    off = gradient_high_water([[12, 4, 16]], contiguous_gradients=False, **common)
    on = gradient_high_water([[12, 4, 16]], contiguous_gradients=True, **common)
    # Rank 0 does not own it but holds its unreduced gradient while it is reduced.
    assert off[0].backward == 4 * (16 + 16)
    # Rank 1 owns it: without contiguous buffers it is not held twice...
    assert off[1].backward == 4 * 16
    # ...with them, its pre-sized slot and its own gradient coexist, and the gradient
    # whose arrival triggers that reduction (4) is alive too.
    assert on[1].backward == 4 * (16 + 16 + 4)
    # Rank 0's buffer (16) is allocated when the 12 arrives and reduces the bucket [4].
    assert on[0].backward == 4 * (16 + 12)


def test_zero2_accumulation_keeps_the_whole_gradients_beside_the_next_backward():
    """Between micro-batches ZeRO-2 keeps every whole gradient touching the partition
    (``all_grad_tensors``); a later micro-batch's backward holds its own beside them.
    Measured on MiniLM, 2 ranks, fp32, micro-batch 4 x 2: 173.2 MiB on the worst rank,
    the figure this gives (129.9 MiB at 8 x 1)."""
    common = dict(stage=2, world_size=2, module_bytes=4, reduce_bucket_size=13)
    one = gradient_high_water([[12, 4, 16]], contiguous_gradients=False, **common)
    two = gradient_high_water(
        [[12, 4, 16]], contiguous_gradients=False, accumulation_steps=2, **common
    )
    # Rank 0: whole 12 + 4 = 16, plus the 16-element parameter larger than the bucket.
    assert one[0].backward == 4 * (16 + 16)
    assert two[0].backward == 4 * (16 + 16 + 16)
    assert two[0].moment.startswith("backward of a later micro-batch")
    # Rank 1 owns the large parameter: whole 16, held once in a backward.
    assert (one[1].backward, two[1].backward) == (4 * 16, 4 * (16 + 16))
    assert [r.step for r in two] == [r.step for r in one]  # the step is unchanged
    # ZeRO-1 reduces once, at the step's last micro-batch: nothing is added.
    zero1 = dict(common, stage=1)
    assert gradient_high_water(
        [[12, 4, 16]], contiguous_gradients=False, accumulation_steps=2, **zero1
    ) == gradient_high_water([[12, 4, 16]], contiguous_gradients=False, **zero1)


def test_mixed_precision_adds_the_fp32_cast_of_the_flat_copy():
    ranks = gradient_high_water(
        [[12, 8]],
        stage=2,
        world_size=2,
        module_bytes=2,
        reduce_bucket_size=100,
        contiguous_gradients=True,
    )
    # Rank 1: 16-bit whole gradients (20) + 16-bit flat copy (10) + its fp32 cast (10).
    assert ranks[1].step == 2 * 20 + 2 * 10 + 4 * 10


def test_zero1_holds_every_full_gradient_until_backward_ends():
    ranks = gradient_high_water(
        [[12, 8], [2]],
        stage=1,
        world_size=2,
        module_bytes=4,
        reduce_bucket_size=100,
        contiguous_gradients=False,
    )
    assert all(r.backward == 4 * 22 for r in ranks)
    # After the reduction each rank keeps only what touches its partitions. Group 1
    # pads [2] to 4: rank 0 owns the parameter, rank 1 only padding.
    # Rank 0 at group 0's step: 12 (its partition is inside it: a view) + group 1's 2.
    assert ranks[0].step == 4 * (12 + 2)
    # Rank 1: whole 20 of group 0 and the flat copy of its 10.
    assert ranks[1].step == 4 * (20 + 10)


def test_zero1_contiguous_allocates_its_partition_buffer_beside_what_is_not_bucketed():
    # Four 4-element parameters, N=2 (partitions of 8), bucket 4. After backward ZeRO-1
    # moves the gradients into its bucket in order, freeing each one's own storage.
    ranks = gradient_high_water(
        [[4, 4, 4, 4]],
        stage=1,
        world_size=2,
        module_bytes=1,
        reduce_bucket_size=4,
        contiguous_gradients=True,
    )
    # Rank 0: the first bucket [p0] is its own, reduced when p1 arrives: the buffer (8)
    # beside the 12 elements not bucketed yet.
    assert ranks[0].backward == 8 + 12
    # Rank 1: its first bucket [p2] is reduced when p3 arrives: 8 + 4, under the 16
    # every rank holds when backward ends.
    assert ranks[1].backward == 16
    assert stage1_contiguous_reduction([[4, 4, 4, 4]], 2, 1, 4) == 8 + 4


def test_zero2_contiguous_holds_the_gradient_whose_arrival_reduces_a_bucket():
    # [8, 2, 2], N=2: partitions of 6; the 8 straddles the cut. Backward produces the
    # gradients in reverse (2, 2, 8); bucket 4, so the 8 is reduced alone.
    common = dict(stage=2, world_size=2, module_bytes=1, reduce_bucket_size=4)
    ranks = gradient_high_water([[8, 2, 2]], contiguous_gradients=True, **common)
    # Rank 1 (whole 8 + 2 + 2): the 8 arrives and reduces [2, 2], its own: buffer 12 + 8.
    assert ranks[1].backward == 12 + 8
    # Rank 0 (whole 8): its buffer comes with the last reduction, of the 8 itself.
    assert ranks[0].backward == 8 + 8
    # A gradient arriving last in another order (a tied embedding) is held the same way.
    late = gradient_high_water(
        [[2, 8, 2]], contiguous_gradients=True, arrival=[(0, 2), (0, 0), (0, 1)], **common
    )
    # [2, 8, 2]: each rank's whole is 10; the 8, last, reduces [2, 2] while alive.
    assert [r.backward for r in late] == [10 + 8, 10 + 8]


@pytest.mark.parametrize("stage", [3, 0])
def test_only_stages_1_and_2_are_laid_out(stage):
    with pytest.raises(ValueError, match="stage must be 1 or 2"):
        gradient_high_water(
            [[4]],
            stage=stage,
            world_size=2,
            module_bytes=4,
            reduce_bucket_size=8,
            contiguous_gradients=True,
        )


def test_gpt2_on_8_gpus_holds_several_times_the_papers_gradient_share():
    """GPT-2's tied word embedding is 31% of the model: 2.5 partitions at N=8."""
    from dpkit.plan.inputs import load_model

    spec = load_model("gpt2")
    ranks = gradient_high_water(
        spec.param_groups,
        stage=2,
        world_size=8,
        module_bytes=2,
        reduce_bucket_size=768 * 768,
        contiguous_gradients=False,
    )
    paper = 2 * spec.num_params / 8
    worst = max(r.bytes for r in ranks)
    assert worst > 5 * paper
    # Ranks 0 and 1 lie inside the embedding: each holds it whole.
    wte = 50257 * 768
    assert all(2 * wte <= r.backward for r in ranks[:2])
