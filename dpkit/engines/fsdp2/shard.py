"""FSDP2 (torch's ``fully_shard``) as dpkit applies it: which modules become units, and the sharding itself.

accelerate enters its own FSDP2 path only for accelerator devices: on a CPU-only
machine an FSDP YAML runs unconnected single-process copies, and ``cpu=True`` wraps
the model in DDP (docs/stack-notes.md). dpkit therefore applies
``fully_shard`` itself, on CPU (gloo) and GPU (nccl) alike, so the suite's CPU runs
exercise the code a GPU runs: each transformer layer is one unit, the root last
(torchtitan's and accelerate's layout), on a 1-D mesh of every rank.

The layer classes come from, in order: ``--fsdp-layer-classes`` (or an accelerate
YAML's ``fsdp_transformer_layer_cls_to_wrap``), the model's ``_no_split_modules``
(transformers' list of blocks that must stay whole), or the model's own list of
repeated blocks (the longest ``nn.ModuleList`` whose entries share one class: BERT's
``encoder.layer``, which declares no ``_no_split_modules``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dpkit.errors import UsageError
from dpkit.models import block_class_names


def layer_classes(model: Any, override: Sequence[str] = (), *, asked_by: str) -> tuple[str, ...]:
    """The class names ``fully_shard`` wraps as units, before the root; bad input raises
    :class:`~dpkit.errors.UsageError` naming the flag and value.

    Args:
        model: the ``torch.nn.Module`` to shard.
        override: class names the user gave (``--fsdp-layer-classes``); each must occur in
            the model.
        asked_by: what asked for FSDP2, for the message (``--strategy=fsdp2_full_shard``,
            or the accelerate launch that did).
    """
    present = {type(m).__name__ for m in model.modules()}
    model_name = type(model).__name__
    if override:
        missing = [name for name in override if name not in present]
        if missing:
            raise UsageError(
                f"--fsdp-layer-classes={','.join(override)}: no {missing[0]} module in {model_name}"
            )
        return tuple(override)
    found = block_class_names(model)
    if found:
        return found
    raise UsageError(
        f"{asked_by}: {model_name} has no recognisable layer list "
        "(no _no_split_modules, no list of repeated blocks); name its block class with "
        "--fsdp-layer-classes"
    )


def shard_model(
    model: Any,
    *,
    layer_class_names: Sequence[str],
    reshard_after_forward: bool,
    precision: str,
    device_type: str,
    offload: bool = False,
) -> Any:
    """Apply ``fully_shard`` to every module of ``layer_class_names``, then to the root,
    on a mesh of all ranks; returns the (same, now sharded) model.

    Every parameter becomes a DTensor sharded on dim 0. ``precision`` ``bf16``:
    FSDP2's ``MixedPrecisionPolicy`` all-gathers bf16 copies for the compute and
    reduce-scatters gradients in fp32, so parameters, gradients and optimizer state
    stay fp32 (as under DDP's autocast).

    ``offload``: torch's ``CPUOffloadPolicy`` on every unit. The shards of parameters,
    gradients (and so the optimizer state built over them) live in host memory; each
    unit's shards are copied to the device for its all-gather and its reduce-scatter
    output copied back (``_fsdp_param.py``, ``_fsdp_collectives.py``), and the optimizer
    steps on the CPU. Pinned host memory only where there is an accelerator: pinning on a
    CPU-only machine raises ``Cannot access accelerator device when none is available``
    (``_fsdp_param.py``, ``_init_sharded_param``: ``padded_sharded_param.pin_memory()``,
    torch 2.13).
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy()
    if precision == "bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload_policy = (
        CPUOffloadPolicy(pin_memory=device_type != "cpu") if offload else OffloadPolicy()
    )
    options = {
        "mesh": mesh,
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": policy,
        "offload_policy": offload_policy,
    }
    wanted = set(layer_class_names)
    # Bottom-up, as fully_shard asks: the root then manages only what no unit took.
    units = [m for m in model.modules() if type(m).__name__ in wanted and m is not model]
    for unit in reversed(units):
        fully_shard(unit, **options)
    fully_shard(model, **options)
    return model


def is_sharded(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor (an FSDP2 parameter, gradient or moment)."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def reshard(model: Any) -> None:
    """Shard again the parameters FSDP2 keeps whole after a forward without a backward
    (shard-grad-op keeps them for the backward that an evaluation never runs): the
    memory goes back, and ``named_parameters()`` yields the shards again. A no-op for
    a model without FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def unit_count(model: Any) -> int:
    """How many modules ``fully_shard`` made units (layers and the root)."""
    from torch.distributed.fsdp import FSDPModule

    return sum(isinstance(m, FSDPModule) for m in model.modules())


def units_of(model: Any) -> dict[int, int]:
    """``id(parameter)`` -> the index of the layer dpkit's FSDP2 makes a unit of it in, for
    the parameters inside one (the innermost where they nest); the rest belong to the
    root. The layer classes are the ones a run picks by default
    (:func:`layer_classes`); a model without any has only the root. A
    module ``fully_shard`` already wrapped keeps its class among its bases, so a live
    model reads the same."""
    try:
        classes = set(layer_classes(model, asked_by="dpkit plan"))
    except UsageError:  # no recognisable layers: a run would need --fsdp-layer-classes
        classes = set()
    unit_of: dict[int, int] = {}
    index = 0
    for module in model.modules():  # parents first: an inner layer overrides its parent
        if module is model or not any(c.__name__ in classes for c in type(module).__mro__):
            continue
        for param in module.parameters():
            unit_of[id(param)] = index
        index += 1
    return unit_of
