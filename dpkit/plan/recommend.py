"""The plan: every strategy's estimate, and the least sharding that fits.

:func:`make_plan` estimates each strategy of :data:`dpkit.engines.STRATEGIES`
with :func:`dpkit.plan.estimate.estimate`, recommends the first that fits in
:func:`recommendation_order` (least sharding first, what dpkit runs before what it
shows for reference), and says why in a sentence or two; when none fits it raises a
one-line :class:`~dpkit.errors.UsageError` that names the flag to change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dpkit.core.spec import PlanInputs
from dpkit.core.strategy import Strategy
from dpkit.core.units import GIB
from dpkit.engines import STRATEGIES, engine_of, get_strategy
from dpkit.errors import UsageError
from dpkit.plan.activations import ActivationProfile, activation_profile
from dpkit.plan.estimate import (
    StrategyEstimate,
    buffer_settings,
    estimate,
    largest_micro_batch,
)
from dpkit.plan.inputs import PlannedTask, first_line
from dpkit.plan.peak import StepPeak, plan_peaks


@dataclass(frozen=True)
class Plan:
    """Every strategy's estimate, and the recommendation."""

    inputs: PlanInputs
    """What was asked."""
    activations: ActivationProfile | None
    """How activations were estimated (None: not estimated)."""
    settings: dict[str, Any]
    """DDP/ZeRO buffer settings assumed."""
    rows: list[StrategyEstimate]
    """One estimate per strategy, in the order of :data:`dpkit.engines.STRATEGIES`."""
    largest_micro_batches: dict[str, int | None]
    """Per strategy name, the largest micro-batch that fits (None: unknown)."""
    recommended: str
    """The name of the first strategy of :func:`recommendation_order` that fits at the
    requested micro-batch."""
    reason: str
    """Why, in a sentence or two."""
    task: PlannedTask | None = None
    """The head the model was planned with and why (None: a bare ``--params`` count)."""
    peaks: dict[str, StepPeak] = field(default_factory=dict)
    """Per strategy name, the step's peak of live tensors at the requested micro-batch
    (:mod:`dpkit.plan.peak`; none without a traced model)."""
    peak_note: str = ""
    """Why there are no peaks, where there are none."""

    def row(self, strategy: str | Strategy) -> StrategyEstimate:
        """The estimate of ``strategy`` (a Strategy or its name)."""
        name = get_strategy(strategy).name
        return next(r for r in self.rows if r.strategy == name)

    def fits(self, row: StrategyEstimate) -> bool:
        """Whether ``row`` can run and fits in the usable memory per GPU."""
        return self.inputs.fits(row)


def format_gib(value: float) -> str:
    """Bytes as GiB with one decimal: ``5.3 GiB``."""
    return f"{value / GIB:.1f} GiB"


def recommendation_order() -> list[Strategy]:
    """The order the plan tries strategies in: those dpkit's recipes run that keep their
    state on the device, least sharding first (DDP, ZeRO-1, ZeRO-2, ZeRO-3, FSDP2
    shard-grad-op, FSDP2 full-shard), then those that offload to host memory (ZeRO-2
    offload: a CPU step every step), then any row shown for reference only (none today:
    every row runs)."""
    strategies = list(STRATEGIES.values())
    # Offload steps on the CPU every step: after every runnable row that keeps its state
    # on the device, however sharded.
    return (
        [s for s in strategies if s.runnable and not s.offload]
        + [s for s in strategies if s.runnable and s.offload]
        + [s for s in strategies if not s.runnable]
    )


def _reason(rows: list[StrategyEstimate], chosen: StrategyEstimate, inputs: PlanInputs) -> str:
    """Why ``chosen``: the strategies tried before it that need too much (``rows`` in
    :func:`recommendation_order`), then what it does."""
    strategy = get_strategy(chosen.strategy)
    if inputs.optimizer == "cpu_adam" and strategy.offload:
        prefix = "--optimizer cpu_adam runs only with optimizer offload. "
    else:
        skipped = rows[: rows.index(chosen)]
        too_big = [f"{r.label} needs {format_gib(r.total)}" for r in skipped if r.applicable]
        usable = format_gib(inputs.usable)
        prefix = f"{'; '.join(too_big)}, over the {usable} usable per GPU. " if too_big else ""
    return prefix + engine_of(strategy).plan.why(strategy, chosen, inputs)


def _nothing_fits(inputs: PlanInputs, rows: list[StrategyEstimate]) -> UsageError:
    """The one-line error when no strategy fits: the flag to change, and by how much."""
    smallest = min((r for r in rows if r.applicable), key=lambda r: r.total)
    if smallest.total <= inputs.usable and smallest.host_offload > inputs.host_usable:
        return UsageError(
            f"--{'model' if inputs.model.source != 'count' else 'params'}={inputs.model.name!r}: "
            f"fits under no strategy on {inputs.world_size} x {format_gib(inputs.gpu_memory)}; "
            f"{smallest.label} fits the GPU but keeps {format_gib(smallest.host_offload)} per GPU "
            f"in host memory, over the {format_gib(inputs.host_usable)} usable per GPU "
            f"({format_gib(inputs.host_per_node)} per node, --host-memory, less "
            f"{inputs.headroom:.0%} headroom); use more GPUs or nodes, or set --host-memory"
        )
    need = (
        f"the smallest need is {smallest.label} at {format_gib(smallest.total)} per GPU "
        f"against {format_gib(inputs.usable)} usable ({format_gib(inputs.gpu_memory)} less "
        f"{inputs.headroom:.0%} headroom)"
    )
    before_activations = smallest.model_states + smallest.buffers + smallest.reserve + smallest.step
    machines = f"{inputs.world_size} x {format_gib(inputs.gpu_memory)}"
    if smallest.activations and before_activations <= inputs.usable:
        return UsageError(
            f"--micro-batch={inputs.micro_batch}: fits under no strategy on {machines}; {need}; "
            "lower --micro-batch or --seq-len, or add --activation-checkpointing"
        )
    return UsageError(
        f"--{'model' if inputs.model.source != 'count' else 'params'}={inputs.model.name!r}: "
        f"fits under no strategy on {machines} even before activations; {need}; use more GPUs "
        "or GPUs with more memory"
    )


def make_plan(inputs: PlanInputs, task: PlannedTask | None = None) -> Plan:
    """Estimate every strategy and pick the least sharding that fits; ``task``: how the
    model's head was chosen, for the output (the model is already built with it).

    Raises UsageError when nothing fits at the requested micro-batch.
    """
    activations = activation_profile(
        inputs.model,
        inputs.seq_len,
        inputs.precision,
        inputs.activation_checkpointing,
        inputs.attention,
        inputs.activation_method,
    )
    settings = buffer_settings(inputs.model, inputs.world_size)
    rows = [
        estimate(inputs, strategy, inputs.micro_batch, activations, settings)
        for strategy in STRATEGIES.values()
    ]
    by_name = {r.strategy: r for r in rows}
    tried = [by_name[s.name] for s in recommendation_order()]
    fitting = [r for r in tried if inputs.fits(r)]
    if not fitting:
        raise _nothing_fits(inputs, rows)
    largest = {
        r.strategy: largest_micro_batch(inputs, r.strategy, activations, settings)
        if r.applicable
        else None
        for r in rows
    }
    chosen = fitting[0]
    peaks, peak_note = _peaks(inputs, activations, rows, settings)
    return Plan(
        inputs=inputs,
        activations=activations,
        settings=settings,
        rows=rows,
        largest_micro_batches=largest,
        recommended=chosen.strategy,
        reason=_reason(tried, chosen, inputs),
        task=task,
        peaks=peaks,
        peak_note=peak_note,
    )


def _peaks(
    inputs: PlanInputs,
    activations: ActivationProfile | None,
    rows: list[StrategyEstimate],
    settings: dict[str, Any],
) -> tuple[dict[str, StepPeak], str]:
    """Each row's peak, or none and why (a bare count; a model the meta device cannot run)."""
    if activations is None:
        return {}, "a bare --params has no shapes to trace"
    if activations.method != "trace":
        return {}, "the peak needs the model's step traced (--activation-estimate trace)"
    try:
        return plan_peaks(inputs, rows, settings), ""
    except Exception as err:  # an unusual model's backward may not run on meta
        return {}, f"the step's trace failed ({first_line(err)})"
