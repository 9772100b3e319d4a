"""Sharded checkpoints: every rank writes its own part of the weights and Adam moments with torch Distributed Checkpoint (DCP), and any other layout reads back what it needs.

One key space for every strategy and world size: each parameter (fp32) and each of its
Adam moments is a 1-D tensor of the parameter's ``numel`` (``model/<name>``,
``optim/<name>/<moment>``); a rank holds a contiguous range of it (:class:`FlatShard`).
That is what each engine holds anyway: a ZeRO-1/2 rank owns one fragment of each
parameter (DeepSpeed's ``lp_fragment_address``), an FSDP2 rank the rows of its dim-0
shard (a contiguous range of the flattened tensor); a replicated tensor (DDP, frozen
weights) is split evenly, so that the ranks share the writing. DCP's load planner then
reads, for any other layout, the byte ranges each rank needs (N -> M, any strategy).

Why not DCP's own ``get_state_dict``: its keys and chunks follow each engine's layout
(DTensor rows for FSDP2, whole tensors for DDP, nothing for ZeRO's flat partitions),
so a checkpoint of one strategy would not load into another without a conversion.
"""

from __future__ import annotations

import contextlib
import json
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dpkit.core.params import whole_shape

SHARDS = "shards"
"""The checkpoint's sub-folder DCP writes into (``.metadata`` and ``__<rank>_<i>.distcp``)."""
TENSORS_FILE = "tensors.json"
"""Every saved tensor's shape and dtype, the moments saved, the optimizer's step and lrs."""
MOMENTS = ("exp_avg", "exp_avg_sq")


def weight_key(name: str) -> str:
    """The key of parameter (or buffer) ``name``'s fp32 values."""
    return f"model/{name}"


def moment_key(name: str, moment: str) -> str:
    """The key of parameter ``name``'s Adam ``moment`` (``exp_avg``, ``exp_avg_sq``)."""
    return f"optim/{name}/{moment}"


@dataclass
class FlatShard:
    """A rank's contiguous range ``[offset, offset + local.numel())`` of a tensor of
    ``numel`` elements flattened to 1-D; ``local`` is 1-D (saved from, or loaded into)."""

    numel: int
    offset: int
    local: torch.Tensor

    @classmethod
    def whole(cls, tensor: torch.Tensor) -> FlatShard:
        return cls(tensor.numel(), 0, tensor.reshape(-1))


def even_range(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """``(offset, length)`` of rank ``rank``'s share of a replicated tensor: an even split,
    so that every rank writes about ``numel / world_size`` of it."""
    start = numel * rank // world_size
    return start, numel * (rank + 1) // world_size - start


def replicated_shard(tensor: torch.Tensor, rank: int, world_size: int) -> FlatShard | None:
    """This rank's share of a tensor every rank holds whole (None: an empty share)."""
    offset, length = even_range(tensor.numel(), rank, world_size)
    if length == 0:
        return None
    return FlatShard(tensor.numel(), offset, tensor.reshape(-1).narrow(0, offset, length))


def fp32(shard: FlatShard) -> FlatShard:
    """The shard in fp32 on CPU-or-device as it is (a copy only when the dtype differs)."""
    local = shard.local.detach()
    if local.is_floating_point() and local.dtype != torch.float32:
        local = local.float()
    return FlatShard(shard.numel, shard.offset, local)


def _chunk(shard: FlatShard) -> Any:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    return ChunkStorageMetadata(
        offsets=torch.Size([shard.offset]), sizes=torch.Size([shard.local.numel()])
    )


def _save_planner() -> Any:
    """DCP's default save planner, taught :class:`FlatShard`: a shard is one chunk of
    its key's 1-D tensor (what DCP does for a DTensor's or ShardedTensor's shard)."""
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import (
        SavePlan,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )

    class Planner(DefaultSavePlanner):
        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False)

        def create_local_plan(self) -> SavePlan:
            items = [
                WriteItem(
                    index=MetadataIndex(key, torch.Size([shard.offset])),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=_chunk(shard),
                        properties=TensorProperties.create_from_tensor(shard.local),
                        size=torch.Size([shard.numel]),
                    ),
                )
                for key, shard in self.state_dict.items()
            ]
            self.plan = SavePlan(items)
            return self.plan

        def lookup_object(self, index: Any) -> Any:
            return self.state_dict[index.fqn].local

    return Planner()


def _load_planner(state: dict[str, FlatShard]) -> Any:
    """DCP's default load planner, taught :class:`FlatShard`: it reads the parts of every
    saved chunk that overlap the range the shard asks for, straight into ``local``."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class Planner(DefaultLoadPlanner):
        # The shards are kept aside: the default set-up replaces what is not a tensor.
        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False)
            self.shards = state

        def create_local_plan(self) -> LoadPlan:
            saved = self.metadata.state_dict_metadata
            missing = [key for key in self.shards if key not in saved]
            if missing:
                raise KeyError(f"the checkpoint has no {', '.join(missing[:3])}")
            requests = []
            for key, shard in self.shards.items():
                if list(saved[key].size) != [shard.numel]:
                    raise ValueError(
                        f"{key}: {list(saved[key].size)} elements in the checkpoint, "
                        f"{shard.numel} in this run"
                    )
                requests += create_read_items_for_chunk_list(key, saved[key], [_chunk(shard)])
            self.plan = LoadPlan(requests)
            return self.plan

        def lookup_tensor(self, index: Any) -> torch.Tensor:
            return self.shards[index.fqn].local

    return Planner()


def save_shards(state: dict[str, FlatShard], path: Path, *, with_process_group: bool) -> None:
    """Write this rank's shards under ``path`` (a collective over the ranks when
    ``with_process_group``); a rank writes only its own ranges."""
    import torch.distributed.checkpoint as dcp

    state = {key: shard for key, shard in state.items() if shard.local.numel() > 0}
    with _one_process_said(with_process_group):
        dcp.save(
            state,
            storage_writer=dcp.FileSystemWriter(str(path)),
            planner=_save_planner(),
            no_dist=not with_process_group,
        )


def async_save_shards(state: dict[str, FlatShard], path: Path, *, process_group: Any) -> Any:
    """Copy this rank's shards to CPU memory, then write them in a thread (torch's
    ``async_save``) over ``process_group`` (a gloo group of its own: its collectives run
    beside the training's; None without a process group). Returns DCP's future."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import AsyncStager

    staged = {
        key: FlatShard(shard.numel, shard.offset, shard.local.detach().to("cpu", copy=True))
        for key, shard in state.items()
        if shard.local.numel() > 0
    }

    class Staged(AsyncStager):
        """The copy above is the staging: DCP's default stager knows tensors, not shards."""

        _synchronize_after_execute = False

        def stage(self, state_dict: dict) -> dict:
            return state_dict

    with _one_process_said(process_group is not None):
        return dcp.async_save(
            staged,
            storage_writer=dcp.FileSystemWriter(str(path)),
            planner=_save_planner(),
            process_group=process_group,
            async_stager=Staged(),
            no_dist=not dist.is_initialized(),
        )


def load_shards(state: dict[str, FlatShard], path: Path, *, with_process_group: bool) -> None:
    """Fill every shard of ``state`` with its range of the saved tensors, whatever layout
    wrote them (any strategy, any world size)."""
    import torch.distributed.checkpoint as dcp

    state = {key: shard for key, shard in state.items() if shard.local.numel() > 0}
    with _one_process_said(with_process_group):
        dcp.load(
            state,
            storage_reader=dcp.FileSystemReader(str(path)),
            planner=_load_planner(state),
            no_dist=not with_process_group,
        )


@contextlib.contextmanager
def _one_process_said(with_process_group: bool) -> Iterator[None]:
    """DCP warns at every call without a process group that it assumes one process: it
    is what dpkit asked for (one process, or ``dpkit consolidate``)."""
    with warnings.catch_warnings():
        if not with_process_group:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@dataclass(frozen=True)
class TensorIndex:
    """``tensors.json``: what a sharded checkpoint holds, readable without loading it."""

    shapes: dict[str, list[int]]
    """Every saved weight (parameters once each, persistent buffers) by name."""
    dtypes: dict[str, str]
    """Their saved dtype (fp32 for floating tensors)."""
    moments: dict[str, list[str]]
    """The Adam moments saved per trainable parameter (none before the first step)."""
    step: int
    param_group_lrs: list[float]

    def write(self, path: Path) -> None:
        (path / TENSORS_FILE).write_text(json.dumps(self.__dict__, indent=1) + "\n")

    @classmethod
    def read(cls, path: Path) -> TensorIndex:
        return cls(**json.loads((path / TENSORS_FILE).read_text()))

    def dtype(self, name: str) -> torch.dtype:
        return getattr(torch, self.dtypes[name])

    def nbytes(self, name: str) -> int:
        """The saved size of weight ``name`` in bytes."""
        return math.prod(self.shapes[name]) * self.dtype(name).itemsize

    def weight(self, checkpoint: Path, name: str) -> torch.Tensor:
        """Weight ``name`` of the checkpoint at ``checkpoint``, whole, read on this process
        (:func:`read_tensor`)."""
        return read_tensor(checkpoint, weight_key(name), self.shapes[name], self.dtype(name))


def read_tensor(path: Path, key: str, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """One saved tensor, whole, read on one process without a process group (what
    ``dpkit consolidate`` streams)."""
    out = torch.empty(math.prod(shape), dtype=dtype)
    load_shards({key: FlatShard(out.numel(), 0, out)}, path / SHARDS, with_process_group=False)
    return out.view(shape)


def is_sharded(path: Path) -> bool:
    """Whether the checkpoint at ``path`` was written sharded (else: the full layout)."""
    return (path / TENSORS_FILE).is_file()


def persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's buffers that its ``state_dict`` holds (non-persistent ones left out)."""
    found = {}
    for prefix, sub in module.named_modules():
        for name, buffer in sub._buffers.items():
            if buffer is not None and name not in sub._non_persistent_buffers_set:
                found[f"{prefix}.{name}" if prefix else name] = buffer
    return found


def _dtensor_shard(tensor: Any) -> FlatShard:
    """A DTensor sharded on dim 0 (FSDP2): its rows are one contiguous range of the
    flattened tensor."""
    local = tensor.to_local()
    chunk = tensor.__create_chunk_list__()[0]  # DCP's protocol: this rank's chunk
    if any(chunk.offsets[1:]):
        raise ValueError(f"a DTensor sharded other than on dim 0: {tensor.placements}")
    row = tensor.numel() // tensor.shape[0] if tensor.shape[0] else 0
    return FlatShard(tensor.numel(), chunk.offsets[0] * row, local.reshape(-1))


def own_shard(tensor: torch.Tensor, rank: int, world_size: int) -> FlatShard | None:
    """This rank's part of ``tensor``: a DTensor's own rows, or an even share of a tensor
    every rank holds whole."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return _dtensor_shard(tensor)
    return replicated_shard(tensor, rank, world_size)


def whole_target(tensor: torch.Tensor) -> tuple[FlatShard, torch.Tensor | None]:
    """What a load fills for ``tensor`` whole (a DTensor: its own rows): a view of it, or,
    where no 1-D view exists, a buffer to copy from afterwards (returned second)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        shard = _dtensor_shard(tensor)
        local = tensor.to_local()
        if local.is_contiguous():
            return shard, None
        buffer = torch.empty(local.numel(), dtype=local.dtype, device=local.device)
        return FlatShard(shard.numel, shard.offset, buffer), local
    if tensor.is_contiguous():
        return FlatShard.whole(tensor), None
    buffer = torch.empty(tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    return FlatShard(tensor.numel(), 0, buffer), tensor


class LoadTargets:
    """The ranges a rank loads, by key, and the copies to make once they are read (for
    tensors without a 1-D view). DCP casts what it reads to each target's dtype."""

    def __init__(self) -> None:
        self.shards: dict[str, FlatShard] = {}
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def whole(self, key: str, tensor: torch.Tensor) -> None:
        """Fill ``tensor`` (a DTensor: its own rows) from the saved ``key``."""
        shard, copy_to = whole_target(tensor)
        self.shards[key] = shard
        if copy_to is not None:
            self._copies.append((copy_to, shard.local))

    def finish(self) -> None:
        """Copy the buffered ranges into their tensors."""
        for tensor, buffer in self._copies:
            tensor.copy_(buffer.view(tensor.shape))
        self._copies.clear()


def replicated_state(
    module: torch.nn.Module,
    optimizer: Any,
    rank: int,
    world_size: int,
    *,
    skip: set[int] = frozenset(),
) -> dict[str, FlatShard]:
    """This rank's part of every parameter (fp32) and of its Adam moments, for engines
    whose tensors are whole on every rank (DDP) or DTensors (FSDP2); the parameters whose
    id is in ``skip`` are the caller's (ZeRO's partitioned ones). Buffers are rank 0's."""
    from dpkit.core.walk import inner_torch_optimizer

    torch_opt = inner_torch_optimizer(optimizer)
    state: dict[str, FlatShard] = {}
    with torch.no_grad():
        for name, param in module.named_parameters():
            if id(param) in skip:
                continue
            shard = own_shard(param.detach(), rank, world_size)
            if shard is not None:
                state[weight_key(name)] = fp32(shard)
            saved = torch_opt.state.get(param) if param.requires_grad else None
            for moment in MOMENTS if saved and "step" in saved else ():
                shard = own_shard(saved[moment], rank, world_size)
                if shard is not None:
                    state[moment_key(name, moment)] = fp32(shard)
        if rank == 0:
            for name, buffer in persistent_buffers(module).items():
                state[weight_key(name)] = fp32(FlatShard.whole(buffer.detach()))
    return state


def replicated_targets(
    module: torch.nn.Module,
    optimizer: Any,
    step: torch.Tensor,
    *,
    with_moments: bool,
    skip: set[int] = frozenset(),
) -> LoadTargets:
    """What a DDP or FSDP2 rank loads: every parameter (its own rows under FSDP2), its
    Adam moments (the optimizer's state made first, if no step has run), the buffers."""
    from dpkit.core.walk import inner_torch_optimizer

    torch_opt = inner_torch_optimizer(optimizer)
    targets = LoadTargets()
    for name, param in module.named_parameters():
        if id(param) in skip:
            continue
        targets.whole(weight_key(name), param.data)
        if with_moments and param.requires_grad:
            torch_opt.state[param] = {
                "step": step.clone(),
                **{moment: torch.zeros_like(param.data) for moment in MOMENTS},
            }
            for moment in MOMENTS:
                targets.whole(moment_key(name, moment), torch_opt.state[param][moment])
    for name, buffer in persistent_buffers(module).items():
        targets.whole(weight_key(name), buffer)
    return targets


def optimizer_step(optimizer: Any) -> int:
    """The optimizer's step count (0 before the first step)."""
    from dpkit.core.walk import inner_torch_optimizer

    torch_opt = inner_torch_optimizer(optimizer)
    steps = [
        float(s["step"]) for s in torch_opt.state.values() if isinstance(s, dict) and "step" in s
    ]
    return int(steps[0]) if steps else 0


def tensor_index(module: torch.nn.Module) -> dict[str, tuple[list[int], str, bool]]:
    """name -> (shape, saved dtype, trainable) of what a sharded checkpoint saves of
    ``module``: each parameter once (tied ones under their first name), persistent buffers."""
    found = {}
    for name, param in module.named_parameters():
        found[name] = (list(whole_shape(param)), _saved_dtype(param), param.requires_grad)
    for name, buffer in persistent_buffers(module).items():
        found[name] = (list(buffer.shape), _saved_dtype(buffer), False)
    return found


def _saved_dtype(tensor: torch.Tensor) -> str:
    dtype = torch.float32 if tensor.is_floating_point() else tensor.dtype
    return str(dtype).removeprefix("torch.")
