"""``dpkit tune``'s choices without launching: candidates, verdicts, the winner, the flags.

The launches (the figures these choices are made on) are in tests/test_tune.py.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from dpkit.errors import UsageError
from dpkit.tune import space
from dpkit.tune.cli import _seconds, _sizes
from dpkit.tune.config import RecipeInfo, TuneConfig, TuneSettings
from dpkit.tune.decide import decide
from dpkit.tune.trials import FAILED, OK, Trial


def _settings(**config) -> TuneSettings:
    return TuneSettings(
        config=TuneConfig(**config),
        recipe=RecipeInfo(Path("train_lm.py"), frozenset(), 4),
        nproc=2,
        device="cpu",
        global_batch_size=8,
        per_rank_batch=4,
        baseline_micro_batch=4,
        micro_batch_sizes=(1, 2, 4),
        precision="no",
        memory_budget=None,
        threads_per_process=1,
        output_dir=Path("/nonexistent"),
    )


def _trial(strategy: str, micro: int, step: float, memory: float = 100.0, losses=None) -> Trial:
    figures = {
        "median_step_time_s": step,
        "memory_bytes": memory,
        "losses": losses or [2.0, 1.9, 1.8],
    }
    return Trial(space.Candidate(strategy, micro, 4 // micro), status=OK, figures=figures)


def test_first_round_starts_with_the_current_configuration_then_ddp():
    names = [c.name for c in space.first_round(_settings(baseline_strategy="zero1"))]
    assert names[0] == "zero1-mb4x1"
    assert names[1:4] == ["ddp-mb4x1", "ddp-mb2x2", "ddp-mb1x4"]  # DDP: the loss reference
    assert len(names) == len(set(names)) == 9
    # Every candidate trains the same 4 samples per rank per optimizer step.
    for candidate in space.first_round(_settings()):
        assert candidate.micro_batch_size * candidate.gradient_accumulation_steps == 4


def test_second_round_varies_buckets_and_flags_around_what_ran():
    best = space.Candidate("zero2", 2, 2)
    ran = {"reduce_bucket_size": 2**21, "contiguous_gradients": True}
    variants = space.second_round(best, ran, _settings())
    assert [v.name for v in variants] == [
        "zero2-mb2x2-bucket512K",
        "zero2-mb2x2-bucket8M",
        "zero2-mb2x2-nocontig",
    ]
    assert variants[0].zero_overrides == {
        "reduce_bucket_size": 2**19,
        "allgather_bucket_size": 2**19,
    }
    chosen = space.second_round(best, ran, _settings(zero_bucket_sizes=(2**21, 2**22)))
    assert [v.name for v in chosen][:1] == ["zero2-mb2x2-bucket4M"]  # 2**21 ran already


def test_the_fastest_eligible_wins_and_a_tie_goes_to_less_sharding():
    trials = [
        _trial("ddp", 4, 1.00, memory=300),
        _trial("zero1", 4, 0.995),
        _trial("zero2", 4, 0.99),
    ]
    decision = decide(trials, "ddp-mb4x1", None, "no", tie_tolerance=0.02)
    assert decision.winner.name == "ddp-mb4x1"  # within 2% of the fastest, least sharded
    assert decision.speedup == pytest.approx(1.0)
    # With a budget DDP does not fit: ZeRO-1 ties with ZeRO-2 and shards less.
    decision = decide(trials, "ddp-mb4x1", 200, "no", tie_tolerance=0.02)
    assert decision.winner.name == "zero1-mb4x1"
    assert "over the budget" in decision.verdicts["ddp-mb4x1"].why_not
    assert decision.speedup is None
    # No tie: the fastest.
    assert decide(trials, "ddp-mb4x1", None, "no", 0.0).winner.name == "zero2-mb4x1"


def test_a_tie_never_picks_something_slower_than_the_current_configuration():
    trials = [_trial("ddp", 4, 1.01), _trial("zero2", 4, 1.00)]
    decision = decide(trials, "zero2-mb4x1", None, "no", tie_tolerance=0.02)
    assert decision.winner.name == "zero2-mb4x1"
    assert decision.speedup == 1.0


def test_losses_that_disagree_with_ddp_make_a_candidate_ineligible():
    trials = [
        _trial("ddp", 4, 1.0),
        _trial("zero2", 4, 0.5, losses=[2.0, 1.9, 1.9]),  # 5% off at step 3
        Trial(space.Candidate("zero1", 4, 1), status=FAILED, reason="exit code 1"),
    ]
    decision = decide(trials, "ddp-mb4x1", None, "no", 0.02)
    assert decision.winner.name == "ddp-mb4x1"
    verdict = decision.verdicts["zero2-mb4x1"]
    assert verdict.agrees is False and verdict.loss_reference == "ddp-mb4x1"
    assert "losses differ from ddp-mb4x1" in verdict.why_not
    assert decision.verdicts["zero1-mb4x1"].why_not == "failed: exit code 1"


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"strategies": ("ddp", "zero3")}, "strategies='ddp,zero3'"),
        (
            {"strategies": ("ddp", "fsdp2_shard_grad_op")},
            "strategies='ddp,fsdp2_shard_grad_op': dpkit tune does not run FSDP2 yet "
            "(fsdp2_shard_grad_op); one of ddp,zero1,zero2",
        ),
        (
            {"baseline_strategy": "fsdp2_full_shard"},
            "baseline_strategy='fsdp2_full_shard': dpkit tune does not run FSDP2 yet",
        ),
        ({"steps": 0}, "steps=0: must be >= 1"),
        ({"zero_bucket_sizes": (3,)}, "3 is not a multiple of 2"),
        ({"tie_tolerance": 1.5}, "tie_tolerance=1.5"),
        ({"recipe_args": ("--output-dir=x",)}, "dpkit tune sets --output-dir"),
        ({"recipe_args": ("--micro_batch_size", "8")}, "dpkit tune sets --micro-batch-size"),
    ],
)
def test_a_bad_config_is_refused_when_built(config, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        TuneConfig(**config)


def test_the_tune_tries_ddp_and_zero_by_default():
    """The recipes run FSDP2 too, but the tune has no FSDP2 trials yet."""
    assert TuneConfig().strategies == ("ddp", "zero1", "zero2")


def test_flag_values_parse_or_name_the_flag():
    assert _seconds("10m", "--time-budget") == 600
    assert _seconds("90", "--time-budget") == 90
    assert _sizes("1,2,4", "--micro-batch-sizes") == (1, 2, 4)
    assert _sizes("2e6", "--zero-bucket-sizes") == (2_000_000,)
    with pytest.raises(UsageError, match="--time-budget='soon'"):
        _seconds("soon", "--time-budget")
    with pytest.raises(UsageError, match="--micro-batch-sizes='0'"):
        _sizes("0", "--micro-batch-sizes")


def test_a_trial_is_reused_only_by_a_tune_that_would_run_it_the_same_way(tmp_path):
    from dataclasses import replace

    from dpkit.tune import trials as tune_trials

    settings = replace(_settings(recipe_args=("--size", "tiny")), output_dir=tmp_path)
    candidate = space.Candidate("zero2", 2, 2)
    done = Trial(candidate, status=OK, figures={"median_step_time_s": 1.0}, wall_s=20.0)
    tune_trials.save(settings, done)
    again = tune_trials.load_previous(settings, candidate)
    assert again.reused and again.status == OK and again.figures == done.figures
    # Other recipe arguments, more steps, another candidate: launched again.
    other_args = replace(settings, config=TuneConfig(recipe_args=("--size", "small")))
    more_steps = replace(settings, config=TuneConfig(recipe_args=("--size", "tiny"), steps=8))
    assert tune_trials.load_previous(other_args, candidate) is None
    assert tune_trials.load_previous(more_steps, candidate) is None
    assert tune_trials.load_previous(settings, space.Candidate("zero2", 1, 4)) is None
    # A failed trial is reused unless --retry-failed.
    tune_trials.save(settings, Trial(candidate, status=FAILED, reason="exit code 1"))
    assert tune_trials.load_previous(settings, candidate).status == FAILED
    retry = replace(settings, config=TuneConfig(recipe_args=("--size", "tiny"), retry_failed=True))
    assert tune_trials.load_previous(retry, candidate) is None


def test_a_script_without_the_flags_the_tune_sets_is_refused(tmp_path):
    from dpkit.tune.config import read_recipe

    script = tmp_path / "train.py"
    script.write_text(
        "import argparse\n"
        "p = argparse.ArgumentParser()\n"
        "p.add_argument('--micro-batch-size', type=int, default=8)\n"
        "p.add_argument('--max-steps', type=int)\n"
        "p.parse_args()\n"
    )
    with pytest.raises(UsageError, match="has no --gradient-accumulation-steps, --output-dir"):
        read_recipe(script, dict(os.environ))
    script.write_text(
        script.read_text().replace(
            "p.parse_args()",
            "p.add_argument('--gradient_accumulation_steps', type=int)\n"
            "p.add_argument('--output-dir')\n"
            "p.add_argument('--no-save-model', action='store_true')\n"
            "p.parse_args()",
        )
    )
    recipe = read_recipe(script, dict(os.environ))
    assert recipe.default_micro_batch is None  # argparse prints no default without %(default)
    assert recipe.extra_args() == ["--no-save-model"]
    script.write_text("raise SystemExit('broken: no parser')\n")
    with pytest.raises(UsageError, match="--help failed: broken: no parser"):
        read_recipe(script, dict(os.environ))


def test_a_trial_past_its_time_names_the_tunes_flag(tmp_path):
    """The tune launches through the bench's launcher; a timeout names --trial-timeout."""
    import sys

    from dpkit.bench import launch

    phase = launch.Phase(
        name="zero2-mb2x2",
        strategy="zero2",
        bare=False,
        launcher="python",
        cmd=[sys.executable, "-c", "import time; time.sleep(60)"],
        run_dir=tmp_path / "trial",
    )
    launch_settings = {**_settings().launch_settings(), "launch_timeout_s": 1}
    with pytest.raises(launch.BenchError, match=r"timed out after 1 s \(--trial-timeout\)"):
        launch.run_phase(phase, 1, 1, launch_settings, env=dict(os.environ))
