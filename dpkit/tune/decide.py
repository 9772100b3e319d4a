"""Which measured candidate ``dpkit tune`` chooses, and why the others were not.

A candidate is eligible when its trial ran, its measured peak per rank fits the budget,
and its losses agree with DDP's at the same micro-batch (the same samples in the same
micro-batches, so only the sharding differs) within the suite's equivalence tolerance
(:func:`dpkit.bench.results.loss_rtol`). The winner is the eligible candidate with the
shortest median step time (every candidate trains the same global batch, so that is
the highest throughput); candidates within ``tie_tolerance`` of it, and no slower
than the current configuration, are a tie, which the least sharding wins (less
sharding, fewer collectives and a simpler run at the same speed), in ``dpkit plan``'s
order: DDP, ZeRO-1, ZeRO-2, FSDP2 shard-grad-op, FSDP2 full-shard
(:attr:`~dpkit.tune.space.Candidate.sharding_rank`; ZeRO-2 before shard-grad-op, though
both shard gradients and optimizer state: ZeRO-2 keeps the parameters whole between
steps). Within one strategy a plain candidate goes before a checkpointed one (no
recomputation), then the faster, then the name, so equal times still give one answer
whatever order the trials ran in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dpkit.bench.results import loss_rtol
from dpkit.engines import REFERENCE, get_strategy
from dpkit.tune.trials import OK, Trial


@dataclass
class Verdict:
    """One trial against the budget and DDP's losses."""

    fits: bool | None = None
    """Measured peak within the budget (None: no budget, or not measured)."""
    loss_reference: str | None = None
    """The DDP trial its losses are compared with."""
    loss_deviation: float | None = None
    """Largest ``|loss - loss_ddp| / |loss_ddp|`` over the steps."""
    agrees: bool | None = None
    """Within the tolerance (None: no DDP trial to compare with)."""
    eligible: bool = False
    why_not: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Decision:
    """The winner and what it is measured against."""

    winner: Trial | None
    baseline: Trial | None
    speedup: float | None
    """Baseline median step time / winner's (throughput ratio; >= 1)."""
    tie: list[str]
    """The candidates tied with the fastest (the winner among them)."""
    reason: str
    verdicts: dict[str, Verdict]
    loss_rtol: float


def _deviation(losses: list[float], reference: list[float]) -> float:
    pairs = list(zip(losses, reference, strict=False))
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in pairs) if pairs else float("inf")


def _reference(trial: Trial, ddp: dict[int, Trial]) -> Trial | None:
    """DDP's trial at the same micro-batch; else the nearest (dropout then draws other
    masks, so only a model without dropout agrees across micro-batches)."""
    micro = trial.candidate.micro_batch_size
    if micro in ddp:
        return ddp[micro]
    return min(ddp.values(), key=lambda t: abs(t.candidate.micro_batch_size - micro), default=None)


def verdicts(trials: list[Trial], budget: float | None, precision: str) -> dict[str, Verdict]:
    """Each measured trial checked against the budget and against DDP's losses."""
    rtol = loss_rtol(precision)
    # Plain DDP is the reference; a checkpointed DDP trial only where no plain one ran at
    # its micro-batch (checkpointing recomputes the same forward: the losses are DDP's).
    ddp = {
        t.candidate.micro_batch_size: t
        for t in sorted(trials, key=lambda t: not t.candidate.gradient_checkpointing)
        if t.status == OK and get_strategy(t.candidate.strategy) is REFERENCE
    }
    found: dict[str, Verdict] = {}
    for trial in trials:
        verdict = found[trial.name] = Verdict()
        if trial.status != OK:
            verdict.why_not = f"{trial.status}: {trial.reason}" if trial.reason else trial.status
            continue
        if budget is not None:
            verdict.fits = trial.memory_bytes <= budget
        reference = _reference(trial, ddp)
        if reference is not None:
            verdict.loss_reference = reference.name
            verdict.loss_deviation = _deviation(
                trial.figures["losses"], reference.figures["losses"]
            )
            verdict.agrees = verdict.loss_deviation <= rtol
        if verdict.fits is False:
            verdict.why_not = (
                f"measured {trial.memory_bytes / 2**20:.1f} MiB per rank, over the budget"
            )
        elif verdict.agrees is False:
            verdict.why_not = (
                f"losses differ from {reference.name} by {verdict.loss_deviation:.2e} "
                f"(tolerance {rtol:g})"
            )
        else:
            verdict.eligible = True
    return found


def decide(
    trials: list[Trial],
    baseline_name: str,
    budget: float | None,
    precision: str,
    tie_tolerance: float,
) -> Decision:
    """The fastest eligible candidate, ties to the least sharding; the speedup over the
    current configuration (``baseline_name``) measured in the same tune."""
    found = verdicts(trials, budget, precision)
    rtol = loss_rtol(precision)
    baseline = next((t for t in trials if t.name == baseline_name and t.status == OK), None)
    eligible = [t for t in trials if found[t.name].eligible]
    if not eligible:
        return Decision(None, baseline, None, [], "no candidate ran, fits and agrees", found, rtol)
    fastest = min(eligible, key=lambda t: (t.step_time, t.candidate.sharding_rank, t.name))
    ceiling = fastest.step_time * (1 + tie_tolerance)
    if baseline is not None and found[baseline.name].eligible:
        # A tie never picks something slower than what the user runs today.
        ceiling = min(ceiling, max(baseline.step_time, fastest.step_time))
    tie = [t for t in eligible if t.step_time <= ceiling]
    winner = min(
        tie,
        key=lambda t: (
            t.candidate.sharding_rank,
            t.candidate.gradient_checkpointing,
            t.step_time,
            t.name,
        ),
    )
    speedup = (
        baseline.step_time / winner.step_time
        if baseline is not None and found[baseline.name].eligible
        else None
    )
    if winner is fastest:
        reason = f"fastest of {len(eligible)} eligible candidates"
    else:
        reason = (
            f"within {tie_tolerance:.0%} of the fastest ({fastest.name}, "
            f"{fastest.step_time:.3f} s) with less sharding"
        )
    return Decision(winner, baseline, speedup, [t.name for t in tie], reason, found, rtol)
