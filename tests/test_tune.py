"""``dpkit tune``: real launches of a small LM at 2 CPU processes, one tune checked many ways.

One tune of 4 strategies (DDP, ZeRO-1, ZeRO-2, FSDP2 shard-grad-op) x 2 micro-batch sizes
(8 launches, 94 s on 2 idle cores) is the fixture; a second tune of a copy of its folder,
with FSDP2 as the current configuration, the second round on, and a budget under every
DDP and ZeRO candidate's measured peak, launches nothing (it reuses the trials the plan
does not prune; FSDP2 gets no second round, and no ZeRO candidate fits to get one) and
must pick FSDP2; that winner's files are launched once. One more tune (one real launch)
has a failing trial and a SIGTERM; bad input is refused before any launch.
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
# Two warm-up steps, the default: the trial's live-tensor peak is watched in the second,
# AdamW's moments alive from its start (the run's peak).
STEPS = ["--warmup-steps", "2", "--steps", "2"]
TUNE_ARGS = [*STEPS, "--no-zero-variants"]
# The strategies of the fixture's tune, least sharding first (dpkit plan's order, which
# ties follow): FSDP2 shard-grad-op after ZeRO-2, whose stage it shares.
STRATEGIES = ("ddp", "zero1", "zero2", "fsdp2_shard_grad_op")
FSDP2 = "fsdp2_shard_grad_op"
MIB = 2**20


def _tune_cmd(
    out: Path, *flags: str, recipe_args: list[str] = LM_ARGS, tune_args: list[str] = TUNE_ARGS
) -> list[str]:
    return [
        sys.executable, "-m", "dpkit.cli", "tune", *flags, *tune_args,
        "--output-dir", str(out), "--", *recipe_args,
    ]  # fmt: skip


def _results(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


def _trial(results: dict, name: str) -> dict:
    return next(t for t in results["trials"] if t["name"] == name)


def _raw_median(out: Path, name: str, warmup: int = 2) -> float:
    """A trial's median step time from its own train_log.jsonl, not the tune's summary."""
    records = harness.read_jsonl(out / "trials" / name / "run" / "train_log.jsonl")
    return statistics.median(r["step_time_s"] for r in records if r["step"] > warmup)


def _raw_report(out: Path, name: str) -> dict:
    return json.loads((out / "trials" / name / "run" / "memory_report.json").read_text())


def _raw_peak(out: Path, name: str) -> float:
    """A trial's largest rank's high-water of live tensor bytes, read from its
    memory_report.json (peak_live, watched in step 2, the second warm-up step)."""
    ranks = _raw_report(out, name)["ranks"]
    assert all(r["peak_live"]["step"] == 2 for r in ranks), name
    return max(r["peak_live"]["bytes"] for r in ranks)


@pytest.fixture(scope="module")
def tune_run(tmp_path_factory) -> tuple[harness.Launch, Path]:
    out = tmp_path_factory.mktemp("tune") / "first"
    flags = ["--strategies", ",".join(STRATEGIES), "--micro-batch-sizes", "1,2"]
    cmd = _tune_cmd(out, *flags, "--micro-batch-size", "2")
    return harness.run(cmd, out).check(), out


@pytest.fixture(scope="module")
def budget_run(tune_run, tmp_path_factory) -> tuple[harness.Launch, Path, float]:
    """The same tune in a copy of the first's folder, FSDP2 shard-grad-op at micro-batch 2
    the current configuration, the second round on, and a budget below every DDP and ZeRO
    candidate's measured peak and above FSDP2's largest."""
    _, first = tune_run
    results = _results(first)
    peaks = {t["name"]: _raw_peak(first, t["name"]) for t in results["trials"]}
    fsdp2 = max(peak for name, peak in peaks.items() if name.startswith(FSDP2))
    others = min(peak for name, peak in peaks.items() if not name.startswith(FSDP2))
    assert fsdp2 < others, f"FSDP2 must hold the least per rank at 2 processes: {peaks}"
    budget = (fsdp2 + others) / 2
    out = tmp_path_factory.mktemp("tune") / "budget"
    shutil.copytree(first / "trials", out / "trials")
    flags = ["--strategies", ",".join(STRATEGIES), "--micro-batch-sizes", "1,2"]
    flags += ["--micro-batch-size", "2", "--baseline-strategy", FSDP2]
    flags += ["--memory-budget", f"{budget / MIB:.3f}MiB"]
    # Checkpointing off: under auto the candidates over the budget would get checkpointed
    # twins, launched (tests/test_tune_decide.py checks which, without launching); this
    # tune is about reuse and the budget, and launches nothing.
    flags += ["--gradient-checkpointing", "off"]
    return harness.run(_tune_cmd(out, *flags, tune_args=STEPS), out).check(), out, budget


@pytest.mark.multiprocess
def test_every_candidate_is_measured_and_the_fastest_wins(tune_run):
    launch, out = tune_run
    results = _results(out)
    trials = results["trials"]
    names = sorted(t["name"] for t in trials)
    assert names == sorted(f"{s}-mb{m}x{2 // m}" for s in STRATEGIES for m in (1, 2)), names
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
    if step > fastest:  # a tie: whatever was faster shards more
        order = STRATEGIES.index
        faster = [n for n, m in medians.items() if m < step]
        assert all(
            order(_trial(results, n)["strategy"]) > order(winner["strategy"]) for n in faster
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
def test_zero_and_fsdp2_losses_match_ddp_at_the_same_micro_batch(tune_run):
    # 2e-3: the suite's DDP-vs-ZeRO tolerance (tests/test_launchers.py), the tune's own in
    # fp32; measured here at most 1.1e-7 (4 steps of a small GPT-2 on random tokens).
    results = _results(tune_run[1])
    for trial in results["trials"]:
        micro = trial["micro_batch_size"]
        verdict = trial["verdict"]
        assert verdict["loss_reference"] == f"ddp-mb{micro}x{2 // micro}"
        assert verdict["loss_deviation"] <= 2e-3
        assert verdict["agrees"] is True and verdict["eligible"] is True
    # FSDP2 against DDP from the trials' own logs, to the suite's FSDP2 bound (1e-5,
    # tests/harness.py), which a gradient averaged wrongly would miss.
    out = tune_run[1]
    for micro in (1, 2):
        name = f"-mb{micro}x{2 // micro}"
        logs = [out / "trials" / f"{s}{name}" / "run" / "train_log.jsonl" for s in (FSDP2, "ddp")]
        fsdp2, ddp = ([r["loss"] for r in harness.read_jsonl(log)] for log in logs)
        assert harness.max_rel_diff(fsdp2, ddp, length=4) <= harness.FSDP2_RTOL
        # Measured equal bit for bit; the losses move 1% between steps, so equal is not trivial.
        assert max(ddp) - min(ddp) > 100 * harness.FSDP2_RTOL * max(ddp)
    # Accumulating 2 micro-batches of 1 trains the same global batch as one of 2.
    one = _trial(results, "ddp-mb1x2")["figures"]["losses"]
    two = _trial(results, "ddp-mb2x1")["figures"]["losses"]
    assert harness.max_rel_diff(one, two, length=4) < 2e-3


@pytest.mark.multiprocess
def test_fsdp2_trials_run_fsdp2_from_its_yaml_and_hold_half_of_ddps_states(tune_run):
    """Each FSDP2 trial ran as FSDP2 shard-grad-op from dpkit's accelerate YAML (the recipe
    applies fully_shard itself on CPU), wrote no DeepSpeed JSON, and holds half of DDP's
    parameters, gradients and Adam moments per rank (every dim 0 of this GPT-2 is even)."""
    _, out = tune_run
    results = _results(out)
    for micro in (1, 2):
        name, reference = (f"{s}-mb{micro}x{2 // micro}" for s in (FSDP2, "ddp"))
        trial = _trial(results, name)
        assert trial["status"] == "ok", trial
        info = trial["figures"]["run_info"]
        assert info["strategy_source"] == f"accelerate launch (FSDP2, {FSDP2})", info
        assert (info["strategy"], info["zero_stage"], info["world_size"]) == (FSDP2, 2, 2)
        assert info["wrapper"].startswith("FSDP2 fully_shard"), info["wrapper"]
        where = out / "trials" / name
        assert (
            "fsdp_reshard_after_forward: false" in (where / "configs" / f"{FSDP2}.yaml").read_text()
        )
        assert not (where / "run" / "ds_config.json").exists()
        assert trial["figures"]["zero_optimization"] is None
        assert trial["round"] == 1 and trial["zero_overrides"] == {}
        fsdp2, ddp = (_raw_report(out, n)["ranks"] for n in (name, reference))
        for category in ("params", "grads"):
            assert [r[category] for r in fsdp2] == [ddp[0][category] / 2] * 2, category
        for moment in ("exp_avg", "exp_avg_sq"):
            half = ddp[0]["holders"]["optimizer"][moment] / 2
            assert [r["holders"]["optimizer"][moment] for r in fsdp2] == [half] * 2, moment
        states = trial["figures"]["model_states_per_rank"]
        assert states < 0.51 * _trial(results, reference)["figures"]["model_states_per_rank"]
        assert states == max(r["model_state_total"] for r in fsdp2)


# dpkit plan --against a trial, per category. Measured on these trials: model states
# within 1% (-0.98% at 1 x 2, exact at 2 x 1); gradients exact at 2 x 1 and -2.97% at
# 1 x 2, where the plan leaves out the reduce bucket being filled during the later
# micro-batch's backward (at most 2^21 elements, 7.5% of those gradients).
PLAN_TOTAL_PCT = 2.0
PLAN_GRADS_PCT = 4.0
# Every other category, in every trial (DDP, ZeRO-1/2, FSDP2, both micro-batches): measured
# within 0.0003% (AdamW's 4-byte step counter per tensor; DeepSpeed's alignment padding is
# 0 on this model). 0.01% is a few hundred bytes of 90 MiB: one tensor missed fails it.
PLAN_EXACT_PCT = 0.01
MODEL_STATES = ("params", "grads", "optimizer", "master")


def _check_every_category(out: Path, name: str, tolerance_pct: dict[str, float]):
    """``dpkit plan --against`` the trial: every model-state category and the total against
    the run's own memory_report.json (its largest rank), within ``tolerance_pct``; a
    category measured as 0 (no master copy in fp32 DDP or FSDP2) must be predicted 0."""
    from dpkit.plan.check import check_run

    check = check_run(out / "trials" / name / "run")
    ranks = _raw_report(out, name)["ranks"]
    for category in (*MODEL_STATES, "total"):
        field = "model_state_total" if category == "total" else category
        measured = max(r[field] for r in ranks)
        assert check.measured[category] == measured, (name, category)
        predicted = check.predicted[category]
        if measured == 0:
            assert predicted == 0, (name, category, predicted)
            continue
        error_pct = 100 * (predicted - measured) / measured
        assert abs(error_pct) <= tolerance_pct[category], (name, category, error_pct)
    # The total is the four categories, on both sides.
    assert check.predicted["total"] == pytest.approx(sum(check.predicted[c] for c in MODEL_STATES))
    return check


@pytest.mark.multiprocess
def test_the_plan_predicts_ddp_and_zero1s_trials_category_by_category(tune_run):
    """``dpkit plan --against`` DDP's and ZeRO-1's trials: every category and the total;
    DDP's master copy measured 0 and predicted 0, ZeRO-1's fp32 master partition not."""
    _, out = tune_run
    tolerance = dict.fromkeys((*MODEL_STATES, "total"), PLAN_EXACT_PCT)
    for micro in (1, 2):
        ddp = _check_every_category(out, f"ddp-mb{micro}x{2 // micro}", tolerance)
        assert ddp.measured["master"] == 0 and ddp.measured["optimizer"] > 0
        zero1 = _check_every_category(out, f"zero1-mb{micro}x{2 // micro}", tolerance)
        assert zero1.measured["master"] > 0
        # Sharded from stage 1: ZeRO-1's optimizer state is DDP's / 2, to 0.1% (padding).
        assert zero1.measured["optimizer"] == pytest.approx(ddp.measured["optimizer"] / 2, 1e-3)


@pytest.mark.multiprocess
def test_the_plan_follows_zero2s_accumulation(tune_run):
    """ZeRO-2 at micro-batch 1 x 2 holds more gradients than at 2 x 1 (DeepSpeed keeps the
    accumulated whole gradients beside the next backward); ``dpkit plan --against`` each
    trial predicts it from the run's own accumulation, and every other category too."""
    _, out = tune_run
    tolerance = {c: PLAN_EXACT_PCT for c in MODEL_STATES}
    tolerance.update(grads=PLAN_GRADS_PCT, total=PLAN_TOTAL_PCT)
    checks = {
        name: _check_every_category(out, name, tolerance) for name in ("zero2-mb1x2", "zero2-mb2x1")
    }
    # Measured: 109.4 against 89.2 MiB on the worst rank.
    assert checks["zero2-mb1x2"].measured["grads"] > 1.1 * checks["zero2-mb2x1"].measured["grads"]
    assert checks["zero2-mb1x2"].grads_where.endswith(
        "backward of a later micro-batch (accumulated whole gradients + its own)"
    )
    # ZeRO-2 in fp32 keeps an fp32 master partition: a category that is not 0 here.
    assert all(check.measured["master"] > 0 for check in checks.values())


# The tune's prediction (dpkit plan's peak of a later step) against each trial's measured
# peak_live of step 2: within the margin the tune prunes by (10%, dpkit/tune/run.py), so
# no candidate that fits is pruned. Measured in this fixture's tune (docs/tune.md), mb 2x1
# / 1x2: DDP +0.0% / +3.4%, ZeRO-1 0.0% / 0.0%, ZeRO-2 -2.2% / -7.8%, FSDP2 shard-grad-op
# +6.0% / +6.9% (docs/peak.md says what each misses).
TUNE_PREDICTION_PCT = 10.0


@pytest.mark.multiprocess
def test_the_plan_predicts_fsdp2s_trials(tune_run):
    """``dpkit plan --against`` each FSDP2 trial: its model states as the plan lays them
    out (each parameter's dim 0 padded to a multiple of 2, none needed here), every
    category, master's 0 included, and the total; the tune's prediction, which prunes, is
    every trial's counted figure."""
    _, out = tune_run
    results = _results(out)
    tolerance = dict.fromkeys((*MODEL_STATES, "total"), PLAN_EXACT_PCT)
    for micro in (1, 2):
        name = f"{FSDP2}-mb{micro}x{2 // micro}"
        check = _check_every_category(out, name, tolerance)
        assert check.strategy == FSDP2
        assert check.measured["master"] == 0  # fp32 FSDP2 keeps no master copy
    for trial in results["trials"]:
        error = trial["predicted_bytes"] / _raw_peak(out, trial["name"]) - 1
        assert abs(error) <= TUNE_PREDICTION_PCT / 100, (trial["name"], error)


@pytest.mark.multiprocess
def test_a_second_tune_reuses_the_trials_and_a_budget_picks_fsdp2(budget_run):
    launch, out, budget = budget_run
    results = _results(out)
    # Nothing launched: every trial was reused or pruned by the plan, and the second round
    # (on here) has nothing to vary: FSDP2 has no ZeRO settings, no ZeRO candidate fits.
    assert "starting" not in launch.output
    assert sorted(t["name"] for t in results["trials"]) == sorted(
        f"{s}-mb{m}x{2 // m}" for s in STRATEGIES for m in (1, 2)
    )
    assert all(t["round"] == 1 for t in results["trials"])
    winner = _trial(results, results["winner"])
    assert winner["strategy"] == FSDP2, results["winner"]
    for trial in results["trials"]:
        assert _raw_peak(out, trial["name"]) > budget or trial["strategy"] == FSDP2
        if trial["status"] == "pruned":  # predicted over the budget by more than 10%
            assert trial["strategy"] != FSDP2 and trial["predicted_bytes"] > 1.1 * budget
            assert "dpkit plan predicts" in trial["reason"]
            continue
        assert trial["status"] == "ok" and trial["reused"], trial
        assert trial["verdict"]["fits"] is (trial["strategy"] == FSDP2)
        if trial["strategy"] != FSDP2:
            assert "over the budget" in trial["verdict"]["why_not"]
    assert results["memory_budget_bytes"] == pytest.approx(budget, rel=1e-3)
    # The current configuration is FSDP2 at micro-batch 2, measured in the first tune.
    assert results["baseline"] == f"{FSDP2}-mb2x1" == results["trials"][0]["name"]
    current = _trial(results, f"{FSDP2}-mb2x1")["figures"]["median_step_time_s"]
    assert results["speedup_over_baseline"] == pytest.approx(
        current / winner["figures"]["median_step_time_s"]
    )


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
    # The FSDP2 mode comes from the winner's accelerate YAML; there is no DeepSpeed JSON.
    assert info["strategy_source"] == f"accelerate launch (FSDP2, {FSDP2})"
    assert not (out / "winner" / "ds_config.json").exists()
    assert not (run_dir / "ds_config.json").exists()


@pytest.mark.multiprocess
def test_a_failed_trial_is_recorded_and_sigterm_stops_after_the_running_one(tmp_path):
    """One tune of a recipe that fails at micro-batch 1: the current configuration
    (micro-batch 1) fails first, the tune goes on to the next trial, and a SIGTERM during
    that trial lets it finish, starts nothing more and still writes the report. Every
    candidate checkpointed (``--gradient-checkpointing on``): the one trial that runs
    is the tune's real checkpointed launch, and the winner's command keeps the flag."""
    out = tmp_path / "failing"
    cmd = _tune_cmd(
        out,
        "--recipe", str(harness.REPO / "tests" / "failing_recipe.py"),
        "--strategies", "ddp,zero2", "--micro-batch-sizes", "1,2", "--micro-batch-size", "1",
        "--global-batch-size", "4", "--gradient-checkpointing", "on",
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
            if "[2/4] ddp-mb2x1-ckpt" in line and "starting" in line:
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
    assert failed["name"] == "ddp-mb1x2-ckpt" and failed["status"] == "failed"
    assert "refusing micro-batch 1 (forced)" in failed["reason"], failed["reason"]
    assert ran["name"] == "ddp-mb2x1-ckpt" and ran["status"] == "ok"  # finished, not killed
    assert ran["figures"]["timed_steps"] == 2
    # It ran checkpointed: the run says so itself (the trial's read checks it too).
    info = json.loads((out / "trials" / ran["name"] / "run" / "run_info.json").read_text())
    assert info["gradient_checkpointing"] is True and ran["gradient_checkpointing"] is True
    assert [t["name"] for t in stopped] == ["zero2-mb2x1-ckpt", "zero2-mb1x2-ckpt"]
    assert all(t["status"] == "not run" and "SIGTERM" in t["reason"] for t in stopped)
    assert "SIGTERM" in results["stopped"] and results["winner"] == "ddp-mb2x1-ckpt"
    assert results["speedup_over_baseline"] is None  # the current configuration failed
    table = (out / "results.md").read_text()
    assert "refusing micro-batch 1" in table and "Stopped early: stopped by SIGTERM" in table
    command = (out / "winner" / "command.sh").read_text()
    assert (
        "--micro-batch-size 2 --gradient-accumulation-steps 1 --gradient-checkpointing" in command
    )


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
        (
            ["--strategies", "ddp,zero4"],
            LM_ARGS,
            "strategies='ddp,zero4': zero4 is not run by dpkit's recipes",
        ),
        (
            ["--fallback-strategies", "zero3,zero3"],
            LM_ARGS,
            "fallback_strategies='zero3,zero3': listed twice",
        ),
        (
            ["--strategies", "fsdp2_full_shard", "--zero-bucket-sizes", "4194304"],
            LM_ARGS,
            "zero_bucket_sizes=(4194304,): no DeepSpeed strategy among",
        ),
    ],
)
@pytest.mark.subprocess_only
def test_bad_input_is_one_line_and_exit_2_before_any_launch(tmp_path, flags, recipe_args, message):
    out = tmp_path / "tune"
    result = harness.run(_tune_cmd(out, *flags, recipe_args=recipe_args), out, timeout=300)
    assert result.returncode == 2, result.output[-3000:]
    errors = [line for line in result.output.splitlines() if "dpkit tune: error:" in line]
    assert len(errors) == 1 and message in errors[0], result.output[-3000:]
    assert "Traceback" not in result.output
    assert not out.exists()  # nothing written, nothing launched
