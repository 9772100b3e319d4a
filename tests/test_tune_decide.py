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


# dpkit plan's least-sharding-first order, written out: the order of the first round and
# of ties (ZeRO-2 keeps whole parameters between steps, FSDP2 shard-grad-op 1/N of them).
LEAST_SHARDING_FIRST = ["ddp", "zero1", "zero2", "fsdp2_shard_grad_op", "fsdp2_full_shard"]


def test_first_round_starts_with_the_current_configuration_then_ddp():
    names = [c.name for c in space.first_round(_settings(baseline_strategy="zero1"))]
    assert names[0] == "zero1-mb4x1"
    assert names[1:4] == ["ddp-mb4x1", "ddp-mb2x2", "ddp-mb1x4"]  # DDP: the loss reference
    # Then least sharding first, FSDP2's two modes after ZeRO-2: all five by default.
    assert [n.rsplit("-mb", 1)[0] for n in names[4:]] == [
        *["zero1"] * 2, *["zero2"] * 3, *["fsdp2_shard_grad_op"] * 3, *["fsdp2_full_shard"] * 3
    ]  # fmt: skip
    assert len(names) == len(set(names)) == 15
    # Every candidate trains the same 4 samples per rank per optimizer step.
    for candidate in space.first_round(_settings()):
        assert candidate.micro_batch_size * candidate.gradient_accumulation_steps == 4


def test_fsdp2_can_be_the_current_configuration():
    settings = _settings(
        strategies=("fsdp2_full_shard", "ddp", "fsdp2_shard_grad_op"),
        baseline_strategy="fsdp2_shard_grad_op",
    )
    names = [c.name for c in space.first_round(settings)]
    assert names == [
        "fsdp2_shard_grad_op-mb4x1",
        "ddp-mb4x1", "ddp-mb2x2", "ddp-mb1x4",
        "fsdp2_shard_grad_op-mb2x2", "fsdp2_shard_grad_op-mb1x4",
        "fsdp2_full_shard-mb4x1", "fsdp2_full_shard-mb2x2", "fsdp2_full_shard-mb1x4",
    ]  # fmt: skip
    ranks = [space.Candidate(name, 1, 4).sharding_rank for name in LEAST_SHARDING_FIRST]
    assert ranks == sorted(ranks) and len(set(ranks)) == 5


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


def test_fsdp2_gets_no_second_round():
    """FSDP2 has no bucket or contiguous_gradients settings: only the DeepSpeed strategies'
    best candidates are varied, and a ZeRO key on an FSDP2 candidate is refused."""
    from dpkit.tune.run import _Stop, _Tuner

    tuner = _Tuner(_settings(), {}, _Stop())
    tuner.trials = [_trial(name, 4, 1.0) for name in LEAST_SHARDING_FIRST]
    for trial in tuner.trials:  # what a ZeRO trial's ds_config.json says, None for the rest
        zero = trial.candidate.strategy.startswith("zero")
        trial.figures["zero_optimization"] = {"reduce_bucket_size": 2**21} if zero else None
    variants = tuner.second_round()
    assert {v.strategy for v in variants} == {"zero1", "zero2"}, [v.name for v in variants]
    assert len(variants) == 6 and all(v.round == 2 for v in variants)
    # FSDP2 alone: nothing to vary.
    tuner.settings = _settings(strategies=("ddp", "fsdp2_shard_grad_op", "fsdp2_full_shard"))
    assert tuner.second_round() == []
    with pytest.raises(ValueError, match="only DeepSpeed's ZeRO candidates"):
        space.second_round(space.Candidate("fsdp2_shard_grad_op", 2, 2), {}, _settings())
    with pytest.raises(ValueError, match="fsdp2_full_shard: zero_optimization keys"):
        space.Candidate("fsdp2_full_shard", 2, 2, (("reduce_bucket_size", 2**21),))


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


def test_a_tie_between_zero2_and_fsdp2_goes_to_zero2_whatever_the_order():
    """ZeRO-2 and FSDP2 shard-grad-op shard the same states in ZeRO's terms (stage 2);
    ZeRO-2 wins their tie (it keeps whole parameters between steps: less sharding),
    whichever is faster within the tolerance and whatever order the trials ran in."""
    trials = [
        _trial("fsdp2_full_shard", 4, 0.985),
        _trial("fsdp2_shard_grad_op", 4, 0.99),
        _trial("zero2", 4, 0.995),
    ]
    for order in (trials, trials[::-1], trials[1:] + trials[:1]):
        decision = decide(order, "ddp-mb4x1", None, "no", tie_tolerance=0.02)
        assert decision.winner.name == "zero2-mb4x1"
        assert decision.reason.startswith("within 2% of the fastest (fsdp2_full_shard-mb4x1")
    # Equal step times: still ZeRO-2, in either order.
    equal = [_trial("fsdp2_shard_grad_op", 4, 1.0), _trial("zero2", 4, 1.0)]
    for order in (equal, equal[::-1]):
        assert decide(order, "ddp-mb4x1", None, "no", 0.0).winner.name == "zero2-mb4x1"
    # Shard-grad-op before full-shard; within one strategy, equal times go by name.
    fsdp2 = [_trial("fsdp2_full_shard", 4, 0.99), _trial("fsdp2_shard_grad_op", 4, 1.0)]
    assert decide(fsdp2, "x", None, "no", 0.02).winner.name == "fsdp2_shard_grad_op-mb4x1"
    same = [_trial("fsdp2_full_shard", 4, 1.0), _trial("fsdp2_full_shard", 2, 1.0)]
    for order in (same, same[::-1]):
        assert decide(order, "x", None, "no", 0.0).winner.name == "fsdp2_full_shard-mb2x2"
    # Beyond the tolerance the faster wins, FSDP2 or not; its losses are checked like ZeRO's.
    faster = [_trial("ddp", 4, 1.0), _trial("zero2", 4, 1.0), _trial("fsdp2_shard_grad_op", 4, 0.9)]
    decision = decide(faster, "ddp-mb4x1", None, "no", 0.02)
    assert decision.winner.name == "fsdp2_shard_grad_op-mb4x1"
    assert decision.speedup == pytest.approx(1.0 / 0.9)
    assert decision.verdicts["fsdp2_shard_grad_op-mb4x1"].loss_reference == "ddp-mb4x1"
    off = [_trial("ddp", 4, 1.0), _trial("fsdp2_shard_grad_op", 4, 0.9, losses=[2.0, 1.9, 1.7])]
    assert decide(off, "ddp-mb4x1", None, "no", 0.02).winner.name == "ddp-mb4x1"


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
        (
            {"strategies": ("ddp", "zero3")},
            "strategies='ddp,zero3': zero3 is not run by dpkit's recipes; a list of ddp, "
            "zero1, zero2, fsdp2_shard_grad_op, fsdp2_full_shard",
        ),
        ({"strategies": ("fsdp2_full_shard",) * 2}, "listed twice"),
        ({"baseline_strategy": "zero2_offload"}, "baseline_strategy='zero2_offload': one of"),
        (
            {"strategies": ("ddp", "fsdp2_shard_grad_op"), "zero_bucket_sizes": (2**22,)},
            "zero_bucket_sizes=(4194304,): no DeepSpeed strategy among "
            "strategies='ddp,fsdp2_shard_grad_op'",
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


def test_the_tune_tries_every_strategy_the_recipes_run_by_default():
    assert list(TuneConfig().strategies) == LEAST_SHARDING_FIRST
    config = TuneConfig(
        strategies=("fsdp2_full_shard", "fsdp2_shard_grad_op"),
        baseline_strategy="fsdp2_full_shard",
    )
    assert config.baseline_strategy == "fsdp2_full_shard"


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


def test_the_plan_predicts_fsdp2_with_padded_shards_as_dpkit_plan_does():
    """At 3 processes the small GPT-2's 8192-row embedding does not split evenly: FSDP2's
    shards are ceil(d0/3) rows each (torch.chunk's), which the prediction counts."""
    import math
    from dataclasses import replace

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from dpkit.plan.inputs import PlanInputs
    from dpkit.plan.recommend import make_plan

    settings = replace(
        _settings(),
        nproc=3,
        plan_model={"LMWorkload": {"size": "small", "synthetic": True, "seq_len": 32}},
    )
    plan = space.MemoryPlan(settings)
    # The parameters by hand: MODEL_SIZES["small"], built on the meta device by transformers.
    with torch.device("meta"):
        model = GPT2LMHeadModel(
            GPT2Config(
                n_layer=6,
                n_embd=512,
                n_head=8,
                vocab_size=8192,
                n_positions=128,
                bos_token_id=None,
                eos_token_id=None,
            )
        )
    shapes = [tuple(p.shape) for p in model.parameters()]  # the tied head counted once
    whole = sum(math.prod(s) for s in shapes)
    padded = sum(-(-s[0] // 3) * math.prod(s[1:]) for s in shapes)
    assert padded > whole / 3  # the padding is there to be counted
    for name in ("fsdp2_shard_grad_op", "fsdp2_full_shard"):
        row = plan.estimate(space.Candidate(name, 2, 2))
        # fp32 parameters, gradients and AdamW's two moments, no master copy.
        assert (row.params, row.grads, row.optimizer, row.master) == (
            4 * padded, 4 * padded, 8 * padded, 0.0
        )  # fmt: skip
    sgo = plan.estimate(space.Candidate("fsdp2_shard_grad_op", 2, 2))
    full = plan.estimate(space.Candidate("fsdp2_full_shard", 2, 2))
    # Shard-grad-op holds every layer's whole parameters from forward to backward.
    # Full-shard: the root's and two layers' (40.3 MiB here, against 88.5).
    assert sgo.buffer_parts["fsdp2_whole_params"] >= 4 * whole
    assert full.buffer_parts["fsdp2_whole_params"] < 0.5 * 4 * whole
    # The same figure as dpkit plan's own row for these inputs.
    inputs = PlanInputs(
        model=plan.spec,
        gpus_per_node=3,
        gpu_memory=2**40,
        precision="fp32",
        micro_batch=2,
        gradient_accumulation_steps=2,
        seq_len=32,
        reserve=0,
        headroom=0.0,
    )
    rows = {row.strategy: row for row in make_plan(inputs).rows}
    for name in ("fsdp2_shard_grad_op", "fsdp2_full_shard"):
        assert plan.predict(space.Candidate(name, 2, 2)) == rows[name].total


def _decision(trial: Trial):
    from dpkit.tune.decide import Decision

    return Decision(trial, None, None, [trial.name], "fastest", {}, 2e-3)


def test_an_fsdp2_winner_gets_its_yaml_and_no_deepspeed_json(tmp_path):
    import yaml

    from dpkit.tune import report

    settings = _settings(recipe_args=("--size", "tiny"))
    trial = Trial(
        space.Candidate("fsdp2_shard_grad_op", 2, 2), status=OK, figures={"median_step_time_s": 1}
    )
    where = report.write_winner(settings, _decision(trial), tmp_path)
    assert sorted(p.name for p in where.iterdir()) == ["accelerate.yaml", "command.sh"]
    config = yaml.safe_load((where / "accelerate.yaml").read_text())
    assert config["distributed_type"] == "FSDP"
    assert config["fsdp_config"]["fsdp_version"] == 2
    assert config["fsdp_config"]["fsdp_reshard_after_forward"] is False
    command = (where / "command.sh").read_text()
    assert f"--config_file {where / 'accelerate.yaml'} --num_processes 2 train_lm.py" in command
    assert "--size tiny --micro-batch-size 2 --gradient-accumulation-steps 2" in command


def test_a_zero_winner_gets_the_json_it_ran_with(tmp_path):
    import json

    import yaml

    from dpkit.tune import report
    from dpkit.tune.trials import trial_dir

    settings = replace_output(_settings(), tmp_path)
    trial = Trial(space.Candidate("zero2", 4, 1), status=OK, figures={"median_step_time_s": 1})
    ran = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 12345}}
    run_dir = trial_dir(settings, trial.candidate) / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "ds_config.json").write_text(json.dumps(ran))
    where = report.write_winner(settings, _decision(trial), tmp_path)
    assert json.loads((where / "ds_config.json").read_text()) == ran
    config = yaml.safe_load((where / "accelerate.yaml").read_text())
    assert config["deepspeed_config"]["deepspeed_config_file"] == str(where / "ds_config.json")


def replace_output(settings: TuneSettings, out: Path) -> TuneSettings:
    from dataclasses import replace

    return replace(settings, output_dir=out)
