"""The memory report of real runs: the recipe under DDP, ZeRO-1 and ZeRO-2 at 2 and 4 CPU processes.

What ZeRO promises, checked on the measured bytes of every rank (MiniLM, fp32, AdamW):
optimizer state is DDP's divided by N (within 1%) at both stages; ZeRO-2 keeps a
gradient partition of DDP's divided by N (within 1%); model-state totals are
within 5% of :func:`dpkit.memory.analytic.model_state_bytes`, or the excess is named in
the report (by the buffers that hold it) and bounded here.

The bound, from DeepSpeed's code (stage_1_and_2.py) and the measurements: beyond
its partition a rank may hold (a) the whole gradients of parameters cut by its
partition boundaries (DeepSpeed copies whole parameters into grads_in_partition;
at most two per boundary pair, each at most the largest parameter), (b) the
gradient of one parameter larger than the bucket, still unreduced when backward
ends, and (c) the flat copy of its partition that ZeRO's step makes while the
gradients it copies are alive (Psi/N). So excess <= Psi/N + 3 x largest parameter.

``dpkit plan`` predicts those excesses from the parameter layout (dpkit.memory.zero_layout):
its figures for the same runs (``dpkit plan --against RUN_DIR``) must match the
measured worst rank per category, and the model-state total within 10%.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dpkit.memory.analytic import model_state_bytes
from dpkit.memory.report import PARTITION_SHARE, MemoryReport, gradient_partition_bytes
from dpkit.plan import check as plan_check
from tests.harness import BIN, REPO, accelerate_cmd, deepspeed_cmd, free_port, run, run_captured

pytestmark = pytest.mark.multiprocess

WORLD_SIZES = (2, 4)
MICRO_BATCH = 8
# Two optimizer steps: the first creates the optimizer state, the second is a
# steady-state step with every buffer in place. No evaluation during training.
MEMORY_RUN = [
    "--max-steps", "2",
    "--micro-batch-size", str(MICRO_BATCH),
    "--max-seq-length", "64",
    "--max-eval-samples", "32",
    "--eval-steps", "0",
    "--logging-steps", "1",
    "--dropout", "0",
    "--no-save-model",
    "--no-save-checkpoints",
    "--overwrite-output-dir",
]  # fmt: skip

# Holders of the excess over the partition, each one a named DeepSpeed mechanism.
RESIDUAL_HOLDERS = (
    "boundary-straddling",  # (a) whole gradients of parameters cut by the partition
    "param.grad (unreduced",  # (b) a gradient not reduced yet (larger than the bucket)
    "flat gradient partition",  # (c) the ZeRO step's flat copy
    "keeps a whole parameter's gradient alive",  # (c') the same, as a view of (a)
)

_reports: dict[tuple[str, int], dict] = {}


def launch_report(strategy: str, world_size: int, root: Path) -> dict:
    """Run the recipe once per (strategy, N) and return its memory_report.json."""
    key = (strategy, world_size)
    if key not in _reports:
        out = root / f"{strategy}-{world_size}"
        args = [
            *MEMORY_RUN,
            "--strategy", strategy,
            "--max-train-samples", str(MICRO_BATCH * world_size * 2),
            "--output-dir", str(out),
        ]  # fmt: skip
        if strategy == "ddp":
            cmd = accelerate_cmd(["--multi_gpu", "--num_processes", str(world_size)], *args)
        else:
            cmd = deepspeed_cmd(world_size, *args)
        run(cmd, out).check()
        _reports[key] = json.loads((out / "memory_report.json").read_text())
    return _reports[key]


@pytest.fixture(scope="module")
def runs_root(module_tmp) -> Path:
    return module_tmp


def _within(measured: float, expected: float, rel: float) -> bool:
    return abs(measured - expected) <= rel * expected


def check_optimizer_sharded(ddp: dict, zero: dict) -> None:
    """Every ZeRO rank holds DDP's optimizer state divided by N, within 1%."""
    n = zero["world_size"]
    ddp_optimizer = max(r["optimizer"] for r in ddp["ranks"])
    for row in zero["ranks"]:
        assert _within(row["optimizer"], ddp_optimizer / n, 0.01), (
            f"{zero['strategy']} rank {row['rank']}: optimizer {row['optimizer']:.0f} B, "
            f"DDP/{n} = {ddp_optimizer / n:.0f} B"
        )


def gradient_partition(row: dict) -> float:
    """Bytes of the rank's own gradient partition, at the probe point where ZeRO holds it."""
    return gradient_partition_bytes(row) or 0.0


def excess_bound(report: dict) -> float:
    """Psi/N (the step's flat copy) + 3 x the largest parameter (module docstring)."""
    psi_bytes = 4.0 * report["num_params"]
    return psi_bytes / report["world_size"] + 3.0 * report["largest_param"]["bytes"]


def check_zero2_gradients(ddp: dict, zero2: dict) -> None:
    """ZeRO-2's gradient partition is DDP's gradients / N; the rest is named and bounded."""
    n = zero2["world_size"]
    ddp_grads = max(r["grads"] for r in ddp["ranks"])
    for row in zero2["ranks"]:
        where = f"zero2 N={n} rank {row['rank']} ({row['high_water_points']['grads']})"
        partition = gradient_partition(row)
        assert _within(partition, ddp_grads / n, 0.01), (
            f"{where}: partition gradients {partition:.0f} B vs DDP/{n} = {ddp_grads / n:.0f} B; "
            f"holders {row['holders']['grads']}"
        )
        beyond = [
            name
            for name, nbytes in row["holders"]["grads"].items()
            if nbytes and not name.endswith(PARTITION_SHARE)
        ]
        for name in beyond:
            assert any(kind in name for kind in RESIDUAL_HOLDERS), f"{where}: unnamed {name}"
        excess = row["grads"] - partition
        assert excess <= excess_bound(zero2), f"{where}: {excess:.0f} B beyond the partition"


def check_model_states(report: dict) -> None:
    """Within 5% of the analytic total, or each excess named in the report and bounded."""
    predicted = model_state_bytes(report["num_params"], report["strategy"], report["world_size"])
    named = {r["category"] for r in report["residuals"]}
    for row in report["ranks"]:
        where = f"{report['strategy']} N={report['world_size']} rank {row['rank']}"
        # Parameters, optimizer state and master copies are exact up to alignment padding.
        for category in ("params", "optimizer", "master"):
            expected = getattr(predicted, category)
            assert abs(row[category] - expected) <= 0.01 * max(expected, 1.0), (
                f"{where}: {category} {row[category]:.0f} B vs predicted {expected:.0f} B"
            )
        if _within(row["model_state_total"], predicted.total, 0.05):
            continue
        excess = row["model_state_total"] - predicted.total
        assert excess > 0, f"{where}: {excess:.0f} B below the prediction"
        assert "grads" in named, f"{where}: {excess:.0f} B above prediction, not named"
        residual = next(r for r in report["residuals"] if r["category"] == "grads")
        assert residual["held_by"], f"{where}: residual without holders"
        assert excess <= excess_bound(report), f"{where}: excess {excess:.0f} B over the bound"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_zero_optimizer_state_is_ddp_divided_by_n(runs_root, world_size):
    ddp = launch_report("ddp", world_size, runs_root)
    for strategy in ("zero1", "zero2"):
        check_optimizer_sharded(ddp, launch_report(strategy, world_size, runs_root))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_zero2_gradient_partition_is_ddp_divided_by_n(runs_root, world_size):
    ddp = launch_report("ddp", world_size, runs_root)
    check_zero2_gradients(ddp, launch_report("zero2", world_size, runs_root))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2"])
def test_model_states_match_the_analytic_core_or_the_residual_is_named(
    runs_root, strategy, world_size
):
    report = launch_report(strategy, world_size, runs_root)
    assert report["world_size"] == world_size == len(report["ranks"])
    check_model_states(report)
    if strategy == "ddp":
        # Full replication: DDP is the prediction itself, buffers included (bucket views).
        assert all(abs(e) < 1.0 for e in report["error_pct"].values() if e is not None)


def test_ddp_per_rank_bytes_do_not_depend_on_world_size(runs_root):
    totals = {
        n: {r["model_state_total"] for r in launch_report("ddp", n, runs_root)["ranks"]}
        for n in WORLD_SIZES
    }
    assert len(set.union(*totals.values())) == 1, totals


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2"])
def test_saved_report_is_complete(runs_root, strategy):
    data = launch_report(strategy, 2, runs_root)
    report = MemoryReport.from_dict(data)
    assert report.to_dict()["savings"] == data["savings"]
    for row in data["ranks"]:
        assert row["measured_at"] == "step probes", "the recipe must call dpkit.memory.track"
        assert row["peak"][row["peak"]["headline"]] > 0
        assert row["activations"] and row["activations"] > 0
    assert all(k.startswith("memory/") for k in report.tracker_scalars())
    text = report.format_table()
    assert "rank 1" in text and "predicted" in text and "saved vs full replication" in text


# The plan against the measurement: the target for the model-state total, and
# per category the slack of DeepSpeed's alignment padding (measured: under 0.1%).
PLAN_TOTAL_TOLERANCE_PCT = 10.0
PLAN_CATEGORY_TOLERANCE_PCT = 2.0


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2"])
def test_plan_predicts_the_measured_model_states(runs_root, strategy, world_size):
    launch_report(strategy, world_size, runs_root)
    check = plan_check.check_run(runs_root / f"{strategy}-{world_size}")
    table = plan_check.format_check(check)
    assert check.world_size == world_size and check.strategy == strategy
    errors = check.error_pct
    assert abs(errors["total"]) <= PLAN_TOTAL_TOLERANCE_PCT, table
    for category in plan_check.CATEGORIES:
        if errors[category] is not None:
            assert abs(errors[category]) <= PLAN_CATEGORY_TOLERANCE_PCT, table
    if strategy == "zero2":
        # The layout matters: MiniLM's word embedding (52% of it) is held whole, so
        # DeepSpeed holds several times the paper's Psi/N; the plan says where.
        assert check.grads_where.startswith("rank ")
        assert check.predicted["grads"] > 2 * check.grads_paper, table


LM_RECIPE = str(REPO / "recipes" / "train_lm.py")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_plan_predicts_contiguous_gradients_too(runs_root, strategy, world_size):
    """The tiny GPT-2 shape: its tied word embedding (2^21 elements) fits the bucket, so
    dpkit keeps contiguous_gradients on; DeepSpeed then reduces through its pre-sized
    partition buffer, which the layout model follows bucket by bucket."""
    out = runs_root / f"lm-{strategy}-{world_size}"
    cmd = [
        str(BIN / "deepspeed"), "--num_gpus", str(world_size), "--master_port", str(free_port()),
        LM_RECIPE, "--strategy", strategy, "--size", "tiny", "--synthetic", "--seq-len", "64",
        "--max-steps", "2", "--output-dir", str(out),
    ]  # fmt: skip
    run(cmd, out).check()
    settings = json.loads((out / "ds_config.json").read_text())["zero_optimization"]
    assert settings["contiguous_gradients"] is True
    check = plan_check.check_run(out)
    table = plan_check.format_check(check)
    for category in plan_check.CATEGORIES:
        if check.error_pct[category] is not None:
            assert abs(check.error_pct[category]) <= PLAN_CATEGORY_TOLERANCE_PCT, table


def test_plan_against_prints_the_comparison(runs_root):
    launch_report("zero2", 2, runs_root)
    run_dir = runs_root / "zero2-2"
    done = run_captured([str(BIN / "dpkit"), "plan", "--against", str(run_dir)])
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0] == f"dpkit plan --against {run_dir}"
    header = next(i for i, line in enumerate(lines) if line.startswith("MiB per GPU"))
    rows = {line.split()[0]: line.split()[1:] for line in lines[header + 1 : header + 6]}
    assert list(rows) == ["params", "grads", "optimizer", "master", "total"]
    as_json = run_captured([str(BIN / "dpkit"), "plan", "--against", str(run_dir), "--json"])
    data = json.loads(as_json.stdout)
    assert data["strategy"] == "zero2" and data["world_size"] == 2
    assert float(rows["total"][0]) == pytest.approx(
        data["predicted_bytes"]["total"] / 2**20, abs=0.05
    )
