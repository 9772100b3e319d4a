"""DDP's bytes per rank, predicted: everything replicated, fp32 even in mixed precision.

Mixed precision under DDP is autocast: parameters, gradients and optimizer state stay
fp32 and there is no separate master copy (16 bytes/param for AdamW, the ZeRO paper's
2 + 2 + 12 in total). Pure arithmetic: no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dpkit.core.units import OPTIMIZER_STATE_BYTES, ModelStateBytes


def model_state_bytes(num_params: float, optimizer: str) -> ModelStateBytes:
    """fp32 parameters and gradients, the optimizer's state, all whole on every rank."""
    return ModelStateBytes(
        params=4 * num_params,
        grads=4 * num_params,
        optimizer=OPTIMIZER_STATE_BYTES[optimizer] * num_params,
        master=0.0,
    )


def paper_grad_bytes(num_params: float) -> float:
    """The paper's figure is DDP's own: every fp32 gradient on every rank."""
    return 4.0 * num_params


def buffer_bytes(settings: Mapping[str, Any], grads: float) -> dict[str, float]:
    """The reducer allocates flat buckets for every gradient up front (bucket_cap_mb only
    splits them); with ``gradient_as_bucket_view`` the gradients are views of those
    buckets and cost nothing more."""
    return {"ddp_gradient_buckets": 0.0 if settings["gradient_as_bucket_view"] else grads}


def autocast_weight_copies(num_params: float, precision: str) -> dict[str, float]:
    """DDP's mixed precision is autocast: it casts each weight to 16 bits once per forward
    and keeps the copy for backward (the matmul saves it): the memory report sees these
    among saved tensors. Norm weights and position embeddings are not cast, so this is
    an upper bound."""
    if precision == "fp32":
        return {}
    return {"autocast_weight_copies": 2.0 * num_params}


def why(strategy: Any, row: Any, inputs: Any) -> str:
    """Why DDP when it fits: nothing needs sharding."""
    from dpkit.core.units import format_gib

    return (
        f"{strategy.label} fits ({format_gib(row.total)} of {format_gib(inputs.usable)} "
        "usable): nothing needs sharding, and ZeRO would add a DeepSpeed engine and sharded "
        "checkpoints for memory that is not needed."
    )
