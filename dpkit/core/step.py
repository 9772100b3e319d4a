"""What one training step holds besides the model states, as plain numbers: the ground
the plan's peak (:mod:`dpkit.plan.peak`) and each engine's peak points stand on.

:class:`StepTrace` is measured on the meta device by :mod:`dpkit.plan.step_trace` (the
model's own forward, loss and backward); :class:`PeakView` is what an engine reads to
say which tensors are alive at each point of its step
(:meth:`~dpkit.engines.roles.planned.PlanArithmetic.peak_points`). No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StepTrace:
    """Bytes a forward, its loss and its backward hold at one micro-batch, beyond the
    parameters, the module's buffers and the batch: what autograd saves, the operators'
    outputs while they live (attention and MLP temporaries, the logits and the loss), and
    in backward the gradients of activations (the model's output dropped before it, as the
    recipes' ``loss = model(**batch).loss`` does). A parameter's gradient counts as long as it is
    an operator's output, until autograd stores it (``.grad``); from then on it is the
    strategy's to hold (DDP's bucket, ZeRO's partition, FSDP2's reduce-scatter)."""

    forward_high: float
    """The high-water during the forward and its loss."""
    forward_point: str
    """Where: ``forward`` (inside a submodule) or ``loss`` (the outermost module's own code
    after its last submodule returned: the head's logits and loss)."""
    backward_high: float
    """The high-water during the backward, the stored gradients left out."""
    grads_at_backward_high: float
    """The stored gradients at that moment (the parameters whose backward ran before it)."""
    backward_kept_high: float
    """The high-water during the backward with every stored gradient kept whole as it
    arrives (ZeRO-1's module gradients, reduced after the backward)."""
    grads_stored: float
    """Bytes of the stored gradients at the end of the backward (every trainable
    parameter's, in the module dtype)."""
    block_forward: tuple[float, ...] = ()
    """At each repeated block's forward entry (:func:`dpkit.models.repeated_blocks`, the
    units FSDP2 shards), in forward order: the bytes held then."""
    block_backward_end: tuple[float, ...] = ()
    """When each block's backward has ended (the next block back starts, or the backward
    ends), the stored gradients left out: the activations still held then."""
    forward_blocks_high: float | None = None
    """The forward's high-water up to the return of its last repeated block (None: a model
    without repeated blocks): what runs while ZeRO-3's prefetched flat all-gather buffer
    is still alive (its last parameters are the blocks' and what precedes the head)."""
    grads_before_blocks: float | None = None
    """The stored gradients when the last repeated block's backward starts (None: no
    repeated blocks): the parameters used after the blocks (a final norm, an untied head).
    A tied embedding is not among them: autograd adds the head's contribution to the
    embedding's before it stores the gradient, at the backward's end, and until then the
    trace counts that contribution as an operator's output."""
    after_blocks_high: float | None = None
    """The backward's high-water after the repeated blocks' backward (None: no repeated
    blocks), the gradients stored before it left out and those stored in it kept: the
    embeddings' backward, where a tied embedding's two contributions and their sum are
    alive at once, beside the position embedding's gradient."""
    params_stored_after_blocks: int | None = None
    """How many parameters' gradients autograd stored after the repeated blocks' backward
    (None: no repeated blocks): the embeddings', whose backward comes last."""
    batch: float = 0.0
    """The batch's own bytes (token ids, attention mask, labels), alive the whole step."""
    micro_batch: int = 0
    seq_len: int = 0


@dataclass(frozen=True)
class PeakView:
    """What an engine reads to place its step's tensors in time: the plan's per-GPU figures
    for one strategy (:class:`~dpkit.plan.estimate.StrategyEstimate`), the step's trace, and
    the model's layout."""

    params: float
    grads: float
    grads_backward: float | None
    grads_step: float | None
    optimizer: float
    master: float
    buffer_parts: Mapping[str, float]
    step_parts: Mapping[str, float]
    """The optimizer step's own temporaries the plan counts (ZeRO's flat copy)."""
    optimizer_temporaries: Mapping[str, float]
    """The torch optimizer's temporaries inside its update, by name (none for the fused
    AdamW dpkit runs; a ``foreach`` AdamW's copy of the moments' square roots)."""
    trace: StepTrace
    spec: Any
    """The :class:`~dpkit.core.spec.ModelSpec` (shapes, units, groups)."""
    world_size: int
    precision: str
    first_step: bool
    """True: the run's first step, before which a torch optimizer has no state (AdamW
    makes its moments inside the first update; what ``peak_live`` measures); False: every
    later step, which holds the state throughout."""
    settings: Mapping[str, Any] = field(default_factory=dict)
    accumulation_steps: int = 1
    """Micro-batches per optimizer step: from the second on, a micro-batch's forward and
    backward run beside the gradients the earlier ones accumulated."""
    on_gpu: bool = True
    """The collectives: NCCL on a GPU, gloo on a CPU (whose reduce-scatter works on a whole
    copy of its input)."""
    host: Mapping[str, float] = field(default_factory=dict)
    """What the backend keeps in host memory under offload, by category (``params``,
    ``grads``, ``optimizer``, ``master``, ``buffers``): outside a GPU's peak, inside a CPU
    run's (one RAM: :meth:`host_alive`)."""

    @property
    def optimizer_before_update(self) -> float:
        """The optimizer state alive before the update: none in the first step."""
        return 0.0 if self.first_step else self.optimizer

    @property
    def module_buffers(self) -> float:
        return float(self.buffer_parts.get("module_buffers", 0.0))

    def host_alive(self, optimizer: bool, grads: bool = True) -> dict[str, float]:
        """The host memory alive at a point, as parts named ``host <category>``, when host
        and device are one RAM (a CPU run: its live bytes hold both); none on a GPU, whose
        peak is the device's. ``optimizer``: whether the optimizer's state is alive there
        (a lazy optimizer makes it inside its first update); ``grads``: whether the host
        gradients are (False where the engine places them in time itself)."""
        if self.on_gpu:
            return {}
        skipped = {c for c, alive in (("optimizer", optimizer), ("grads", grads)) if not alive}
        return {
            f"host {category}": float(value)
            for category, value in self.host.items()
            if value and category not in skipped
        }


@dataclass(frozen=True)
class PeakPoint:
    """One candidate point of a step: the bytes alive there, by what holds them and why."""

    point: str
    """Where in the step (:data:`dpkit.memory.live.PHASES`: ``forward``, ``loss``,
    ``backward``, ``gradient reduction``, ``optimizer step``)."""
    parts: Mapping[str, float]
    """Bytes alive there by name (``params``, ``grads``, ``activations``, a bucket...)."""
    through: tuple[str, ...] = ()
    """Later points the same bytes stay alive through (a plateau: DDP's gradients and
    AdamW's moments from the update until ``zero_grad``)."""

    @property
    def bytes(self) -> float:
        return float(sum(self.parts.values()))

    def covers(self, point: str | None) -> bool:
        """Whether a measured high-water at ``point`` is this one (or its plateau)."""
        return point == self.point or point in self.through


def highest(points: list[PeakPoint] | tuple[PeakPoint, ...]) -> PeakPoint:
    """The candidate with the most bytes alive (the first of equals: the earlier point)."""
    best = points[0]
    for candidate in points[1:]:
        if candidate.bytes > best.bytes:
            best = candidate
    return best
