"""Per-GPU bytes of one strategy at one micro-batch: the arithmetic of ``dpkit plan``.

:func:`estimate` adds, for one :class:`~dpkit.core.strategy.Strategy`: model states from
:func:`dpkit.memory.analytic.model_state_bytes` (the memory report's prediction), with
gradients as the strategy's engine lays them out (:func:`gradient_layout`: DeepSpeed's
partitions, FSDP2's padded shards); activations from :mod:`dpkit.plan.activations`;
buffers (:func:`buffer_bytes`: communication buffers, and FSDP2's whole parameters) with
the settings dpkit runs with (:func:`buffer_settings`); the optimizer step's
temporaries; and a runtime reserve. Every backend-specific term is its engine's
(``dpkit/engines/*/plan.py``). :func:`largest_micro_batch` searches on
:func:`estimate` itself; choosing a strategy is :mod:`dpkit.plan.recommend`'s job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dpkit.core.spec import ModelSpec, PlanInputs
from dpkit.core.strategy import Strategy
from dpkit.core.units import canonical_precision
from dpkit.engines import ENGINES, engine_of, get_strategy
from dpkit.memory.analytic import model_state_bytes, paper_grad_bytes
from dpkit.plan.activations import ActivationProfile, saved_bytes

if TYPE_CHECKING:
    from dpkit.core.units import GradientHighWater

# The micro-batch search stops here; past it the answer is "more than you need".
MAX_MICRO_BATCH = 1 << 16


def buffer_settings(spec: ModelSpec, world_size: int = 1, on_cuda: bool = True) -> dict[str, Any]:
    """The buffer settings a dpkit run uses, every engine's (:meth:`Engine.plan_settings`:
    DDP's ``gradient_as_bucket_view``, ZeRO's bucket sizes over DeepSpeed's defaults);
    plan targets GPUs, hence ``on_cuda``."""
    settings: dict[str, Any] = {}
    for engine in ENGINES:
        settings.update(engine.plan.plan_settings(spec, world_size, on_cuda))
    return settings


def buffer_bytes(
    strategy: str | Strategy,
    spec: ModelSpec,
    world_size: int,
    precision: str,
    settings: dict[str, Any],
    ddp_grad_bytes: float = 0.0,
) -> dict[str, float]:
    """Per-GPU communication buffers held through forward and backward, by name: the
    strategy's engine's (:meth:`~dpkit.engines.base.Engine.buffer_bytes`: DDP's reducer
    buckets, ZeRO's reduce buckets, FSDP2's whole parameters)."""
    strategy = get_strategy(strategy)
    return engine_of(strategy).plan.buffer_bytes(
        strategy, spec, world_size, canonical_precision(precision), settings, ddp_grad_bytes
    )


# --- one strategy's estimate --------------------------------------------------------


@dataclass(frozen=True)
class StrategyEstimate:
    """Predicted bytes per GPU under one strategy."""

    strategy: str
    """The strategy's name (:data:`dpkit.engines.STRATEGIES`), as JSON output shows it."""
    applicable: bool
    """False where the optimizer cannot run under the strategy (cpu_adam without offload)."""
    params: float = 0.0
    """Module parameters on the GPU."""
    grads: float = 0.0
    """Gradients on the GPU at their high-water (the memory report's ``grads``)."""
    grads_backward: float | None = None
    """Gradients while activations are alive, where that differs from ``grads``."""
    grads_step: float | None = None
    """Gradients during the optimizer step, where that differs from ``grads``."""
    grads_paper: float = 0.0
    """The ZeRO paper's figure (Psi/N under stage 2), for comparison."""
    grads_where: str = ""
    """Which rank holds ``grads`` and when (ZeRO-1/2 with the layout known)."""
    optimizer: float = 0.0
    """Optimizer state on the GPU."""
    master: float = 0.0
    """fp32 master weights on the GPU."""
    activations: float = 0.0
    """Saved-for-backward bytes and the logits peak (0 when not estimated)."""
    buffers: float = 0.0
    """Sum of ``buffer_parts``."""
    step: float = 0.0
    """Sum of ``step_parts``: optimizer-step temporaries, alive once activations are freed."""
    reserve: float = 0.0
    """The runtime reserve (``--reserve``)."""
    host_offload: float = 0.0
    """Host bytes per GPU under offload: the sum of ``host``."""
    host: dict[str, float] = field(default_factory=dict)
    """Host bytes per GPU under offload, by category (``grads``, ``optimizer``,
    ``master``, ``buffers``): what the backend keeps in host memory; the fields above
    are the device's."""
    buffer_parts: dict[str, float] = field(default_factory=dict)
    """Buffers by name (see :func:`buffer_bytes`)."""
    step_parts: dict[str, float] = field(default_factory=dict)
    """Step temporaries by name (see :func:`step_bytes`)."""
    activation_parts: dict[str, float] = field(default_factory=dict)
    """Activation bytes by part, at this micro-batch."""

    @property
    def label(self) -> str:
        """How tables show the strategy (``DDP``, ``ZeRO-1``...)."""
        return get_strategy(self.strategy).label

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer + self.master

    @property
    def probed(self) -> float:
        """What a run's memory probes count at their high-waters (a CPU run's memory
        figure, which ``dpkit tune`` holds to a budget there): the model states, the
        buffers the probes see and the activations a forward saves; not the transients
        that live between probe points (the loss's logits peak, the layer recomputed under
        checkpointing, FSDP2's whole gradients and reduce-scatter input in backward)."""
        strategy = get_strategy(self.strategy)
        unprobed = engine_of(strategy).plan.unprobed_buffer_parts(strategy)
        buffers = sum(v for k, v in self.buffer_parts.items() if k not in unprobed)
        return self.model_states + buffers + saved_bytes(self.activation_parts)

    @property
    def total(self) -> float:
        """The peak: backward's (with activations) or the step's, whichever is larger."""
        backward = self.activations + (
            self.grads if self.grads_backward is None else self.grads_backward
        )
        step = self.step + (self.grads if self.grads_step is None else self.grads_step)
        return (
            self.params + self.optimizer + self.master + self.buffers + self.reserve
            + max(backward, step)
        )  # fmt: skip


def step_bytes(
    strategy: str | Strategy,
    optimizer: str,
    num_params: int,
    world_size: int,
    grads_laid_out: bool = False,
    precision: str = "fp32",
) -> dict[str, float]:
    """Per-GPU temporaries of the optimizer step, by name: the strategy's engine's
    (:meth:`~dpkit.engines.base.Engine.step_bytes`: ZeRO's flat gradient partition). They
    exist after backward has freed the activations, so a step's peak is the larger of the
    two, not their sum. dpkit's optimizer is torch's fused AdamW (:func:`dpkit.models.adamw`),
    which updates in place: no temporaries of its own (a ``foreach`` AdamW would add one
    fp32 copy of the parameters it updates); SGD updates in place."""
    strategy = get_strategy(strategy)
    return engine_of(strategy).plan.step_bytes(
        strategy, float(num_params), world_size, canonical_precision(precision), grads_laid_out
    )


def gradient_layout(
    inputs: PlanInputs, strategy: str | Strategy, settings: dict[str, Any]
) -> GradientHighWater | None:
    """The worst rank's gradient holding from the parameter layout, where the strategy's
    engine lays gradients out otherwise than the paper counts them (DeepSpeed ZeRO-1/2:
    :mod:`dpkit.engines.deepspeed.layout`); None where the paper's figure stands."""
    strategy = get_strategy(strategy)
    return engine_of(strategy).plan.gradient_layout(strategy, inputs, settings)


def estimate(
    inputs: PlanInputs,
    strategy: str | Strategy,
    micro_batch: int,
    activations: ActivationProfile | None,
    settings: dict[str, Any],
) -> StrategyEstimate:
    """Bytes per GPU for ``strategy`` (a Strategy or its name) at ``micro_batch``."""
    strategy = get_strategy(strategy)
    engine = engine_of(strategy)
    optimizer = engine.plan.optimizer_for_plan(strategy, inputs.optimizer)
    if optimizer is None:
        return StrategyEstimate(strategy.name, applicable=False)
    num_params = inputs.model.num_params
    states = model_state_bytes(
        num_params,
        strategy,
        inputs.world_size,
        inputs.precision,
        optimizer,
        param_shapes=inputs.model.shapes_where(trains=True) or None,
        frozen_params=inputs.model.frozen_params,
        frozen_param_shapes=inputs.model.shapes_where(trains=False) or None,
    )
    activation_parts: dict[str, float] = {}
    precision = canonical_precision(inputs.precision)
    autocast = engine.plan.activations_under_autocast(strategy, precision)
    if activations is not None and autocast and activations.under_autocast is not None:
        # DDP's mixed precision: the trace made under autocast, weight copies included.
        activation_parts = activations.under_autocast.parts(micro_batch)
    else:
        if activations is not None:
            activation_parts = activations.parts(micro_batch)
        # What the backend adds to the saved tensors (DDP autocast's 16-bit weight copies,
        # where no trace under autocast counted them: of every weight the forward uses,
        # LoRA's frozen ones too; FSDP2's matmuls save its whole 16-bit parameters,
        # counted among its buffers).
        all_params = float(num_params + inputs.model.frozen_params)
        activation_parts.update(engine.plan.activation_extras(strategy, all_params, precision))
    buffers = buffer_bytes(
        strategy, inputs.model, inputs.world_size, inputs.precision, settings, states.grads
    )
    if inputs.model.module_buffer_bytes:  # every strategy keeps the module's own whole
        buffers["module_buffers"] = float(inputs.model.module_buffer_bytes)
    laid_out = engine.plan.gradient_layout(strategy, inputs, settings)
    step = engine.plan.step_bytes(
        strategy,
        float(num_params),
        inputs.world_size,
        canonical_precision(inputs.precision),
        laid_out is not None,
    )
    host = engine.plan.host_bytes(strategy, inputs, optimizer)
    return StrategyEstimate(
        strategy=strategy.name,
        applicable=True,
        params=states.params,
        grads=states.grads if laid_out is None else laid_out.bytes,
        grads_backward=None if laid_out is None else laid_out.backward,
        grads_step=None if laid_out is None else laid_out.step,
        grads_paper=paper_grad_bytes(num_params, strategy, inputs.world_size, inputs.precision),
        grads_where="" if laid_out is None else f"rank {laid_out.rank}, {laid_out.moment}",
        optimizer=states.optimizer,
        master=states.master,
        activations=sum(activation_parts.values()),
        buffers=sum(buffers.values()),
        step=sum(step.values()),
        reserve=float(inputs.reserve),
        host_offload=sum(host.values()),
        host=host,
        buffer_parts=buffers,
        step_parts=step,
        activation_parts=activation_parts,
    )


def largest_micro_batch(
    inputs: PlanInputs,
    strategy: str | Strategy,
    activations: ActivationProfile | None,
    settings: dict[str, Any],
) -> int | None:
    """The largest micro-batch whose estimate fits, 0 if none does, None if unknown.

    Doubles, then bisects, on :func:`estimate` itself, so it stays right
    whatever shape the estimate takes. Unknown without activations (a bare
    parameter count) or when the strategy cannot run; capped at
    :data:`MAX_MICRO_BATCH`.
    """
    if activations is None:
        return None

    def fits(micro_batch: int) -> bool:
        row = estimate(inputs, strategy, micro_batch, activations, settings)
        return inputs.fits(row)

    if not fits(1):
        return 0
    # Each loop doubles or halves within 1..MAX_MICRO_BATCH: it ends within this many
    # steps, and is bounded by it so that no estimate can make it spin.
    steps = MAX_MICRO_BATCH.bit_length()
    low, high = 1, 2
    for _ in range(steps):
        if high > MAX_MICRO_BATCH or not fits(high):
            break
        low, high = high, high * 2
    if high > MAX_MICRO_BATCH:
        return MAX_MICRO_BATCH
    for _ in range(steps):  # fits(low) and not fits(high)
        if high - low <= 1:
            break
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low
