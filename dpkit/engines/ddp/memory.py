"""Where a DDP rank's memory lives: the module's parameters and gradients, the torch
optimizer's state, and the reducer's flat buckets (which the walk cannot reach; their
sizes come from DDP's own logging data)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dpkit.core.walk import (
    Ledger,
    claim_module_buffers,
    claim_optimizer_state,
    inner_torch_optimizer,
    unwrap_module,
)
from dpkit.engines.roles.measured import MeasuredMemory

if TYPE_CHECKING:
    from dpkit.core.walk import Ledger


def find_ddp(model: torch.nn.Module) -> torch.nn.parallel.DistributedDataParallel | None:
    """The DDP wrapper around (or at) ``model``, or None."""
    module = model
    for _ in range(8):
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            return module
        module = getattr(module, "module", None)
        if not isinstance(module, torch.nn.Module):
            return None
    return None


def bucket_bytes(ddp: torch.nn.parallel.DistributedDataParallel) -> float:
    """Bytes of the reducer's flat gradient buckets, from DDP's own logging data."""
    try:
        sizes = str(ddp._get_ddp_logging_data().get("bucket_sizes", ""))
    except (AttributeError, RuntimeError):
        return 0.0
    return float(sum(int(s) for s in sizes.replace(" ", "").split(",") if s))


class DDPMemory(MeasuredMemory):
    """DDP's measured memory: the module's parameters and their gradients (or DDP's buckets, whose views they are), the torch optimizer's state."""

    def walk(self, ledger: Ledger, model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
        """A plain module or DDP with a torch optimizer: parameters, optimizer-held copies
        (a master), the optimizer's state, ``.grad`` fields and the reducer's buckets."""
        module = unwrap_module(model)
        torch_opt = inner_torch_optimizer(optimizer)
        params = list(module.parameters())
        ledger.claim_all(params, "params", "module parameters")
        # Parameters the optimizer updates that are not the module's own: a master copy.
        if torch_opt is not None:
            for group in torch_opt.param_groups:
                ledger.claim_all(group["params"], "master", "optimizer-held parameter copies")
        claim_optimizer_state(ledger, torch_opt)

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
            buckets = bucket_bytes(ddp)
            info.update(gradient_as_bucket_view=bucket_view, ddp_bucket_bytes=buckets)
            # The reducer's buckets are C++ tensors the walk cannot reach; their sizes come
            # from DDP's logging data. With gradient_as_bucket_view the .grad fields *are*
            # the buckets (counted above); zero_grad(set_to_none) drops the views but the
            # reducer keeps the buckets, so the gradient memory is still held, by them.
            # DDP rebuilds its buckets once, in the second iteration's forward (in the order
            # the first backward's gradients arrived): the ones counted here are freed then.
            rebuilt = bool(getattr(ddp, "_has_rebuilt_buckets", False))

            def still_held() -> bool:
                return bool(getattr(ddp, "_has_rebuilt_buckets", False)) == rebuilt

            if buckets and not bucket_view:
                ledger.count_unreachable("buffers", "ddp_buckets", buckets, still_held)
            elif buckets and not grads_seen:
                ledger.count_unreachable(
                    "grads", "ddp_buckets (grad views released, buckets kept)", buckets, still_held
                )
        claim_module_buffers(ledger, module)
        return info

    def settings_in_effect(self, model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
        """DDP's memory-relevant settings as the live wrapper holds them ({} without one)."""
        ddp = find_ddp(model)
        if ddp is None:
            return {}
        return {
            "ddp.gradient_as_bucket_view": bool(getattr(ddp, "gradient_as_bucket_view", False)),
            "ddp.bucket_cap_bytes": getattr(ddp, "bucket_bytes_cap", None),
            "ddp.bucket_bytes_total": bucket_bytes(ddp),
            "ddp.static_graph": bool(getattr(ddp, "static_graph", False)),
            "ddp.find_unused_parameters": bool(getattr(ddp, "find_unused_parameters", False)),
        }
