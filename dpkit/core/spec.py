"""What the plan knows about a model (:class:`ModelSpec`) and a validated request
(:class:`PlanInputs`): plain values that the engines' plan arithmetic reads.

:mod:`dpkit.plan.inputs` builds them (a bundled config, a local ``config.json`` or a Hub
name, counted on the meta device; a live module; a run's record).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any

from dpkit.core.units import GIB, PRECISIONS
from dpkit.errors import UsageError
from dpkit.models import max_positions

OPTIMIZER_CHOICES = ("adamw", "sgd", "sgd_momentum", "cpu_adam")
ATTENTION_CHOICES = ("sdpa", "eager")


@dataclass(frozen=True)
class ModelSpec:
    """What the plan knows about the model."""

    name: str
    """As given: a bundled name, a path, a Hub name, or the ``--params`` text."""
    source: str
    """``bundled``, ``path``, ``hub``, ``count`` (a bare ``--params``), ``recipe`` (a
    config a recipe built, for ``--against``) or ``trainer`` (the live model of a
    Transformers ``Trainer`` run, recorded in its memory report)."""
    num_params: int
    """Distinct parameters, tied weights counted once."""
    config: Any = field(default=None, repr=False, compare=False)
    """The transformers config (None for a bare count): the shapes activations come from."""
    largest_layer_params: int = 0
    """Most parameters held directly by one module: the layer ZeRO-3 gathers whole (DeepSpeed's term)."""
    small_tensor_params: int = 0
    """Parameters in tensors under ZeRO-3's persistence threshold, which every rank keeps whole."""
    gated_mlp: bool = False
    """Whether the MLP is gated (SwiGLU: gate and up projections), for the formula."""
    param_groups: tuple[tuple[int, ...], ...] = ()
    """Elements of each parameter, per optimizer group of the recipes, in order: the
    layout DeepSpeed partitions (:mod:`dpkit.engines.deepspeed.layout`). Empty for a bare count."""
    param_order: tuple[tuple[int, int], ...] = ()
    """(group, index in ``param_groups``) of every parameter in the model's own order:
    backward produces their gradients roughly in reverse. Empty for a bare count."""
    param_shapes: tuple[tuple[int, ...], ...] = ()
    """The shape of every parameter in the model's own order (tied ones once): FSDP2 shards
    each on dim 0 (:mod:`dpkit.engines.fsdp2.layout`). Empty for a bare count."""
    param_units: tuple[int, ...] = ()
    """For each of ``param_shapes``, the FSDP2 unit holding it: the index of the
    transformer layer (a module of a class in the model's ``_no_split_modules``) it is
    in, or -1 for the root (embeddings, head, final norm). Empty for a bare count."""
    module_buffer_bytes: int = 0
    """Bytes of the module's own buffers (position ids, rotary frequencies), which the
    memory report counts among its buffers."""
    task: str = "causal_lm"
    """The head the model is built with for the activation trace: the transformers class
    it was built as (``BertForSequenceClassification``), or ``causal_lm`` where that is
    unknown (a bare count, a class transformers does not export)."""
    frozen_params: int = 0
    """Parameters that do not train (LoRA's frozen weights): held, with no gradient and
    no optimizer state. ``num_params`` counts the ones that train."""
    trainable: tuple[bool, ...] = ()
    """For each of ``param_shapes``, whether it trains (empty: all do)."""
    lora: dict[str, Any] | None = field(default=None, compare=False)
    """The LoRA adapters the model carries (:func:`dpkit.lora.lora_settings`), which the
    activation trace puts back on the model it builds; None without."""

    def shapes_where(self, trains: bool) -> tuple[tuple[int, ...], ...]:
        """The shapes of the parameters that train (or, ``trains=False``, that do not)."""
        if not self.trainable:
            return self.param_shapes if trains else ()
        return tuple(
            s for s, t in zip(self.param_shapes, self.trainable, strict=True) if t == trains
        )

    @property
    def has_shapes(self) -> bool:
        return self.config is not None

    def shape(self, *names: str, default: Any = None) -> Any:
        """The first of ``names`` the config defines (configs name the same shape differently)."""
        for name in names:
            value = getattr(self.config, name, None)
            if value is not None:
                return value
        return default

    @property
    def hidden_size(self) -> int | None:
        return self.shape("hidden_size", "n_embd", "d_model")

    @property
    def max_positions(self) -> int | None:
        return max_positions(self.config) if self.config is not None else None


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
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step (ZeRO-2 holds more gradients when above 1)."""
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
    host_memory: int | None = None
    """Bytes of host memory per node an offloading plan may use (what its ranks keep in
    host memory together, less the same headroom); None: this machine's physical memory."""

    def __post_init__(self) -> None:
        checks = (
            ("--gpus-per-node", self.gpus_per_node, self.gpus_per_node > 0, "must be positive"),
            ("--nodes", self.nodes, self.nodes > 0, "must be positive"),
            ("--gpu-memory", self.gpu_memory, self.gpu_memory > 0, "must be positive"),
            ("--micro-batch", self.micro_batch, self.micro_batch > 0, "must be positive"),
            (
                "--gradient-accumulation-steps",
                self.gradient_accumulation_steps,
                self.gradient_accumulation_steps > 0,
                "must be positive",
            ),
            ("--seq-len", self.seq_len, self.seq_len > 0, "must be positive"),
            ("--reserve", self.reserve, self.reserve >= 0, "must not be negative"),
            ("--headroom", self.headroom, 0 <= self.headroom < 1, "must be in [0, 1)"),
            (
                "--host-memory",
                self.host_memory,
                self.host_memory is None or self.host_memory > 0,
                "must be positive",
            ),
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

    @functools.cached_property
    def host_per_node(self) -> int:
        """Bytes of host memory per node: ``host_memory``, or this machine's (read once:
        ``fits`` asks for every row)."""
        if self.host_memory is not None:
            return self.host_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    @property
    def host_usable(self) -> float:
        """Host bytes per GPU an offloading plan may use: the node's share per GPU, less
        the headroom."""
        return self.host_per_node / self.gpus_per_node * (1 - self.headroom)

    def fits(self, row: Any) -> bool:
        """Whether a :class:`~dpkit.plan.estimate.StrategyEstimate` can run here: its
        device bytes within the GPU's usable memory, and what it offloads within the
        host's share per GPU."""
        return row.applicable and row.total <= self.usable and row.host_offload <= self.host_usable
