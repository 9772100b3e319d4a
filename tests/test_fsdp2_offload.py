"""FSDP2 full-shard with torch's ``CPUOffloadPolicy`` (``fsdp2_full_shard_offload``) through
the classification recipe: the strategy recorded, losses as FSDP2's, the report's host and
device split as planned.

One offload launch (2 processes, ``torchrun --strategy fsdp2_full_shard_offload``, the
flags of tests/checkpoint_runs.py's ``fsdp2_shard_grad_op`` reference: 6 steps, 128
samples, sequence length 32, micro-batch 16, dropout as the reference's; checkpoints at
steps 3 and 6) is checked many ways, beside that shared reference; its step 3 is resumed
by DDP, and ZeRO-2's step 3 under offload (two launches). Resolution, the accelerate YAML
and the plan's arithmetic are checked in process.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from dpkit.core.spec import ModelSpec, PlanInputs
from dpkit.engines import STRATEGIES
from dpkit.errors import UsageError
from dpkit.train.launcher import read_launch
from tests.checkpoint_runs import (
    CK_RUN,
    LOGS_ONLY,
    assert_follows,
    assert_saved_again_unchanged,
    step3,
)
from tests.harness import FSDP2_RTOL, REPO, max_rel_diff, run, torchrun_cmd

OFFLOAD = STRATEGIES["fsdp2_full_shard_offload"]
FULL_SHARD = STRATEGIES["fsdp2_full_shard"]
MIB = 2**20
FP32 = 4
ADAMW_STATE = 8  # exp_avg and exp_avg_sq, fp32 (the 4-byte step counters aside)


# ---- resolution, in process ---------------------------------------------------------------


def _accelerate_fsdp_env(**settings: str) -> dict[str, str]:
    """What ``accelerate launch`` with an FSDP YAML puts in the environment
    (accelerate's utils/launch.py writes each fsdp_config key upper-cased)."""
    env = {
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": "2",
        "FSDP_RESHARD_AFTER_FORWARD": "true",
        "FSDP_OFFLOAD_PARAMS": "false",
        "WORLD_SIZE": "2",
    }
    return {**env, **settings}


def _launch_of(flag: str, env: dict[str, str]):
    args = SimpleNamespace(strategy=flag, deepspeed=None, mixed_precision=None)
    return read_launch(args, env, on_cuda=False)


def test_the_row_is_full_shard_with_offload():
    assert (OFFLOAD.backend, OFFLOAD.zero_stage) == ("fsdp2", 3)
    assert OFFLOAD.offload and OFFLOAD.reshard_after_forward and OFFLOAD.runnable
    # dpkit bench runs it beside a fully_shard twin with CPUOffloadPolicy, when named; a
    # tune tries it where nothing lighter fits.
    assert OFFLOAD.benched and OFFLOAD.memory_fallback


def test_an_accelerate_yaml_with_offload_params_runs_as_this_strategy():
    launch = _launch_of("auto", _accelerate_fsdp_env(FSDP_OFFLOAD_PARAMS="true"))
    assert launch.strategy is OFFLOAD
    assert launch.source == "accelerate launch (FSDP2, fsdp2_full_shard_offload)"
    # Without offload the same YAML is plain full-shard, as before.
    assert _launch_of("auto", _accelerate_fsdp_env()).strategy is FULL_SHARD
    # The flag naming the same strategy beside the YAML is not a conflict; another is.
    env = _accelerate_fsdp_env(FSDP_OFFLOAD_PARAMS="true")
    assert _launch_of("fsdp2_full_shard_offload", env).strategy is OFFLOAD
    with pytest.raises(UsageError, match=r"^--strategy=fsdp2_full_shard conflicts with"):
        _launch_of("fsdp2_full_shard", env)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"FSDP_OFFLOAD_PARAMS": "true", "FSDP_RESHARD_AFTER_FORWARD": "false"},
         "accelerate config fsdp_offload_params=true with fsdp_reshard_after_forward=false: "
         "dpkit offloads under full-shard only"),
        ({"FSDP_OFFLOAD_PARAMS": "cpu"}, "accelerate config fsdp_offload_params=cpu: one of true, false"),
    ],
    ids=["shard-grad-op", "not-a-bool"],
)  # fmt: skip
def test_offload_launches_dpkit_does_not_run_are_refused_in_one_line(settings, message):
    with pytest.raises(UsageError) as refused:
        _launch_of("auto", _accelerate_fsdp_env(**settings))
    assert str(refused.value).startswith(message)
    assert "\n" not in str(refused.value)


def test_the_shipped_yaml_is_full_shards_with_offload_on_and_mirrored():
    import yaml

    folder = REPO / "ds_configs" / "accelerate"
    shipped = (folder / "fsdp2_full_shard_offload.yaml").read_text()
    full_shard = yaml.safe_load((folder / "fsdp2_full_shard.yaml").read_text())
    offload = yaml.safe_load(shipped)
    # The same file as full-shard's but for the one setting.
    assert offload["fsdp_config"].pop("fsdp_offload_params") is True
    assert full_shard["fsdp_config"].pop("fsdp_offload_params") is False
    assert offload == full_shard
    packaged = REPO / "dpkit" / "configs" / "accelerate" / "fsdp2_full_shard_offload.yaml"
    assert packaged.read_text() == shipped


# ---- the plan's arithmetic, in process ----------------------------------------------------
#
# A toy layout, 2 ranks, three parameters of shapes (5, 3), (4,) and (7,): Psi = 26. FSDP2
# pads each parameter's dim 0 to a multiple of N, so the worst rank (rank 0) holds
# ceil(5/2) x 3 = 9, ceil(4/2) = 2 and ceil(7/2) = 4 elements: 15.

SHAPES = ((5, 3), (4,), (7,))
NUMELS = (15, 4, 7)
WORST_RANK_ELEMENTS = 9 + 2 + 4


def _row(strategy, trainable=()):
    from dpkit.plan import estimate

    kept = trainable or (True,) * len(SHAPES)
    frozen = sum(n for n, t in zip(NUMELS, kept, strict=True) if not t)
    spec = ModelSpec(
        name="toy", source="count", num_params=26 - frozen, param_shapes=SHAPES,
        param_units=(0, 1, -1), trainable=trainable, frozen_params=frozen,
    )  # fmt: skip
    inputs = PlanInputs(model=spec, gpus_per_node=2, precision="fp32", seq_len=8)
    return estimate.estimate(inputs, strategy, 1, None, estimate.buffer_settings(spec, 2))


def test_offload_plan_moves_every_sharded_state_to_the_host():
    offload, on_device = _row(OFFLOAD), _row(FULL_SHARD)
    # Full-shard keeps 4 + 4 + 8 bytes per shard element on the device...
    assert (on_device.params, on_device.grads, on_device.optimizer) == (
        FP32 * WORST_RANK_ELEMENTS, FP32 * WORST_RANK_ELEMENTS, ADAMW_STATE * WORST_RANK_ELEMENTS,
    )  # fmt: skip
    # ...offload keeps none of them there, and the same bytes in host memory.
    assert (offload.params, offload.grads, offload.optimizer, offload.master) == (0, 0, 0, 0)
    assert offload.host == {
        "params": FP32 * 15,
        "grads": FP32 * 15,
        "optimizer": ADAMW_STATE * 15,
    }
    assert on_device.host == {} and on_device.host_offload == 0
    assert offload.host_offload == (4 + 4 + 8) * 15
    # The whole parameters and gradients of the unit computing stay on the device.
    assert offload.buffer_parts == on_device.buffer_parts
    assert offload.buffers > 0


def test_offload_plan_puts_frozen_shards_on_the_host_without_gradients_or_state():
    # (4,) frozen: its 2-element shard is a parameter in host memory, nothing more.
    row = _row(OFFLOAD, trainable=(True, False, True))
    assert row.host == {
        "params": FP32 * (9 + 2 + 4),
        "grads": FP32 * (9 + 4),
        "optimizer": ADAMW_STATE * (9 + 4),
    }


def test_a_bare_count_plans_offload_with_the_whole_model_gathered():
    """Without shapes the plan cannot say which layers are whole; offload keeps no model
    state on the device, so a floor would read as nothing: the whole model in the compute
    dtype is counted (bf16: 2 bytes x 1e9), an upper bound, as shard-grad-op's."""
    from dpkit.plan import estimate

    spec = ModelSpec(name="1B", source="count", num_params=10**9)
    inputs = PlanInputs(model=spec, gpus_per_node=8, precision="bf16", seq_len=8)
    row = estimate.estimate(inputs, OFFLOAD, 1, None, estimate.buffer_settings(spec, 8))
    assert row.buffer_parts == {"fsdp2_whole_params": 2 * 10**9}
    assert row.params == row.grads == row.optimizer == 0
    assert row.host == {"params": 4e9 / 8, "grads": 4e9 / 8, "optimizer": 8e9 / 8}


def test_offload_is_recommended_after_every_row_that_keeps_its_state_on_the_device():
    from dpkit.plan.recommend import recommendation_order

    order = [s.name for s in recommendation_order()]
    assert order.index("fsdp2_full_shard_offload") > order.index("fsdp2_full_shard")
    assert all(order.index(s.name) < order.index(OFFLOAD.name) for s in STRATEGIES.values()
               if s.runnable and not s.offload)  # fmt: skip


# ---- one launch ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def offload(module_tmp):
    out = module_tmp / "fsdp2_full_shard_offload"
    cmd = torchrun_cmd(
        2, *CK_RUN, "--strategy", "fsdp2_full_shard_offload", "--micro-batch-size", "16",
        "--no-save-model", "--output-dir", str(out),
    )  # fmt: skip
    return run(cmd, out).check()


@pytest.mark.multiprocess
def test_offload_checkpoint_resumes_as_ddp(offload, tmp_path):
    """The offload run's step 3 (its shards saved from host memory), resumed by DDP on
    the same 2 processes: steps 4-6 follow the uninterrupted offload run (dropout on: the
    RNG streams are restored, and FSDP2 and DDP draw the same masks)."""
    cmd = torchrun_cmd(
        2, *CK_RUN, "--strategy", "ddp", "--micro-batch-size", "16", *LOGS_ONLY,
        "--resume", str(step3(offload)), "--output-dir", str(tmp_path),
    )  # fmt: skip
    resumed = run(cmd, tmp_path).check()
    assert "as ddp on 2 process(es)" in resumed.output
    assert_follows(resumed, offload, FSDP2_RTOL)


@pytest.mark.multiprocess
def test_zero2_state_resumed_and_saved_by_fsdp2_offload_is_the_same_state(reference, tmp_path):
    """ZeRO-2's step-3 checkpoint resumed under FSDP2 offload with --max-steps 3 (no step to
    train): the final save, written from the host shards, holds every Adam moment of the
    source bit for bit (tests/test_checkpoint.py shows the comparison catches a swap and
    zeroes)."""
    source = step3(reference("zero2"))
    cmd = torchrun_cmd(
        2, *CK_RUN, "--strategy", "fsdp2_full_shard_offload", "--micro-batch-size", "16",
        "--dropout", "0", "--max-steps", "3", "--no-save-model", "--resume", str(source),
        "--output-dir", str(tmp_path),
    )  # fmt: skip
    assert_saved_again_unchanged(run(cmd, tmp_path).check(), source)


@pytest.mark.multiprocess
def test_offload_runs_as_offload_and_trains_as_fsdp2(reference, offload):
    """The shared ``fsdp2_shard_grad_op`` reference (same flags, dropout on: FSDP2's modes
    draw the same masks and equal DDP's losses bit for bit, docs/fsdp2.md)."""
    info = offload.run_info
    assert (info["strategy"], info["zero_stage"], info["world_size"]) == (
        "fsdp2_full_shard_offload", 3, 2,
    )  # fmt: skip
    assert info["strategy_source"] == "--strategy fsdp2_full_shard_offload"
    assert info["wrapper"] == "FSDP2 fully_shard (8 units)+AdamW"  # MiniLM: 6 layers,
    # the embeddings, the root (docs/fsdp2.md's units); the optimizer steps in host memory
    assert info["offload_optimizer"] == "cpu"
    assert "strategy=fsdp2_full_shard_offload" in offload.output
    fsdp2 = reference("fsdp2_shard_grad_op")
    assert len(offload.losses) == len(fsdp2.losses) == 6
    assert max_rel_diff(offload.losses, fsdp2.losses) <= FSDP2_RTOL, (offload.losses, fsdp2.losses)
    assert max(fsdp2.losses) - min(fsdp2.losses) > 10 * FSDP2_RTOL * max(fsdp2.losses)
    assert offload.final("test")["accuracy"] == fsdp2.final("test")["accuracy"]


@pytest.mark.multiprocess
def test_offload_report_places_the_shards_on_the_host(reference, offload):
    """Every rank: no parameter, gradient or optimizer shard on the device; in host memory
    the same bytes FSDP2 keeps on the device without offload (the shared reference's
    report: MiniLM's every dim 0 is even, so both ranks hold exact halves)."""
    report = json.loads((offload.output_dir / "memory_report.json").read_text())
    on_device = json.loads(
        (reference("fsdp2_shard_grad_op").output_dir / "memory_report.json").read_text()
    )
    assert any("same RAM" in note for note in report["notes"]), report["notes"]
    for rank, without in zip(report["ranks"], on_device["ranks"], strict=True):
        assert (rank["params"], rank["grads"], rank["optimizer"], rank["master"]) == (0, 0, 0, 0)
        host = rank["host"]
        for category in ("params", "grads", "optimizer"):
            assert host[category] == without[category], category
        assert host["params"] == FP32 * report["num_params"] / 2
        assert host["master"] == host["buffers"] == 0
        assert set(rank["host_holders"]["optimizer"]) == {"exp_avg", "exp_avg_sq", "step"}


@pytest.mark.multiprocess
def test_dpkit_plan_against_the_offload_run(offload):
    """``dpkit plan --against`` the run: each model-state category within 2%, on the
    device (all 0) and in host memory; buffers are FSDP2's, planned but live between the
    report's probe points (docs/fsdp2.md), so not compared; the CPU run's live peak holds
    host and device alike, so not compared either."""
    from dpkit.plan.check import check_run, format_check

    check = check_run(offload.output_dir)
    table = format_check(check)
    assert (check.strategy, check.world_size) == ("fsdp2_full_shard_offload", 2)
    psi = json.loads((offload.output_dir / "memory_report.json").read_text())["num_params"]
    # By hand, fp32 AdamW over 2 ranks, all of it in host memory.
    assert {k: check.predicted[k] for k in ("params", "grads", "optimizer", "master")} == {
        "params": 0, "grads": 0, "optimizer": 0, "master": 0,
    }  # fmt: skip
    assert {k: check.predicted[f"host {k}"] for k in ("params", "grads", "optimizer")} == {
        "params": FP32 * psi / 2, "grads": FP32 * psi / 2, "optimizer": ADAMW_STATE * psi / 2,
    }  # fmt: skip
    for key in ("host params", "host grads", "host optimizer", "host total"):
        error = check.error_pct[key]  # None: nothing measured there
        assert error is not None and abs(error) <= 2, (key, table)
    for key in ("params", "grads", "optimizer", "master", "host master", "host buffers"):
        assert check.measured[key] == check.predicted[key] == 0, (key, table)
    assert set(check.not_checked) == {"buffers"}
    # On a CPU host and device are one RAM: the peak predicted with the host's shards in it.
    assert abs(check.error_pct["peak"]) <= 5, table
    assert "host rows" in table and "same RAM" in table
