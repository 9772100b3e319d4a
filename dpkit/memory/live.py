"""The high-water of live tensor bytes during one optimizer step, with what was alive then.

The walk (:mod:`dpkit.core.walk`) counts what the training objects hold at a probe
point; a step's true high-water also holds what no object holds: the logits and the
loss, attention and MLP temporaries, the optimizer's foreach temporaries, DeepSpeed's
flat copies. :class:`LiveTensors` is a ``TorchDispatchMode`` active for one optimizer
step (the first, which the step probes walk: see :class:`PeakLive`). It starts from the
storages a walk finds at the step's first training forward, adds every storage an
operator's output brings (a weak reference on each: its death is the free), and keeps
the running total and its high-water. At the high-water it keeps which storages were
alive; each is then named by the walks of the step (the probes' points: the category of
the last walk before the high-water that saw it, else the first after), as saved for
backward (``activations``), or ``temporary``.

What it cannot see: memory that is no tensor storage (a kernel's own scratch inside one
operator, gloo's and NCCL's internal buffers, allocator slack and fragmentation),
allocations on threads that do not carry the autograd thread-local state (a process
group's worker threads), and storages made before the step that no walk reaches (they
are absent, freed or not). On a GPU each storage counts as the caching allocator rounds
it (512 bytes), and ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` are
read beside it.
"""

from __future__ import annotations

import math
import time
import weakref
from typing import Any

import torch
from torch._guards import active_fake_mode
from torch.utils._python_dispatch import TorchDispatchMode

from dpkit.core.categories import CATEGORIES
from dpkit.core.walk import (
    Ledger,
    Unreached,
    inner_torch_optimizer,
    local_shard,
    storage_key,
    unwrap_module,
    walk,
)
from dpkit.memory.timeline import phase_of

LIVE_CATEGORIES = (*CATEGORIES, "activations", "temporary")
"""What the live bytes at the high-water are split into: the walk's categories, the
bytes autograd saved for backward, and the rest."""
PHASES = ("forward", "loss", "backward", "gradient reduction", "optimizer step", "after update")
"""The points of a step a high-water is placed at (see :class:`PeakLive`)."""
CUDA_BLOCK = 512
"""The CUDA caching allocator rounds every block up to this many bytes."""


class _Storage:
    """One storage the tracker follows: its size and what named it."""

    __slots__ = ("nbytes", "key", "seen", "saved_at", "__weakref__")

    def __init__(self, nbytes: int, key: tuple[str, int, int]) -> None:
        self.nbytes = nbytes
        self.key = key
        self.seen: list[tuple[int, str]] = []
        """(walk number, category) each time a walk named it something new."""
        self.saved_at: int | None = None
        """The operator count when autograd saved it for backward, if it did."""


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []


class LiveTensors(TorchDispatchMode):
    """Live tensor bytes on one device while the mode is active, and their high-water."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device_type = device.type
        self.total = 0
        self.peak = 0
        self.ops = 0
        self.walks = 0
        self.where: Any = lambda: {}
        """Called at each new high-water: where the step is (set by :class:`PeakLive`)."""
        self.at_peak: dict[str, Any] = {}
        self._live: dict[int, _Storage] = {}
        self._by_key: dict[tuple[str, int, int], _Storage] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._peak_live: list[tuple[_Storage, int]] = []
        self._peak_walks = 0
        self._peak_ops = 0
        self._dirty = False
        self._original_resize: Any = None
        self._fake_mode: Any = None
        self._unreached: list[Unreached] = []
        """Bytes held from the step's start that no walk reached as tensors (DDP's reducer
        buckets): in the total until their storage shows up or their holder lets them go."""
        self._peak_unreached: dict[str, float] = {}

    # ---- storages -------------------------------------------------------------------

    def _size(self, storage: torch.UntypedStorage) -> int:
        nbytes = int(storage.nbytes())
        if self.device_type == "cuda":
            return math.ceil(nbytes / CUDA_BLOCK) * CUDA_BLOCK
        return nbytes

    def add(self, tensor: torch.Tensor, category: str | None = None) -> bool:
        """Follow ``tensor``'s storage (once); True if the live total grew."""
        if tensor.device.type != self.device_type or storage_key(tensor) is None:
            return False
        try:
            storage = local_shard(tensor).untyped_storage()
        except (RuntimeError, NotImplementedError):
            return False  # a subclass without a plain storage (fake, functional)
        return self._follow(storage, category)

    def _follow(self, storage: torch.UntypedStorage, category: str | None = None) -> bool:
        ident = id(storage)
        if ident in self._live:
            return False
        device = storage.device
        record = _Storage(self._size(storage), (device.type, device.index or 0, storage.data_ptr()))
        if category is not None:
            record.seen.append((-1, category))
        self._live[ident] = record
        self._by_key[record.key] = record
        self._refs[ident] = weakref.ref(storage, lambda _, ident=ident: self._freed(ident))
        self.total += record.nbytes
        return True

    def hold_unreached(self, held: Unreached) -> None:
        """Count bytes held where no walk reaches a tensor (the ledger's
        :attr:`~dpkit.core.walk.Ledger.unreached`): alive from now on. The storage behind
        them shows up later as an operator's ``out=`` or in-place argument (DDP's reducer
        writing its first gradient into a bucket) and is then taken from them rather than
        counted a second time; if their holder frees them first (DDP rebuilding its
        buckets in the second step's forward), :meth:`drop_released` takes them out."""
        self._unreached.append(held)
        self.total += int(held.nbytes)

    def drop_released(self) -> None:
        """Take out the unreached bytes their holder has let go (checked at each module)."""
        for held in self._unreached:
            if held.nbytes > 0 and held.still_held is not None and not held.still_held():
                if self._dirty:
                    self._keep_peak()
                self.total -= int(held.nbytes)
                held.nbytes = 0.0

    def _take_unreached(self, tensor: torch.Tensor) -> bool:
        """``tensor``, an operator's output written in place, is a storage from before the
        step: follow it, its bytes taken from the unreached bytes. True if the total grew
        (the storage was larger than what was left unreached)."""
        held = next((h for h in self._unreached if h.nbytes > 0), None)
        before = self.total
        if held is None or not self.add(tensor, held.category):
            return False
        taken = min(float(self.total - before), held.nbytes)
        held.nbytes -= taken
        self.total -= int(taken)
        return self.total > before

    def _freed(self, ident: int) -> None:
        record = self._live.get(ident)
        if record is None:
            return
        if self._dirty:
            self._keep_peak()
        del self._live[ident]
        self._refs.pop(ident, None)
        if self._by_key.get(record.key) is record:
            del self._by_key[record.key]
        self.total -= record.nbytes

    def _resized(self, storage: torch.UntypedStorage) -> None:
        """``UntypedStorage.resize_`` is no operator (FSDP2 frees and refills its
        unsharded parameters so): the record follows the new size and address."""
        record = self._live.get(id(storage))
        if record is None:
            if storage.nbytes() > 0 and storage.device.type == self.device_type:
                self._follow(storage)
                self._maybe_peak("resize_")
            return
        if self._dirty:
            self._keep_peak()
        if self._by_key.get(record.key) is record:
            del self._by_key[record.key]
        new = self._size(storage)
        self.total += new - record.nbytes
        record.nbytes = new
        if storage.data_ptr():
            record.key = (record.key[0], record.key[1], storage.data_ptr())
            self._by_key[record.key] = record
        self._maybe_peak("resize_")

    # ---- the high-water ----------------------------------------------------------------

    def _maybe_peak(self, op: str) -> None:
        if self.total > self.peak:
            self.peak = self.total
            self.at_peak = {"op": op, **self.where()}
            self._peak_walks = self.walks
            self._peak_ops = self.ops
            self._peak_unreached = {}
            for held in self._unreached:
                split = self._peak_unreached
                split[held.category] = split.get(held.category, 0.0) + held.nbytes
            # The live set is copied lazily, at the next free: until then every change
            # is an allocation, which makes a new high-water.
            self._dirty = True

    def _keep_peak(self) -> None:
        # Sizes as they are now: FSDP2 resizes a storage to 0 after the high-water.
        self._peak_live = [(record, record.nbytes) for record in self._live.values()]
        self._dirty = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if _has_dtensor(types):
            return NotImplemented  # DTensor runs its local ops, which come back here
        out = func(*args, **(kwargs or {}))
        if active_fake_mode() is not self._fake_mode:
            return out  # DTensor's sharding propagation runs on fake tensors: no memory
        self.ops += 1
        grew = False
        written = self._written_inputs(args, kwargs) if self._pool_left() else set()
        for tensor in _tensors(out):
            if written and _storage_id(tensor) in written:
                grew |= self._take_unreached(tensor)
            else:
                grew |= self.add(tensor)
        if grew:
            self._maybe_peak(str(func))
        return out

    def _pool_left(self) -> bool:
        return any(held.nbytes > 0 for held in self._unreached)

    def _written_inputs(self, args: Any, kwargs: Any) -> set[int]:
        """The storages of the operator's tensor arguments not followed yet: an output on
        one of them was written in place (``out=``, ``copy_``), not allocated."""
        found = set()
        for tensor in _tensors(list(args) + list((kwargs or {}).values())):
            ident = _storage_id(tensor) if tensor.device.type == self.device_type else None
            if ident is not None and ident not in self._live:
                found.add(ident)
        return found

    def __enter__(self) -> LiveTensors:
        self._fake_mode = active_fake_mode()  # None in eager
        self._original_resize = torch.UntypedStorage.resize_
        original = self._original_resize

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            result = original(storage, size)
            self._resized(storage)
            return result

        # Restored by __exit__; MemTracker follows resize_ the same way.
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        torch.UntypedStorage.resize_ = self._original_resize  # type: ignore[method-assign]
        if self._dirty:
            self._keep_peak()

    # ---- naming what was alive ----------------------------------------------------------

    def walked(self, ledger: Ledger) -> None:
        """A walk of the step: name the storages it found."""
        for key, category in ledger.owners().items():
            record = self._by_key.get(key)
            if record is not None and (not record.seen or record.seen[-1][1] != category):
                record.seen.append((self.walks, category))
        self.walks += 1

    def saved(self, key: tuple[str, int, int]) -> None:
        """Autograd saved this storage for backward."""
        record = self._by_key.get(key)
        if record is not None and record.saved_at is None:
            # An operator's inputs are packed before it runs (at the count of the one
            # before), its outputs after it returned (at its own count).
            record.saved_at = self.ops

    def breakdown(self) -> dict[str, float]:
        """Bytes alive at the high-water by category."""
        split = dict.fromkeys(LIVE_CATEGORIES, 0.0)
        for record, nbytes in self._peak_live:
            split[self._category(record)] += nbytes
        for category, nbytes in self._peak_unreached.items():
            split[category] += nbytes
        return split

    def _category(self, record: _Storage) -> str:
        before = [c for n, c in record.seen if n < self._peak_walks]
        after = [c for n, c in record.seen if n >= self._peak_walks]
        if before or after:
            return before[-1] if before else after[0]
        # Saved for backward before the high-water's operator returned (what a later
        # operator saves, or the high-water's own outputs, are still temporaries then).
        saved = record.saved_at is not None and record.saved_at < self._peak_ops
        return "activations" if saved else "temporary"

    @property
    def storages(self) -> int:
        return len(self._live)

    def release(self) -> None:
        """Stop following: the weak references go (no callback on later frees)."""
        self._refs.clear()
        self._live.clear()
        self._by_key.clear()


def _storage_id(tensor: torch.Tensor) -> int | None:
    """The identity of ``tensor``'s storage object (torch keeps one Python object per
    live storage), None for a tensor without a plain storage."""
    if storage_key(tensor) is None:
        return None
    try:
        return id(local_shard(tensor).untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None


def _batch_shape(inputs: list[Any]) -> dict[str, int] | None:
    """The measured forward's micro-batch and tokens: the first 2-D integer input (the token
    ids), which ``dpkit plan --against`` plans the peak for; None for other inputs."""
    for tensor in _tensors(inputs):
        if tensor.dim() == 2 and not tensor.is_floating_point():
            return {"micro_batch": int(tensor.shape[0]), "seq_len": int(tensor.shape[1])}
    return None


def _has_dtensor(types: Any) -> bool:
    return any(t.__name__ == "DTensor" for t in types)


class PeakLive:
    """Measures one optimizer step: opens :class:`LiveTensors` at its first training
    forward and closes it at :meth:`close` (:meth:`MemoryTracker.step_done
    <dpkit.memory.tracker.MemoryTracker.step_done>`), naming where the step is.

    The step is the last one the step probes walk (their walks name each storage; this
    adds one walk, at the step's start), so the cost lands on a step that already pays for
    probes: the first by default. In the first, Adam's moments are made lazily inside the
    update, so its forward and backward run without them; a later step (``dpkit tune``
    probes two) holds them from its start, the run's peak.

    Points (:data:`PHASES`): ``forward`` (with the innermost module running), ``loss``
    (the outermost forward after its last submodule returned, and anything between the
    forward and its backward), ``backward``, ``gradient reduction`` (from the end of the
    backward pass to the update, and an engine's reduction points inside the backward),
    ``optimizer step`` (the update, and an engine's step points before it), ``after
    update`` (``zero_grad``, ZeRO's all-gather of the updated partitions, the loop's
    own work).
    """

    def __init__(
        self, model: torch.nn.Module, optimizer: Any, engine: Any, device: Any, from_step: int = 1
    ) -> None:
        """``from_step``: the optimizer step watched (the engine's steady step: 2 under
        ZeRO-3, whose first step records its parameter trace)."""
        self.model = model
        self.optimizer = optimizer
        self.engine = engine
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.live: LiveTensors | None = None
        self.result: dict[str, Any] | None = None
        self.from_step = from_step
        self._steps_before = 0
        self.phase = "forward"
        self.probe_point: str | None = None
        self._modules: list[str] = []
        self._top: torch.nn.Module = unwrap_module(model)
        self._children_returned = 0
        # Opened at the user's module, inside a wrapper's own pre-forward work: DDP
        # rebuilds its buckets there in its second iteration, freeing the old ones in C++
        # (unseen) before making the new ones; opened after it, the walk sees the buckets
        # that stay.
        self._handles: list[Any] = [
            self._top.register_forward_pre_hook(self._open, with_kwargs=True),
        ]
        self._window_handles: list[Any] = []
        self._started = 0.0
        self._at_start = 0
        self._cuda_at_start: float | None = None
        self._torch_opt = inner_torch_optimizer(optimizer)
        self._batch: dict[str, int] | None = None
        if from_step > 1 and self._torch_opt is not None:
            # Counted by the optimizer itself: a loop of one's own need not report its steps.
            self._handles.append(self._torch_opt.register_step_post_hook(self._stepped))

    def _stepped(self, *_: Any) -> None:
        if self.live is None:
            self._steps_before += 1

    # ---- the window ---------------------------------------------------------------------

    @property
    def open(self) -> bool:
        return self.live is not None and self.result is None

    def _open(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if (
            self._steps_before + 1 < self.from_step
            or not module.training
            or not torch.is_grad_enabled()
        ):
            return
        if self.live is not None:
            if self.open:  # a later micro-batch of the measured step: its own shape
                self._batch = _batch_shape(list(args) + list(kwargs.values()))
            return
        self._started = time.perf_counter()
        live = LiveTensors(self.device)
        ledger = Ledger(keep_tensors=True)
        walk(self.engine, self.model, self.optimizer, ledger=ledger)
        for tensor, category in ledger.tensors():
            live.add(tensor, category)
        for held in ledger.unreached:
            live.hold_unreached(held)
        for tensor in _tensors(list(args) + list(kwargs.values())):
            live.add(tensor)  # the batch: temporary
        self._batch = _batch_shape(list(args) + list(kwargs.values()))
        live.walks = 1
        live.peak = live.total
        self._at_start = live.total
        live.where = self._where
        if self.device.type == "cuda" and torch.cuda.is_available():
            self._cuda_at_start = float(torch.cuda.memory_allocated(self.device))
        for name, sub in self._top.named_modules():
            self._window_handles += [
                sub.register_forward_pre_hook(lambda m, a, name=name: self._enter_module(name)),
                sub.register_forward_hook(lambda m, a, o, name=name: self._leave_module(name)),
            ]
        self._window_handles += [
            module.register_forward_hook(self._forward_end),
        ]
        if self._torch_opt is not None:
            self._window_handles += [
                self._torch_opt.register_step_pre_hook(lambda *_: self._set("optimizer step")),
                self._torch_opt.register_step_post_hook(lambda *_: self._set("after update")),
            ]
        self.live = live
        if module is self._top:
            # Hooks added inside a pre-hook do not run for the call in progress.
            self._enter_module("")
        live.__enter__()

    def close(self, step: int | None = None) -> None:
        """The measured step is over (or the run ends inside it): the figures are kept."""
        if not self.open:
            return
        live = self.live
        assert live is not None
        live.__exit__(None, None, None)
        for handle in self._handles + self._window_handles:
            handle.remove()
        self._handles, self._window_handles = [], []
        at = dict(live.at_peak)
        if (
            at.get("phase") == "forward"
            and at.pop("top_after_child", None) == self._children_returned
        ):
            at["phase"] = "loss"  # no submodule ran after it: the head's loss
        at.pop("top_after_child", None)
        result: dict[str, Any] = {
            "bytes": float(live.peak),
            "point": at.get("phase"),
            "module": at.get("module") or None,  # "": the outermost module's own code
            "op": at.get("op"),
            "probe_point": at.get("probe_point"),
            "by_category": live.breakdown(),
            "at_step_start": float(self._at_start),
            "batch": at.get("batch", self._batch),
            "step": step,
            "ops_seen": live.ops,
            "storages_live_at_end": live.storages,
            "walks": live.walks,
            "seconds": time.perf_counter() - self._started,
            "device": str(self.device),
        }
        live.release()
        if self.device.type == "cuda" and torch.cuda.is_available():
            result.update(
                max_memory_allocated=float(torch.cuda.max_memory_allocated(self.device)),
                max_memory_reserved=float(torch.cuda.max_memory_reserved(self.device)),
                memory_allocated_at_step_start=self._cuda_at_start,
                cuda_peaks_since="the memory tracker's start (reset after prepare)",
            )
        self.result = result

    def remove(self) -> None:
        """Take the hooks off without measuring (a run that stops before its first step)."""
        if self.open:
            self.close()
        for handle in self._handles + self._window_handles:
            handle.remove()
        self._handles, self._window_handles = [], []

    # ---- where the step is --------------------------------------------------------------

    def _where(self) -> dict[str, Any]:
        where: dict[str, Any] = {
            "phase": self.phase,
            "probe_point": self.probe_point,
            "batch": self._batch,
        }
        if self.phase == "forward":
            where["module"] = self._modules[-1] if self._modules else None
            if self._modules == [""] and self._children_returned:
                where["top_after_child"] = self._children_returned
        return where

    def _set(self, phase: str) -> None:
        self.phase = phase

    def _enter_module(self, name: str) -> None:
        if self.live is None or self.result is not None:
            return
        self.live.drop_released()
        if name == "" and self.phase != "forward":
            self._set("forward")
            self._children_returned = 0
        self._modules.append(name)

    def _leave_module(self, name: str) -> None:
        if self._modules and self._modules[-1] == name:
            self._modules.pop()
        if name:
            self._children_returned += 1

    def _forward_end(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not module.training or self.result is not None:
            return
        from dpkit.train.phases import backward_root

        self._set("loss")
        root = backward_root(output)
        if root is not None:
            root.register_hook(self._backward_started)

    def _backward_started(self, grad: Any) -> None:
        self._set("backward")
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: self._set("gradient reduction")
        )

    def walked(self, point: str, ledger: Ledger) -> None:
        """A probe's walk at ``point`` (an engine's point or the timeline's)."""
        if not self.open:
            return
        assert self.live is not None
        self.live.walked(ledger)
        self.probe_point = point
        phase = phase_of(point)
        if phase == "reduce" and self.phase == "backward":
            self._set("gradient reduction")
        elif (
            phase == "backward"
            and self.phase == "gradient reduction"
            and point.startswith("backward block")
        ):
            self._set("backward")  # the backward goes on after an engine's reduction
        elif phase == "optimizer" and self.phase in ("backward", "gradient reduction"):
            self._set("optimizer step")

    def saved(self, key: tuple[str, int, int]) -> None:
        if self.open:
            assert self.live is not None
            self.live.saved(key)
