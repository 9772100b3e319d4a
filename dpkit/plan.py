"""``dpkit plan``: per-GPU memory of DDP and ZeRO before launching, and the least sharding that fits.

    dpkit plan --model gpt2-xl                    # bundled config; 8 x 80GiB, bf16, AdamW
    dpkit plan --model llama-7b --gpu-memory 24GB --activation-checkpointing
    dpkit plan --model ./my-model/config.json --gpus-per-node 4 --nodes 2 --json
    dpkit plan --params 1.5B --precision fp32 --optimizer sgd_momentum

``--model`` is looked up in this order: a config bundled in ``dpkit/configs``
(``gpt2``, ``gpt2-medium``, ``gpt2-large``, ``gpt2-xl``, ``llama-7b``), a local
``config.json`` or a folder holding one, then the Hugging Face Hub (or its
local cache). Only the config is read; the model is built on the meta device.

Per GPU, for DDP, ZeRO-1, ZeRO-2, ZeRO-2 with the optimizer offloaded to the
CPU, and ZeRO-3 (for reference: dpkit's recipes run the first four):

* model states (parameters, gradients, optimizer state, fp32 master weights)
  from :func:`dpkit.analytic.model_state_bytes`, the same figures the memory
  report predicts with;
* activations: the bytes autograd saves for backward (what the memory report
  measures), found by running the model's real forward on the meta device at
  full size, plus the loss's logits peak; :func:`dpkit.activations.formula_layer_bytes`
  is the paper formula it is checked against and falls back to;
* buffers: DDP's gradient buckets, DeepSpeed's reduce bucket, the fp32
  gradient partition ZeRO builds for the optimizer step, ZeRO-3's gathered
  layers, with the settings dpkit runs with (:mod:`dpkit.memory_settings`);
* a runtime reserve (CUDA context, NCCL, allocator fragmentation: ``--reserve``)
  and a share of the GPU kept free (``--headroom``).

What is not counted is in :data:`NOT_COUNTED`; it is printed with every plan.

Flag parsing and the model live in :mod:`dpkit.plan_inputs`, the activation
estimate in :mod:`dpkit.activations`; this module holds the buffers, the plan,
its output and the command line.
"""

from __future__ import annotations

import argparse
import functools
import json
from dataclasses import dataclass, field
from typing import Any

from dpkit.activations import ActivationProfile, _act_bytes, activation_profile
from dpkit.analytic import PRECISIONS, ZERO_STAGE, model_state_bytes
from dpkit.errors import UsageError
from dpkit.plan_inputs import (
    PERSISTENCE_THRESHOLD,
    ModelSpec,
    _fraction,
    _positive_int,
    bundled_models,
    load_model,
    parse_count,
    parse_memory,
)
from dpkit.zero_layout import GradientHighWater, gradient_high_water

GIB = 2**30

STRATEGY_LABELS = {
    "ddp": "DDP",
    "zero1": "ZeRO-1",
    "zero2": "ZeRO-2",
    "zero2_offload": "ZeRO-2 offload",
    "zero3": "ZeRO-3 (ref)",
}
# Least sharding first: the recommendation is the first of these that fits.
RECOMMENDATION_ORDER = ("ddp", "zero1", "zero2", "zero2_offload", "zero3")
OPTIMIZER_CHOICES = ("adamw", "sgd", "sgd_momentum", "cpu_adam")
ATTENTION_CHOICES = ("sdpa", "eager")
ACTIVATION_METHODS = ("trace", "formula")

# The sequence length defaults to the model's context, but no longer than this:
# long-context configs (128k positions) would otherwise plan for a run nobody does.
MAX_DEFAULT_SEQ_LEN = 4096
# The micro-batch search stops here; past it the answer is "more than you need".
MAX_MICRO_BATCH = 1 << 16

# DeepSpeed's own defaults (deepspeed/runtime/zero/config.py), used where
# dpkit.memory_settings says nothing.
DEEPSPEED_DEFAULTS = {
    "reduce_bucket_size": 500_000_000,
    "contiguous_gradients": True,
    "overlap_comm": False,  # DeepSpeed turns it on for stage 3 only
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": PERSISTENCE_THRESHOLD,
}

NOT_COUNTED = (
    "other processes on the GPU, and CUDA/NCCL memory beyond --reserve",
    "temporaries inside one layer's forward or backward (the largest is a few MLP-sized tensors)",
    "under DDP's autocast, the residual stream and norm inputs stay fp32: "
    "the 16-bit trace undercounts them by about 2 bytes per hidden unit per token per norm",
    "evaluation, generation and checkpoint saving (the plan is one training step)",
    "host memory other than what offload moves there (and the fp32 model each process "
    "loads at start-up)",
)

# --- buffers ------------------------------------------------------------------------


def buffer_settings(spec: ModelSpec, world_size: int = 1, on_cuda: bool = True) -> dict[str, Any]:
    """The DDP and ZeRO-2 settings a dpkit run uses (``dpkit.memory_settings``), over
    DeepSpeed's defaults; plan targets GPUs, hence ``on_cuda``."""
    from dpkit import memory_settings as dpkit_settings

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
    strategy: str,
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
    """
    module_bytes = _act_bytes(precision)
    if strategy == "ddp":
        return {
            "ddp_gradient_buckets": 0.0 if settings["gradient_as_bucket_view"] else ddp_grad_bytes
        }
    # Stages 1-2 double-buffer with overlap_comm; stage 3 keeps one flat bucket either way.
    reduce_buckets = 2 if settings["overlap_comm"] and strategy != "zero3" else 1
    parts = {"reduce_bucket": reduce_buckets * settings["reduce_bucket_size"] * module_bytes}
    if strategy == "zero3":
        parts["gathered_layer"] = 2 * module_bytes * spec.largest_layer_params
        parts["prefetch_bucket"] = module_bytes * settings["stage3_prefetch_bucket_size"]
        parts["persistent_small_tensors"] = module_bytes * spec.small_tensor_params
    return parts


def step_bytes(
    strategy: str, optimizer: str, num_params: int, world_size: int, grads_laid_out: bool = False
) -> dict[str, float]:
    """Per-GPU temporaries of the optimizer step, by name.

    They exist after backward has freed the activations, so a step's peak is
    the larger of the two, not their sum.

    * ZeRO (not offloaded): the fp32 copy of this rank's gradient partition
      the step reads (DeepSpeed's estimator counts it as "4 bytes grads
      32bit"); offload builds it in host memory. With the parameter layout
      known (``grads_laid_out``) it is part of the step's gradients instead
      (:mod:`dpkit.zero_layout`).
    * torch AdamW (dpkit's optimizer; foreach on GPUs): one fp32 temporary
      the size of the parameters it updates (``exp_avg_sq_sqrt``): all of
      them under DDP, this rank's partition under ZeRO, none on the GPU under
      offload. SGD updates in place.
    """
    psi, n = float(num_params), float(world_size)
    updated_here = {"ddp": psi, "zero2_offload": 0.0}.get(strategy, psi / n)
    parts: dict[str, float] = {}
    if strategy not in ("ddp", "zero2_offload") and not grads_laid_out:
        parts["fp32_grad_partition"] = 4 * psi / n
    if optimizer in ("adamw", "adam"):
        parts["optimizer_temporaries"] = 4 * updated_here
    return parts


# --- the plan -----------------------------------------------------------------------


@dataclass(frozen=True)
class PlanInputs:
    """A validated request: the model, the machines and the training step."""

    model: ModelSpec
    """The model to plan for."""
    gpus_per_node: int = 8
    """GPUs in each node."""
    nodes: int = 1
    """Nodes; the data-parallel world size is ``gpus_per_node * nodes``."""
    gpu_memory: int = 80 * GIB
    """Bytes of memory on each GPU."""
    precision: str = "bf16"
    """``fp32``, or ``bf16``/``fp16`` mixed precision."""
    optimizer: str = "adamw"
    """``adamw``, ``sgd``, ``sgd_momentum``, or ``cpu_adam`` (offload only)."""
    micro_batch: int = 1
    """Samples per GPU per forward."""
    seq_len: int = 1024
    """Tokens per sample."""
    activation_checkpointing: bool = False
    """Recompute each layer in backward, keeping only its input."""
    attention: str = "sdpa"
    """``sdpa`` (a fused kernel on GPUs) or ``eager`` (scores materialised)."""
    activation_method: str = "trace"
    """``trace`` the model on the meta device, or the paper ``formula``."""
    reserve: int = 2 * GIB
    """Bytes per GPU for the CUDA context, NCCL and allocator slack."""
    headroom: float = 0.10
    """Share of each GPU kept free: a plan fits if its total is within the rest."""

    def __post_init__(self) -> None:
        checks = (
            ("--gpus-per-node", self.gpus_per_node, self.gpus_per_node > 0, "must be positive"),
            ("--nodes", self.nodes, self.nodes > 0, "must be positive"),
            ("--gpu-memory", self.gpu_memory, self.gpu_memory > 0, "must be positive"),
            ("--micro-batch", self.micro_batch, self.micro_batch > 0, "must be positive"),
            ("--seq-len", self.seq_len, self.seq_len > 0, "must be positive"),
            ("--reserve", self.reserve, self.reserve >= 0, "must not be negative"),
            ("--headroom", self.headroom, 0 <= self.headroom < 1, "must be in [0, 1)"),
            ("--precision", self.precision, self.precision in PRECISIONS, "unknown"),
            ("--optimizer", self.optimizer, self.optimizer in OPTIMIZER_CHOICES, "unknown"),
            ("--attention", self.attention, self.attention in ATTENTION_CHOICES, "unknown"),
        )
        for flag, value, ok, problem in checks:
            if not ok:
                raise UsageError(f"{flag}={value!r}: {problem}")
        positions = self.model.max_positions
        if positions is not None and self.seq_len > positions:
            raise UsageError(
                f"--seq-len={self.seq_len}: longer than the model's {positions} positions"
            )
        if self.usable <= self.reserve:
            raise UsageError(
                f"--gpu-memory={self.gpu_memory / GIB:.1f}GiB: nothing left after --reserve "
                f"and --headroom"
            )

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def usable(self) -> float:
        """Bytes per GPU a plan may use: the GPU less the headroom."""
        return self.gpu_memory * (1 - self.headroom)


@dataclass(frozen=True)
class StrategyEstimate:
    """Predicted bytes per GPU under one strategy."""

    strategy: str
    """A key of :data:`STRATEGY_LABELS`."""
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


def _analytic_optimizer(strategy: str, optimizer: str) -> str | None:
    """The optimizer the analytic core should count for this row, or None if it cannot run.

    ``cpu_adam`` needs its parameters in host memory, so DeepSpeed runs it only
    with optimizer offload. Under offload DeepSpeed swaps Adam/AdamW for its
    CPU Adam (same state size), and runs SGD on the CPU as a torch optimizer
    (which needs ``zero_force_ds_cpu_optimizer: false``).
    """
    if optimizer == "cpu_adam":
        return "cpu_adam" if strategy == "zero2_offload" else None
    if strategy == "zero2_offload" and optimizer in ("adamw", "adam"):
        return "cpu_adam"
    return optimizer


def gradient_layout(
    inputs: PlanInputs, strategy: str, settings: dict[str, Any]
) -> GradientHighWater | None:
    """ZeRO-1/2's gradient holding on its worst rank, from the parameter layout
    (:mod:`dpkit.zero_layout`); None where the paper's figure stands (DDP holds
    exactly its gradients, offload keeps them off the GPU, ZeRO-3 is for reference,
    and a bare ``--params`` has no layout)."""
    if strategy not in ("zero1", "zero2") or not inputs.model.param_groups:
        return None
    return _worst_rank_gradients(
        inputs.model.param_groups,
        ZERO_STAGE[strategy],
        inputs.world_size,
        4 if inputs.precision == "fp32" else 2,
        settings["reduce_bucket_size"],
        settings["contiguous_gradients"],
        inputs.model.param_order[::-1] or None,
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
    strategy: str,
    micro_batch: int,
    activations: ActivationProfile | None,
    settings: dict[str, Any],
) -> StrategyEstimate:
    """Bytes per GPU for ``strategy`` at ``micro_batch``."""
    optimizer = _analytic_optimizer(strategy, inputs.optimizer)
    if optimizer is None:
        return StrategyEstimate(strategy, applicable=False)
    states = model_state_bytes(
        inputs.model.num_params, strategy, inputs.world_size, inputs.precision, optimizer
    )
    activation_parts: dict[str, float] = {}
    if activations is not None:
        activation_parts = activations.parts(micro_batch)
    if strategy == "ddp" and inputs.precision != "fp32":
        # Autocast casts each weight to 16 bits once per forward and keeps the
        # copy for backward (the matmul saves it): the memory report sees
        # these among saved tensors. Norm weights and position embeddings are
        # not cast, so this is an upper bound.
        activation_parts["autocast_weight_copies"] = 2.0 * inputs.model.num_params
    buffers = buffer_bytes(
        strategy, inputs.model, inputs.world_size, inputs.precision, settings, states.grads
    )
    laid_out = gradient_layout(inputs, strategy, settings)
    step = step_bytes(
        strategy, optimizer, inputs.model.num_params, inputs.world_size, laid_out is not None
    )
    # Offload builds the fp32 gradient partition in host memory, beside the
    # optimizer state it feeds (DeepSpeed's estimator counts it there too).
    offloaded = strategy == "zero2_offload"
    host_grads = 4.0 * inputs.model.num_params / inputs.world_size if offloaded else 0.0
    return StrategyEstimate(
        strategy=strategy,
        applicable=True,
        params=states.params,
        grads=states.grads if laid_out is None else laid_out.bytes,
        grads_backward=None if laid_out is None else laid_out.backward,
        grads_step=None if laid_out is None else laid_out.step,
        grads_paper=states.grads,
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
    strategy: str,
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
    """One estimate per strategy, in :data:`RECOMMENDATION_ORDER`."""
    largest_micro_batches: dict[str, int | None]
    """Per strategy, the largest micro-batch that fits (None: unknown)."""
    recommended: str
    """The least sharding that fits at the requested micro-batch."""
    reason: str
    """Why, in a sentence or two."""

    def row(self, strategy: str) -> StrategyEstimate:
        return next(r for r in self.rows if r.strategy == strategy)

    def fits(self, row: StrategyEstimate) -> bool:
        return row.applicable and row.total <= self.inputs.usable


def _gib(value: float) -> str:
    return f"{value / GIB:.1f} GiB"


def _reason(plan_rows: dict[str, StrategyEstimate], chosen: str, inputs: PlanInputs) -> str:
    row = plan_rows[chosen]
    usable = _gib(inputs.usable)
    skipped = [s for s in RECOMMENDATION_ORDER[: RECOMMENDATION_ORDER.index(chosen)]]
    too_big = [
        f"{STRATEGY_LABELS[s]} needs {_gib(plan_rows[s].total)}"
        for s in skipped
        if plan_rows[s].applicable
    ]
    prefix = (f"{'; '.join(too_big)}, over the {usable} usable per GPU. ") if too_big else ""
    n = inputs.world_size
    why = {
        "ddp": (
            f"DDP fits ({_gib(row.total)} of {usable} usable): nothing needs sharding, and ZeRO "
            "would add a DeepSpeed engine and sharded checkpoints for memory that is not needed."
        ),
        "zero1": (
            f"ZeRO-1 shards optimizer state and master weights {n} ways at DDP's communication "
            "volume (ZeRO paper: 2x parameters per step): the least sharding that fits."
        ),
        "zero2": (
            f"ZeRO-2 also shards gradients {n} ways (reduce-scatter during backward, still DDP's "
            "volume): the least sharding that fits."
        ),
        "zero2_offload": (
            "Offload keeps ZeRO-2's sharding and moves optimizer state, master weights and fp32 "
            f"gradients to host memory ({_gib(row.host_offload)} per GPU, "
            f"{_gib(row.host_offload * inputs.gpus_per_node)} per node); the optimizer step "
            "runs on the CPU and gradients and weights cross PCIe every step, so steps slow down."
        ),
        "zero3": (
            "Only ZeRO-3 fits: it shards the parameters too, all-gathering them in forward and "
            "backward (1.5x DDP's communication). dpkit's recipes stop at ZeRO-2; ZeRO-3 needs a "
            "DeepSpeed config of your own."
        ),
    }[chosen]
    if inputs.optimizer == "cpu_adam" and chosen == "zero2_offload":
        prefix = "--optimizer cpu_adam runs only with optimizer offload. "
    return prefix + why


def _nothing_fits(inputs: PlanInputs, rows: list[StrategyEstimate]) -> UsageError:
    smallest = min((r for r in rows if r.applicable), key=lambda r: r.total)
    need = (
        f"the smallest need is {STRATEGY_LABELS[smallest.strategy]} at {_gib(smallest.total)} "
        f"per GPU against {_gib(inputs.usable)} usable ({_gib(inputs.gpu_memory)} less "
        f"{inputs.headroom:.0%} headroom)"
    )
    before_activations = smallest.model_states + smallest.buffers + smallest.reserve + smallest.step
    if smallest.activations and before_activations <= inputs.usable:
        return UsageError(
            f"--micro-batch={inputs.micro_batch}: fits under no strategy on "
            f"{inputs.world_size} x {_gib(inputs.gpu_memory)}; {need}; lower --micro-batch or "
            "--seq-len, or add --activation-checkpointing"
        )
    return UsageError(
        f"--{'model' if inputs.model.source != 'count' else 'params'}={inputs.model.name!r}: "
        f"fits under no strategy on {inputs.world_size} x {_gib(inputs.gpu_memory)} even "
        f"before activations; {need}; use more GPUs or GPUs with more memory"
    )


def make_plan(inputs: PlanInputs) -> Plan:
    """Estimate every strategy and pick the least sharding that fits.

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
        estimate(inputs, s, inputs.micro_batch, activations, settings) for s in RECOMMENDATION_ORDER
    ]
    by_name = {r.strategy: r for r in rows}
    fitting = [r.strategy for r in rows if r.applicable and r.total <= inputs.usable]
    if not fitting:
        raise _nothing_fits(inputs, rows)
    largest = {
        r.strategy: largest_micro_batch(inputs, r.strategy, activations, settings)
        if r.applicable
        else None
        for r in rows
    }
    chosen = fitting[0]
    return Plan(
        inputs=inputs,
        activations=activations,
        settings=settings,
        rows=rows,
        largest_micro_batches=largest,
        recommended=chosen,
        reason=_reason(by_name, chosen, inputs),
    )


# --- output -------------------------------------------------------------------------


def _describe_inputs(inputs: PlanInputs) -> list[str]:
    model = inputs.model
    source = {"bundled": "bundled config", "path": "local config", "hub": "Hub config"}
    origin = f"{model.name} ({source[model.source]})" if model.source != "count" else "--params"
    precision = "fp32" if inputs.precision == "fp32" else f"{inputs.precision} mixed precision"
    return [
        f"model: {origin}, {model.num_params:,} parameters",
        f"GPUs: {inputs.world_size} ({inputs.nodes} node{'s' if inputs.nodes > 1 else ''} x "
        f"{inputs.gpus_per_node}) x "
        f"{_gib(inputs.gpu_memory)}; usable per GPU {_gib(inputs.usable)} "
        f"({inputs.headroom:.0%} headroom kept free)",
        f"step: {precision}, {inputs.optimizer}, micro-batch {inputs.micro_batch} x "
        f"{inputs.seq_len} tokens, activation checkpointing "
        f"{'on' if inputs.activation_checkpointing else 'off'}, attention {inputs.attention}",
    ]


def _describe_method(plan: Plan) -> str:
    activations = plan.activations
    if activations is None:
        return (
            "activations: NOT COUNTED (a bare --params has no shapes), except DDP autocast's "
            "16-bit weight copies; the totals are a floor and no micro-batch limit is given"
        )
    if activations.method == "trace":
        return (
            "activations: bytes saved for backward, traced by running the model's forward on the "
            "meta device (attention as a fused kernel, dropout masks 1 byte), plus the logits peak"
        )
    note = f" ({activations.note})" if activations.note else ""
    return (
        f"activations: Korthikanti et al. 2022 formula from the config's shapes{note}, "
        "plus the logits peak"
    )


def format_table(plan: Plan) -> str:
    """The human-readable plan."""
    inputs = plan.inputs
    header = (
        f"{'GiB per GPU':<15}{'params':>8}{'grads':>8}{'optim':>8}{'master':>8}{'activ':>8}"
        f"{'step':>8}{'buffers':>9}{'reserve':>9}{'total':>8}  {'fits (free)':<13}"
        f"{'max micro-batch':>15}"
    )
    lines = ["dpkit plan", *("  " + line for line in _describe_inputs(inputs)), "", header]
    total_rule = (
        "total = params + optim + master + buffers + reserve + the larger of backward's "
        "(grads then + activ) and the step's (grads then + step temporaries)"
    )
    for row in plan.rows:
        label = STRATEGY_LABELS[row.strategy]
        if not row.applicable:
            lines.append(f"{label:<15}  n/a: --optimizer {inputs.optimizer} needs offload")
            continue
        figures = (row.params, row.grads, row.optimizer, row.master, row.activations, row.step)
        free = (inputs.gpu_memory - row.total) / inputs.gpu_memory
        fits = f"{'yes' if plan.fits(row) else 'no'} ({free:.0%})"
        largest = plan.largest_micro_batches[row.strategy]
        largest_text = "-" if largest is None else str(largest)
        lines.append(
            f"{label:<15}"
            + "".join(f"{v / GIB:>8.2f}" for v in figures)
            + f"{row.buffers / GIB:>9.2f}{row.reserve / GIB:>9.2f}{row.total / GIB:>8.2f}"
            + f"  {fits:<13}{largest_text:>15}"
        )
    chosen = plan.row(plan.recommended)
    largest = plan.largest_micro_batches[plan.recommended]
    largest_text = (
        f"; largest micro-batch that fits under it: {largest}" if largest is not None else ""
    )
    offload = plan.row("zero2_offload")
    settings = plan.settings
    ddp_buckets = (
        "DDP gradients are views of its buckets"
        if settings["gradient_as_bucket_view"]
        else "DDP's buckets copy every gradient"
    )
    laid_out = [r for r in plan.rows if r.applicable and r.grads_where]
    lines += [
        total_rule,
        *(
            f"{STRATEGY_LABELS[r.strategy]} grads: DeepSpeed's layout, worst {r.grads_where}: "
            f"{_gib(r.grads)} (the ZeRO paper's figure: {_gib(r.grads_paper)}; dpkit.zero_layout)"
            for r in laid_out
        ),
        "",
        f"recommended: {STRATEGY_LABELS[plan.recommended]} at micro-batch {inputs.micro_batch} "
        f"({_gib(chosen.total)} per GPU){largest_text}",
        f"  why: {plan.reason}",
        "",
        _describe_method(plan),
        f"host memory: ZeRO-2 offload keeps {_gib(offload.host_offload)} per GPU in host RAM "
        f"({_gib(offload.host_offload * inputs.gpus_per_node)} per node)",
        f"buffers: {ddp_buckets}; ZeRO reduce bucket {settings['reduce_bucket_size']:,} "
        f"elements, overlap_comm {settings['overlap_comm']} (dpkit.memory_settings over "
        "DeepSpeed's defaults)",
        "not counted:",
        *(f"  - {item}" for item in NOT_COUNTED),
    ]
    return "\n".join(lines)


def _row_dict(row: StrategyEstimate, plan: Plan) -> dict[str, Any]:
    if not row.applicable:
        return {"strategy": row.strategy, "applicable": False}
    return {
        "strategy": row.strategy,
        "applicable": True,
        "bytes_per_gpu": {
            "params": round(row.params),
            "grads": round(row.grads),
            "grads_backward": round(
                row.grads if row.grads_backward is None else row.grads_backward
            ),
            "grads_step": round(row.grads if row.grads_step is None else row.grads_step),
            "grads_paper": round(row.grads_paper),
            "optimizer": round(row.optimizer),
            "master": round(row.master),
            "activations": round(row.activations),
            "step": round(row.step),
            "buffers": round(row.buffers),
            "reserve": round(row.reserve),
            "total": round(row.total),
        },
        "grads_where": row.grads_where or None,
        "buffer_parts": {k: round(v) for k, v in row.buffer_parts.items()},
        "step_parts": {k: round(v) for k, v in row.step_parts.items()},
        "activation_parts": {k: round(v) for k, v in row.activation_parts.items()},
        "host_offload_bytes_per_gpu": round(row.host_offload),
        "fits": plan.fits(row),
        "free_fraction": (plan.inputs.gpu_memory - row.total) / plan.inputs.gpu_memory,
        "largest_micro_batch": plan.largest_micro_batches[row.strategy],
    }


def plan_dict(plan: Plan) -> dict[str, Any]:
    """The plan for ``--json``: bytes as integers, per GPU unless named otherwise."""
    inputs = plan.inputs
    activations = plan.activations
    return {
        "model": {
            "name": inputs.model.name,
            "source": inputs.model.source,
            "num_params": inputs.model.num_params,
        },
        "inputs": {
            "gpus_per_node": inputs.gpus_per_node,
            "nodes": inputs.nodes,
            "world_size": inputs.world_size,
            "gpu_memory_bytes": inputs.gpu_memory,
            "usable_bytes": round(inputs.usable),
            "headroom": inputs.headroom,
            "reserve_bytes": inputs.reserve,
            "precision": inputs.precision,
            "optimizer": inputs.optimizer,
            "micro_batch": inputs.micro_batch,
            "seq_len": inputs.seq_len,
            "activation_checkpointing": inputs.activation_checkpointing,
            "attention": inputs.attention,
        },
        "activations": None
        if activations is None
        else {
            "method": activations.method,
            "note": activations.note,
            "bytes_at_micro_batch_1": round(activations.at(1)),
            "bytes_per_sample_from_2": round(sum(activations.per_sample.values())),
        },
        "settings": plan.settings,
        "strategies": [_row_dict(row, plan) for row in plan.rows],
        "recommendation": {
            "strategy": plan.recommended,
            "reason": plan.reason,
            "largest_micro_batch": plan.largest_micro_batches[plan.recommended],
        },
        "not_counted": list(NOT_COUNTED),
    }


# --- command line -------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``dpkit plan`` flags. Values are parsed in :func:`main` so that every
    bad value gets the same one-line error (argparse's own spans several lines)."""
    parser.epilog = __doc__.split("\n\n")[1] if __doc__ else None
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    model = parser.add_argument_group("model (one of)")
    model.add_argument(
        "--model",
        metavar="NAME_OR_PATH",
        help=f"bundled config ({', '.join(bundled_models())}), a config.json or its folder, "
        "or a Hub name; built on the meta device, no weights read",
    )
    model.add_argument(
        "--params", metavar="N", help="a bare parameter count (124M, 1.5B); no activations"
    )
    machine = parser.add_argument_group("machines")
    machine.add_argument("--gpus-per-node", metavar="N", default="8", help="default: 8")
    machine.add_argument("--nodes", metavar="N", default="1", help="default: 1")
    machine.add_argument(
        "--gpu-memory",
        metavar="SIZE",
        default="80GiB",
        help="per GPU: 80GiB, 24GB (GB=1e9, GiB=2**30, bare G=GiB); default: 80GiB",
    )
    step = parser.add_argument_group("training step")
    step.add_argument(
        "--precision",
        metavar="{fp32,bf16,fp16}",
        default="bf16",
        help=f"{'/'.join(PRECISIONS)}; default: bf16",
    )
    step.add_argument(
        "--optimizer",
        metavar="{adamw,sgd,sgd_momentum,cpu_adam}",
        default="adamw",
        help="adamw, sgd, sgd_momentum, or cpu_adam (DeepSpeed's CPU Adam: offload only); "
        "the offload row runs AdamW as CPU Adam. Default: adamw",
    )
    step.add_argument("--micro-batch", metavar="N", default="1", help="samples per GPU; default: 1")
    step.add_argument(
        "--seq-len",
        metavar="N",
        default=None,
        help=f"tokens per sample; default: the model's positions, at most {MAX_DEFAULT_SEQ_LEN}",
    )
    step.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each layer in backward (keeps only layer inputs)",
    )
    step.add_argument(
        "--attention",
        metavar="{sdpa,eager}",
        default="sdpa",
        help="sdpa (fused kernel, no scores kept) or eager (scores kept); default: sdpa",
    )
    estimate_group = parser.add_argument_group("estimate")
    estimate_group.add_argument(
        "--activation-estimate",
        metavar="{trace,formula}",
        default="trace",
        help="trace (the model's forward on the meta device) or formula "
        "(Korthikanti et al. 2022); default: trace",
    )
    estimate_group.add_argument(
        "--reserve",
        metavar="SIZE",
        default="2GiB",
        help="per GPU for CUDA context, NCCL and allocator slack; default: 2GiB",
    )
    estimate_group.add_argument(
        "--headroom",
        metavar="FRACTION",
        default="0.1",
        help="share of each GPU kept free for what the estimate misses; default: 0.1 (10%%)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--against",
        metavar="RUN_DIR",
        help="check the plan against a finished run (recipes/finetune.py, recipes/train_lm.py, "
        "dpkit bench): its model, strategy, world size and settings; predicted vs measured "
        "model states per category",
    )


def _choice(value: str, flag: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise UsageError(f"{flag}={value!r}: not one of {', '.join(choices)}")
    return value


def inputs_from_args(args: argparse.Namespace) -> PlanInputs:
    """Parse and check the flags (one-line UsageError on the first bad one)."""
    if (args.model is None) == (args.params is None):
        raise UsageError(
            f"--model={args.model!r} / --params={args.params!r}: give exactly one of them"
        )
    precision = _choice(args.precision, "--precision", PRECISIONS)
    optimizer = _choice(args.optimizer, "--optimizer", OPTIMIZER_CHOICES)
    attention = _choice(args.attention, "--attention", ATTENTION_CHOICES)
    method = _choice(args.activation_estimate, "--activation-estimate", ACTIVATION_METHODS)
    gpus_per_node = _positive_int(args.gpus_per_node, "--gpus-per-node")
    nodes = _positive_int(args.nodes, "--nodes")
    gpu_memory = parse_memory(args.gpu_memory, "--gpu-memory")
    if gpu_memory <= 0:
        raise UsageError(f"--gpu-memory={args.gpu_memory!r}: must be positive")
    reserve = parse_memory(args.reserve, "--reserve")
    headroom = _fraction(args.headroom, "--headroom")
    micro_batch = _positive_int(args.micro_batch, "--micro-batch")
    seq_len = None if args.seq_len is None else _positive_int(args.seq_len, "--seq-len")
    if args.params is not None:
        spec = ModelSpec(name=args.params, source="count", num_params=parse_count(args.params))
    else:
        spec = load_model(args.model)
    if seq_len is None:
        seq_len = min(spec.max_positions or 1024, MAX_DEFAULT_SEQ_LEN)
    return PlanInputs(
        model=spec,
        gpus_per_node=gpus_per_node,
        nodes=nodes,
        gpu_memory=gpu_memory,
        precision=precision,
        optimizer=optimizer,
        micro_batch=micro_batch,
        seq_len=seq_len,
        activation_checkpointing=args.activation_checkpointing,
        attention=attention,
        activation_method=method,
        reserve=reserve,
        headroom=headroom,
    )


def main(args: argparse.Namespace) -> int:
    """Run ``dpkit plan``; bad input raises UsageError (exit code 2 from the CLI)."""
    if args.against is not None:
        from dpkit import plan_check

        if args.model is not None or args.params is not None:
            raise UsageError(
                f"--against={args.against!r}: the run says which model; drop --model/--params"
            )
        check = plan_check.check_run(args.against)
        text = json.dumps(plan_check.check_dict(check), indent=2)
        print(text if args.json else plan_check.format_check(check))
        return 0
    plan = make_plan(inputs_from_args(args))
    print(json.dumps(plan_dict(plan), indent=2) if args.json else format_table(plan))
    return 0
