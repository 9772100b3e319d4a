"""The whole step's peak per GPU, predicted: the high-water of live tensor bytes,
temporaries included, and the point of the step where it occurs.

It is what a run's ``peak_live`` measures (:mod:`dpkit.memory.live`), predicted from
the mechanism, in two halves:

* the activation side, the same for every strategy: the model's own forward, loss and
  backward on the meta device with every live tensor followed
  (:mod:`dpkit.plan.step_trace`): saved activations, attention and MLP temporaries, the
  logits and the loss, the gradients of activations, each weight's gradient until autograd
  stores it;
* the states side, each strategy's engine (``engine.plan.peak_points``): which
  parameters, gradients, master weights, optimizer state, buckets and gathered or
  reduce-scattered tensors are alive at each candidate point of its step, and the
  optimizer's temporaries (:func:`optimizer_temporaries`).

The peak is the largest candidate. Two steps are predicted: the first (AdamW makes its
moments inside the first update, so before it a torch optimizer holds nothing: what a
run's ``peak_live`` measures) and every later one (the moments alive throughout), whose
peak is the run's. The plan's ``--reserve`` is not in it: on a GPU that is the CUDA
context and the caching allocator's rounding and slack, which hold no tensor; on a CPU
there is none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dpkit.core.spec import PlanInputs
from dpkit.core.step import PeakPoint, PeakView, StepTrace, highest
from dpkit.core.strategy import Strategy
from dpkit.core.units import canonical_precision
from dpkit.engines import engine_of, get_strategy
from dpkit.plan.estimate import StrategyEstimate

OPTIMIZER_IMPLEMENTATIONS = ("fused", "foreach", "for-loop")
"""How torch's AdamW updates: dpkit makes the fused kernel (:func:`dpkit.models.adamw`)."""


def optimizer_temporaries(
    optimizer: str, implementation: str, largest_group_elements: float, state_bytes: int = 4
) -> dict[str, float]:
    """Bytes torch's Adam/AdamW allocates inside one update besides its state.

    ``fused``: one kernel per tensor list, in place: none. ``foreach``
    (``torch/optim/adamw.py``, ``_multi_tensor_adamw``): ``torch._foreach_sqrt`` of the
    second moments makes one new tensor per parameter of the group it updates (the
    denominator, then divided and added to in place), so one copy of the largest group's
    state dtype is alive at once. ``for-loop``: the same per parameter, one at a time
    (the largest parameter; not modelled: pass its elements). SGD updates in place."""
    if implementation not in OPTIMIZER_IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}: one of {OPTIMIZER_IMPLEMENTATIONS}")
    if implementation == "fused" or optimizer not in ("adamw", "adam"):
        return {}
    return {"adamw_sqrt_denominator": float(state_bytes * largest_group_elements)}


@dataclass(frozen=True)
class StepPeak:
    """One strategy's predicted peak per GPU, first step and later steps."""

    strategy: str
    first_step: tuple[PeakPoint, ...]
    """The candidate points of the run's first step (what ``peak_live`` measures)."""
    later_steps: tuple[PeakPoint, ...]
    """The same points once the optimizer's state exists from the step's start."""
    trace: StepTrace

    @property
    def first(self) -> PeakPoint:
        return highest(self.first_step)

    @property
    def later(self) -> PeakPoint:
        return highest(self.later_steps)

    @property
    def run(self) -> PeakPoint:
        """The run's peak: the larger of the first step's and a later step's."""
        return highest((self.first, self.later))

    @property
    def bytes(self) -> float:
        return self.run.bytes

    @property
    def point(self) -> str:
        return self.run.point


def step_trace_for(
    inputs: PlanInputs, strategy: str | Strategy, micro_batch: int, device: str = "cuda"
) -> StepTrace | None:
    """The step's activation side as ``strategy`` runs it (DDP's mixed precision is autocast
    over fp32 weights; DeepSpeed and FSDP2 compute with 16-bit weights)."""
    from dpkit.plan.step_trace import step_trace

    strategy = get_strategy(strategy)
    precision = canonical_precision(inputs.precision)
    autocast = engine_of(strategy).plan.activations_under_autocast(strategy, precision)
    return step_trace(
        inputs.model,
        micro_batch,
        inputs.seq_len,
        precision,
        inputs.activation_checkpointing,
        inputs.attention,
        device=device,
        autocast=autocast and precision != "fp32",
    )


def step_peak(
    inputs: PlanInputs,
    strategy: str | Strategy,
    row: StrategyEstimate,
    trace: StepTrace,
    settings: dict[str, Any],
    on_gpu: bool = True,
    optimizer_implementation: str = "fused",
) -> StepPeak:
    """The peak of ``strategy``'s step at ``row``'s figures (:func:`dpkit.plan.estimate.
    estimate` at the same micro-batch) with the step's ``trace``."""
    strategy = get_strategy(strategy)
    precision = canonical_precision(inputs.precision)
    groups = inputs.model.param_groups
    largest_group = max((sum(g) for g in groups), default=float(inputs.model.num_params))
    if strategy.shards_optimizer:  # the update runs on this rank's partition of a group
        largest_group /= inputs.world_size
    temporaries = optimizer_temporaries(inputs.optimizer, optimizer_implementation, largest_group)

    def view(first_step: bool) -> PeakView:
        return PeakView(
            params=row.params,
            grads=row.grads,
            grads_backward=row.grads_backward,
            grads_step=row.grads_step,
            optimizer=row.optimizer,
            master=row.master,
            buffer_parts=row.buffer_parts,
            step_parts=row.step_parts,
            optimizer_temporaries=temporaries,
            trace=trace,
            spec=inputs.model,
            world_size=inputs.world_size,
            precision=precision,
            first_step=first_step,
            settings=settings,
            accumulation_steps=inputs.gradient_accumulation_steps,
            on_gpu=on_gpu,
            host=row.host,
        )

    plan = engine_of(strategy).plan
    return StepPeak(
        strategy=strategy.name,
        first_step=tuple(plan.peak_points(strategy, view(True))),
        later_steps=tuple(plan.peak_points(strategy, view(False))),
        trace=trace,
    )


def plan_peaks(
    inputs: PlanInputs, rows: list[StrategyEstimate], settings: dict[str, Any]
) -> dict[str, StepPeak]:
    """Every applicable row's peak at the plan's micro-batch (none without shapes)."""
    peaks: dict[str, StepPeak] = {}
    for row in rows:
        if not row.applicable:
            continue
        trace = step_trace_for(inputs, row.strategy, inputs.micro_batch)
        if trace is None:
            continue
        peaks[row.strategy] = step_peak(inputs, row.strategy, row, trace, settings)
    return peaks


def peak_dict(peak: StepPeak) -> dict[str, Any]:
    """A strategy's predicted peak for ``--json``: the run's, the first step's and a later
    step's, each with its point and what is alive there (bytes as integers)."""

    def point(p: PeakPoint) -> dict[str, Any]:
        return {
            "bytes": round(p.bytes),
            "point": p.point,
            "parts": {k: round(v) for k, v in p.parts.items()},
        }

    return {
        "bytes": round(peak.bytes),
        "point": peak.point,
        "first_step": point(peak.first),
        "later_steps": point(peak.later),
        "batch": {"micro_batch": peak.trace.micro_batch, "seq_len": peak.trace.seq_len},
    }
