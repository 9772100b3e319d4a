"""The memory arithmetic's edges, in process: refusals, settings, FSDP2's units.

What the ZeRO-paper and DeepSpeed-estimator checks of tests/test_plan.py do not reach:
the one-line refusals (their text is asserted: a user reads it), DeepSpeed's settings
for a model that is not MiniLM (tests/test_memory.py), and FSDP2's per-unit holdings
worked by hand on shapes where each rule gives a different number.
"""

from __future__ import annotations

import pytest

from dpkit.core.units import ModelStateBytes, canonical_precision, dtype_bytes
from dpkit.engines.ddp.settings import ddp_kwargs
from dpkit.engines.deepspeed.settings import (
    bucket_elements,
    fill_zero_settings,
    zero_memory_settings,
)
from dpkit.engines.fsdp2 import layout as fsdp2_layout
from dpkit.memory.analytic import (
    full_replication_bytes,
    model_state_bytes,
    paper_grad_bytes,
    savings_vs_replication,
)

# --- the analytic core's refusals and conversions -------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, "ddp", 2), "num_params must be positive, got 0"),
        ((-4, "ddp", 2), "num_params must be positive, got -4"),
        ((10, "ddp", 0), "world_size must be positive, got 0"),
        ((10, "ddp", 2, "fp8"), "precision must be one of fp32, bf16, fp16, got 'fp8'"),
        ((10, "ddp", 2, "fp32", "lion"),
         "optimizer must be one of adamw, adam, sgd_momentum, sgd, cpu_adam, got 'lion'"),
        ((10, "zero4", 2), "unknown strategy 'zero4'"),
        ((10, "ddp", 2, "fp32", "adamw", None, -1), "frozen_params must be >= 0, got -1"),
    ],
)  # fmt: skip
def test_model_state_bytes_refuses_in_one_line(args, message):
    with pytest.raises(ValueError) as err:
        model_state_bytes(*args)
    assert str(err.value).startswith(message)


def test_frozen_parameters_add_their_weights_only_as_the_engine_holds_them():
    """A frozen (LoRA base) weight is a parameter and nothing else: no gradient, optimizer
    state or master copy. ZeRO-2 in bf16 holds it whole on every rank in the module's
    bf16 (2 B), even a single one; FSDP2 shards it as its own parameters, in fp32 (it casts
    for compute): a (6,) weight over 4 ranks is padded to 8 rows, 2 per rank, 4 B each."""
    plain = model_state_bytes(100, "zero2", 2, "bf16")
    one = model_state_bytes(100, "zero2", 2, "bf16", frozen_params=1)
    assert one == ModelStateBytes(
        params=plain.params + 2, grads=plain.grads, optimizer=plain.optimizer,
        master=plain.master, offloaded_to_cpu=0.0,
    )  # fmt: skip
    shapes = [(100,)]
    sharded = model_state_bytes(100, "fsdp2_full_shard", 4, "bf16", param_shapes=shapes)
    with_frozen = model_state_bytes(
        100, "fsdp2_full_shard", 4, "bf16", param_shapes=shapes, frozen_params=6,
        frozen_param_shapes=[(6,)],
    )  # fmt: skip
    assert with_frozen.params == sharded.params + 2 * 4
    assert (with_frozen.grads, with_frozen.optimizer) == (sharded.grads, sharded.optimizer)


def test_precision_names_and_their_bytes():
    assert [canonical_precision(p) for p in ("no", "fp32", "bf16", "fp16")] == [
        "fp32", "fp32", "bf16", "fp16",
    ]  # fmt: skip
    assert [dtype_bytes(p) for p in ("no", "fp32", "bf16", "fp16")] == [4, 4, 2, 2]
    with pytest.raises(ValueError, match="got 'no_such'"):
        dtype_bytes("no_such")


def test_accelerates_no_is_fp32_and_not_sharded_by_ddp():
    """``no`` (accelerate's name) is fp32: DDP 4 + 4 + 8 bytes per parameter at any N."""
    states = model_state_bytes(1000, "ddp", 8, "no")
    assert states.as_dict() == {
        "params": 4000, "grads": 4000, "optimizer": 8000, "master": 0, "offloaded_to_cpu": 0,
        "total": 16000,
    }  # fmt: skip


def test_model_state_total_leaves_out_what_offload_moved_to_the_host():
    states = ModelStateBytes(params=1, grads=2, optimizer=4, master=8, offloaded_to_cpu=16)
    assert states.total == 15
    assert states.as_dict() == {
        "params": 1, "grads": 2, "optimizer": 4, "master": 8, "offloaded_to_cpu": 16, "total": 15,
    }  # fmt: skip


@pytest.mark.parametrize("optimizer", ["adamw", "cpu_adam", "sgd_momentum"])
def test_offload_moves_the_optimizer_and_master_to_the_host(optimizer):
    """ZeRO-2 offload, bf16, N=4, Psi=8000: the GPU keeps the 16-bit module (2 Psi) and
    its 16-bit gradient partition (2 Psi / 4; the fp32 cast is made on the host); the
    host holds the optimizer's state (8 Psi / 4 for Adam, 4 Psi / 4 for momentum) and the
    fp32 master (4 Psi / 4)."""
    own = {"adamw": 8, "cpu_adam": 8, "sgd_momentum": 4}[optimizer]
    states = model_state_bytes(8000, "zero2_offload", 4, "bf16", optimizer)
    assert states.as_dict() == {
        "params": 16000, "grads": 4000, "optimizer": 0, "master": 0,
        "offloaded_to_cpu": (own + 4) * 2000, "total": 20000,
    }  # fmt: skip


def test_the_papers_gradient_figure_per_engine():
    """Psi = 8000, N = 4: the module's gradients, sharded from stage 2; DDP's are fp32
    (autocast), DeepSpeed's in the module dtype, FSDP2's fp32 and sharded in both modes."""
    figures = {
        (s, p): paper_grad_bytes(8000, s, 4, p)
        for s in ("ddp", "zero1", "zero2", "zero3", "fsdp2_shard_grad_op", "fsdp2_full_shard")
        for p in ("fp32", "bf16")
    }
    assert figures == {
        ("ddp", "fp32"): 32000, ("ddp", "bf16"): 32000,
        ("zero1", "fp32"): 32000, ("zero1", "bf16"): 16000,
        ("zero2", "fp32"): 8000, ("zero2", "bf16"): 4000,
        ("zero3", "fp32"): 8000, ("zero3", "bf16"): 4000,
        ("fsdp2_shard_grad_op", "fp32"): 8000, ("fsdp2_shard_grad_op", "bf16"): 8000,
        ("fsdp2_full_shard", "fp32"): 8000, ("fsdp2_full_shard", "bf16"): 8000,
    }  # fmt: skip


def test_savings_against_full_replication():
    """ZeRO-2, bf16 SGD with momentum, Psi = 1000, N = 4: per rank 2000 (params) +
    max(500, 1500) grads (16-bit partition and its fp32 cast: 6 bytes / 4) + 1000 momentum
    + 1000 master = 5500, against DDP's 4 + 4 + 4 = 12 bytes per parameter (autocast)."""
    full = full_replication_bytes(1000, "bf16", "sgd_momentum")
    assert (full.params, full.grads, full.optimizer, full.master) == (4000, 4000, 4000, 0)
    saved = savings_vs_replication(1000, "zero2", 4, "bf16", "sgd_momentum")
    assert saved == {"saved_bytes": 12000 - 5500, "ratio": 5500 / 12000}
    # The defaults are fp32 AdamW: 16 bytes replicated; ZeRO-1 at N=2 holds 4 + 4 + (8 + 4) / 2.
    assert full_replication_bytes(1000).total == 16000
    assert savings_vs_replication(1000, "zero1", 2) == {"saved_bytes": 2000, "ratio": 14 / 16}
    # 500 frozen parameters (LoRA's base) are held, 4 bytes each, with nothing else.
    frozen = full_replication_bytes(1000, frozen_params=500)
    assert (frozen.params, frozen.grads, frozen.optimizer) == (4 * 1500, 4000, 8000)


def test_zero1_in_mixed_precision_holds_the_larger_of_its_gradients_and_the_step_cast():
    """ZeRO-1 bf16 keeps every 16-bit gradient (2 Psi) until backward ends; its step holds the
    16-bit partition and its fp32 cast (6 Psi / N). At N=2 the cast is larger (3 Psi), at
    N=4 the gradients (2 Psi > 1.5 Psi). Offloaded, the cast is the host's."""
    assert model_state_bytes(1000, "zero1", 2, "bf16").grads == 3000
    assert model_state_bytes(1000, "zero1", 4, "bf16").grads == 2000
    assert model_state_bytes(1000, "zero1", 1, "fp16").grads == 6000
    assert model_state_bytes(1000, "zero2_offload", 2, "bf16", "cpu_adam").grads == 1000


# --- DeepSpeed settings for other shapes than MiniLM ----------------------------------------


def test_ddp_keeps_torchs_bucket_cap_and_views_the_gradients():
    assert ddp_kwargs() == {"gradient_as_bucket_view": True, "bucket_cap_mb": 25}


@pytest.mark.parametrize(
    ("hidden", "psi", "elements"),
    [
        (4096, 10**10, 4096 * 4096),  # hidden^2 above the 2^21 floor
        (1000, 10**10, 2**21),  # hidden^2 = 10^6, under the floor
        (None, 10**9, 10**7),  # no hidden size: Psi / 100
        (None, 10**8, 2**21),  # Psi / 100 = 10^6, under the floor
        (None, 10**12, 500_000_000),  # Psi / 100 above DeepSpeed's default: capped
        (30_000, 10**12, 500_000_000),  # hidden^2 = 9e8: capped
        (4096, 3_000_001, 3_000_002),  # never above the model, rounded up to even
        (None, None, 500_000_000),  # nothing known: DeepSpeed's default
        (8, None, 2**21),  # the floor, uncapped (no parameter count yet)
        (1, 1, 2),  # one element, rounded up to DeepSpeed's even bucket
    ],
)
def test_bucket_elements_by_shape(hidden, psi, elements):
    assert bucket_elements(hidden, psi) == elements


def test_settings_refuse_what_they_do_not_cover():
    with pytest.raises(ValueError) as err:
        zero_memory_settings(0, 8, world_size=2, stage=2)
    assert str(err.value) == "num_params and world_size must be positive, got 0, 2"
    with pytest.raises(ValueError) as err:
        zero_memory_settings(100, 8, world_size=-1, stage=2)
    assert str(err.value) == "num_params and world_size must be positive, got 100, -1"
    with pytest.raises(ValueError) as err:
        zero_memory_settings(100, 8, world_size=2, stage=4)
    assert str(err.value) == "stage must be 1, 2 or 3, got 4"


@pytest.mark.parametrize(
    ("n", "largest", "contiguous"),
    [
        # Psi = 40M; the bucket is 2^21 (hidden 1448: 1448^2 is under the floor).
        # N = 2: partitions of 20M, a quarter is 5M.
        (2, None, True),  # unknown: DeepSpeed's default
        (2, 3_000_000, True),  # over the bucket, under a quarter of the partition
        (2, 5_000_000, True),  # a quarter exactly: not larger
        (2, 5_000_001, False),  # over both: reduced alone beside its pre-sized slot
        # N = 64: partitions of 625,000, a quarter is 156,250.
        (64, 2**21, True),  # over a quarter, the bucket exactly: not larger
        (64, 2**21 + 1, False),
    ],
)
def test_contiguous_gradients_off_only_for_a_parameter_over_the_bucket_and_a_quarter(
    n, largest, contiguous
):
    settings = zero_memory_settings(
        40_000_000, 1448, world_size=n, stage=2, largest_param_numel=largest, on_cuda=True
    )
    assert settings["reduce_bucket_size"] == settings["allgather_bucket_size"] == 2**21
    assert settings["contiguous_gradients"] is contiguous
    # On CUDA ZeRO-2 overlaps its reduction, but not without contiguous gradients; ZeRO-1
    # never (it would reduce inside backward), nor on the CPU (nothing to overlap).
    assert settings["overlap_comm"] is contiguous
    for stage, on_cuda in ((1, True), (2, False)):
        other = zero_memory_settings(
            40_000_000, 1448, world_size=n, stage=stage, largest_param_numel=largest,
            on_cuda=on_cuda,
        )  # fmt: skip
        assert other["overlap_comm"] is False
        assert other["contiguous_gradients"] is contiguous
    assert settings["round_robin_gradients"] is False and settings["reduce_scatter"] is True


def test_fill_zero_settings_fills_auto_and_missing_keys_and_keeps_written_ones():
    settings = zero_memory_settings(10**9, 4096, world_size=8, stage=2)
    zero = {
        "stage": 2, "reduce_bucket_size": "auto", "allgather_bucket_size": 1234,
        "overlap_comm": True, "other": "auto",
    }  # fmt: skip
    out = fill_zero_settings(zero, settings)
    assert out is zero
    assert zero == {
        "stage": 2, "reduce_bucket_size": 4096 * 4096, "allgather_bucket_size": 1234,
        "overlap_comm": True, "other": "auto", "contiguous_gradients": True,
        "round_robin_gradients": False, "reduce_scatter": True,
    }  # fmt: skip
    # Keys the settings lack stay as they are, "auto" included.
    partial = fill_zero_settings({"reduce_scatter": "auto"}, {"reduce_bucket_size": 8})
    assert partial == {"reduce_scatter": "auto", "reduce_bucket_size": 8}


# --- FSDP2: units and what each holds ---------------------------------------------------------


def test_fsdp2_units_group_shapes_by_layer_in_order():
    root, layers = fsdp2_layout.units([(4,), (2, 3), (5,), (6,)], [-1, 1, 0, 1])
    assert root == [(4,)]
    assert layers == [[(5,)], [(2, 3), (6,)]]
    with pytest.raises(ValueError) as err:
        fsdp2_layout.units([(4,)], [-1, 0])
    assert str(err.value) == "1 shapes but 2 unit indices"


def test_fsdp2_shards_a_0_dim_parameter_as_one_row():
    assert fsdp2_layout.numel([(), (3, 2)]) == 7
    assert fsdp2_layout.shard_numel([(), (3, 2)], 2) == 1 + 2 * 2
    with pytest.raises(ValueError) as err:
        fsdp2_layout.shard_numel([(3,)], 0)
    assert str(err.value) == "world_size must be positive, got 0"


def test_fsdp2_transient_bytes_by_hand():
    """Root (7,) and (3, 2); three layers of 10, 20 and 30 elements on 2 ranks, bf16.
    Padded whole sizes: root ceil(7/2)*2 + ceil(3/2)*2*2 = 8 + 8 = 16; layers 10, 20, 30.
    Shard-grad-op holds every unit whole: 2 B x (16 + 60); full-shard the root and the two
    largest layers: 2 B x (16 + 50). Root gradients whole: 13 elements. Reduce-scatter: the
    largest of unit gradients (compute dtype, unpadded) + fp32 padded input: the layer of
    30: 2 x 30 + 4 x 30 = 180, against the root's 2 x 13 + 4 x 16 = 90."""
    shapes = [(7,), (10,), (3, 2), (20,), (30,)]
    unit_of = [-1, 0, -1, 1, 2]
    keep = fsdp2_layout.transient_bytes(shapes, unit_of, 2, 2, reshard_after_forward=False)
    assert keep == {"whole_params": 2 * 76, "root_whole_grads": 26, "reduce_scatter": 180}
    reshard = fsdp2_layout.transient_bytes(shapes, unit_of, 2, 2, reshard_after_forward=True)
    assert reshard == {"whole_params": 2 * 66, "root_whole_grads": 26, "reduce_scatter": 180}
    # fp32 compute, 4 ranks, the root the largest unit: (41,) pads to 44.
    big_root = fsdp2_layout.transient_bytes([(41,), (5,)], [-1, 0], 4, 4, True)
    assert big_root == {
        "whole_params": 4 * (44 + 8), "root_whole_grads": 4 * 41,
        "reduce_scatter": 4 * 41 + 4 * 44,
    }  # fmt: skip


def test_the_defaults_are_fp32_adamw():
    """Called without a precision or optimizer, the figures are fp32 AdamW's: ZeRO-2 at
    N = 4, Psi = 8000: 4 Psi params, 4 Psi / 4 grads, 8 Psi / 4 moments, 4 Psi / 4 master."""
    assert model_state_bytes(8000, "zero2", 4).as_dict() == {
        "params": 32000, "grads": 8000, "optimizer": 16000, "master": 8000,
        "offloaded_to_cpu": 0, "total": 64000,
    }  # fmt: skip
    assert paper_grad_bytes(8000, "zero2", 4) == 8000
    assert savings_vs_replication(8000, "zero2", 4) == {"saved_bytes": 64000, "ratio": 0.5}


def test_the_smallest_valid_inputs_and_the_settings_defaults():
    """One parameter is a model (4 + 4 + 8 bytes under fp32 DDP); a world of none is not.
    Settings for a 1000-parameter model: the bucket is the model (rounded to even), never
    more; without on_cuda (the default: the CPU), ZeRO-2 overlaps nothing."""
    assert model_state_bytes(1, "ddp", 1).total == 16
    with pytest.raises(ValueError) as err:
        zero_memory_settings(100, 8, world_size=0, stage=2)
    assert str(err.value) == "num_params and world_size must be positive, got 100, 0"
    tiny = zero_memory_settings(1, 384, world_size=1, stage=2)
    assert tiny["reduce_bucket_size"] == 2
    small = zero_memory_settings(1000, 384, world_size=2, stage=2)
    assert small["reduce_bucket_size"] == small["allgather_bucket_size"] == 1000
    assert small["overlap_comm"] is False and small["contiguous_gradients"] is True
