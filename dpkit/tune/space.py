"""The candidates of ``dpkit tune`` and their predicted memory.

Two rounds, so the default tune stays within minutes:

1. every strategy (DDP, ZeRO-1/2, FSDP2's two modes) at every micro-batch, accumulation
   making up the same global batch (so every candidate trains the same samples per
   optimizer step and their losses are comparable), ZeRO with dpkit's own bucket settings;
2. for each DeepSpeed ZeRO strategy, its fastest fitting round-1 micro-batch with other
   bucket sizes, and ``contiguous_gradients`` (and on CUDA ``overlap_comm``) flipped.
   FSDP2 has no such settings (``fully_shard`` all-gathers and reduce-scatters one unit,
   a transformer layer, at a time): it has no second round.

ZeRO-3 and the offloads (``TuneConfig.fallback_strategies``) buy memory with speed: by
default they are tried only where no candidate of the first round fits
(:func:`fallback_round`), as a checkpointed twin is; named in ``strategies`` they are
tried from the start.

Activation checkpointing is a dimension of the first round (``TuneConfig.gradient_
checkpointing``). By default (``auto``) a candidate is tried checkpointed only where it
does not fit plain (predicted over the budget, measured over it, or out of memory): at
the same strategy and micro-batch the checkpointed twin computes the same step with one
more forward, so it is never the faster of the two, and only a budget can make it the
choice (:func:`checkpointed_twins`). ``both`` tries every candidate both ways, ``on``
checkpointed only, ``off`` never.

Each candidate's memory is predicted by ``dpkit plan``'s arithmetic
(:func:`dpkit.plan.estimate.estimate`) with the candidate's own settings (FSDP2: each
parameter's shard padded on dim 0, and the whole parameters it gathers), and a
candidate predicted over the budget is not launched.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from dpkit.engines import engine_of, get_strategy
from dpkit.plan.estimate import StrategyEstimate
from dpkit.plan.recommend import recommendation_order
from dpkit.tune.config import TuneSettings

if TYPE_CHECKING:
    from dpkit.core.spec import PlanInputs
    from dpkit.core.step import StepTrace
    from dpkit.plan.peak import StepPeak

MIB = 2**20


@dataclass(frozen=True)
class Candidate:
    """One configuration: a strategy, a micro-batch and its accumulation, and the
    ``zero_optimization`` keys set over dpkit's own (none: dpkit's)."""

    strategy: str
    micro_batch_size: int
    gradient_accumulation_steps: int
    zero: tuple[tuple[str, Any], ...] = ()
    round: int = 1
    gradient_checkpointing: bool = False
    """The recipe's ``--gradient-checkpointing``: activations recomputed in backward."""

    def __post_init__(self) -> None:
        # Only DeepSpeed reads zero_optimization keys; on another engine they would be
        # silently dropped while the trial's name claims them.
        if self.zero and not engine_of(self.strategy).tunable:
            raise ValueError(f"{self.strategy}: zero_optimization keys are DeepSpeed's only")

    @property
    def name(self) -> str:
        """A short unique name, also the trial's folder: ``zero2-mb2x2-bucket4M-nocontig``,
        ``ddp-mb8x1-ckpt`` (checkpointed)."""
        parts = [f"{self.strategy}-mb{self.micro_batch_size}x{self.gradient_accumulation_steps}"]
        if self.gradient_checkpointing:
            parts.append("ckpt")
        for key, value in self.zero:
            if key == "reduce_bucket_size":
                parts.append(f"bucket{_short(value)}")
            elif key == "contiguous_gradients":
                parts.append("contig" if value else "nocontig")
            elif key == "overlap_comm":
                parts.append("overlap" if value else "nooverlap")
        return "-".join(parts)

    @property
    def zero_overrides(self) -> dict[str, Any]:
        """The keys for the DeepSpeed JSON (a bucket size sets both buckets)."""
        overrides = dict(self.zero)
        if "reduce_bucket_size" in overrides:
            overrides["allgather_bucket_size"] = overrides["reduce_bucket_size"]
        return overrides

    @property
    def sharding(self) -> int:
        """What is sharded, as a ZeRO stage: DDP 0, ZeRO-1 1, ZeRO-2 and FSDP2
        shard-grad-op 2, FSDP2 full-shard 3."""
        return get_strategy(self.strategy).zero_stage

    @property
    def sharding_rank(self) -> int:
        """Where the strategy stands in ``dpkit plan``'s least-sharding-first order (DDP,
        ZeRO-1, ZeRO-2, FSDP2 shard-grad-op, FSDP2 full-shard): a tie goes to the lowest.

        ZeRO-2 and FSDP2 shard-grad-op have the same stage; ZeRO-2 ranks first because it
        shards less: every rank keeps the whole parameters between steps, where FSDP2 keeps
        1/N of them and all-gathers every layer in every micro-batch's forward (with
        accumulation k all-gathers per step, against ZeRO-2's one after the step).
        """
        names = [s.name for s in recommendation_order()]
        return names.index(get_strategy(self.strategy).name)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "strategy": self.strategy,
            "micro_batch_size": self.micro_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "zero_overrides": self.zero_overrides,
            "gradient_checkpointing": self.gradient_checkpointing,
            "round": self.round,
        }

    def checkpointed(self) -> Candidate:
        """The same candidate with activation checkpointing on."""
        return replace(self, gradient_checkpointing=True)


def _short(elements: int) -> str:
    for unit, size in (("M", 2**20), ("K", 2**10)):
        if elements % size == 0:
            return f"{elements // size}{unit}"
    return str(elements)


def baseline(settings: TuneSettings) -> Candidate:
    """The current configuration: its strategy, micro-batch and accumulation, dpkit's
    ZeRO settings; checkpointed when every candidate is (``gradient_checkpointing="on"``)."""
    config = settings.config
    return Candidate(
        config.baseline_strategy,
        settings.baseline_micro_batch,
        settings.per_rank_batch // settings.baseline_micro_batch,
        gradient_checkpointing=config.gradient_checkpointing == "on",
    )


def _every_micro_batch(settings: TuneSettings, strategies: tuple[str, ...]) -> list[Candidate]:
    """``strategies`` at every micro-batch, least sharding first, largest micro-batches
    first; checkpointed when every candidate is (``gradient_checkpointing="on"``)."""
    mode = settings.config.gradient_checkpointing
    return sorted(
        (
            Candidate(
                name,
                micro,
                settings.per_rank_batch // micro,
                gradient_checkpointing=mode == "on",
            )
            for name in strategies
            for micro in settings.micro_batch_sizes
        ),
        key=lambda c: (c.sharding_rank, -c.micro_batch_size),
    )


def _with_twins(settings: TuneSettings, candidates: list[Candidate]) -> list[Candidate]:
    """Under ``gradient_checkpointing="both"`` each candidate followed by its checkpointed
    twin; ``candidates`` as they are otherwise."""
    if settings.config.gradient_checkpointing == "both":
        return [twin for c in candidates for twin in (c, c.checkpointed())]
    return candidates


def first_round(settings: TuneSettings) -> list[Candidate]:
    """Every strategy at every micro-batch; the baseline first, then least sharding first
    (:attr:`Candidate.sharding_rank`: DDP, the reference of the losses, leads), largest
    micro-batches first. Checkpointed as ``gradient_checkpointing`` says: ``on`` every
    candidate, ``both`` each also right after its plain twin; ``auto`` and ``off`` none
    here (``auto`` adds :func:`checkpointed_twins` once the budget is known to bite)."""
    ordered = _every_micro_batch(settings, settings.config.strategies)
    first = baseline(settings)
    return _with_twins(settings, [first, *(c for c in ordered if c != first)])


def fallback_round(settings: TuneSettings, known: set[str]) -> list[Candidate]:
    """Where no candidate of the first round fits (the caller says when): the fallback
    strategies (``TuneConfig.fallback_strategies``: ZeRO-3 and the offloads, which pay in
    speed for memory) not among the first round's, at every micro-batch, least sharding
    first, checkpointed as the first round is; none already known by name (added to
    ``known``)."""
    config = settings.config
    names = tuple(n for n in config.fallback_strategies if n not in config.strategies)
    candidates = []
    for candidate in _with_twins(settings, _every_micro_batch(settings, names)):
        if candidate.name not in known:
            candidates.append(candidate)
            known.add(candidate.name)
    return candidates


def checkpointed_twins(
    candidates: list[Candidate], known: set[str], settings: TuneSettings
) -> list[Candidate]:
    """Under ``gradient_checkpointing="auto"``: the checkpointed twin of each plain
    candidate that does not fit (the caller says which), unless already known by name.
    Nothing for the other modes: ``on`` and ``both`` have them from the first round."""
    if settings.config.gradient_checkpointing != "auto":
        return []
    twins = []
    for candidate in candidates:
        twin = candidate.checkpointed()
        if not candidate.gradient_checkpointing and twin.name not in known:
            twins.append(twin)
            known.add(twin.name)
    return twins


def second_round(
    best: Candidate, resolved_zero: dict[str, Any], settings: TuneSettings
) -> list[Candidate]:
    """Variants of a DeepSpeed ZeRO candidate's settings around what it ran with
    (``resolved_zero``, the ``zero_optimization`` section of its ``ds_config.json``);
    :class:`ValueError` for any other engine (DDP and FSDP2 have no such settings)."""
    engine = engine_of(best.strategy)
    if not engine.tunable:
        raise ValueError(f"{best.name}: only DeepSpeed's ZeRO candidates have a second round")
    variants = engine.tuning_variants(
        get_strategy(best.strategy),
        resolved_zero,
        bucket_sizes=settings.config.zero_bucket_sizes,
        on_cuda=settings.device == "cuda",
    )
    return [replace(best, zero=zero, round=2) for zero in variants]


class MemoryPlan:
    """``dpkit plan``'s prediction for each candidate: the model and the activation
    profile built once, the estimate per candidate with its own settings."""

    def __init__(self, settings: TuneSettings) -> None:
        from dpkit.core.units import canonical_precision
        from dpkit.plan.activations import activation_profile
        from dpkit.plan.check import recipe_model

        self.settings = settings
        self.model_name, self.spec, _, self.seq_len = recipe_model(
            settings.plan_model or {}, f"--recipe={settings.recipe.path.name}"
        )
        self.precision = canonical_precision(settings.precision)
        self._traces: dict[tuple[str, int, bool, str], StepTrace | None] = {}
        # The trials' kernels: a CPU saves other tensors for backward than a GPU does.
        self.activations = {
            checkpointing: activation_profile(
                self.spec, self.seq_len, self.precision, checkpointing, device=settings.device
            )
            for checkpointing in self._checkpointing_searched(settings)
        }

    @staticmethod
    def _checkpointing_searched(settings: TuneSettings) -> tuple[bool, ...]:
        mode = settings.config.gradient_checkpointing
        return {"off": (False,), "on": (True,)}.get(mode, (False, True))

    def predict(self, candidate: Candidate) -> float:
        """Predicted bytes per rank of what a trial measures: the peak of live tensor
        bytes, temporaries included (:mod:`dpkit.plan.peak`, no reserve), of the step the
        trial watches (:attr:`~dpkit.tune.config.TuneSettings.probe_steps`): a later step,
        AdamW's moments alive from its start, the run's peak; the first with one warm-up
        step. A trial measures it as ``peak_live`` on CPU, the allocator's peak on CUDA."""
        peak = self.peak(candidate)
        return (peak.later if self.settings.probe_steps >= 2 else peak.first).bytes

    def peak(self, candidate: Candidate) -> StepPeak:
        """``dpkit plan``'s step peak for ``candidate`` (:func:`dpkit.plan.peak.step_peak`),
        its step traced on the meta device once per micro-batch, checkpointing and
        strategy."""
        from dpkit.plan.peak import step_peak, step_trace_for

        inputs = self._inputs(candidate)
        key = (
            candidate.strategy,
            candidate.micro_batch_size,
            candidate.gradient_checkpointing,
            self.settings.device,
        )
        if key not in self._traces:
            self._traces[key] = step_trace_for(
                inputs, candidate.strategy, candidate.micro_batch_size, self.settings.device
            )
        trace = self._traces[key]
        if trace is None:
            raise ValueError(f"{self.model_name}: no parameter shapes to trace its step")
        return step_peak(
            inputs,
            candidate.strategy,
            self.estimate(candidate),
            trace,
            self._plan_settings(candidate),
            on_gpu=self.settings.device == "cuda",
        )

    def _inputs(self, candidate: Candidate) -> PlanInputs:
        from dpkit.core.spec import PlanInputs

        return PlanInputs(
            model=self.spec,
            gpus_per_node=self.settings.nproc,
            gpu_memory=max(self.settings.memory_budget or 0, 2**40),
            precision=self.precision,
            micro_batch=candidate.micro_batch_size,
            gradient_accumulation_steps=candidate.gradient_accumulation_steps,
            seq_len=self.seq_len,
            activation_checkpointing=candidate.gradient_checkpointing,
            reserve=0,
            headroom=0.0,
        )

    def _plan_settings(self, candidate: Candidate) -> dict[str, Any]:
        from dpkit.plan.estimate import buffer_settings

        plan_settings = buffer_settings(
            self.spec, self.settings.nproc, on_cuda=self.settings.device == "cuda"
        )
        plan_settings.update(candidate.zero_overrides)
        return plan_settings

    def estimate(self, candidate: Candidate) -> StrategyEstimate:
        """``dpkit plan``'s row (:class:`~dpkit.plan.estimate.StrategyEstimate`) for the
        candidate: its micro-batch and accumulation, its ZeRO keys over dpkit's buffer
        settings. FSDP2's rows come from the model's parameter shapes, each padded on dim
        0 to a multiple of the processes, as ``dpkit plan`` makes them."""
        from dpkit.plan.estimate import estimate

        activations = self.activations[candidate.gradient_checkpointing]
        return estimate(
            self._inputs(candidate),
            candidate.strategy,
            candidate.micro_batch_size,
            activations,
            self._plan_settings(candidate),
        )


def memory_plan(settings: TuneSettings) -> tuple[MemoryPlan | None, str]:
    """The plan, or None and why not (a recipe not of dpkit's: its model is unknown
    before it runs)."""
    if settings.plan_model is None:
        return None, (
            f"no plan: {settings.recipe.path.name} is not one of dpkit's recipes, so its model "
            "is known only once it runs; the budget is checked against measurements"
        )
    plan = MemoryPlan(settings)
    return plan, f"plan: {plan.model_name}, {plan.seq_len} tokens, {plan.precision}"
