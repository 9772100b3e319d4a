"""Count the bytes one rank holds, by what holds them, from the tensors themselves.

The walk visits the objects that can hold training memory (the module, the
optimizer and whatever the backend keeps of its own: each engine's ``walk``,
``dpkit/engines/*/memory.py``) and counts every storage once: tensors that share storage (tied weights, parameters that
are views into one flat buffer, gradients that are views into a bucket) are
counted by their storage's size, under the first category that claims it.
The claim order is therefore part of the accounting and is spelled out in
each engine's walk.

Each claim also says where the backend placed the storage: ``device`` (the compute
device) or ``host`` (host memory the backend offloads to, DeepSpeed's optimizer offload).
On a CPU run both are the same RAM and ``tensor.device`` is ``cpu`` either way, so the
placement comes from the backend's structure, as the engine's walk knows it, not from
the tensor. A category's figure is its device bytes; its host bytes are kept beside it.

Gradients live for a fraction of each step and, under some backends, not in
``param.grad``: :mod:`dpkit.memory.probes` runs this walk at the points of a
step where they exist.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from dpkit.core.categories import CATEGORIES


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (an FSDP2 parameter, gradient or Adam moment),
    whose own storage reports the whole tensor's size; any other tensor as it is."""
    if type(tensor) in (torch.Tensor, torch.nn.Parameter):
        return tensor  # the common case, without the import: a timeline walks per block
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def storage_key(tensor: torch.Tensor) -> tuple[str, int, int] | None:
    """A key for the tensor's storage, or None for tensors without memory (meta, empty)."""
    return _local_storage_key(local_shard(tensor))


def _local_storage_key(tensor: torch.Tensor) -> tuple[str, int, int] | None:
    """:func:`storage_key` of a tensor that is already a local shard (or a plain tensor)."""
    if tensor.is_sparse or tensor.device.type == "meta":
        return None
    try:
        storage = tensor.untyped_storage()
        if storage.data_ptr() == 0 or storage.nbytes() == 0:
            return None
    except (RuntimeError, NotImplementedError):
        return None  # tensor subclasses without a plain storage (fake, functional): not memory
    return (tensor.device.type, tensor.device.index or 0, storage.data_ptr())


@dataclass
class Unreached:
    """Bytes a walk knows are held but reaches no tensor of (:meth:`Ledger.count_unreachable`)."""

    category: str
    nbytes: float
    still_held: Callable[[], bool] | None = None


class Ledger:
    """Storages seen in one walk; each is counted once, under the first category claiming it."""

    def __init__(self, keep_tensors: bool = False) -> None:
        self._owner: dict[tuple[str, int, int], str] = {}
        # category -> holder name -> bytes, on the device and in host memory
        self.holders: dict[str, dict[str, float]] = {c: {} for c in CATEGORIES}
        self.host_holders: dict[str, dict[str, float]] = {c: {} for c in CATEGORIES}
        # (tensor, category) of every storage counted, when asked (the live-bytes tracker
        # follows them from there: dpkit.memory.live).
        self._tensors: list[tuple[torch.Tensor, str]] | None = [] if keep_tensors else None
        self.unreached: list[Unreached] = []
        """Bytes held where no tensor is reachable from Python (DDP's reducer buckets):
        counted by size; the live-bytes tracker holds them until their storage shows up."""

    def owners(self) -> dict[tuple[str, int, int], str]:
        """The category each storage counted was claimed under, by :func:`storage_key`."""
        return self._owner

    def tensors(self) -> list[tuple[torch.Tensor, str]]:
        """A tensor of every storage counted, with its category (``keep_tensors=True``)."""
        return list(self._tensors or [])

    def owner(self, tensor: torch.Tensor) -> str | None:
        key = storage_key(tensor)
        return None if key is None else self._owner.get(key)

    def claim(self, tensor: Any, category: str, holder: str, placement: str = "device") -> bool:
        """Count ``tensor``'s storage under ``category``/``holder`` unless already counted;
        ``placement``: ``device`` or ``host``, where the backend keeps it."""
        if not isinstance(tensor, torch.Tensor):
            return False
        tensor = local_shard(tensor)
        key = _local_storage_key(tensor)
        if key is None or key in self._owner:
            return False
        self._owner[key] = category
        if self._tensors is not None:
            self._tensors.append((tensor, category))
        bucket = (self.host_holders if placement == "host" else self.holders)[category]
        bucket[holder] = bucket.get(holder, 0.0) + float(tensor.untyped_storage().nbytes())
        return True

    def count_unreachable(
        self,
        category: str,
        holder: str,
        nbytes: float,
        still_held: Callable[[], bool] | None = None,
    ) -> None:
        """Count ``nbytes`` that are held (a C++ object's tensors, known by their sizes)
        but that no walk can reach as tensors; ``still_held`` says, later, whether the
        holder still has them (None: until the storage shows up)."""
        self.holders[category][holder] = self.holders[category].get(holder, 0.0) + nbytes
        self.unreached.append(Unreached(category, float(nbytes), still_held))

    def claim_all(
        self, tensors: Iterable[Any], category: str, holder: str, placement: str = "device"
    ) -> None:
        """:meth:`claim` each of ``tensors``."""
        for tensor in tensors:
            self.claim(tensor, category, holder, placement)

    def snapshot(self) -> dict[str, Any]:
        """Device bytes per category, their ``holders``; host bytes per category under
        ``host`` and their holders under ``host_holders``."""
        totals: dict[str, Any] = {c: sum(self.holders[c].values()) for c in CATEGORIES}
        totals["holders"] = {c: dict(h) for c, h in self.holders.items() if h}
        totals["host"] = {c: sum(self.host_holders[c].values()) for c in CATEGORIES}
        totals["host_holders"] = {c: dict(h) for c, h in self.host_holders.items() if h}
        return totals


def unwrap_module(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside DDP / DeepSpeedEngine / compiled wrappers."""
    module = model
    for _ in range(8):
        inner = getattr(module, "module", None) or getattr(module, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            break
        module = inner
    return module


def optimizer_chain(optimizer: Any) -> list[Any]:
    """``optimizer`` and every optimizer it wraps, outermost first: accelerate's
    ``AcceleratedOptimizer``, a backend's own (DeepSpeed's ZeRO optimizer), the torch
    optimizer (each keeps the next in ``.optimizer``)."""
    chain = []
    current = optimizer
    for _ in range(8):
        if current is None:
            break
        chain.append(current)
        inner = getattr(current, "optimizer", None)
        if inner is None or not hasattr(inner, "param_groups"):
            break
        current = inner
    return chain


def unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer inside accelerate's wrapper (a backend's own, or the torch optimizer)."""
    from accelerate.optimizer import AcceleratedOptimizer

    chain = [o for o in optimizer_chain(optimizer) if not isinstance(o, AcceleratedOptimizer)]
    return chain[0] if chain else optimizer


def inner_torch_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer whose ``state`` holds exp_avg/exp_avg_sq (innermost of the chain)."""
    chain = optimizer_chain(optimizer)
    innermost = chain[-1] if chain else None
    return innermost if isinstance(innermost, torch.optim.Optimizer) else None


def tensors_in(value: Any) -> Iterable[torch.Tensor]:
    """Tensors in a (possibly nested) list/tuple/dict."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)


def claim_optimizer_state(
    ledger: Ledger, torch_opt: torch.optim.Optimizer | None, placement: str = "device"
) -> None:
    """Claim every tensor of the optimizer's state (placed at ``placement``)."""
    if torch_opt is None:
        return
    for state in torch_opt.state.values():
        for name, value in state.items():
            # Holder named by the state key (exp_avg, exp_avg_sq, step...): says which state it is.
            ledger.claim_all(tensors_in(value), "optimizer", str(name), placement)


def claim_module_buffers(ledger: Ledger, module: torch.nn.Module) -> None:
    ledger.claim_all(module.buffers(), "buffers", "module_buffers")


def walk(
    engine: Any,
    model: torch.nn.Module,
    optimizer: Any,
    extra: Iterable[tuple[torch.Tensor, str, str]] = (),
    ledger: Ledger | None = None,
) -> dict[str, Any]:
    """Bytes this rank holds now, by category, with the holder of every byte.

    ``engine`` (the run's :class:`~dpkit.engines.base.Engine`) knows where its backend
    keeps the training state (:meth:`~dpkit.engines.base.Engine.walk`). Claim order (a
    storage counted twice would overstate memory, so each is counted under the first
    claim) is the engine's; ``extra`` (tensor, category, holder) are tensors a probe
    caught in flight that no object holds yet, claimed last. ``ledger``: count into this
    one (to read which storage went where), else a new one.
    """
    ledger = Ledger() if ledger is None else ledger
    info = engine.memory.walk(ledger, model, optimizer)
    for tensor, category, holder in extra:
        ledger.claim(tensor, category, holder)
    snap = ledger.snapshot()
    snap["walk"] = info
    return snap
