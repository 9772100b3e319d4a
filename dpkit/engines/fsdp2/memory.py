"""Where an FSDP2 rank's memory lives, and the points of a step where it is probed.

Each rank holds its shard of every parameter, gradient and Adam moment (DTensor local
storages, padded on dim 0 to a multiple of N) as model states; the whole parameters and
gradients that exist only inside a forward/backward (a unit's all-gather output, its
reduce-scatter input) are communication buffers, beside DDP's and ZeRO's buckets. The
module's attributes point at the whole parameters during the compute, so the walk goes
through FSDP2's records (``FSDPParam``), not ``module.parameters()``.

Under ``CPUOffloadPolicy`` (``fsdp2_full_shard_offload``) the shards live in host memory:
each record's ``offload_to_cpu`` says so (``_fsdp_param.py``: the padded shard is moved
``.cpu()`` when built, each sharded gradient is copied ``.to("cpu")`` after its
reduce-scatter in ``_fsdp_collectives.py``), and an optimizer built over the shards keeps
its state beside them. Those claims are placed ``host``; the whole parameters and
gradients of the unit computing stay on the device. On a CPU run every tensor says
``cpu`` either way, so the placement comes from the records, not from ``tensor.device``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dpkit.core.walk import (
    Ledger,
    claim_module_buffers,
    claim_optimizer_state,
    inner_torch_optimizer,
    storage_key,
)
from dpkit.engines.roles.measured import MeasuredMemory

if TYPE_CHECKING:
    from dpkit.core.walk import Ledger
    from dpkit.engines.roles.views import StepProbesView


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


def whole_param_keys(unit: torch.nn.Module) -> set[tuple[str, int, int]]:
    """Storages of the whole parameters an FSDP2 unit holds now (its all-gather output)."""
    return {
        key
        for record in fsdp2_params(unit, recurse=False)
        for tensor in getattr(record, "all_gather_outputs", None) or []
        if (key := storage_key(tensor)) is not None
    }


def install_probes(probes: StepProbesView, model: torch.nn.Module) -> None:
    """Shard-grad-op holds every unit's whole parameters from the end of the forward
    until each unit's backward: the largest moment of its buffers, probed at the end of
    a training forward. The activation count skips each unit's whole parameters (a
    pre-hook registered after FSDP2's own, so it runs after the all-gather)."""

    def after_forward(module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():  # a training forward; evaluation keeps nothing
            probes.probe("forward_end")

    handle = model.register_forward_hook(after_forward)
    probes.add_remover(handle.remove)
    activations = probes.activations
    if activations is None:
        return
    activations.param_storages = whole_param_keys
    for module in model.modules():
        if module is not model and fsdp2_params(module, recurse=False):
            activations.add_handle(module.register_forward_pre_hook(activations.note_params))


def _placement(on_host: bool) -> str:
    """The ledger's placement of a claim (:meth:`dpkit.core.walk.Ledger.claim`)."""
    return "host" if on_host else "device"


class FSDP2Memory(MeasuredMemory):
    """FSDP2's measured memory: each parameter's local shard, its gradient and optimizer state, and the whole parameters a unit holds while it computes."""

    def walk(self, ledger: Ledger, model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
        """The shards as model states; the whole parameters and gradients as buffers (a
        model FSDP2 does not shard walks as plain torch)."""
        records = fsdp2_params(model)
        if not records:
            from dpkit.engines.ddp.memory import DDPMemory

            return DDPMemory().walk(ledger, model, optimizer)
        shards = [getattr(r, "sharded_param", None) for r in records]
        offloaded = [bool(getattr(r, "offload_to_cpu", False)) for r in records]
        for shard, on_host in zip(shards, offloaded, strict=True):
            ledger.claim(shard, "params", "parameter shards", _placement(on_host))
        for record in records:
            ledger.claim_all(
                getattr(record, "all_gather_outputs", None) or [],
                "buffers",
                "whole parameters (FSDP2 all-gather output)",
            )
        torch_opt = inner_torch_optimizer(optimizer)
        # The optimizer's state is built beside the parameters it updates: in host memory
        # when the shards are (one policy for every unit: dpkit's shard_model).
        claim_optimizer_state(ledger, torch_opt, _placement(any(offloaded)))
        for shard, on_host in zip(shards, offloaded, strict=True):
            grad = getattr(shard, "grad", None)
            ledger.claim(grad, "grads", "gradient shards", _placement(on_host))
        whole = (getattr(r, "_unsharded_param", None) for r in records)
        ledger.claim_all(
            (getattr(p, "grad", None) for p in whole),
            "buffers",
            "whole gradients (FSDP2 reduce-scatter input)",
        )
        claim_module_buffers(ledger, model)
        return {"kind": "fsdp2"}

    def install_probes(
        self, probes: StepProbesView, model: torch.nn.Module, optimizer: Any
    ) -> None:
        if fsdp2_params(model):
            install_probes(probes, model)

    def report_param_shapes(self) -> bool:
        return True
