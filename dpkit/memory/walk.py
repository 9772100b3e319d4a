"""Count the bytes one rank holds, by what holds them, from the tensors themselves.

The walk visits the objects that can hold training memory (the module, the
optimizer and, under DeepSpeed, the ZeRO optimizer's own buffers) and counts
every storage once: tensors that share storage (tied weights, parameters that
are views into one flat buffer, gradients that are views into a bucket) are
counted by their storage's size, under the first category that claims it.
The claim order is therefore part of the accounting and is spelled out in
:func:`walk`.

Gradients live for a fraction of each step and, under DeepSpeed, not in
``param.grad``: :mod:`dpkit.memory.probes` runs this walk at the points of a
step where they exist.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from dpkit.memory.categories import CATEGORIES, PARTITION_SHARE
from dpkit.memory.settings import ZERO_MEMORY_KEYS

# Attributes of DeepSpeed's ZeRO stage 1/2 optimizer (deepspeed 0.15-0.19); read
# with getattr defaults so that a renamed attribute costs a category, not a crash.
_ZERO_MARKERS = ("single_partition_of_fp32_groups", "bit16_groups_flat")


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (an FSDP2 parameter, gradient or Adam moment),
    whose own storage reports the whole tensor's size; any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def storage_key(tensor: torch.Tensor) -> tuple[str, int, int] | None:
    """A key for the tensor's storage, or None for tensors without memory (meta, empty)."""
    tensor = local_shard(tensor)
    if tensor.is_sparse or tensor.device.type == "meta":
        return None
    try:
        storage = tensor.untyped_storage()
        if storage.data_ptr() == 0 or storage.nbytes() == 0:
            return None
    except (RuntimeError, NotImplementedError):
        return None  # tensor subclasses without a plain storage (fake, functional): not memory
    return (tensor.device.type, tensor.device.index or 0, storage.data_ptr())


class Ledger:
    """Storages seen in one walk; each is counted once, under the first category claiming it."""

    def __init__(self) -> None:
        self._owner: dict[tuple[str, int, int], str] = {}
        # category -> holder name -> bytes
        self.holders: dict[str, dict[str, float]] = {c: {} for c in CATEGORIES}

    def owner(self, tensor: torch.Tensor) -> str | None:
        key = storage_key(tensor)
        return None if key is None else self._owner.get(key)

    def claim(self, tensor: Any, category: str, holder: str) -> bool:
        """Count ``tensor``'s storage under ``category``/``holder`` unless already counted."""
        if not isinstance(tensor, torch.Tensor):
            return False
        tensor = local_shard(tensor)
        key = storage_key(tensor)
        if key is None or key in self._owner:
            return False
        self._owner[key] = category
        bucket = self.holders[category]
        bucket[holder] = bucket.get(holder, 0.0) + float(tensor.untyped_storage().nbytes())
        return True

    def claim_all(self, tensors: Iterable[Any], category: str, holder: str) -> None:
        for tensor in tensors:
            self.claim(tensor, category, holder)

    def snapshot(self) -> dict[str, Any]:
        totals: dict[str, Any] = {c: sum(self.holders[c].values()) for c in CATEGORIES}
        totals["holders"] = {c: dict(h) for c, h in self.holders.items() if h}
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


def is_zero_optimizer(obj: Any) -> bool:
    return all(hasattr(obj, name) for name in _ZERO_MARKERS)


def unwrap_optimizer(optimizer: Any) -> Any:
    """The object that owns the training state: DeepSpeed's ZeRO optimizer or the torch optimizer.

    accelerate wraps both in an ``AcceleratedOptimizer`` (``.optimizer``); the ZeRO
    optimizer itself wraps the client torch optimizer in ``.optimizer``, so the
    descent stops at the first ZeRO optimizer.
    """
    opt = optimizer
    for _ in range(8):
        if opt is None or is_zero_optimizer(opt):
            return opt
        inner = getattr(opt, "optimizer", None)
        if inner is None or not hasattr(inner, "param_groups"):
            return opt
        opt = inner
    return opt


def find_ddp(model: torch.nn.Module) -> torch.nn.parallel.DistributedDataParallel | None:
    module = model
    for _ in range(8):
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            return module
        module = getattr(module, "module", None)
        if not isinstance(module, torch.nn.Module):
            return None
    return None


def inner_torch_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer whose ``state`` holds exp_avg/exp_avg_sq (ZeRO wraps it)."""
    owner = unwrap_optimizer(optimizer)
    if is_zero_optimizer(owner):
        owner = getattr(owner, "optimizer", None)
    return owner if isinstance(owner, torch.optim.Optimizer) else None


def _tensors_in(value: Any) -> Iterable[torch.Tensor]:
    """Tensors in a (possibly nested) list/tuple/dict, or in a DeepSpeed grad-buffer group."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)
    elif value is not None and isinstance(getattr(value, "flat_partition", None), torch.Tensor):
        # GradPartitionBufferGroup: one flat fp32 partition that its grad views share.
        yield value.flat_partition


def _claim_optimizer_state(ledger: Ledger, torch_opt: torch.optim.Optimizer | None) -> None:
    if torch_opt is None:
        return
    for state in torch_opt.state.values():
        for name, value in state.items():
            # Holder named by the state key (exp_avg, exp_avg_sq, step...): says which state it is.
            ledger.claim_all(_tensors_in(value), "optimizer", str(name))


def _claim_module_buffers(ledger: Ledger, module: torch.nn.Module) -> None:
    ledger.claim_all(module.buffers(), "buffers", "module_buffers")


def _ddp_bucket_bytes(ddp: torch.nn.parallel.DistributedDataParallel) -> float:
    """Bytes of the reducer's flat gradient buckets, from DDP's own logging data."""
    try:
        sizes = str(ddp._get_ddp_logging_data().get("bucket_sizes", ""))
    except (AttributeError, RuntimeError):
        return 0.0
    return float(sum(int(s) for s in sizes.replace(" ", "").split(",") if s))


def _walk_torch(ledger: Ledger, model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """Plain module or DDP with a torch optimizer."""
    module = unwrap_module(model)
    torch_opt = inner_torch_optimizer(optimizer)
    params = list(module.parameters())
    ledger.claim_all(params, "params", "module parameters")
    # Parameters the optimizer updates that are not the module's own: a master copy.
    if torch_opt is not None:
        for group in torch_opt.param_groups:
            ledger.claim_all(group["params"], "master", "optimizer-held parameter copies")
    _claim_optimizer_state(ledger, torch_opt)

    ddp = find_ddp(model)
    bucket_view = bool(getattr(ddp, "gradient_as_bucket_view", False))
    grad_holder = "param.grad (views of DDP buckets)" if bucket_view else "param.grad"
    grads_before = sum(ledger.holders["grads"].values())
    ledger.claim_all((p.grad for p in params), "grads", grad_holder)
    if torch_opt is not None:
        for group in torch_opt.param_groups:
            ledger.claim_all((p.grad for p in group["params"]), "grads", grad_holder)
    grads_seen = sum(ledger.holders["grads"].values()) > grads_before
    info: dict[str, Any] = {"kind": "ddp" if ddp is not None else "torch"}
    if ddp is not None:
        bucket_bytes = _ddp_bucket_bytes(ddp)
        info.update(gradient_as_bucket_view=bucket_view, ddp_bucket_bytes=bucket_bytes)
        # The reducer's buckets are C++ tensors the walk cannot reach; their sizes come
        # from DDP's logging data. With gradient_as_bucket_view the .grad fields *are*
        # the buckets (counted above); zero_grad(set_to_none) drops the views but the
        # reducer keeps the buckets, so the gradient memory is still held, by them.
        if bucket_bytes and not bucket_view:
            ledger.holders["buffers"]["ddp_buckets"] = bucket_bytes
        elif bucket_bytes and not grads_seen:
            ledger.holders["grads"]["ddp_buckets (grad views released, buckets kept)"] = (
                bucket_bytes
            )
    _claim_module_buffers(ledger, module)
    return info


def fsdp2_params(model: torch.nn.Module, recurse: bool = True) -> list[Any]:
    """FSDP2's per-parameter records (``FSDPParam``: the shard, the all-gathered whole
    parameter, its gradient before the reduce-scatter) of every unit in ``model`` (of
    ``model`` alone if not ``recurse``); torch-internal attributes (torch 2.6-2.13), read
    with defaults so that a renamed one costs a holder, not a crash. Empty for a model
    without FSDP2."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    records = []
    for module in model.modules() if recurse else (model,):
        if not isinstance(module, FSDPModule):
            continue
        group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
        records += list(getattr(group, "fsdp_params", None) or [])
    return records


def _walk_fsdp2(ledger: Ledger, model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """FSDP2: each rank's parameter, gradient and Adam-moment shards (DTensor local
    storages, padded on dim 0 to a multiple of N) as model states; the whole parameters
    and gradients that exist only inside a forward/backward (a unit's all-gather
    output, its reduce-scatter input) as communication buffers, beside DDP's and ZeRO's
    buckets. The module's attributes point at the whole parameters during the compute,
    so the walk goes through FSDP2's records, not ``module.parameters()``."""
    records = fsdp2_params(model)
    shards = [getattr(r, "sharded_param", None) for r in records]
    ledger.claim_all(shards, "params", "parameter shards")
    for record in records:
        ledger.claim_all(
            getattr(record, "all_gather_outputs", None) or [],
            "buffers",
            "whole parameters (FSDP2 all-gather output)",
        )
    torch_opt = inner_torch_optimizer(optimizer)
    _claim_optimizer_state(ledger, torch_opt)
    ledger.claim_all((getattr(p, "grad", None) for p in shards), "grads", "gradient shards")
    whole = (getattr(r, "_unsharded_param", None) for r in records)
    ledger.claim_all(
        (getattr(p, "grad", None) for p in whole),
        "buffers",
        "whole gradients (FSDP2 reduce-scatter input)",
    )
    _claim_module_buffers(ledger, model)
    return {"kind": "fsdp2"}


def _partition_bounds(zero: Any, group: int) -> tuple[torch.Tensor, int, int] | None:
    """The flat buffer of ``group`` and this rank's partition of it, as [start, end) elements."""
    import torch.distributed as dist

    try:
        flat = zero.bit16_groups_flat[group]
        process_group = zero.real_dp_process_group[group]
        rank = dist.get_rank(group=process_group) if dist.is_initialized() else 0
        partition = zero.parallel_partitioned_bit16_groups[group][rank]
    except (AttributeError, IndexError, TypeError, RuntimeError):
        return None
    start = (partition.data_ptr() - flat.data_ptr()) // flat.element_size()
    return flat, start, start + partition.numel()


def straddle_extras(zero: Any, module: torch.nn.Module) -> dict[int, tuple[str, int]]:
    """Per parameter cut by this rank's partition boundary: its name and elements outside.

    DeepSpeed keeps the *whole* gradient of every parameter that touches the rank's
    partition (``grads_in_partition`` is sized by whole parameters), so a parameter
    cut by a boundary is held in full by each rank it touches: with one large
    parameter (a word embedding) this can double a rank's gradient memory.
    Parameters are views into the flat buffer, so their offsets (alignment padding
    included) come from their addresses. Keyed by ``id(param)``.
    """
    names = {id(p): n for n, p in module.named_parameters()}
    extras: dict[int, tuple[str, int]] = {}
    for i, params in enumerate(getattr(zero, "params_in_partition", [])):
        bounds = _partition_bounds(zero, i)
        if bounds is None:
            continue
        flat, start, end = bounds
        for index, param in enumerate(params):
            offset = (param.data_ptr() - flat.data_ptr()) // flat.element_size()
            inside = max(0, min(end, offset + param.numel()) - max(start, offset))
            if inside < param.numel():
                name = names.get(id(param), f"group {i} param {index}")
                extras[id(param)] = (name, param.numel() - inside)
    return extras


def straddling_params(zero: Any, module: torch.nn.Module) -> tuple[int, list[str]]:
    """Total elements held beyond the partition by whole-gradient copies, and the params."""
    extras = straddle_extras(zero, module)
    return sum(e for _, e in extras.values()), [n for n, _ in extras.values()]


def _claim_partition_grads(
    ledger: Ledger,
    tensors: Iterable[Any],
    label: str,
    params: Iterable[torch.nn.Parameter],
    extras: dict[int, tuple[str, int]],
) -> None:
    """Claim gradients of the rank's partition, naming the part that lies outside it."""
    scratch = f"{label}\0"
    tensors = list(tensors)
    ledger.claim_all(tensors, "grads", scratch)
    held = ledger.holders["grads"].pop(scratch, 0.0)
    if not held:
        return
    element_size = next((t.element_size() for t in tensors if isinstance(t, torch.Tensor)), 4)
    cut = [extras[id(p)] for p in params if id(p) in extras]
    outside = min(held, float(element_size * sum(e for _, e in cut)))
    grads = ledger.holders["grads"]
    share = f"{label} {PARTITION_SHARE}"
    grads[share] = grads.get(share, 0.0) + held - outside
    if outside:
        name = f"{label} (whole gradients of boundary-straddling params: {', '.join(n for n, _ in cut)})"
        grads[name] = grads.get(name, 0.0) + outside


def _walk_zero(ledger: Ledger, model: torch.nn.Module, zero: Any) -> dict[str, Any]:
    """DeepSpeed ZeRO stage 1/2: the partitions and buffers inside ``DeepSpeedZeroOptimizer``."""
    module = unwrap_module(model)
    fp32_partitions = list(getattr(zero, "single_partition_of_fp32_groups", []))
    # 1. The fp32 master partition the inner optimizer updates (Psi/N per rank).
    ledger.claim_all(fp32_partitions, "master", "zero_fp32_partition")
    # 2. The flat buffer the module's parameters are views of (all Psi, padded).
    ledger.claim_all(getattr(zero, "bit16_groups_flat", []), "params", "zero_flat_params")
    ledger.claim_all(module.parameters(), "params", "module parameters outside ZeRO groups")
    # 3. Optimizer state on the fp32 partition.
    _claim_optimizer_state(ledger, getattr(zero, "optimizer", None))
    # 4. Gradients ZeRO keeps on purpose: the reduced partition (during backward, in
    # grads_in_partition / averaged_gradients; during the step, as the master's .grad).
    for partition in fp32_partitions:
        grad = partition.grad
        if isinstance(grad, torch.Tensor):
            # Flattening a single gradient returns a view, not a copy: a partition that lies
            # inside one parameter keeps that parameter's whole gradient alive through the step.
            whole = grad.untyped_storage().nbytes() > grad.numel() * grad.element_size()
            suffix = " (a view: keeps a whole parameter's gradient alive)" if whole else ""
            ledger.claim(grad, "grads", "zero_fp32_partition.grad" + suffix)
    extras = straddle_extras(zero, module)
    groups = list(getattr(zero, "params_in_partition", []))
    in_partition = {id(p) for params in groups for p in params}
    # grads_in_partition (contiguous_gradients) holds all groups' partition parameters,
    # whole; it is dropped at the end of backward, and averaged_gradients (its views, or
    # without contiguous_gradients views of the parameters' own gradients) keeps it alive
    # until the step.
    all_partition_params = [p for params in groups for p in params]
    partition_buffer = getattr(zero, "grads_in_partition", None)
    _claim_partition_grads(
        ledger, [partition_buffer], "grads_in_partition", all_partition_params, extras
    )
    averaged = getattr(zero, "averaged_gradients", None) or {}
    # With contiguous_gradients every group's averaged_gradients are views into the one
    # buffer of all groups: claiming any of them claims the whole buffer, so the part
    # outside the partition is named from every group's cut parameters.
    shared_buffer = bool(getattr(zero, "contiguous_gradients", False))
    for group, value in averaged.items() if isinstance(averaged, dict) else []:
        params = (
            all_partition_params
            if shared_buffer
            else (groups[group] if group < len(groups) else [])
        )
        _claim_partition_grads(ledger, _tensors_in(value), "averaged_gradients", params, extras)
    ledger.claim_all(
        _tensors_in(getattr(zero, "all_grad_tensors", None)), "grads", "all_grad_tensors"
    )
    # 5. Reduction buckets: the contiguous ipg buffer(s), one per comm dtype (two with overlap_comm).
    for bucket in getattr(zero, "ipg_buckets", {}).values():
        ledger.claim_all(getattr(bucket, "buffer", []), "buffers", "zero_ipg_bucket")
    # 6. What param.grad still points at. A view into a larger storage not claimed above
    # is a stale view into an ipg buffer that DeepSpeed already dropped: the view keeps
    # the whole bucket alive until the step frees the .grad fields. A gradient with a
    # storage of its own is either a reduced one of this rank's partition (ZeRO-2
    # without contiguous_gradients keeps them so) or one not reduced yet: all of them in
    # ZeRO-1 before its post-backward reduction, in ZeRO-2 those waiting in a bucket or
    # larger than reduce_bucket_size (reduced alone, after backward).
    param_ids = getattr(zero, "param_id", {})
    reduced_flags = getattr(zero, "params_already_reduced", [])
    unreduced: list[tuple[str, torch.Tensor]] = []
    for name, param in module.named_parameters():
        for grad in (param.grad, getattr(param, "grad_accum", None)):
            if not isinstance(grad, torch.Tensor) or ledger.owner(grad) is not None:
                continue
            if grad.untyped_storage().nbytes() > grad.numel() * grad.element_size():
                ledger.claim(grad, "buffers", "zero_ipg_bucket (kept alive by param.grad views)")
                continue
            index = param_ids.get(id(param))
            reduced = index is not None and index < len(reduced_flags) and reduced_flags[index]
            if reduced and id(param) in in_partition:
                _claim_partition_grads(ledger, [grad], "param.grad", [param], extras)
            else:
                unreduced.append((name, grad))
    if unreduced:
        names = [n for n, _ in unreduced]
        listed = ", ".join(names) if len(names) <= 3 else f"{len(names)} params"
        ledger.claim_all((g for _, g in unreduced), "grads", f"param.grad (unreduced: {listed})")
    # 7. Offload staging buffers and other per-optimizer scratch space.
    for name in (
        "temp_grad_buffer_for_cpu_offload",
        "temp_grad_buffer_for_gpu_offload",
        "param_buffer_of_bit16_for_cpu_offload_groups",
        "_muon_allgather_buffers",
        "accumulated_grads_in_cpu",
    ):
        ledger.claim_all(
            _tensors_in(getattr(zero, name, None)), "buffers", f"zero_{name.strip('_')}"
        )
    _claim_module_buffers(ledger, module)
    return {"kind": "zero", "stage": 2 if getattr(zero, "partition_gradients", False) else 1}


def walk(
    model: torch.nn.Module,
    optimizer: Any,
    extra: Iterable[tuple[torch.Tensor, str, str]] = (),
) -> dict[str, Any]:
    """Bytes this rank holds now, by category, with the holder of every byte.

    Claim order (a storage counted twice would overstate memory, so each is counted
    under the first claim): master copies, parameters, optimizer state, gradients,
    then buffers; ``extra`` (tensor, category, holder) are tensors a probe caught in
    flight that no object holds yet, claimed last.
    """
    ledger = Ledger()
    owner = unwrap_optimizer(optimizer)
    if owner is None:
        owner = unwrap_optimizer(getattr(model, "optimizer", None))
    if is_zero_optimizer(owner):
        info = _walk_zero(ledger, model, owner)
    elif fsdp2_params(model):
        info = _walk_fsdp2(ledger, model, optimizer)
    else:
        info = _walk_torch(ledger, model, optimizer)
    for tensor, category, holder in extra:
        ledger.claim(tensor, category, holder)
    snap = ledger.snapshot()
    snap["walk"] = info
    return snap


def memory_settings_in_effect(model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """The memory-relevant settings as the live objects hold them (not as configured)."""
    owner = unwrap_optimizer(optimizer)
    if is_zero_optimizer(owner):
        names = (*ZERO_MEMORY_KEYS, "partition_gradients", "cpu_offload")
        return {f"zero.{n}": getattr(owner, n) for n in names if hasattr(owner, n)}
    ddp = find_ddp(model)
    if ddp is None:
        return {}
    return {
        "ddp.gradient_as_bucket_view": bool(getattr(ddp, "gradient_as_bucket_view", False)),
        "ddp.bucket_cap_bytes": getattr(ddp, "bucket_bytes_cap", None),
        "ddp.bucket_bytes_total": _ddp_bucket_bytes(ddp),
        "ddp.static_graph": bool(getattr(ddp, "static_graph", False)),
        "ddp.find_unused_parameters": bool(getattr(ddp, "find_unused_parameters", False)),
    }
