"""``dpkit tune``'s choices without launching: candidates, verdicts, the winner, the flags.

The launches (the figures these choices are made on) are in tests/test_tune.py.
"""

from __future__ import annotations

import json
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


def test_a_candidates_name_and_json_keys_say_what_it_runs():
    """Bucket sizes in the name in M or K where whole, else in elements; a bucket sets the
    reduce and the all-gather bucket; a flag named for the way it is set."""
    names = {
        3 * 2**20: "zero1-mb8x1-bucket3M",
        1536 * 2**10: "zero1-mb8x1-bucket1536K",
        2**19: "zero1-mb8x1-bucket512K",
        1_000_002: "zero1-mb8x1-bucket1000002",
    }
    for size, name in names.items():
        candidate = space.Candidate("zero1", 8, 1, (("reduce_bucket_size", size),))
        assert candidate.name == name
        assert candidate.zero_overrides == {
            "reduce_bucket_size": size,
            "allgather_bucket_size": size,
        }
    flags = (("contiguous_gradients", True), ("overlap_comm", False))
    candidate = space.Candidate("zero2", 1, 4, flags, round=2)
    assert candidate.name == "zero2-mb1x4-contig-nooverlap"
    assert candidate.zero_overrides == {"contiguous_gradients": True, "overlap_comm": False}
    flipped = space.Candidate("zero2", 1, 4, (("contiguous_gradients", False), ("overlap_comm", 1)))
    assert flipped.name == "zero2-mb1x4-nocontig-overlap"
    assert candidate.as_dict() == {
        "name": "zero2-mb1x4-contig-nooverlap",
        "strategy": "zero2",
        "micro_batch_size": 1,
        "gradient_accumulation_steps": 4,
        "zero_overrides": {"contiguous_gradients": True, "overlap_comm": False},
        "gradient_checkpointing": False,
        "round": 2,
    }
    assert space.Candidate("ddp", 4, 1).as_dict()["round"] == 1
    # What each strategy shards, in ZeRO stages, and its place in dpkit plan's order.
    stages = [space.Candidate(name, 4, 1).sharding for name in LEAST_SHARDING_FIRST]
    assert stages == [0, 1, 2, 2, 3]
    ranks = [space.Candidate(name, 4, 1).sharding_rank for name in LEAST_SHARDING_FIRST]
    assert ranks == [0, 1, 2, 4, 5]  # 3 is ZeRO-3's place in the plan's order (not tuned yet)
    with pytest.raises(ValueError, match="^ddp: zero_optimization keys are DeepSpeed's only$"):
        space.Candidate("ddp", 4, 1, (("overlap_comm", True),))


def test_the_current_configuration_is_its_strategy_at_its_micro_batch():
    from dataclasses import replace

    settings = replace(_settings(baseline_strategy="zero1"), per_rank_batch=8)
    settings = replace(settings, baseline_micro_batch=2)
    assert space.baseline(settings) == space.Candidate("zero1", 2, 4)


def test_second_round_buckets_are_clamped_aligned_and_flags_follow_what_ran():
    """A quarter and four times the bucket that ran, each at least 2^18 elements (smaller
    only adds per-call costs), at most DeepSpeed's 5e8, rounded up to an even count (its
    alignment assert)."""
    best = space.Candidate("zero1", 4, 1)

    def variants(ran: dict, **settings) -> list[tuple]:
        found = space.second_round(best, ran, _settings(**settings))
        assert all(v.round == 2 and v.micro_batch_size == 4 for v in found)
        assert all(v.gradient_accumulation_steps == 1 and v.strategy == "zero1" for v in found)
        return [v.zero for v in found]

    assert variants({"reduce_bucket_size": 2**19, "contiguous_gradients": False}) == [
        (("reduce_bucket_size", 2**18),),  # 2^17 raised to the floor
        (("reduce_bucket_size", 2**21),),
        (("contiguous_gradients", True),),
    ]
    # 4,000,006 / 4 = 1,000,001.5 -> 1,000,001 -> 1,000,002 (even); x 4 = 16,000,024.
    assert variants({"reduce_bucket_size": 4_000_006})[:2] == [
        (("reduce_bucket_size", 1_000_002),),
        (("reduce_bucket_size", 16_000_024),),
    ]
    # Nothing resolved: DeepSpeed's defaults ran (5e8 elements, contiguous gradients on);
    # four times it is clamped back to 5e8, which ran already.
    assert variants({}) == [
        (("reduce_bucket_size", 125_000_000),),
        (("contiguous_gradients", False),),
    ]
    assert variants({"reduce_bucket_size": 3 * 10**8})[1] == (("reduce_bucket_size", 500_000_000),)
    # Sizes given: those, less the one that ran.
    assert variants({"reduce_bucket_size": 2**21}, zero_bucket_sizes=(2**20, 2**21, 2**22)) == [
        (("reduce_bucket_size", 2**20),),
        (("reduce_bucket_size", 2**22),),
        (("contiguous_gradients", False),),
    ]


def test_overlap_comm_is_tried_for_zero2_on_cuda_only():
    from dataclasses import replace

    cuda = replace(_settings(), device="cuda")
    ran = {"reduce_bucket_size": 2**21, "overlap_comm": True}
    zero2 = space.second_round(space.Candidate("zero2", 4, 1), ran, cuda)
    assert [v.name for v in zero2][-2:] == ["zero2-mb4x1-nocontig", "zero2-mb4x1-nooverlap"]
    default = space.second_round(space.Candidate("zero2", 4, 1), {}, cuda)
    assert default[-1].zero == (("overlap_comm", True),)  # DeepSpeed's default is off
    # ZeRO-1 reduces after the backward: nothing to overlap. On CPU: no CUDA streams.
    zero1 = space.second_round(space.Candidate("zero1", 4, 1), ran, cuda)
    assert [v.name for v in zero1][-1] == "zero1-mb4x1-nocontig"
    cpu = space.second_round(space.Candidate("zero2", 4, 1), ran, _settings())
    assert [v.name for v in cpu][-1] == "zero2-mb4x1-nocontig"


def test_the_plan_is_made_for_dpkits_recipes_only():
    from dataclasses import replace

    with pytest.raises(UsageError, match="^--recipe=train_lm.py: not from recipes/finetune.py"):
        space.MemoryPlan(replace(_settings(), plan_model={"SomeWorkload": {}}))

    plan, note = space.memory_plan(_settings())
    assert plan is None
    assert note == (
        "no plan: train_lm.py is not one of dpkit's recipes, so its model is known only once "
        "it runs; the budget is checked against measurements"
    )
    workload = {"LMWorkload": {"size": "tiny", "synthetic": True, "seq_len": 16}}
    plan, note = space.memory_plan(replace(_settings(), plan_model=workload))
    assert note == "plan: train_lm --size tiny, 16 tokens, fp32"
    assert (plan.model_name, plan.seq_len, plan.precision) == ("train_lm --size tiny", 16, "fp32")


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


def test_the_tie_window_is_a_fraction_of_the_fastest_step_at_any_scale():
    """--tie-tolerance is a share of the fastest step time (2%), not seconds: at 0.05 s a
    candidate 20% slower is no tie (an absolute 0.02 s window would take it); at 20 s one
    1% slower is (an absolute window would miss it)."""
    fast = [_trial("ddp", 4, 0.06), _trial("zero2", 4, 0.05)]
    decision = decide(fast, "ddp-mb4x1", None, "no", tie_tolerance=0.02)
    assert decision.winner.name == "zero2-mb4x1"
    assert decision.tie == ["zero2-mb4x1"]
    assert decision.reason == "fastest of 2 eligible candidates"
    assert decision.speedup == pytest.approx(0.06 / 0.05)
    slow = [_trial("ddp", 4, 20.2), _trial("zero2", 4, 20.0)]
    decision = decide(slow, "ddp-mb4x1", None, "no", tie_tolerance=0.02)
    assert decision.winner.name == "ddp-mb4x1"
    assert decision.tie == ["ddp-mb4x1", "zero2-mb4x1"]
    assert decision.reason == "within 2% of the fastest (zero2-mb4x1, 20.000 s) with less sharding"
    assert decision.speedup == 1.0
    # 2% of 20 s is 0.4 s: 20.5 s is outside the window, whatever the order of the trials.
    outside = [_trial("ddp", 4, 20.5), _trial("zero2", 4, 20.0)]
    for order in (outside, outside[::-1]):
        decision = decide(order, "ddp-mb4x1", None, "no", tie_tolerance=0.02)
        assert decision.winner.name == "zero2-mb4x1" and decision.tie == ["zero2-mb4x1"]
        assert decision.speedup == pytest.approx(20.5 / 20.0)
    # A wider window (10%) takes it in: the tolerance given is the one used.
    assert decide(outside, "ddp-mb4x1", None, "no", 0.10).winner.name == "ddp-mb4x1"


# The equivalence tolerances, argued where they were measured (never read from dpkit):
# fp32 2e-3, tests/test_launchers.py (the bare stack's DDP drifted from DeepSpeed to ~3e-4
# relative by step 6, docs/equivalence.md: about 6x margin); bf16 2^-6 = 4 units of bf16's
# roundoff, tests/test_mixed_precision.py (DeepSpeed's bf16 module against DDP's autocast
# measured at most 0.61% over 6 steps).
FP32_LOSS_RTOL = 2e-3
BF16_LOSS_RTOL = 2.0**-6


def test_fp32_losses_are_held_to_fp32s_tolerance_and_bf16_to_bf16s():
    """A ZeRO-2 trial 1% off DDP is a broken run in fp32 (5x the tolerance) and within
    bf16's rounding: the fast, wrong trial must not win an fp32 tune."""
    ddp = _trial("ddp", 4, 1.0)  # losses 2.0, 1.9, 1.8
    one_percent_off = _trial("zero2", 4, 0.5, losses=[2.0, 1.9, 1.8 * 1.01])
    for precision in ("no", "fp32"):  # accelerate's name for fp32, and dpkit's
        decision = decide([ddp, one_percent_off], "ddp-mb4x1", None, precision, 0.02)
        assert decision.loss_rtol == FP32_LOSS_RTOL
        assert decision.winner.name == "ddp-mb4x1", precision
        verdict = decision.verdicts["zero2-mb4x1"]
        assert verdict.loss_deviation == pytest.approx(0.01)
        assert (verdict.agrees, verdict.eligible) == (False, False)
        assert verdict.why_not == "losses differ from ddp-mb4x1 by 1.00e-02 (tolerance 0.002)"
    decision = decide([ddp, one_percent_off], "ddp-mb4x1", None, "bf16", 0.02)
    assert decision.loss_rtol == BF16_LOSS_RTOL
    assert decision.winner.name == "zero2-mb4x1"
    assert decision.verdicts["zero2-mb4x1"].agrees is True
    assert decision.speedup == 2.0
    # "Within" the tolerance: 2^-6 itself (exact in binary) agrees in bf16.
    one = _trial("ddp", 4, 1.0, losses=[1.0])
    edge = _trial("zero2", 4, 0.5, losses=[1.0 + 2.0**-6])
    verdict = decide([one, edge], "ddp-mb4x1", None, "bf16", 0.02).verdicts["zero2-mb4x1"]
    assert verdict.loss_deviation == 2.0**-6 and verdict.agrees is True
    # Each tolerance's edge: 0.75x of it agrees, 1.5x does not.
    for precision, rtol in (("no", FP32_LOSS_RTOL), ("bf16", BF16_LOSS_RTOL)):
        for share, agrees in ((0.75, True), (1.5, False)):
            trial = _trial("zero2", 4, 0.5, losses=[2.0, 1.9 * (1 + share * rtol), 1.8])
            verdict = decide([ddp, trial], "ddp-mb4x1", None, precision, 0.02).verdicts
            assert verdict["zero2-mb4x1"].agrees is agrees, (precision, share)


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


def test_a_verdict_says_why_a_trial_is_out_budget_first():
    mib = 2**20
    trials = [
        _trial("ddp", 4, 0.3, memory=300 * mib),
        # Over the budget and off DDP's losses: the budget is named.
        _trial("zero1", 4, 0.1, memory=250 * mib, losses=[2.0, 1.9, 1.5]),
        _trial("zero2", 4, 0.2, memory=200 * mib),  # exactly the budget: fits
        Trial(space.Candidate("fsdp2_full_shard", 4, 1), status=FAILED),
        Trial(space.Candidate("fsdp2_shard_grad_op", 4, 1), status="pruned", reason="too big"),
    ]
    decision = decide(trials, "ddp-mb4x1", 200 * mib, "no", 0.02)
    verdicts = {name: v.as_dict() for name, v in decision.verdicts.items()}
    assert verdicts["ddp-mb4x1"] == {
        "fits": False,
        "loss_reference": "ddp-mb4x1",
        "loss_deviation": 0.0,
        "agrees": True,
        "eligible": False,
        "why_not": "measured 300.0 MiB per rank, over the budget",
    }
    assert verdicts["zero1-mb4x1"]["why_not"] == "measured 250.0 MiB per rank, over the budget"
    assert verdicts["zero1-mb4x1"]["agrees"] is False
    assert verdicts["zero2-mb4x1"]["fits"] is True and verdicts["zero2-mb4x1"]["eligible"]
    assert verdicts["fsdp2_full_shard-mb4x1"] == {
        "fits": None,
        "loss_reference": None,
        "loss_deviation": None,
        "agrees": None,
        "eligible": False,
        "why_not": "failed",
    }
    assert verdicts["fsdp2_shard_grad_op-mb4x1"]["why_not"] == "pruned: too big"
    assert decision.winner.name == "zero2-mb4x1"
    assert decision.speedup is None  # the current configuration does not fit
    assert decision.baseline.name == "ddp-mb4x1"
    # Nothing eligible: no winner, and why.
    decision = decide(trials, "ddp-mb4x1", 100 * mib, "no", 0.02)
    assert (decision.winner, decision.speedup, decision.tie) == (None, None, [])
    assert decision.reason == "no candidate ran, fits and agrees"
    assert decision.baseline.name == "ddp-mb4x1" and decision.loss_rtol == 2e-3
    assert decision.verdicts["zero2-mb4x1"].why_not == (
        "measured 200.0 MiB per rank, over the budget"
    )
    # The current configuration failed: no baseline at all.
    assert decide(trials, "fsdp2_full_shard-mb4x1", None, "no", 0.02).baseline is None


def test_losses_are_compared_relative_to_ddps_whatever_their_size():
    """Relative to DDP's loss, also below 1 (0.25: 1e-3 off is 0.4%) and at 0, and a
    trial that logged no loss is not taken to agree."""
    ddp = _trial("ddp", 4, 1.0, losses=[0.5, 0.25])
    small = _trial("zero2", 4, 0.5, losses=[0.5, 0.251])
    found = decide([ddp, small], "ddp-mb4x1", None, "no", 0.02).verdicts["zero2-mb4x1"]
    assert found.loss_deviation == pytest.approx(0.001 / 0.25)
    assert found.agrees is False
    zero = _trial("ddp", 4, 1.0, losses=[0.0])
    near = _trial("zero2", 4, 0.5, losses=[1e-9])
    found = decide([zero, near], "ddp-mb4x1", None, "no", 0.02).verdicts["zero2-mb4x1"]
    assert found.loss_deviation > 100 and found.agrees is False  # relative to 0: unbounded
    silent = Trial(
        space.Candidate("zero2", 4, 1), status=OK, figures={"median_step_time_s": 0.5, "losses": []}
    )
    found = decide([ddp, silent], "ddp-mb4x1", None, "no", 0.02).verdicts["zero2-mb4x1"]
    assert found.loss_deviation == float("inf") and found.agrees is False
    assert found.why_not == "losses differ from ddp-mb4x1 by inf (tolerance 0.002)"
    # Only the steps both logged are compared (a shorter reference: its steps).
    longer = _trial("zero2", 4, 0.5, losses=[0.5, 0.25, 9.0])
    found = decide([ddp, longer], "ddp-mb4x1", None, "no", 0.02).verdicts["zero2-mb4x1"]
    assert found.loss_deviation == 0.0 and found.agrees is True


def test_without_ddp_at_the_same_micro_batch_the_nearest_is_the_reference():
    ddp = [_trial("ddp", 4, 1.0), _trial("ddp", 1, 1.0)]
    three = _trial("zero2", 3, 0.5)  # |4 - 3| = 1 against |1 - 3| = 2
    verdicts = decide([*ddp, three], "ddp-mb4x1", None, "no", 0.02).verdicts
    assert verdicts["zero2-mb3x1"].loss_reference == "ddp-mb4x1"
    two = _trial("zero2", 2, 0.5)
    assert decide([ddp[1], two], "x", None, "no", 0.02).verdicts["zero2-mb2x2"].loss_reference == (
        "ddp-mb1x4"
    )
    # No DDP trial ran: nothing to compare with, the losses are not held against it.
    alone = decide([two], "x", None, "no", 0.02)
    assert alone.verdicts["zero2-mb2x2"].agrees is None and alone.winner.name == "zero2-mb2x2"
    # A failed DDP trial is no reference.
    failed = Trial(space.Candidate("ddp", 2, 2), status=FAILED, reason="exit code 1")
    assert decide([failed, two], "x", None, "no", 0.02).verdicts["zero2-mb2x2"].agrees is None


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"strategies": ("ddp", "zero4")},
            "strategies='ddp,zero4': zero4 is not run by dpkit's recipes; a list of ddp, zero1, "
            "zero2, zero2_offload, zero3, zero3_offload, fsdp2_shard_grad_op, "
            "fsdp2_full_shard, fsdp2_full_shard_offload",
        ),
        ({"strategies": ("fsdp2_full_shard",) * 2}, "listed twice"),
        ({"baseline_strategy": "zero4"}, "baseline_strategy='zero4': one of"),
        (
            {"fallback_strategies": ("zero3", "zero4")},
            "fallback_strategies='zero3,zero4': zero4 is not one of ddp, zero1, zero2, "
            "zero2_offload, zero3, zero3_offload, fsdp2_shard_grad_op",
        ),
        ({"fallback_strategies": ("zero3", "zero3")}, "fallback_strategies='zero3,zero3': listed"),
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


# What pays in speed for memory, tried only where nothing lighter fits, in the order the
# tune tries them (dpkit plan's: what stays on the device first, then the offloads).
FALLBACKS = ["zero3", "zero2_offload", "zero3_offload", "fsdp2_full_shard_offload"]


def test_the_tune_tries_every_strategy_the_recipes_run_by_default():
    """By default the five that keep their state on the device without ZeRO-3's gathers;
    ZeRO-3 and the offloads are fallbacks, and any of them can be named."""
    config = TuneConfig()
    assert list(config.strategies) == LEAST_SHARDING_FIRST
    assert sorted(config.fallback_strategies) == sorted(FALLBACKS)
    config = TuneConfig(
        strategies=("fsdp2_full_shard", "fsdp2_shard_grad_op"),
        baseline_strategy="fsdp2_full_shard",
    )
    assert config.baseline_strategy == "fsdp2_full_shard"
    named = TuneConfig(strategies=("ddp", "zero3", "zero2_offload"), baseline_strategy="zero3")
    assert named.strategies == ("ddp", "zero3", "zero2_offload")
    # Named, a fallback is in the first round; it is not tried again as a fallback.
    settings = _settings(strategies=("ddp", "zero3_offload"))
    assert [c.name for c in space.first_round(settings)] == [
        "ddp-mb4x1", "ddp-mb2x2", "ddp-mb1x4",
        "zero3_offload-mb4x1", "zero3_offload-mb2x2", "zero3_offload-mb1x4",
    ]  # fmt: skip
    assert {c.strategy for c in space.fallback_round(settings, set())} == {
        "zero3", "zero2_offload", "fsdp2_full_shard_offload"
    }  # fmt: skip


def test_the_command_line_names_the_fallbacks_or_none():
    import argparse

    from dpkit.tune.cli import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    default = config_from_args(parser.parse_args([]))
    assert list(default.strategies) == LEAST_SHARDING_FIRST
    assert sorted(default.fallback_strategies) == sorted(FALLBACKS)
    assert (
        config_from_args(parser.parse_args(["--fallback-strategies", "none"])).fallback_strategies
        == ()
    )
    named = config_from_args(
        parser.parse_args(["--strategies", "ddp,zero3", "--fallback-strategies", "zero3_offload"])
    )
    assert (named.strategies, named.fallback_strategies) == (("ddp", "zero3"), ("zero3_offload",))


def test_the_fallbacks_are_every_micro_batch_of_zero3_and_the_offloads_once():
    known: set[str] = set()
    found = [c.name for c in space.fallback_round(_settings(), known)]
    assert found == [f"{name}-mb{m}x{4 // m}" for name in FALLBACKS for m in (4, 2, 1)]
    assert known == set(found)
    assert space.fallback_round(_settings(), known) == []  # known by now
    assert space.fallback_round(_settings(fallback_strategies=()), set()) == []
    on = space.fallback_round(_settings(gradient_checkpointing="on"), set())
    assert on[0].name == "zero3-mb4x1-ckpt" and all(c.gradient_checkpointing for c in on)
    both = [c.name for c in space.fallback_round(_settings(gradient_checkpointing="both"), set())]
    assert both[:2] == ["zero3-mb4x1", "zero3-mb4x1-ckpt"] and len(both) == 24


def test_the_tuner_adds_the_fallbacks_only_where_nothing_measured_fits():
    """Every trial over the budget or out of memory: the fallbacks follow. One that fits,
    or a failure that is not a memory matter, and none is tried."""
    from dpkit.tune.run import _Stop, _Tuner

    def tuner_with(*trials: Trial) -> _Tuner:
        tuner = _Tuner(replace_budget(_settings(gradient_checkpointing="off"), 150.0), {}, _Stop())
        tuner.trials = list(trials)
        tuner.known = {t.name for t in trials}
        return tuner

    oom = Trial(space.Candidate("zero1", 4, 1), status=FAILED,
                reason="exit code 1; torch.OutOfMemoryError: CUDA out of memory.")  # fmt: skip
    over = _trial("ddp", 4, 1.0, memory=200.0)
    fallbacks = tuner_with(over, oom).fallbacks_where_nothing_fits()
    assert [t.name for t in fallbacks] == [
        f"{name}-mb{m}x{4 // m}" for name in FALLBACKS for m in (4, 2, 1)
    ]
    assert (
        tuner_with(over, oom, _trial("zero2", 4, 1.0, memory=100.0)).fallbacks_where_nothing_fits()
        == []
    )
    crash = Trial(space.Candidate("zero2", 4, 1), status=FAILED, reason="exit code 1; KeyError")
    assert tuner_with(over, crash).fallbacks_where_nothing_fits() == []
    # No budget: nothing is over it, and a default tune on a model that fits stays as it is.
    tuner = _Tuner(_settings(gradient_checkpointing="off"), {}, _Stop())
    tuner.trials = [_trial("ddp", 4, 1.0, memory=1e12)]
    assert tuner.fallbacks_where_nothing_fits() == []


def test_the_plan_brings_in_the_fallbacks_only_where_it_prunes_every_lighter_candidate():
    """A CUDA budget of 45 MiB for the tiny GPT-2 at micro-batch 4: dpkit plan puts every
    default candidate over it by more than its error bound; the fallbacks are predicted
    next, and what they keep on the device decides (FSDP2's offload keeps the least).
    With room for everything, the first round is the five strategies' fifteen."""
    from dataclasses import replace

    from dpkit.tune.run import _Stop, _Tuner
    from dpkit.tune.trials import PRUNED

    settings = replace(
        _lm_settings("tiny", device="cuda"), config=TuneConfig(gradient_checkpointing="off")
    )
    roomy = _Tuner(replace_budget(settings, 2.0**40), {}, _Stop()).first_round()
    assert [t.name for t in roomy] == [c.name for c in space.first_round(settings)]
    assert len(roomy) == 15 and not any(t.status == PRUNED for t in roomy)

    tight = _Tuner(replace_budget(settings, 45 * 2.0**20), {}, _Stop()).first_round()
    names = [t.name for t in tight]
    fallback_names = [f"{name}-mb{m}x{4 // m}" for name in FALLBACKS for m in (4, 2, 1)]
    assert names[:15] == [t.name for t in roomy] and names[15:] == fallback_names
    assert all(t.status == PRUNED for t in tight[:15])
    assert [t.name for t in tight if t.status != PRUNED] == [
        "fsdp2_full_shard_offload-mb4x1",
        "fsdp2_full_shard_offload-mb2x2",
        "fsdp2_full_shard_offload-mb1x4",
    ]


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


# What shapes a trial's time or memory, varied one at a time: a tune with any of these
# changed launches the trial again. TuneConfig fields resolved into TuneSettings (nproc,
# threads_per_process, recipe) are varied where the trial reads them, in the settings.
SHAPES_THE_TRIAL_CONFIG = {
    "recipe_args": ("--size", "small"),
    "warmup_steps": 3,
    "steps": 8,
}
SHAPES_THE_TRIAL_SETTINGS = {
    "nproc": 4,
    "device": "cuda",
    "threads_per_process": 2,
}
SHAPES_THE_TRIAL_CANDIDATE = {
    "strategy": "zero1",
    "micro_batch_size": 1,
    "gradient_accumulation_steps": 4,
    "zero": (("reduce_bucket_size", 1_000_000),),
    "gradient_checkpointing": True,
}
# What only chooses candidates or judges trials: the same trial is reused.
JUDGES_ONLY_CONFIG = {
    "strategies": ("ddp", "zero2"),
    "fallback_strategies": ("zero3",),
    "micro_batch_size": 1,
    "gradient_accumulation_steps": 2,
    "baseline_strategy": "zero2",
    "global_batch_size": 16,
    "micro_batch_sizes": (1, 2),
    "zero_bucket_sizes": (1_000_000,),
    "gradient_checkpointing": "both",
    "zero_variants": False,
    "memory_budget": 2**30,
    "time_budget_s": 60.0,
    "max_trials": 3,
    "trial_timeout_s": 60.0,
    "tie_tolerance": 0.1,
    "output_dir": "elsewhere",
    "retry_failed": True,  # an ok trial is reused all the same
}
JUDGES_ONLY_SETTINGS = {
    "global_batch_size": 16,
    "per_rank_batch": 8,
    "baseline_micro_batch": 1,
    "micro_batch_sizes": (1,),
    "precision": "bf16",  # the precision a trial runs in is a recipe argument
    "memory_budget": 2**30,
    "output_dir": None,  # the folder itself: the trial is read from it
    "plan_model": {"model": "other"},
}
RESOLVED_INTO_SETTINGS = {"nproc", "threads_per_process", "recipe"}


def test_every_tune_setting_is_known_to_shape_a_trial_or_not():
    """A new setting must be sorted into one of the lists above (and so into the
    fingerprint, or not) before this passes."""
    from dataclasses import fields

    config = {f.name for f in fields(TuneConfig)}
    assert config == set(SHAPES_THE_TRIAL_CONFIG) | set(JUDGES_ONLY_CONFIG) | RESOLVED_INTO_SETTINGS
    settings = {f.name for f in fields(TuneSettings)} - {"config", "recipe"}
    assert settings == set(SHAPES_THE_TRIAL_SETTINGS) | set(JUDGES_ONLY_SETTINGS)
    candidate = {f.name for f in fields(space.Candidate)} - {"round"}
    assert candidate == set(SHAPES_THE_TRIAL_CANDIDATE)


def _saved_trial(tmp_path: Path):
    from dataclasses import replace

    from dpkit.tune import trials as tune_trials

    tmp_path.mkdir(parents=True, exist_ok=True)
    recipe = tmp_path / "train_lm.py"
    recipe.write_text("print('a recipe')\n")
    settings = replace(
        _settings(recipe_args=("--size", "tiny")),
        output_dir=tmp_path / "out",
        recipe=RecipeInfo(recipe, frozenset(), 4),
    )
    candidate = space.Candidate("zero2", 2, 2)
    tune_trials.save(settings, Trial(candidate, status=OK, figures={"median_step_time_s": 1.0}))
    assert tune_trials.load_previous(settings, candidate).reused
    return settings, candidate


@pytest.mark.parametrize("name", sorted(SHAPES_THE_TRIAL_CONFIG))
def test_a_tune_setting_that_shapes_the_trial_launches_it_again(name, tmp_path):
    from dataclasses import replace

    from dpkit.tune import trials as tune_trials

    settings, candidate = _saved_trial(tmp_path)
    changed = replace(
        settings, config=replace(settings.config, **{name: SHAPES_THE_TRIAL_CONFIG[name]})
    )
    assert tune_trials.load_previous(changed, candidate) is None


@pytest.mark.parametrize("name", sorted(SHAPES_THE_TRIAL_SETTINGS))
def test_a_machine_setting_that_shapes_the_trial_launches_it_again(name, tmp_path):
    from dataclasses import replace

    from dpkit.tune import trials as tune_trials

    settings, candidate = _saved_trial(tmp_path)
    changed = replace(settings, **{name: SHAPES_THE_TRIAL_SETTINGS[name]})
    assert tune_trials.load_previous(changed, candidate) is None


@pytest.mark.parametrize("name", sorted(SHAPES_THE_TRIAL_CANDIDATE))
def test_another_candidate_is_another_trial(name, tmp_path):
    from dataclasses import replace

    from dpkit.tune import trials as tune_trials

    settings, candidate = _saved_trial(tmp_path)
    other = replace(candidate, **{name: SHAPES_THE_TRIAL_CANDIDATE[name]})
    # Another candidate has its own folder too; the fingerprint must differ on its own.
    assert tune_trials.fingerprint(settings, other) != tune_trials.fingerprint(settings, candidate)


@pytest.mark.parametrize("name", sorted(JUDGES_ONLY_CONFIG))
def test_a_setting_that_only_judges_trials_reuses_them(name, tmp_path):
    from dataclasses import replace

    from dpkit.tune import trials as tune_trials

    settings, candidate = _saved_trial(tmp_path)
    value = JUDGES_ONLY_CONFIG[name]
    config = replace(settings.config, **{name: value})
    changed = replace(settings, config=config)
    again = tune_trials.load_previous(changed, candidate)
    assert again is not None and again.reused


@pytest.mark.parametrize("name", sorted(JUDGES_ONLY_SETTINGS))
def test_a_resolved_setting_that_only_judges_trials_reuses_them(name, tmp_path):
    from dataclasses import replace

    from dpkit.tune import trials as tune_trials

    settings, candidate = _saved_trial(tmp_path)
    value = JUDGES_ONLY_SETTINGS[name]
    changed = replace(settings, **{name: settings.output_dir if value is None else value})
    again = tune_trials.load_previous(changed, candidate)
    assert again is not None and again.reused


def test_an_edited_recipe_or_another_library_version_launches_the_trial_again(
    tmp_path, monkeypatch
):
    import importlib.metadata

    from dpkit.tune import trials as tune_trials

    settings, candidate = _saved_trial(tmp_path)
    settings.recipe.path.write_text("print('the recipe, edited')\n")
    assert tune_trials.load_previous(settings, candidate) is None
    settings, candidate = _saved_trial(tmp_path / "again")
    real = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata, "version", lambda name: "0.0.1" if name == "deepspeed" else real(name)
    )
    assert tune_trials.load_previous(settings, candidate) is None


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
    import copy
    import math
    from dataclasses import replace

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from dpkit.core.spec import PlanInputs
    from dpkit.plan.peak import step_peak, step_trace_for
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
    made = make_plan(inputs)
    rows = {row.strategy: row for row in made.rows}
    for name in ("fsdp2_shard_grad_op", "fsdp2_full_shard"):
        # A CPU trial's peak_live of its second step: dpkit plan's peak of a later step for
        # these inputs, the step traced with a CPU's kernels (as dpkit plan --against a
        # CPU run plans it), the row's model states with each shard padded.
        trace = step_trace_for(inputs, name, 2, device="cpu")
        later = step_peak(inputs, name, rows[name], trace, made.settings, on_gpu=False).later
        assert plan.predict(space.Candidate(name, 2, 2)) == pytest.approx(later.bytes, rel=1e-12)
        cuda = copy.copy(plan)
        cuda.settings = replace(plan.settings, device="cuda")
        # A GPU's: dpkit plan's own peak for these inputs (traced with a GPU's kernels).
        assert cuda.predict(space.Candidate(name, 2, 2)) == made.peaks[name].later.bytes


def _lm_settings(size: str, device: str = "cpu") -> TuneSettings:
    from dataclasses import replace

    workload = {"LMWorkload": {"size": size, "synthetic": True, "seq_len": 32}}
    return replace(_settings(), device=device, plan_model=workload)


def test_the_plan_predicts_each_candidate_with_its_own_settings():
    """The candidate's micro-batch, accumulation and ZeRO keys, and CUDA's settings on a
    CUDA machine, reach the prediction; on a GPU it is ``dpkit plan``'s own row."""
    import copy
    from dataclasses import replace

    from dpkit.core.spec import PlanInputs
    from dpkit.plan.recommend import make_plan

    # The tiny GPT-2 (its 2^21-element embedding fits dpkit's 2^21 bucket, so contiguous
    # gradients stay on): ZeRO-2 holds one fp32 flat bucket, 4 B x 2^21, and while
    # reducing a flat copy of the fullest bucket: the embedding alone, 8192 x 256 = 2^21
    # elements (a 2-rank run's memory report measured both, 8 MiB each). With a 2^23
    # bucket every gradient fits one bucket: 5,289,472 elements (embeddings 2^21 + 128 x
    # 256, 4 layers of 789,760, the final norm 512). On CUDA overlap_comm adds a second
    # bucket (docs/memory.md, overlap_comm).
    tiny_params = 2**21 + 128 * 256 + 4 * 789_760 + 512
    tiny = space.MemoryPlan(_lm_settings("tiny"))
    assert tiny.estimate(space.Candidate("zero2", 4, 1)).buffers == 4 * 2**21 + 4 * 2**21
    bucket = space.Candidate("zero2", 4, 1, (("reduce_bucket_size", 2**23),))
    assert tiny.estimate(bucket).buffers == 4 * 2**23 + 4 * tiny_params
    tiny_cuda = copy.copy(tiny)
    tiny_cuda.settings = replace(tiny.settings, device="cuda")
    assert tiny_cuda.estimate(space.Candidate("zero2", 4, 1)).buffers == 2 * 4 * 2**21 + 4 * 2**21
    # The small GPT-2: activations are per micro-batch (4 samples hold 4x one's, up to the
    # trace's few hundred bytes that do not grow with the batch: 15.3 MB a sample), and
    # under accumulation ZeRO-2 keeps the accumulated whole gradients beside the next
    # backward (measured in tests/test_tune.py: 109.4 against 89.2 MiB).
    small = space.MemoryPlan(_lm_settings("small"))
    one, four = (small.estimate(space.Candidate("zero2", m, 4 // m)) for m in (1, 4))
    assert one.activations > 0
    assert abs(four.activations - 4 * one.activations) < 1000
    assert one.grads > 1.1 * four.grads
    inputs = PlanInputs(
        model=small.spec,
        gpus_per_node=2,
        gpu_memory=2**40,
        precision="fp32",
        micro_batch=1,
        gradient_accumulation_steps=4,
        seq_len=32,
        reserve=0,
        headroom=0.0,
    )
    peaks = make_plan(inputs).peaks
    small.settings = replace(small.settings, device="cuda")  # dpkit plan plans for GPUs
    for name in ("ddp", "zero1", "zero2"):
        # The peak of a later step (the tune's trials watch their second step).
        assert small.predict(space.Candidate(name, 1, 4)) == peaks[name].later.bytes, name


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


def _tuned_json(settings: TuneSettings, candidate: space.Candidate) -> dict:
    """The DeepSpeed JSON a trial of ``candidate`` is launched with: the one its accelerate
    YAML (the launch command's --config_file) names."""
    import yaml

    from dpkit.tune import trials as tune_trials

    cmd = tune_trials.phase(settings, candidate).cmd
    config = yaml.safe_load(Path(cmd[cmd.index("--config_file") + 1]).read_text())
    return json.loads(Path(config["deepspeed_config"]["deepspeed_config_file"]).read_text())


# A second-round candidate: a quarter of dpkit's 2^21-element bucket, contiguous gradients off.
TUNED = (("reduce_bucket_size", 2**19), ("contiguous_gradients", False))


def test_the_tuners_zero_settings_win_over_the_jsons_auto_and_written_values(tmp_path, monkeypatch):
    """The candidate's keys go over the template's, "auto" and written values alike; the
    run fills only what is left "auto"; the winner's JSON is what the trial ran with.
    Merged the other way, "auto" would stay and the run fill it with dpkit's 2^21 bucket:
    a trial named bucket512K measured with another bucket, and a winner JSON to match."""
    from dpkit import resources
    from dpkit.engines.deepspeed.config import fill_deepspeed_config
    from dpkit.tune import report
    from dpkit.tune.trials import trial_dir

    settings = replace_output(_settings(), tmp_path)
    candidate = space.Candidate("zero2", 2, 2, TUNED, round=2)
    # dpkit's own zero2.json ("reduce_bucket_size": "auto", the rest left out).
    assert _tuned_json(settings, candidate)["zero_optimization"] == {
        "stage": 2,
        "reduce_bucket_size": 2**19,
        "allgather_bucket_size": 2**19,
        "contiguous_gradients": False,
        "reduce_scatter": True,
    }
    # A template with "auto" in one of the keys the tuner sets and written values in the
    # others (and in one it leaves alone, which stays).
    user = tmp_path / "user_zero2.json"
    user.write_text(
        '{"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", '
        '"allgather_bucket_size": 500000000, "contiguous_gradients": true, '
        '"overlap_comm": true}, "train_batch_size": "auto"}'
    )
    monkeypatch.setattr(resources, "deepspeed_config", lambda name: user)
    tuned = _tuned_json(settings, candidate)
    assert tuned["zero_optimization"] == {
        "stage": 2,
        "reduce_bucket_size": 2**19,
        "allgather_bucket_size": 2**19,
        "contiguous_gradients": False,
        "overlap_comm": True,
    }
    # The run resolves what is left "auto" (dpkit's sizes for its model: 2^21 buckets) and
    # writes the result as its ds_config.json; the winner's files carry that JSON.
    dpkit_sizes = {
        "reduce_bucket_size": 2**21,
        "allgather_bucket_size": 2**21,
        "contiguous_gradients": True,
        "overlap_comm": False,
        "round_robin_gradients": False,
        "reduce_scatter": True,
    }
    resolved = fill_deepspeed_config(
        tuned,
        micro_batch_size=2,
        gradient_accumulation_steps=2,
        world_size=2,
        max_grad_norm=1.0,
        precision="no",
        zero_settings=dpkit_sizes,
    )
    run_dir = trial_dir(settings, candidate) / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "ds_config.json").write_text(json.dumps(resolved))
    trial = Trial(candidate, status=OK, figures={"median_step_time_s": 0.05})
    where = report.write_winner(settings, _decision(trial), tmp_path)
    winner = json.loads((where / "ds_config.json").read_text())
    assert winner["zero_optimization"] == {
        "stage": 2,
        "reduce_bucket_size": 2**19,
        "allgather_bucket_size": 2**19,
        "contiguous_gradients": False,
        "overlap_comm": True,
        "round_robin_gradients": False,
        "reduce_scatter": True,
    }
    assert winner["train_batch_size"] == 8  # 2 x 2 accumulation x 2 processes


def replace_output(settings: TuneSettings, out: Path) -> TuneSettings:
    from dataclasses import replace

    return replace(settings, output_dir=out)


# ---- activation checkpointing as a dimension -----------------------------------------------


def _with_flag(settings: TuneSettings) -> TuneSettings:
    """The settings of a recipe whose --help lists --gradient-checkpointing."""
    from dataclasses import replace

    recipe = replace(settings.recipe, flags=frozenset({"gradient-checkpointing"}))
    return replace(settings, recipe=recipe)


def test_checkpointing_modes_shape_the_first_round():
    """on: every candidate checkpointed; both: each plain one followed by its checkpointed
    twin; auto and off: plain only (auto adds twins once the budget bites)."""
    plain = [c.name for c in space.first_round(_settings(strategies=("ddp", "zero2")))]
    assert plain[:2] == ["ddp-mb4x1", "ddp-mb2x2"] and len(plain) == 6
    for mode in ("auto", "off"):
        names = [c.name for c in space.first_round(_settings(strategies=("ddp", "zero2"),
                                                              gradient_checkpointing=mode))]  # fmt: skip
        assert names == plain
    on = space.first_round(_settings(strategies=("ddp", "zero2"), gradient_checkpointing="on"))
    assert [c.name for c in on] == [f"{name}-ckpt" for name in plain]
    assert all(c.gradient_checkpointing for c in on)
    both = space.first_round(_settings(strategies=("ddp", "zero2"), gradient_checkpointing="both"))
    assert [c.name for c in both][:4] == [
        "ddp-mb4x1", "ddp-mb4x1-ckpt", "ddp-mb2x2", "ddp-mb2x2-ckpt"
    ]  # fmt: skip
    assert len(both) == 12
    # The flag reaches the recipe, and the JSON says it; a ZeRO variant keeps it.
    from dpkit.tune.trials import recipe_command

    ckpt = space.Candidate("zero2", 2, 2, gradient_checkpointing=True)
    assert recipe_command(_settings(), ckpt)[-1] == "--gradient-checkpointing"
    assert "--gradient-checkpointing" not in recipe_command(
        _settings(), ckpt.__class__("zero2", 2, 2)
    )
    assert ckpt.as_dict()["gradient_checkpointing"] is True
    variants = space.second_round(ckpt, {"reduce_bucket_size": 2**21}, _settings())
    assert variants and all(v.gradient_checkpointing and v.round == 2 for v in variants)
    assert variants[0].name == "zero2-mb2x2-ckpt-bucket512K"


def test_auto_adds_the_checkpointed_twin_of_what_does_not_fit_once():
    settings = _settings(gradient_checkpointing="auto")
    plain = [space.Candidate("ddp", 4, 1), space.Candidate("zero2", 4, 1)]
    known = {c.name for c in plain}
    twins = space.checkpointed_twins(plain, known, settings)
    assert [t.name for t in twins] == ["ddp-mb4x1-ckpt", "zero2-mb4x1-ckpt"]
    assert space.checkpointed_twins(plain, known, settings) == []  # known by now
    assert space.checkpointed_twins(twins, set(), settings) == []  # no twin of a twin
    for mode in ("off", "on", "both"):
        assert space.checkpointed_twins(plain, set(), _settings(gradient_checkpointing=mode)) == []


def test_the_tuner_finds_what_did_not_fit_measured_or_out_of_memory():
    """Over the budget as measured, or a CUDA out-of-memory failure: the twins' source.
    Another failure is not a memory matter."""
    from dpkit.tune.run import _Stop, _Tuner

    tuner = _Tuner(replace_budget(_settings(), 150.0), {}, _Stop())
    oom = Trial(space.Candidate("zero1", 4, 1), status=FAILED,
                reason="exit code 1; torch.OutOfMemoryError: CUDA out of memory. Tried to ...")  # fmt: skip
    crash = Trial(space.Candidate("zero1", 2, 2), status=FAILED, reason="exit code 1; KeyError")
    tuner.trials = [_trial("ddp", 4, 1.0, memory=200.0), _trial("zero2", 4, 1.0, memory=100.0),
                    oom, crash]  # fmt: skip
    assert [c.name for c in tuner.did_not_fit()] == ["ddp-mb4x1", "zero1-mb4x1"]


def replace_budget(settings: TuneSettings, budget: float) -> TuneSettings:
    from dataclasses import replace

    return replace(settings, memory_budget=budget)


def test_a_plain_candidate_wins_a_tie_with_its_checkpointed_twin_and_is_the_reference():
    plain = _trial("ddp", 4, 1.00, losses=[2.0, 1.9])
    ckpt = Trial(
        space.Candidate("ddp", 4, 1, gradient_checkpointing=True),
        status=OK,
        figures={"median_step_time_s": 0.99, "memory_bytes": 50.0, "losses": [2.0, 1.9]},
    )
    zero2 = _trial("zero2", 4, 1.2, losses=[2.0, 1.9])
    for order in ([plain, ckpt, zero2], [ckpt, zero2, plain]):
        decision = decide(order, "ddp-mb4x1", None, "no", tie_tolerance=0.02)
        assert decision.winner.name == "ddp-mb4x1"  # 1% slower, no recomputation
        assert decision.verdicts["zero2-mb4x1"].loss_reference == "ddp-mb4x1"
    # Under a budget only the twin fits: it wins.
    decision = decide([plain, ckpt, zero2], "ddp-mb4x1", 80.0, "no", tie_tolerance=0.02)
    assert decision.winner.name == "ddp-mb4x1-ckpt"


def test_the_plan_predicts_a_checkpointed_candidate_as_dpkit_plan_does():
    """The checkpointed twin: the same model states, the activations of
    `dpkit plan --activation-checkpointing` (a layer's input kept per layer, not its
    insides), so less than the plain candidate's."""
    from dataclasses import replace

    from dpkit.core.spec import PlanInputs
    from dpkit.plan.recommend import make_plan

    settings = replace(_lm_settings("small", device="cuda"),
                       config=TuneConfig(gradient_checkpointing="both"))  # fmt: skip
    plan = space.MemoryPlan(settings)
    plain = plan.estimate(space.Candidate("ddp", 4, 1))
    ckpt = plan.estimate(space.Candidate("ddp", 4, 1, gradient_checkpointing=True))
    assert (ckpt.params, ckpt.grads, ckpt.optimizer) == (plain.params, plain.grads, plain.optimizer)
    assert 0 < ckpt.activations < 0.5 * plain.activations
    inputs = PlanInputs(
        model=plan.spec, gpus_per_node=2, gpu_memory=2**40, precision="fp32", micro_batch=4,
        gradient_accumulation_steps=1, seq_len=32, reserve=0, headroom=0.0,
        activation_checkpointing=True,
    )  # fmt: skip
    later = make_plan(inputs).peaks["ddp"].later
    assert plan.predict(space.Candidate("ddp", 4, 1, gradient_checkpointing=True)) == later.bytes
    assert later.bytes < plan.predict(space.Candidate("ddp", 4, 1))


def test_checkpointing_needs_the_recipes_flag_and_is_the_tunes_to_set(tmp_path):
    """on/both with a recipe that has no --gradient-checkpointing: refused; auto then
    searches nothing and says so; the flag among the recipe's arguments: refused."""
    from dpkit.tune.config import tune_settings

    with pytest.raises(UsageError, match=re.escape("gradient_checkpointing='sometimes': one of")):
        TuneConfig(gradient_checkpointing="sometimes")
    with pytest.raises(UsageError, match=re.escape(
        "recipe argument '--gradient-checkpointing': dpkit tune decides checkpointing per trial")):  # fmt: skip
        TuneConfig(recipe_args=("--gradient-checkpointing",))
    script = tmp_path / "plain.py"
    script.write_text(
        "import argparse\np = argparse.ArgumentParser()\n"
        "for f in ('--micro-batch-size', '--gradient-accumulation-steps', '--max-steps', "
        "'--output-dir'):\n    p.add_argument(f)\np.parse_args()\n"
    )
    env = dict(os.environ)
    with pytest.raises(UsageError, match=re.escape(
        "--gradient-checkpointing=both: plain.py's --help lists no --gradient-checkpointing")):  # fmt: skip
        tune_settings(TuneConfig(recipe=str(script), micro_batch_size=2,
                                 gradient_checkpointing="both"), 0, env)  # fmt: skip
    settings = tune_settings(TuneConfig(recipe=str(script), micro_batch_size=2), 0, env)
    assert settings.config.gradient_checkpointing == "off"
    assert settings.checkpointing_note == (
        "checkpointing not searched (plain.py has no --gradient-checkpointing)"
    )
    assert _with_flag(_settings()).checkpointing_note == "checkpointed where plain does not fit"


def test_with_every_candidate_checkpointed_so_is_the_current_configuration():
    settings = _settings(baseline_strategy="zero2", gradient_checkpointing="on")
    assert space.baseline(settings).name == "zero2-mb4x1-ckpt"
    names = [c.name for c in space.first_round(settings)]
    assert names[0] == "zero2-mb4x1-ckpt" and len(names) == len(set(names)) == 15
    assert space.baseline(_settings(gradient_checkpointing="both")).name == "ddp-mb4x1"


def test_the_plan_traces_only_the_activations_the_search_needs():
    """A trace per checkpointing setting searched: ``off`` plain, ``on`` checkpointed,
    ``auto`` and ``both`` both (auto may add twins)."""
    from dataclasses import replace

    expected = {"off": {False}, "on": {True}, "auto": {False, True}, "both": {False, True}}
    for mode, kinds in expected.items():
        settings = replace(_lm_settings("tiny"), config=TuneConfig(gradient_checkpointing=mode))
        assert set(space.MemoryPlan(settings).activations) == kinds, mode


def test_auto_follows_each_pruned_candidate_with_its_checkpointed_twin_predicted():
    """A budget between DDP's plain and checkpointed predictions at micro-batch 4 (more than
    the plan's 10% margin): DDP is pruned, its checkpointed twin, predicted with fewer
    activations, is not; every candidate predicted over gets its twin, each judged by its
    own prediction; after the round, a candidate measured over the budget gets its twin
    once."""
    from dataclasses import replace

    from dpkit.tune.run import _Stop, _Tuner

    settings = _with_flag(_lm_settings("small"))
    plan = space.MemoryPlan(settings)
    plain = plan.predict(space.Candidate("ddp", 4, 1))
    checkpointed = plan.predict(space.Candidate("ddp", 4, 1, gradient_checkpointing=True))
    assert checkpointed < plain
    limit = (plain + checkpointed) / 2  # the budget plus the 10% margin
    settings = replace(settings, memory_budget=limit / 1.1)
    tuner = _Tuner(settings, {}, _Stop())
    first = tuner.first_round()
    names = [t.name for t in first]
    plain_round, twins = first[:15], first[15:]  # every strategy x 3 micro-batches, then twins
    assert len(names) == len(set(names))
    pruned = [t for t in plain_round if t.status == "pruned"]
    assert pruned[0].name == "ddp-mb4x1" == names[0]
    assert [t.name for t in twins] == [f"{t.name}-ckpt" for t in pruned]
    for trial in first:
        assert (trial.status == "pruned") is (trial.predicted_bytes > limit), trial.name
        assert trial.status in ("pruned", "not run")
    assert twins[0].name == "ddp-mb4x1-ckpt" and twins[0].status == "not run"  # to be measured
    # Measured: zero1 at micro-batch 4 over the budget, the rest within it.
    tuner.trials = [_trial("zero1", 4, 1.0, memory=2 * plain), _trial("zero2", 4, 1.0, memory=1.0)]
    later = tuner.twins_of_what_did_not_fit()
    assert [t.name for t in later] == ["zero1-mb4x1-ckpt"] and later[0].predicted_bytes > 0
    assert tuner.twins_of_what_did_not_fit() == []  # once
    # off: no twin, whatever the budget.
    off = replace(settings, config=TuneConfig(gradient_checkpointing="off"))
    assert [t.name for t in _Tuner(off, {}, _Stop()).first_round()][-1] != "ddp-mb4x1-ckpt"


def test_the_plan_traces_with_the_trials_devices_kernels():
    """With dropout a CPU's kernels save the dropout masks a GPU's fused attention does not
    (dpkit.plan.activations): the tune plans a CPU trial as a CPU runs it."""
    from dataclasses import replace

    from dpkit.plan.activations import activation_profile

    workload = {"LMWorkload": {"size": "tiny", "synthetic": True, "seq_len": 32, "dropout": 0.1}}
    found = {}
    for device in ("cpu", "cuda"):
        plan = space.MemoryPlan(replace(_settings(), device=device, plan_model=workload))
        expected = activation_profile(plan.spec, 32, "fp32", False, device=device)
        assert plan.activations[False] == expected
        found[device] = plan.estimate(space.Candidate("ddp", 4, 1)).activations
    assert found["cpu"] > found["cuda"]  # measured 33.7 against 32.0 MB at micro-batch 4


def test_the_decoder_recipe_is_planned_as_a_causal_lm_of_its_resolved_length(tmp_path):
    """finetune_lm.py's arguments give the plan its model as a causal LM and the sequence
    length the recipe would use: without --max-seq-length, the model's own limit (the
    tiny Llama of tests/local_models.py has 128 positions, under the cap of 1024)."""
    from dataclasses import replace

    from dpkit.tune.config import _plan_model
    from tests import local_models

    folder = local_models.build("llama", tmp_path / "llama")
    sections = _plan_model(Path("finetune_lm.py"), ("--model", str(folder)))
    assert sections["DecoderModelConfig"]["max_seq_length"] == 128
    plan, note = space.memory_plan(replace(_settings(), plan_model=sections))
    assert note == f"plan: {folder}, 128 tokens, fp32"
    assert plan.model_name == str(folder)
    given = _plan_model(Path("finetune_lm.py"), ("--model", str(folder), "--max-seq-length", "64"))
    assert given["DecoderModelConfig"]["max_seq_length"] == 64
