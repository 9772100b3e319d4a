"""``dpkit tune``: real launches of a small LM at 2 CPU processes, one tune checked many ways.

One tune of 3 strategies x 2 micro-batch sizes (6 launches, ~2 min) is the fixture; a
second tune of a copy of its folder, with a budget under DDP's measured peak, reuses all
six trials (no launch) and must pick a ZeRO candidate that fits; that winner's files are
launched once. One more tune (one real launch) has a failing trial and a SIGTERM; bad
input is refused before any launch.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import harness

# A small GPT-2 shape (23M parameters: ZeRO saves more than its buckets cost at 2 ranks,
# which the 5M-parameter "tiny" does not) on random tokens, short sequences.
LM_ARGS = ["--size", "small", "--synthetic", "--seq-len", "32"]
TUNE_ARGS = ["--warmup-steps", "1", "--steps", "2", "--no-zero-variants"]
MIB = 2**20


def _tune_cmd(out: Path, *flags: str, recipe_args: list[str] = LM_ARGS) -> list[str]:
    return [
        sys.executable, "-m", "dpkit.cli", "tune", *flags, *TUNE_ARGS,
        "--output-dir", str(out), "--", *recipe_args,
    ]  # fmt: skip


def _results(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


def _trial(results: dict, name: str) -> dict:
    return next(t for t in results["trials"] if t["name"] == name)


def _raw_median(out: Path, name: str, warmup: int = 1) -> float:
    """A trial's median step time from its own train_log.jsonl, not the tune's summary."""
    records = harness.read_jsonl(out / "trials" / name / "run" / "train_log.jsonl")
    return statistics.median(r["step_time_s"] for r in records if r["step"] > warmup)


def _raw_peak(out: Path, name: str) -> float:
    """A trial's largest rank, counted from its memory_report.json: model states, buffers
    and activations at their high-waters."""
    report = json.loads((out / "trials" / name / "run" / "memory_report.json").read_text())
    return max(
        r["model_state_total"] + r["buffers_total"] + r["activations"] for r in report["ranks"]
    )


@pytest.fixture(scope="module")
def tune_run(tmp_path_factory) -> tuple[harness.Launch, Path]:
    out = tmp_path_factory.mktemp("tune") / "first"
    cmd = _tune_cmd(out, "--micro-batch-sizes", "1,2", "--micro-batch-size", "2")
    return harness.run(cmd, out).check(), out


@pytest.fixture(scope="module")
def budget_run(tune_run, tmp_path_factory) -> tuple[harness.Launch, Path, float]:
    """The same tune in a copy of the first's folder, with a budget below every DDP
    candidate's measured peak and above the smallest ZeRO one's."""
    _, first = tune_run
    results = _results(first)
    peaks = {t["name"]: _raw_peak(first, t["name"]) for t in results["trials"]}
    ddp = min(peak for name, peak in peaks.items() if name.startswith("ddp"))
    zero = min(peak for name, peak in peaks.items() if not name.startswith("ddp"))
    assert zero < ddp, "ZeRO must save memory per rank against DDP at 2 processes"
    budget = (zero + ddp) / 2
    out = tmp_path_factory.mktemp("tune") / "budget"
    shutil.copytree(first / "trials", out / "trials")
    flags = ["--micro-batch-sizes", "1,2", "--micro-batch-size", "2"]
    cmd = _tune_cmd(out, *flags, "--memory-budget", f"{budget / MIB:.3f}MiB")
    return harness.run(cmd, out).check(), out, budget


@pytest.mark.multiprocess
def test_every_candidate_is_measured_and_the_fastest_wins(tune_run):
    launch, out = tune_run
    results = _results(out)
    trials = results["trials"]
    names = sorted(t["name"] for t in trials)
    assert names == sorted(
        f"{s}-mb{m}x{2 // m}" for s in ("ddp", "zero1", "zero2") for m in (1, 2)
    ), names
    for trial in trials:
        assert trial["status"] == "ok", trial
        figures = trial["figures"]
        assert figures["timed_steps"] == 2
        assert figures["median_step_time_s"] > 0 and figures["samples_per_s"] > 0
        assert figures["memory_bytes"] > figures["model_states_per_rank"] > 0
        assert trial["predicted_bytes"] > 0  # the plan's prediction, shown beside it
        assert figures["run_info"]["world_size"] == 2
        # Every candidate trains the same 4 samples per step on each of the 2 ranks.
        assert figures["samples_per_step_per_rank"] == 2
        assert trial["verdict"]["agrees"] is True, trial["verdict"]
    # The fastest candidate wins (all are eligible: no budget, losses agree), unless a less
    # sharded one is within the tie tolerance (--tie-tolerance, 2% by default) of it.
    medians = {name: _raw_median(out, name) for name in names}
    assert medians == {t["name"]: t["figures"]["median_step_time_s"] for t in trials}
    fastest = min(medians.values())
    winner = _trial(results, results["winner"])
    step = medians[winner["name"]]
    assert step <= fastest * 1.02
    if step > fastest:
        stages = {"ddp": 0, "zero1": 1, "zero2": 2}
        faster = [n for n, m in medians.items() if m < step]
        assert all(
            stages[_trial(results, n)["strategy"]] > stages[winner["strategy"]] for n in faster
        )
    # The current configuration is DDP at micro-batch 2, measured in the same tune.
    assert results["baseline"] == "ddp-mb2x1"
    baseline = _trial(results, "ddp-mb2x1")["figures"]["median_step_time_s"]
    assert results["speedup_over_baseline"] == pytest.approx(baseline / step)
    assert results["speedup_over_baseline"] >= 1.0
    # The report: the table (also printed), the chart, the winner's files.
    table = (out / "results.md").read_text()
    assert f"{results['winner']} **winner**" in table and table.strip() in launch.output
    assert (out / "chart.png").stat().st_size > 10_000
    command = (out / "winner" / "command.sh").read_text()
    assert f"--micro-batch-size {winner['micro_batch_size']}" in command


@pytest.mark.multiprocess
def test_zero_losses_match_ddp_at_the_same_micro_batch(tune_run):
    # 2e-3: the suite's DDP-vs-ZeRO tolerance (tests/test_launchers.py); measured here
    # at most 1.1e-7 (3 steps of a small GPT-2 on random tokens).
    results = _results(tune_run[1])
    for trial in results["trials"]:
        micro = trial["micro_batch_size"]
        verdict = trial["verdict"]
        assert verdict["loss_reference"] == f"ddp-mb{micro}x{2 // micro}"
        assert verdict["loss_deviation"] <= 2e-3
    # Accumulating 2 micro-batches of 1 trains the same global batch as one of 2.
    one = _trial(results, "ddp-mb1x2")["figures"]["losses"]
    two = _trial(results, "ddp-mb2x1")["figures"]["losses"]
    assert harness.max_rel_diff(one, two, length=3) < 2e-3


# dpkit plan --against a trial, per category. Measured on these trials: model states
# within 1% (-0.98% at 1 x 2, exact at 2 x 1); gradients exact at 2 x 1 and -2.97% at
# 1 x 2, where the plan leaves out the reduce bucket being filled during the later
# micro-batch's backward (at most 2^21 elements, 7.5% of those gradients).
PLAN_TOTAL_PCT = 2.0
PLAN_GRADS_PCT = 4.0


@pytest.mark.multiprocess
def test_the_plan_follows_zero2s_accumulation(tune_run):
    """ZeRO-2 at micro-batch 1 x 2 holds more gradients than at 2 x 1 (DeepSpeed keeps the
    accumulated whole gradients beside the next backward); ``dpkit plan --against`` each
    trial predicts it from the run's own accumulation."""
    from dpkit.plan.check import check_run

    _, out = tune_run
    checks = {
        name: check_run(out / "trials" / name / "run") for name in ("zero2-mb1x2", "zero2-mb2x1")
    }
    # Measured: 109.4 against 89.2 MiB on the worst rank.
    assert checks["zero2-mb1x2"].measured["grads"] > 1.1 * checks["zero2-mb2x1"].measured["grads"]
    assert checks["zero2-mb1x2"].grads_where.endswith(
        "backward of a later micro-batch (accumulated whole gradients + its own)"
    )
    for name, check in checks.items():
        assert abs(check.error_pct["total"]) <= PLAN_TOTAL_PCT, (name, check.error_pct)
        assert abs(check.error_pct["grads"]) <= PLAN_GRADS_PCT, (name, check.error_pct)


@pytest.mark.multiprocess
def test_a_second_tune_reuses_the_trials_and_a_budget_picks_zero(budget_run):
    launch, out, budget = budget_run
    results = _results(out)
    assert "starting" not in launch.output  # nothing launched: every trial was reused
    assert all(t["reused"] for t in results["trials"] if t["status"] == "ok")
    winner = _trial(results, results["winner"])
    assert winner["strategy"] in ("zero1", "zero2"), results["winner"]
    assert _raw_peak(out, winner["name"]) <= budget
    for trial in results["trials"]:
        if trial["strategy"] == "ddp" and trial["status"] == "ok":
            assert _raw_peak(out, trial["name"]) > budget
            assert trial["verdict"]["fits"] is False
            assert "over the budget" in trial["verdict"]["why_not"]
    assert results["memory_budget_bytes"] == pytest.approx(budget, rel=1e-3)


@pytest.mark.multiprocess
def test_the_winner_files_launch_the_winner(budget_run, tmp_path):
    _, out, _ = budget_run
    results = _results(out)
    winner = _trial(results, results["winner"])
    run_dir = tmp_path / "again"
    launch = harness.run(
        ["bash", str(out / "winner" / "command.sh"), "--max-steps", "1",
         "--output-dir", str(run_dir)],
        run_dir,
    ).check()  # fmt: skip
    info = launch.run_info
    assert (info["strategy"], info["micro_batch_size"], info["gradient_accumulation_steps"]) == (
        winner["strategy"],
        winner["micro_batch_size"],
        winner["gradient_accumulation_steps"],
    )
    assert info["world_size"] == 2
    assert launch.ds_config["zero_optimization"] == winner["figures"]["zero_optimization"]


@pytest.mark.multiprocess
def test_a_failed_trial_is_recorded_and_sigterm_stops_after_the_running_one(tmp_path):
    """One tune of a recipe that fails at micro-batch 1: the current configuration
    (micro-batch 1) fails first, the tune goes on to the next trial, and a SIGTERM during
    that trial lets it finish, starts nothing more and still writes the report."""
    out = tmp_path / "failing"
    cmd = _tune_cmd(
        out,
        "--recipe", str(harness.REPO / "tests" / "failing_recipe.py"),
        "--strategies", "ddp,zero2", "--micro-batch-sizes", "1,2", "--micro-batch-size", "1",
        "--global-batch-size", "4",
    )  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        cwd=harness.REPO,
        env=harness.launch_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "[2/4] ddp-mb2x1" in line and "starting" in line:
                time.sleep(2)
                os.kill(proc.pid, signal.SIGTERM)
                break
        output = "".join(lines) + proc.communicate(timeout=harness.LAUNCH_TIMEOUT_S)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, output[-3000:]
    results = _results(out)
    failed, ran, *stopped = results["trials"]
    assert failed["name"] == "ddp-mb1x2" and failed["status"] == "failed"
    assert "refusing micro-batch 1 (forced)" in failed["reason"], failed["reason"]
    assert ran["name"] == "ddp-mb2x1" and ran["status"] == "ok"  # finished, not killed
    assert ran["figures"]["timed_steps"] == 2
    assert [t["name"] for t in stopped] == ["zero2-mb2x1", "zero2-mb1x2"]
    assert all(t["status"] == "not run" and "SIGTERM" in t["reason"] for t in stopped)
    assert "SIGTERM" in results["stopped"] and results["winner"] == "ddp-mb2x1"
    assert results["speedup_over_baseline"] is None  # the current configuration failed
    table = (out / "results.md").read_text()
    assert "refusing micro-batch 1" in table and "Stopped early: stopped by SIGTERM" in table
    assert (out / "winner" / "command.sh").is_file()


@pytest.mark.parametrize(
    ("flags", "recipe_args", "message"),
    [
        (["--recipe", "no_such_recipe.py"], [], "--recipe='no_such_recipe.py': no such file"),
        (["--global-batch-size", "5"], LM_ARGS, "--global-batch-size=5: not divisible by the 2"),
        (["--memory-budget", "12XB"], LM_ARGS, "--memory-budget"),
        (["--memory-budget", "2MiB"], LM_ARGS, "no candidate fits; the smallest"),
        (["--micro-batch-sizes", "3"], LM_ARGS, "3 does not divide the 4 samples per rank"),
        (
            ["--global-batch-size", "16", "--gradient-accumulation-steps", "3"],
            LM_ARGS,
            "--gradient-accumulation-steps=3: micro-batch 4 x 3 x 2 processes is not",
        ),
        ([], [*LM_ARGS, "--micro-batch-size", "8"], "dpkit tune sets --micro-batch-size"),
        (["--strategies", "ddp,zero3"], LM_ARGS, "strategies='ddp,zero3'"),
        (
            ["--strategies", "fsdp2_full_shard"],
            LM_ARGS,
            "strategies='fsdp2_full_shard': dpkit tune does not run FSDP2 yet",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_any_launch(tmp_path, flags, recipe_args, message):
    out = tmp_path / "tune"
    result = harness.run(_tune_cmd(out, *flags, recipe_args=recipe_args), out, timeout=300)
    assert result.returncode == 2, result.output[-3000:]
    errors = [line for line in result.output.splitlines() if "dpkit tune: error:" in line]
    assert len(errors) == 1 and message in errors[0], result.output[-3000:]
    assert "Traceback" not in result.output
    assert not out.exists()  # nothing written, nothing launched
