"""DeepSpeed's ZeRO-1/2 gradient layout (dpkit.engines.deepspeed.layout), on layouts worked by hand.

The real-run check (plan against measurement, every category) is in
tests/test_memory_multiprocess.py; these pin the arithmetic it rests on.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpkit.engines.deepspeed.layout import (
    gradient_high_water,
    partition_group,
    reduces_on_arrival,
    stage1_contiguous_reduction,
    stage2_contiguous_backward,
    stage2_held_before,
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


def test_zero2_before_a_late_embedding_holds_the_partitions_reduced_already():
    # A tied embedding first in the model: [8, 2, 2, 2, 2], N=2, one group of 16:
    # partitions [0, 8) (the embedding alone) and [8, 16). Backward stores the four 2s
    # (arrival: 4, 3, 2, 1), then the embedding (0) last. Bucket 4: the 2s fill it twice.
    groups = [[8, 2, 2, 2, 2]]
    arrival = [(0, 4), (0, 3), (0, 2), (0, 1), (0, 0)]
    common = dict(world_size=2, reduce_bucket_size=4, arrival=arrival, arrived=4)
    # Contiguous. Rank 1 (whole 2+2+2+2 = 8): the third 2 reduced [2, 2] (its own), and the
    # embedding's arrival reduces the last [2, 2]: the buffer of 8 exists.
    assert stage2_held_before(groups, rank=1, contiguous_gradients=True, **common) == 8
    # Rank 0 (whole 8, the embedding): no reduction before the embedding's reached it.
    assert stage2_held_before(groups, rank=0, contiguous_gradients=True, **common) == 0
    # Not contiguous: rank 1 keeps the four reduced 2s it touches; rank 0 none.
    assert stage2_held_before(groups, rank=1, contiguous_gradients=False, **common) == 8
    assert stage2_held_before(groups, rank=0, contiguous_gradients=False, **common) == 0
    # Bucket 5: the embedding's arrival (8 > 5, over the bucket) still reduces the open
    # [2, 2] first; a 3rd and 4th arrival of 2 and 2 went in at 4 + 2 > 5: [2,2] then [2,2].
    five = dict(common, reduce_bucket_size=5)
    assert stage2_held_before(groups, rank=1, contiguous_gradients=True, **five) == 8
    # Earlier: after two 2s only, nothing was reduced, and the third 2 (arriving, left
    # out) reduces the first two on rank 1; uncontiguous, they are kept (2 + 2).
    early = dict(common, arrived=2)
    assert stage2_held_before(groups, rank=1, contiguous_gradients=True, **early) == 8
    assert stage2_held_before(groups, rank=1, contiguous_gradients=False, **early) == 2 + 2
    # A parameter over the bucket is reduced by the next arrival, whatever its size:
    # [2, 6, 2], N=2 (12 padded: partitions [0, 6), [6, 12)), bucket 4, arrival 2, 1 (the
    # 6), 0. The 6's arrival reduced [2] (rank 1's: its buffer, 6 + 2, exists); the 0's
    # reduces the 6. Uncontiguous, rank 1 keeps both (it touches the 6 from 6 to 8).
    layout = ([[2, 6, 2]], 2, 1, 4, [(0, 2), (0, 1), (0, 0)], 2)
    assert stage2_held_before(*layout, contiguous_gradients=True) == 6 + 2
    assert stage2_held_before(*layout, contiguous_gradients=False) == 2 + 6
    # Rank 0 touches the 6 (from 2 to 6) and the first 2: reduced with the 6, its buffer
    # exists (2 + 6); uncontiguous it keeps the 6 only (the first 2 has not arrived).
    rank0 = ([[2, 6, 2]], 2, 0, 4, [(0, 2), (0, 1), (0, 0)], 2)
    assert stage2_held_before(*rank0, contiguous_gradients=True) == 2 + 6
    assert stage2_held_before(*rank0, contiguous_gradients=False) == 6
    # Which arrival reduces a bucket (every rank alike): the 2s at bucket 4 fill it at the
    # second and the fourth, so the third and the embedding's arrival reduce; at 5 too.
    for bucket in (4, 5):
        assert [reduces_on_arrival(groups, bucket, arrival, i) for i in range(5)] == [
            False, False, True, False, True,
        ]  # fmt: skip
    # At bucket 8 the four 2s share one bucket: only the embedding's arrival reduces it.
    assert [reduces_on_arrival(groups, 8, arrival, i) for i in range(5)] == [False] * 4 + [True]
    with pytest.raises(ValueError, match="the next one must exist"):
        stage2_held_before([[2, 6, 2]], 2, 0, 4, [(0, 2), (0, 1), (0, 0)], 3, True)


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


# --- DeepSpeed's reduction walked tensor by tensor, against the layout model ---------------------
#
# A second statement of what stage_1_and_2.py does with contiguous_gradients, written as a
# walk over live tensors (each gradient alive or freed, the partition buffer allocated or
# not) rather than as running counters: the layout model must give the same high-water on
# any layout. The walks follow DeepSpeed's order: a gradient is copied into the
# pre-allocated bucket and its own storage freed, unless it is larger than the bucket
# (reduced alone, kept); a full bucket is reduced before the next gradient goes in; the
# first reduction holding a gradient of this rank's partition allocates the buffer of its
# whole touching parameters.


def _touching(groups, n, rank):
    """Per group, per parameter: does its interval meet ``rank``'s partition? (Partitions
    of the group padded to a multiple of 2N.)"""
    flags = []
    for numels in groups:
        size = -(-sum(numels) // (2 * n)) * 2
        first, last = rank * size, (rank + 1) * size
        offsets = [sum(numels[:i]) for i in range(len(numels))]
        flags.append([o < last and o + k > first for o, k in zip(offsets, numels, strict=True)])
    return flags


def _walk_zero1(groups, n, rank, bucket_size):
    """ZeRO-1 after backward: every full gradient alive, moved into the bucket in group order."""
    flags = _touching(groups, n, rank)
    params = [(g, i) for g, numels in enumerate(groups) for i in range(len(numels))]
    alive = {p: groups[p[0]][p[1]] for p in params}
    buffer = sum(groups[g][i] for g, i in params if flags[g][i])
    in_bucket: list = []
    for g, i in params:
        numel = groups[g][i]
        if sum(groups[h][j] for h, j in in_bucket) + numel > bucket_size:
            if any(flags[h][j] for h, j in in_bucket):
                return sum(alive.values()) + buffer  # the buffer is allocated now
            in_bucket = []
        if numel <= bucket_size:
            del alive[(g, i)]  # copied into the bucket
        in_bucket.append((g, i))
    touched = any(flags[h][j] for h, j in in_bucket)
    return sum(alive.values()) + buffer if touched else 0


def _walk_zero2(groups, n, rank, bucket_size, arrival):
    """ZeRO-2 in backward: gradients arrive one by one; the largest holding is at a bucket's
    reduction (with the arriving gradient alive) or at the epilogue's."""
    flags = _touching(groups, n, rank)
    buffer = sum(k for numels, f in zip(groups, flags, strict=True)
                 for k, t in zip(numels, f, strict=True) if t)  # fmt: skip
    allocated, peak = False, 0
    in_bucket: list = []
    kept: list = []  # larger than the bucket: alive until the next reduction
    for g, i in arrival:
        numel = groups[g][i]
        if sum(groups[h][j] for h, j in in_bucket) + numel > bucket_size:
            allocated = allocated or any(flags[h][j] for h, j in in_bucket)
            held = (buffer if allocated else 0) + sum(groups[h][j] for h, j in kept) + numel
            peak = max(peak, held)
            in_bucket, kept = [], []
        if numel > bucket_size:
            kept = [(g, i)]
        in_bucket.append((g, i))
    allocated = allocated or any(flags[h][j] for h, j in in_bucket)
    return max(peak, (buffer if allocated else 0) + sum(groups[h][j] for h, j in kept))


_layouts = st.lists(
    st.lists(st.integers(min_value=1, max_value=12), min_size=1, max_size=6),
    min_size=1,
    max_size=3,
)


@settings(derandomize=True, database=None, deadline=None, max_examples=150)
@given(groups=_layouts, n=st.integers(1, 4), bucket=st.integers(1, 16), data=st.data())
def test_contiguous_reduction_matches_a_walk_over_live_tensors(groups, n, bucket, data):
    params = [(g, i) for g, numels in enumerate(groups) for i in range(len(numels))]
    arrival = data.draw(st.permutations(params))
    for rank in range(n):
        assert stage1_contiguous_reduction(groups, n, rank, bucket) == _walk_zero1(
            groups, n, rank, bucket
        )
        assert stage2_contiguous_backward(groups, n, rank, bucket, arrival) == _walk_zero2(
            groups, n, rank, bucket, arrival
        )


def _step_by_hand(groups, n, rank, module_bytes):
    """The step, group by group: the whole gradients of this group and the later ones, the
    flat copy of the rank's partition (a view when one parameter holds it, but never on the
    last rank), and its fp32 cast in mixed precision."""
    flags = _touching(groups, n, rank)
    whole = [
        sum(k for k, t in zip(g, f, strict=True) if t) for g, f in zip(groups, flags, strict=True)
    ]
    worst = 0
    for index, numels in enumerate(groups):
        size = -(-sum(numels) // (2 * n)) * 2
        copy = rank == n - 1 or sum(flags[index]) > 1
        held = module_bytes * (sum(whole[index:]) + size * copy)
        worst = max(worst, held + (4 * size if module_bytes == 2 else 0))
    return worst


@settings(derandomize=True, database=None, deadline=None, max_examples=100)
@given(
    groups=_layouts,
    n=st.integers(1, 4),
    bucket=st.integers(1, 16),
    module_bytes=st.sampled_from([2, 4]),
    contiguous=st.booleans(),
    stage=st.sampled_from([1, 2]),
)
def test_high_water_per_rank_against_the_walks(groups, n, bucket, module_bytes, contiguous, stage):
    """Per rank: the step as worked by :func:`_step_by_hand`; in backward ZeRO-1 holds every
    gradient (and, contiguous, the walk's reduction), ZeRO-2 contiguous the walk's; the
    high-water is the larger, its moment named, and the paper's share is the partitions."""
    arrival = [(g, i) for g, numels in enumerate(groups) for i in range(len(numels))][::-1]
    rows = gradient_high_water(
        groups, stage=stage, world_size=n, module_bytes=module_bytes,
        reduce_bucket_size=bucket, contiguous_gradients=contiguous,
    )  # fmt: skip
    total = sum(map(sum, groups))
    for rank, row in enumerate(rows):
        assert row.rank == rank
        assert row.step == _step_by_hand(groups, n, rank, module_bytes)
        if stage == 1:
            reduction = _walk_zero1(groups, n, rank, bucket) if contiguous else 0
            assert row.backward == module_bytes * max(total, reduction)
        elif contiguous:
            assert row.backward == module_bytes * _walk_zero2(groups, n, rank, bucket, arrival)
        assert row.bytes == max(row.backward, row.step)
        assert row.moment.startswith("step" if row.step > row.backward else "")
        sizes = [-(-sum(numels) // (2 * n)) * 2 for numels in groups]
        assert row.partition_bytes == module_bytes * sum(sizes)


def test_a_rank_outside_the_world_is_refused():
    for world_size, rank in ((0, 0), (2, 2), (2, -1)):
        with pytest.raises(ValueError) as err:
            partition_group([4], world_size, rank)
        assert str(err.value) == f"rank {rank} of world size {world_size}"
    assert isinstance(partition_group([5], 2, 1).partition_numel, int)  # 5 pads to 8: 4


def test_each_moment_is_named_where_it_happens():
    """fp32, N=2, a 4-element bucket. [4, 4, 4, 4] (partitions of 8) under ZeRO-1: rank 0's
    first reduction holds its buffer (8) beside the 12 elements not bucketed yet, more than
    the 16 of the end of backward or its step (8 whole + 8 flat); rank 1's largest is every
    gradient at the end of backward (16, its step as much, named second). [24], [3] under
    ZeRO-2 with a 10-element bucket (tests/test_plan_check.py's Linear): the weight arrives
    after the bias and reduces it, beside the buffer of 27: 51 elements, over the step's 39."""
    common = dict(world_size=2, module_bytes=4, reduce_bucket_size=4, contiguous_gradients=True)
    zero1 = gradient_high_water([[4, 4, 4, 4]], stage=1, **common)
    assert (zero1[0].backward, zero1[0].step) == (4 * 20, 4 * 16)
    assert zero1[0].moment == "reduction (partition buffer + gradients not reduced yet)"
    assert (zero1[1].backward, zero1[1].step) == (4 * 16, 4 * 16)
    assert zero1[1].moment == "end of backward (every full gradient)"
    zero2 = gradient_high_water(
        [[24], [3]], stage=2, world_size=2, module_bytes=4, reduce_bucket_size=10,
        contiguous_gradients=True, arrival=[(1, 0), (0, 0)],
    )  # fmt: skip
    assert (zero2[0].backward, zero2[0].step) == (4 * 51, 4 * 27)
    assert zero2[0].moment == "backward (partition buffer + gradients being reduced)"


def test_a_parameter_exactly_the_bucket_is_not_reduced_alone():
    """ZeRO-2 without contiguous buffers, N=2, [6, 2, 8] (partitions of 8): rank 0 touches
    6 and 2. The 8 is as large as an 8-element bucket, not larger: it is bucketed like the
    others and rank 0 does not hold it; with a 7-element bucket it is held unreduced."""
    common = dict(stage=2, world_size=2, module_bytes=1, contiguous_gradients=False)
    assert gradient_high_water([[6, 2, 8]], reduce_bucket_size=8, **common)[0].backward == 8
    assert gradient_high_water([[6, 2, 8]], reduce_bucket_size=7, **common)[0].backward == 16


def test_an_empty_group_holds_nothing():
    rows = gradient_high_water(
        [[]], stage=2, world_size=2, module_bytes=4, reduce_bucket_size=0,
        contiguous_gradients=False,
    )  # fmt: skip
    assert [(r.backward, r.step, r.partition_bytes) for r in rows] == [(0, 0, 0), (0, 0, 0)]


def test_the_fullest_ordinary_bucket_is_what_deepspeed_flattens_to_reduce():
    """Gradients fill a bucket in the given order, and it is reduced when the next would
    overflow it; one larger than the bucket is reduced alone and is no ordinary bucket's.
    Measured on GPT-2 124M, ZeRO-2, 2 ranks, a 2^21 bucket (docs/levers.md's table): the
    largest flat copy was 1,771,776 elements."""
    from dpkit.engines.deepspeed.layout import largest_bucket_fill

    groups = [[60, 30, 150, 20], [5, 90]]
    in_order = [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]
    # 60 + 30 = 90 | 150 alone (left out) | 20 + 5 = 25 | 90: buckets of 90, 25, 90
    assert largest_bucket_fill(groups, 100, in_order) == 90
    # Backward's order: 90 + 5 = 95 | 20 | 150 | 30 + 60
    assert largest_bucket_fill(groups, 100, in_order[::-1]) == 95
    assert largest_bucket_fill(groups, 1000, in_order) == 355  # everything, one bucket
    assert largest_bucket_fill([[150]], 100, [(0, 0)]) == 0  # nothing ordinary
    # A bucket filled exactly to its size is reduced only when the next overflows it
    # (DeepSpeed's test is `elements + numel > reduce_bucket_size`): 50 + 50 | 10.
    assert largest_bucket_fill([[50, 50, 10]], 100, [(0, 0), (0, 1), (0, 2)]) == 100
    # Two GPT-2 blocks in the model's order (ln_1 w, b; c_attn w, b; attn c_proj w, b;
    # ln_2 w, b; c_fc w, b; mlp c_proj w, b), backward reversing it. The MLP's matrices
    # (768 x 3072 = 2,359,296) overflow 2^21 alone; the fullest bucket is the second
    # block's c_attn weight, its ln_1 weight and bias and the first block's mlp c_proj
    # bias: 768 x 2304 + 3 x 768 = 1,771,776.
    block = [768, 768, 768 * 2304, 2304, 768 * 768, 768, 768, 768, 768 * 3072, 3072,
             3072 * 768, 768]  # fmt: skip
    two_blocks = [block + block]
    arrival = [(0, i) for i in range(2 * len(block))][::-1]
    assert largest_bucket_fill(two_blocks, 2**21, arrival) == 768 * 2304 + 3 * 768 == 1_771_776
