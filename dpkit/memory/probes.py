"""Probes that run the memory walk inside a training step, and count activations.

A report taken after training cannot see gradients: DeepSpeed frees them in its
step and ``zero_grad`` releases DDP's. These probes run :func:`walk` at the
optimizer's step and at the points each engine adds where its backend holds them
(:meth:`dpkit.engines.base.Engine.install_probes`), and keep the high-water of
each category.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from typing import Any

import torch

from dpkit.core.walk import (
    CATEGORIES,
    Ledger,
    inner_torch_optimizer,
    storage_key,
    unwrap_module,
    walk,
)
from dpkit.memory.timeline import StepTimeline
from dpkit.models import repeated_blocks


def _rss_now() -> float | None:
    try:
        import psutil
    except ImportError:
        return None
    return float(psutil.Process().memory_info().rss)


class _SavedActivations:
    """Bytes saved for backward during one forward: the activation memory autograd keeps.

    A forward pre-hook enters ``saved_tensors_hooks`` and the forward hook leaves it;
    the pack hook returns the tensor unchanged and only counts its storage once,
    skipping parameter storages (model states, already counted) and whatever the
    engine says a module holds as parameters during its compute (FSDP2's all-gathered
    whole parameters, communication buffers to the walk: :attr:`param_storages`, and
    :meth:`note_params` as each unit starts its forward).

    With ``track_release`` on (the steps a timeline is recorded in), the unpack hook
    also counts each packed storage once as backward unpacks it: :meth:`held` is the
    bytes packed by the last training forward less those unpacked since, which drains
    to about 0 by the end of backward. A saved tensor is freed when its autograd node
    has run, shortly after the unpack; one kept alive by something else (an output the
    script still holds) counts as released all the same.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.high_water = 0.0
        self.last = 0.0
        self._seen: set[tuple[str, int, int]] = set()
        self._param_keys: set[tuple[str, int, int]] = set()
        self._bytes = 0.0
        self.track_release = False
        self._packed: dict[tuple[str, int, int], float] = {}
        self._released = 0.0
        self._context: contextlib.AbstractContextManager | None = None
        self.param_storages: Any = lambda module: set()
        """The engine's: storage keys a module holds as parameters beside its own."""
        self._batch_shape: tuple[int, int] | None = None
        self.high_water_batch: tuple[int, int] | None = None
        """(micro-batch, sequence length) of the forward that saved the most."""
        self.on_saved: Any = None
        """Told each storage key saved for backward (the live-bytes tracker's
        activations: :class:`~dpkit.memory.live.PeakLive`)."""
        self.seq_lens: list[int] = []
        """The padded sequence length of every counted forward (dynamic padding makes
        most batches shorter than the longest allowed)."""
        self._handles = [
            model.register_forward_pre_hook(self._begin),
            model.register_forward_pre_hook(self._note_batch, with_kwargs=True),
            model.register_forward_hook(self._end, always_call=True),
        ]

    def add_handle(self, handle: Any) -> None:
        """A hook an engine installed for this count, removed with it."""
        self._handles.append(handle)

    def note_params(self, module: torch.nn.Module, args: Any = None) -> None:
        """``module`` starts its compute inside a counted forward: what it holds as
        parameters is not activation memory."""
        if self._context is not None:
            self._param_keys |= self.param_storages(module)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = storage_key(tensor)
        if key is not None and key not in self._seen and key not in self._param_keys:
            self._seen.add(key)
            if self.on_saved is not None:
                self.on_saved(key)
            nbytes = float(tensor.untyped_storage().nbytes())
            self._bytes += nbytes
            if self.track_release:
                self._packed[key] = nbytes
        return tensor

    def _unpack(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.track_release and self._packed:
            self._released += self._packed.pop(storage_key(tensor), 0.0)
        return tensor

    def held(self) -> float:
        """Bytes saved for backward now: packed by the last training forward (or the one
        running) less those its backward has unpacked (each storage once)."""
        return self._bytes - self._released

    def _begin(self, module: torch.nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled() or self._context is not None:
            return  # evaluation saves nothing for backward; nested calls count once
        self._param_keys = {k for p in module.parameters() if (k := storage_key(p)) is not None}
        self._param_keys |= self.param_storages(module)
        self._seen.clear()
        self._bytes = 0.0
        self._packed.clear()
        self._released = 0.0
        self._context = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._context.__enter__()

    def _note_batch(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        """The (batch, sequence) shape of a counted forward's token ids."""
        if self._context is None:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._batch_shape = None
        if isinstance(ids, torch.Tensor) and ids.dim() == 2:
            self._batch_shape = (int(ids.shape[0]), int(ids.shape[1]))
            self.seq_lens.append(self._batch_shape[1])

    def batch_record(self) -> dict[str, Any] | None:
        """The batch shapes the count saw, for the memory report (None if none had token
        ids): the shape at the high-water, and the sequence lengths over the run."""
        if not self.seq_lens:
            return None
        batch = self.high_water_batch
        return {
            "micro_batch_at_high_water": batch[0] if batch else None,
            "seq_len_at_high_water": batch[1] if batch else None,
            "seq_len_min": min(self.seq_lens),
            "seq_len_mean": sum(self.seq_lens) / len(self.seq_lens),
            "seq_len_max": max(self.seq_lens),
            "forwards": len(self.seq_lens),
        }

    def _end(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._context is None:
            return
        self._context.__exit__(None, None, None)
        self._context = None
        self.last = self._bytes
        if self._bytes >= self.high_water or self.high_water_batch is None:
            self.high_water_batch = self._batch_shape
        self.high_water = max(self.high_water, self._bytes)
        self._seen.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self.stop_tracking_release()

    def stop_tracking_release(self) -> None:
        """Back to counting the forward only (the steps after the timeline's)."""
        self.track_release = False
        self._packed.clear()


class StepProbes:
    """Walks the rank's tensors at the points of a step where the backend holds its gradients.

    Points: the torch optimizer's step (pre and post hooks; DDP's gradients and the
    optimizer state are all alive there), and those the engine adds
    (:meth:`dpkit.engines.base.Engine.install_probes`: DeepSpeed's reductions and the
    copies its step makes, FSDP2's end of forward).

    Per category the high-water is kept with the point it came from; per point the
    last breakdown is kept in ``phases``; ``largest_moment`` is the point where all
    counted tensors together were largest. ``timeline``
    (:class:`~dpkit.memory.timeline.StepTimeline`) keeps every walk of the last step
    recorded, with its own points in forward and backward (``record_timeline=False``:
    none of them).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        engine: Any,
        count_activations: bool = True,
        record_timeline: bool = True,
    ):
        self.model = model
        self.optimizer = optimizer
        self.engine = engine
        self.high_water: dict[str, dict[str, Any]] = {}
        # The same for the bytes the backend keeps in host memory (offload), per category.
        self.host_high_water: dict[str, dict[str, Any]] = {}
        self.phases: dict[str, dict[str, float]] = {}
        self.largest_moment: dict[str, Any] = {}
        # Buffers an engine sizes rather than walks, by name, at their largest (DeepSpeed's
        # flat copy of an ordinary reduction bucket): counted as if they coexisted.
        self.sized_buffers: dict[str, float] = {}
        self.probe_seconds = 0.0
        # Methods the engine's probes rely on that this version of the backend lacks:
        # gradients held only there are not seen, and the report says so.
        self.missing: list[str] = []
        self._removers: list[Any] = []
        self.point_name: Any = lambda point: point
        """How a point of the optimizer's step is named (an engine that steps parameter
        groups one at a time names them per group)."""
        self.inner_step_done: list[Any] = []
        """Called after each step of the torch optimizer (engines' bookkeeping)."""
        self.activations = _SavedActivations(model) if count_activations else None
        self.peak_live: Any = None
        """The step's live-bytes high-water (:class:`~dpkit.memory.live.PeakLive`), told
        of every walk, whose ledger names what it follows."""
        # What the process holds besides counted tensors, measured once (after prepare,
        # before the first step): the interpreter, the libraries, the data. It is the
        # part of a CPU peak that no parallelism strategy can shrink.
        snap = walk(engine, model, optimizer)
        self.baseline = {
            "rss": _rss_now(),
            "counted_tensors": sum(snap[c] for c in CATEGORIES),
        }
        torch_opt = inner_torch_optimizer(optimizer)
        if torch_opt is not None:
            pre = torch_opt.register_step_pre_hook(
                lambda *_: self.probe(self.point_name("optimizer_step_begin"))
            )
            post = torch_opt.register_step_post_hook(self._after_inner_step)
            self._removers += [pre.remove, post.remove]
        engine.memory.install_probes(self, model, optimizer)
        self.timeline: StepTimeline | None = None
        if record_timeline:
            self.timeline = StepTimeline(self, model, repeated_blocks(unwrap_module(model)))
            if self.activations is not None:
                self.activations.track_release = True

    def _after_inner_step(self, *_: Any) -> None:
        self.probe(self.point_name("optimizer_step_end"))
        if self.timeline is not None:
            self.timeline.optimizer_stepped()
        for done in self.inner_step_done:
            done()

    def end_step(self, step: int | None = None) -> None:
        """An optimizer step is over: its timeline is kept (``step``: the run's count)."""
        if self.timeline is not None:
            self.timeline.end_step(step)

    def record(self, point: str) -> None:
        """A timeline point: walk now and keep the figures in the timeline only (the
        category high-waters and ``phases`` are the engine's probe points')."""
        started = time.perf_counter()
        snap = self._walk(point)
        if self.timeline is not None:
            self.timeline.add(point, snap, started)
        self.probe_seconds += time.perf_counter() - started

    def _walk(self, point: str, extra: Iterable[tuple[torch.Tensor, str, str]] = ()) -> dict:
        ledger = Ledger()
        snap = walk(self.engine, self.model, self.optimizer, extra, ledger=ledger)
        if self.peak_live is not None:
            self.peak_live.walked(point, ledger)
        return snap

    def add_remover(self, remover: Any) -> None:
        """A callable that takes an engine's probe out again (run by :meth:`remove`)."""
        self._removers.append(remover)

    def replace(self, obj: Any, name: str, replacement: Any) -> None:
        """Shadow ``obj.name`` with ``replacement`` until :meth:`remove`."""
        # An instance attribute shadows a class method (removing it restores the method);
        # an attribute that was already the instance's own (ZeRO's `flatten`) is put back.
        own = name in vars(obj)
        previous = vars(obj).get(name)
        setattr(obj, name, replacement)
        self._removers.append(
            (lambda: setattr(obj, name, previous)) if own else (lambda: delattr(obj, name))
        )

    def probe(self, point: str, extra: Iterable[tuple[torch.Tensor, str, str]] = ()) -> None:
        """Walk now at an engine's probe point: the category high-waters, ``phases``,
        the largest moment and the timeline."""
        started = time.perf_counter()
        snap = self._walk(point, extra)
        self.phases[point] = {**{c: snap[c] for c in CATEGORIES}, "holders": snap["holders"]}
        for category in CATEGORIES:
            best = self.high_water.get(category)
            if best is None or snap[category] > best["bytes"]:
                self.high_water[category] = {
                    "bytes": snap[category],
                    "point": point,
                    "holders": dict(snap["holders"].get(category, {})),
                }
        for category, nbytes in snap.get("host", {}).items():
            best = self.host_high_water.get(category)
            if nbytes and (best is None or nbytes > best["bytes"]):
                self.host_high_water[category] = {
                    "bytes": nbytes,
                    "point": point,
                    "holders": dict(snap["host_holders"].get(category, {})),
                }
        total = sum(snap[c] for c in CATEGORIES)
        if total > self.largest_moment.get("total", -1.0):
            self.largest_moment = {"point": point, "total": total, **self.phases[point]}
        if self.timeline is not None:
            self.timeline.add(point, snap, started)
        self.probe_seconds += time.perf_counter() - started

    def reset(self) -> None:
        self.high_water.clear()
        self.host_high_water.clear()
        self.phases.clear()
        self.largest_moment = {}
        self.sized_buffers.clear()
        if self.activations is not None:
            self.activations.high_water = 0.0
            self.activations.high_water_batch = None
            self.activations.seq_lens.clear()

    @property
    def installed(self) -> bool:
        """Whether the probes are still in place (each step pays for their walks)."""
        return bool(self._removers)

    def remove(self, keep_activations: bool = False) -> None:
        """Take the walks out of the step (and the activation count, unless kept)."""
        if self.timeline is not None and self.timeline.in_progress:
            self.end_step()  # a step recorded up to here is still the timeline
        for remover in reversed(self._removers):
            remover()
        self._removers.clear()
        if self.activations is not None:
            self.activations.stop_tracking_release()
            if not keep_activations:
                self.activations.remove()
