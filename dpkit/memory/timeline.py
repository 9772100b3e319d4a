"""The memory timeline of a step: what a rank holds, by category, at each point of one step.

:class:`StepTimeline` records, during the steps :class:`~dpkit.memory.probes.StepProbes`
is installed for, one entry per point: the engine's probe points (the optimizer's
step, DeepSpeed's reductions and copies, FSDP2's end of forward) and its own:

* ``forward_begin``: the step's first training forward starts (time 0);
* ``forward block i``: block ``i`` of the model's repeated blocks
  (:func:`dpkit.models.repeated_blocks`, the layers FSDP2 makes units) starts its
  forward, after FSDP2 has all-gathered its parameters;
* ``forward_end``: the model's forward returns;
* ``backward block i``: the gradient of block ``i``'s input is computed, i.e. the
  block's backward is done;
* ``backward_end``: autograd's last callback of the backward (where DDP waits for its
  reduction).

Each entry walks the rank's tensors (:func:`dpkit.core.walk.walk`), so a model of
more than :data:`MAX_BLOCK_POINTS` blocks is sampled at every k-th block. The
timeline kept is that of the last step recorded (with ``--memory-probe-steps 1``, the
default, the first optimizer step). The schema is in docs/memory.md.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any

import torch

from dpkit.core.categories import CATEGORIES

MAX_BLOCK_POINTS = 16
"""At most this many blocks are probed in each direction (a walk each)."""
MAX_ENTRIES = 400
"""Entries kept per step (ZeRO-2 probes every bucket's reduction); the rest are counted."""
TIMELINE_CATEGORIES = (*CATEGORIES, "activations")
"""What each entry holds, in bytes, in the order the chart stacks them."""
PHASES = ("forward", "backward", "reduce", "optimizer")

# Engine probe points by prefix -> phase. DeepSpeed's reduction and backward epilogue run
# inside or right after the backward; its step's copies belong to the optimizer step.
_PHASE_PREFIXES = (
    ("optimizer_step", "optimizer"),
    ("zero_step", "optimizer"),
    ("zero_reduce", "reduce"),
    ("zero_backward_epilogue", "reduce"),
    ("zero_partition_buffer", "reduce"),
    ("backward", "backward"),
    ("forward", "forward"),
)


def phase_of(point: str) -> str:
    """The phase of the step a point belongs to: forward, backward, reduce or optimizer."""
    for prefix, phase in _PHASE_PREFIXES:
        if point.startswith(prefix):
            return phase
    return "forward"  # an engine's point of its own, before the backward (FSDP2's)


def _first_grad_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The block's input that carries the gradient back (its hidden states)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.requires_grad and value.is_floating_point():
            return value
    return None


class StepTimeline:
    """One rank's memory over the steps its probes run in; the last step is kept.

    Installed by :class:`~dpkit.memory.probes.StepProbes`, which calls :meth:`add` from
    every walk and removes the hooks with its own.
    """

    def __init__(self, probes: Any, model: torch.nn.Module, blocks: list[torch.nn.Module]) -> None:
        self.probes = probes
        self.recorded: dict[str, Any] | None = None
        self._entries: list[dict[str, Any]] = []
        self._dropped = 0
        self._t0: float | None = None
        self._probe_seconds_at_t0 = 0.0
        self._stepped = False
        self._backward_seen = False
        self.steps_recorded = 0
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self._cuda = device if device.type == "cuda" else None
        self.memory_kind = "cuda_memory_allocated" if self._cuda is not None else "rss"
        self._process: Any = None
        if self._cuda is None:
            import psutil

            self._process = psutil.Process()
        stride = max(1, math.ceil(len(blocks) / MAX_BLOCK_POINTS))
        self.blocks = list(enumerate(blocks))[::stride]
        handles = [model.register_forward_pre_hook(self._forward_begin)]
        for index, block in self.blocks:
            hook = functools.partial(self._block_forward, index)
            handles.append(block.register_forward_pre_hook(hook, with_kwargs=True))
        handles.append(model.register_forward_hook(self._forward_end))
        for handle in handles:
            probes.add_remover(handle.remove)

    # ---- the step's bounds ------------------------------------------------------------

    def optimizer_stepped(self) -> None:
        """The torch optimizer's step ended: the next training forward starts a new step."""
        self._stepped = True

    def end_step(self, step: int | None = None) -> None:
        """Keep the step recorded so far as the timeline (``step``: the run's count)."""
        if not self._entries:
            return
        self.steps_recorded += 1
        self.recorded = {
            "step": step if step is not None else self.steps_recorded,
            "complete": self._stepped,
            "memory_figure": self.memory_kind,
            "points": self._entries,
            **({"points_dropped": self._dropped} if self._dropped else {}),
        }
        self._entries = []
        self._dropped = 0
        self._t0 = None

    def _begin_step(self) -> None:
        self._entries = []
        self._dropped = 0
        self._t0 = time.perf_counter()
        self._probe_seconds_at_t0 = self.probes.probe_seconds
        self._stepped = False

    @property
    def in_progress(self) -> bool:
        """Whether a step is being recorded (entries not kept yet)."""
        return bool(self._entries)

    def current(self) -> dict[str, Any] | None:
        """The timeline for the report: the last step kept, else the step in progress."""
        if self.recorded is not None:
            return self.recorded
        if not self._entries:
            return None
        return {
            "step": None,
            "complete": False,
            "memory_figure": self.memory_kind,
            "points": list(self._entries),
        }

    # ---- entries ----------------------------------------------------------------------

    def add(self, point: str, snap: dict[str, Any], started: float) -> None:
        """An entry at ``point`` from a walk's ``snap`` that began at ``started``."""
        if self._t0 is None:
            self._begin_step()  # a point before any forward: the step starts here
        if not self._entries:
            self._t0 = started  # the step's time starts at its first point
        if len(self._entries) >= MAX_ENTRIES:
            self._dropped += 1
            return
        # The walks' own time is left out, so that time stamps are the step's own.
        spent_in_probes = self.probes.probe_seconds - self._probe_seconds_at_t0
        entry: dict[str, Any] = {
            "point": point,
            "phase": phase_of(point),
            "t": max(0.0, started - self._t0 - spent_in_probes),
        }
        entry.update({c: float(snap[c]) for c in CATEGORIES})
        activations = self.probes.activations
        entry["activations"] = activations.held() if activations is not None else None
        entry["memory"] = self._memory_now()
        self._entries.append(entry)

    def _memory_now(self) -> float:
        if self._cuda is not None:
            return float(torch.cuda.memory_allocated(self._cuda))
        return float(self._process.memory_info().rss)

    # ---- hooks ------------------------------------------------------------------------

    def _forward_begin(self, module: torch.nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():
            return  # evaluation: not part of a training step
        if self._t0 is not None and self._stepped:
            self.end_step()  # the caller did not say where its step ended
        self._backward_seen = False  # each micro-batch's backward has its own end
        if self._t0 is None:
            self._begin_step()
            self.probes.record("forward_begin")

    def _block_forward(self, index: int, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if not torch.is_grad_enabled() or self._t0 is None:
            return
        self.probes.record(f"forward block {index}")
        hidden = _first_grad_tensor(args, kwargs)
        if hidden is not None:
            hidden.register_hook(functools.partial(self._block_backward, index))

    def _forward_end(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled() or self._t0 is None:
            return
        # FSDP2's engine probes the end of forward itself (its largest buffer moment).
        if not (self._entries and self._entries[-1]["point"] == "forward_end"):
            self.probes.record("forward_end")

    def _block_backward(self, index: int, grad: torch.Tensor) -> None:
        if self._t0 is None:
            return
        if not self._backward_seen:
            self._backward_seen = True
            # Runs when autograd's whole backward is done (DDP finalises its reduction the
            # same way); the engine is only reachable from inside a backward.
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)
        self.probes.record(f"backward block {index}")

    def _backward_end(self) -> None:
        if self._t0 is not None:
            self.probes.record("backward_end")


def timeline_totals(points: list[dict[str, Any]]) -> list[float]:
    """Per entry, the bytes of the walk's categories together (the report's worst moment
    is the largest such figure over its probe points; activations are apart)."""
    return [sum(float(p[c]) for c in CATEGORIES) for p in points]
