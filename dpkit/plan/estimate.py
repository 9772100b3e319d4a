"""Per-GPU bytes of one strategy at one micro-batch: the arithmetic of ``dpkit plan``.

:func:`estimate` adds, for one :class:`~dpkit.strategy.Strategy`: model states from
:func:`dpkit.memory.analytic.model_state_bytes` (the memory report's prediction), with
ZeRO-1/2's gradients as DeepSpeed lays them out (:func:`gradient_layout`) and FSDP2's
padded per parameter; activations from :mod:`dpkit.plan.activations`; buffers
(:func:`buffer_bytes`: communication buffers, and FSDP2's whole parameters) with the
settings dpkit runs with (:func:`buffer_settings`); the optimizer step's temporaries
(:func:`step_bytes`); and a runtime reserve. :func:`largest_micro_batch` searches on
:func:`estimate` itself; choosing a strategy is :mod:`dpkit.plan.recommend`'s job.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from dpkit.memory import fsdp2_layout
from dpkit.memory.analytic import dtype_bytes, model_state_bytes, paper_grad_bytes
from dpkit.memory.zero_layout import GradientHighWater, gradient_high_water
from dpkit.plan.activations import ActivationProfile
from dpkit.plan.inputs import PERSISTENCE_THRESHOLD, ModelSpec, PlanInputs
from dpkit.strategy import Strategy, get_strategy

# The micro-batch search stops here; past it the answer is "more than you need".
MAX_MICRO_BATCH = 1 << 16

# DeepSpeed's own defaults (deepspeed/runtime/zero/config.py), used where
# dpkit.memory.settings says nothing.
DEEPSPEED_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {
        "reduce_bucket_size": 500_000_000,
        "contiguous_gradients": True,
        "overlap_comm": False,  # DeepSpeed turns it on for stage 3 only
        "stage3_prefetch_bucket_size": 50_000_000,
        "stage3_param_persistence_threshold": PERSISTENCE_THRESHOLD,
    }
)


def buffer_settings(spec: ModelSpec, world_size: int = 1, on_cuda: bool = True) -> dict[str, Any]:
    """The DDP and ZeRO-2 settings a dpkit run uses (:mod:`dpkit.memory.settings`), over
    DeepSpeed's defaults; plan targets GPUs, hence ``on_cuda``."""
    from dpkit.memory import settings as dpkit_settings

    settings: dict[str, Any] = dict(DEEPSPEED_DEFAULTS)
    settings["gradient_as_bucket_view"] = bool(
        dpkit_settings.ddp_kwargs().get("gradient_as_bucket_view", False)
    )
    if spec.hidden_size:  # a bare --params has no hidden size: DeepSpeed's defaults stand
        largest = max((n for group in spec.param_groups for n in group), default=None)
        settings.update(
            dpkit_settings.zero_memory_settings(
                spec.num_params,
                spec.hidden_size,
                world_size=world_size,
                stage=2,
                largest_param_numel=largest,
                on_cuda=on_cuda,
            )
        )
    return settings


def buffer_bytes(
    strategy: str | Strategy,
    spec: ModelSpec,
    world_size: int,
    precision: str,
    settings: dict[str, Any],
    ddp_grad_bytes: float = 0.0,
) -> dict[str, float]:
    """Per-GPU communication buffers held through forward and backward, by name.

    * DDP: the reducer allocates flat buckets for every gradient up front
      (bucket_cap_mb only splits them); with ``gradient_as_bucket_view`` the
      gradients are views of those buckets and cost nothing more.
    * ZeRO-1/2 (and offload): the reduce bucket of ``reduce_bucket_size``
      elements in the module dtype, two with ``overlap_comm``. The post-step
      all-gather writes into the parameters in place (all_gather_into_tensor).
    * ZeRO-3: one reduce bucket, the largest layer gathered whole with its
      16-bit gradient (DeepSpeed's ``largest_layer_memory``), the prefetch
      bucket, and the small tensors every rank keeps whole.
    * FSDP2: what ``fully_shard`` holds whole in the compute dtype at the start of
      backward (:func:`fsdp2_buffer_bytes`).
    """
    strategy = get_strategy(strategy)
    module_bytes = dtype_bytes(precision)
    if strategy.uses_fsdp2:
        return fsdp2_buffer_bytes(strategy, spec, world_size, precision)
    if not strategy.uses_deepspeed:
        return {
            "ddp_gradient_buckets": 0.0 if settings["gradient_as_bucket_view"] else ddp_grad_bytes
        }
    # Stages 1-2 double-buffer with overlap_comm; stage 3 keeps one flat bucket either way.
    shards_params = strategy.zero_stage >= 3
    reduce_buckets = 2 if settings["overlap_comm"] and not shards_params else 1
    parts = {"reduce_bucket": reduce_buckets * settings["reduce_bucket_size"] * module_bytes}
    if shards_params:
        parts["gathered_layer"] = 2 * module_bytes * spec.largest_layer_params
        parts["prefetch_bucket"] = module_bytes * settings["stage3_prefetch_bucket_size"]
        parts["persistent_small_tensors"] = module_bytes * spec.small_tensor_params
    return parts


def fsdp2_buffer_bytes(
    strategy: str | Strategy, spec: ModelSpec, world_size: int, precision: str
) -> dict[str, float]:
    """FSDP2's whole parameters and gradients per GPU at the start of backward, by name
    (:func:`dpkit.memory.fsdp2_layout.transient_bytes`), in the compute dtype (bf16/fp16
    under mixed precision: ``MixedPrecisionPolicy.param_dtype``).

    Shard-grad-op keeps every layer's parameters whole from its forward to its backward:
    about the whole model again, in the compute dtype. Full-shard keeps the root's and
    about two layers'. Both hold the root's whole gradients through backward and one
    unit's whole gradients with its fp32 reduce-scatter input. A bare ``--params`` has no
    layout: shard-grad-op's whole parameters are then Psi in the compute dtype, and
    nothing else is counted.
    """
    strategy = get_strategy(strategy)
    compute_bytes = dtype_bytes(precision)
    if not spec.param_shapes:
        if strategy.reshard_after_forward:
            return {}
        return {"fsdp2_whole_params": float(compute_bytes * spec.num_params)}
    parts = fsdp2_layout.transient_bytes(
        spec.param_shapes,
        spec.param_units,
        world_size,
        compute_bytes,
        strategy.reshard_after_forward,
    )
    return {f"fsdp2_{name}": value for name, value in parts.items()}


def step_bytes(
    strategy: str | Strategy,
    optimizer: str,
    num_params: int,
    world_size: int,
    grads_laid_out: bool = False,
    precision: str = "fp32",
) -> dict[str, float]:
    """Per-GPU temporaries of the optimizer step, by name.

    They exist after backward has freed the activations, so a step's peak is
    the larger of the two, not their sum.

    * ZeRO-1/2 (not offloaded): the flat copy of this rank's gradient partition the
      step makes (in fp32 it becomes the master's gradient; in mixed precision it is
      cast to fp32, and that fp32 gradient is already among the model states,
      :func:`~dpkit.memory.analytic.model_state_bytes`). ZeRO-3: the fp32 gradient
      partition the step reads (DeepSpeed's estimator counts it as "4 bytes grads
      32bit"). Offload builds them in host memory. With the parameter layout known
      (``grads_laid_out``) they are part of the step's gradients instead
      (:mod:`dpkit.memory.zero_layout`).
    * dpkit's optimizer is torch's fused AdamW (:func:`dpkit.models.adamw`), which
      updates in place: no temporaries (a ``foreach`` AdamW would add one fp32 copy of
      the parameters it updates). SGD updates in place.
    """
    strategy = get_strategy(strategy)
    psi, n = float(num_params), float(world_size)
    parts: dict[str, float] = {}
    # The fp32 gradient partition feeds the fp32 master update on the GPU.
    if strategy.keeps_fp32_master and not strategy.offload and not grads_laid_out:
        if strategy.zero_stage in (1, 2):
            parts["flat_grad_partition"] = dtype_bytes(precision) * psi / n
        else:
            parts["fp32_grad_partition"] = 4 * psi / n
    return parts


# --- one strategy's estimate --------------------------------------------------------


@dataclass(frozen=True)
class StrategyEstimate:
    """Predicted bytes per GPU under one strategy."""

    strategy: str
    """The strategy's name (:data:`dpkit.strategy.STRATEGIES`), as JSON output shows it."""
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
    """Host bytes per GPU under offload: optimizer state, master weights, and the
    fp32 gradient partition the CPU step reads."""
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


def _analytic_optimizer(strategy: Strategy, optimizer: str) -> str | None:
    """The optimizer the analytic core should count for this row, or None if it cannot run.

    ``cpu_adam`` needs its parameters in host memory, so DeepSpeed runs it only
    with optimizer offload. Under offload DeepSpeed swaps Adam/AdamW for its
    CPU Adam (same state size), and runs SGD on the CPU as a torch optimizer
    (which needs ``zero_force_ds_cpu_optimizer: false``).
    """
    if optimizer == "cpu_adam":
        return "cpu_adam" if strategy.offload else None
    if strategy.offload and optimizer in ("adamw", "adam"):
        return "cpu_adam"
    return optimizer


def gradient_layout(
    inputs: PlanInputs, strategy: str | Strategy, settings: dict[str, Any]
) -> GradientHighWater | None:
    """ZeRO-1/2's gradient holding on its worst rank, from the parameter layout
    (:mod:`dpkit.memory.zero_layout`); None where the paper's figure stands (DDP holds
    exactly its gradients, offload keeps them off the GPU, ZeRO-3 is for reference,
    and a bare ``--params`` has no layout; FSDP2 is not DeepSpeed)."""
    strategy = get_strategy(strategy)
    if (
        not strategy.uses_deepspeed
        or strategy.zero_stage not in (1, 2)
        or strategy.offload
        or not inputs.model.param_groups
    ):
        return None
    return _worst_rank_gradients(
        inputs.model.param_groups,
        strategy.zero_stage,
        inputs.world_size,
        dtype_bytes(inputs.precision),
        settings["reduce_bucket_size"],
        settings["contiguous_gradients"],
        inputs.model.param_order[::-1] or None,
        inputs.gradient_accumulation_steps,
    )


@functools.lru_cache(maxsize=64)
def _worst_rank_gradients(
    groups: tuple[tuple[int, ...], ...],
    stage: int,
    world_size: int,
    module_bytes: int,
    reduce_bucket_size: int,
    contiguous_gradients: bool,
    arrival: tuple[tuple[int, int], ...] | None,
    accumulation_steps: int,
) -> GradientHighWater:
    # Cached: the micro-batch search asks for the same layout dozens of times.
    ranks = gradient_high_water(
        groups,
        stage=stage,
        world_size=world_size,
        module_bytes=module_bytes,
        reduce_bucket_size=reduce_bucket_size,
        contiguous_gradients=contiguous_gradients,
        arrival=arrival,
        accumulation_steps=accumulation_steps,
    )
    worst = max(ranks, key=lambda r: r.bytes)
    # The peak of each phase may sit on another rank than the overall high-water.
    return GradientHighWater(
        rank=worst.rank,
        backward=max(r.backward for r in ranks),
        step=max(r.step for r in ranks),
        moment=worst.moment,
        partition_bytes=worst.partition_bytes,
    )


def estimate(
    inputs: PlanInputs,
    strategy: str | Strategy,
    micro_batch: int,
    activations: ActivationProfile | None,
    settings: dict[str, Any],
) -> StrategyEstimate:
    """Bytes per GPU for ``strategy`` (a Strategy or its name) at ``micro_batch``."""
    strategy = get_strategy(strategy)
    optimizer = _analytic_optimizer(strategy, inputs.optimizer)
    if optimizer is None:
        return StrategyEstimate(strategy.name, applicable=False)
    num_params = inputs.model.num_params
    states = model_state_bytes(
        num_params,
        strategy,
        inputs.world_size,
        inputs.precision,
        optimizer,
        param_shapes=inputs.model.param_shapes or None,
    )
    activation_parts: dict[str, float] = {}
    if activations is not None:
        activation_parts = activations.parts(micro_batch)
    if strategy.engine == "ddp" and inputs.precision != "fp32":
        # DDP's mixed precision is autocast: it casts each weight to 16 bits once
        # per forward and keeps the copy for backward (the matmul saves it): the
        # memory report sees these among saved tensors. Norm weights and position
        # embeddings are not cast, so this is an upper bound. (FSDP2's matmuls save
        # its whole 16-bit parameters, counted among its buffers.)
        activation_parts["autocast_weight_copies"] = 2.0 * num_params
    buffers = buffer_bytes(
        strategy, inputs.model, inputs.world_size, inputs.precision, settings, states.grads
    )
    laid_out = gradient_layout(inputs, strategy, settings)
    step = step_bytes(
        strategy, optimizer, num_params, inputs.world_size, laid_out is not None, inputs.precision
    )
    # Offload builds the fp32 gradient partition in host memory, beside the
    # optimizer state it feeds (DeepSpeed's estimator counts it there too).
    host_grads = 4.0 * num_params / inputs.world_size if strategy.offload else 0.0
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
        host_offload=states.offloaded_to_cpu + host_grads,
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
        return row.applicable and row.total <= inputs.usable

    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= MAX_MICRO_BATCH and fits(high):
        low, high = high, high * 2
    if high > MAX_MICRO_BATCH:
        return MAX_MICRO_BATCH
    while high - low > 1:  # fits(low) and not fits(high)
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low
