"""FSDP2's bytes per rank, predicted: every state sharded on dim 0, fp32 even in bf16.

Under torch ``fully_shard`` (both modes) parameters, gradients and optimizer state are
all sharded over N and stay fp32 in bf16 runs too (the 16-bit copy the compute uses is
transient: :mod:`dpkit.engines.fsdp2.layout`); no master copy. Per rank 4 + 4 + K bytes
per parameter, over N: ZeRO-3's sharding even in shard-grad-op mode, which differs only
in how long parameters stay whole. With the parameters' shapes known the figure is exact
for the worst rank (each parameter's dim 0 padded to a multiple of N); from a bare count
it is Psi/N. Pure arithmetic: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dpkit.core.units import OPTIMIZER_STATE_BYTES, ModelStateBytes, dtype_bytes
from dpkit.engines.fsdp2 import layout


def model_state_bytes(
    num_params: float, world_size: int, optimizer: str, shapes: Sequence[Sequence[int]] | None
) -> ModelStateBytes:
    """fp32 parameters, gradients and optimizer state: each parameter's ceil(d0/N) rows on
    rank 0 (:mod:`dpkit.engines.fsdp2.layout`), or Psi/N from a count."""
    if shapes:
        if layout.numel(shapes) != num_params:
            raise ValueError(
                f"param_shapes hold {layout.numel(shapes)} elements, num_params is {num_params:.0f}"
            )
        per_rank = float(layout.shard_numel(shapes, world_size))
    else:
        per_rank = num_params / world_size
    return ModelStateBytes(
        params=4 * per_rank,
        grads=4 * per_rank,
        optimizer=OPTIMIZER_STATE_BYTES[optimizer] * per_rank,
        master=0.0,
    )


def paper_grad_bytes(num_params: float, world_size: int) -> float:
    """fp32 gradients sharded N ways in either mode (padding aside)."""
    return 4.0 * num_params / world_size


def buffer_bytes(
    reshard_after_forward: bool, spec: Any, world_size: int, precision: str
) -> dict[str, float]:
    """FSDP2's whole parameters and gradients per GPU at the start of backward, by name
    (:func:`dpkit.engines.fsdp2.layout.transient_bytes`), in the compute dtype (bf16/fp16
    under mixed precision: ``MixedPrecisionPolicy.param_dtype``).

    Shard-grad-op keeps every layer's parameters whole from its forward to its backward:
    about the whole model again, in the compute dtype. Full-shard keeps the root's and
    about two layers'. Both hold the root's whole gradients through backward and one
    unit's whole gradients with its fp32 reduce-scatter input. A bare ``--params`` has no
    layout: shard-grad-op's whole parameters are then Psi in the compute dtype, and
    nothing else is counted.
    """
    compute_bytes = dtype_bytes(precision)
    if not spec.param_shapes:
        if reshard_after_forward:
            return {}
        return {"fsdp2_whole_params": float(compute_bytes * (spec.num_params + spec.frozen_params))}
    parts = layout.transient_bytes(
        spec.param_shapes,
        spec.param_units,
        world_size,
        compute_bytes,
        reshard_after_forward,
        trainable=spec.trainable or None,
    )
    return {f"fsdp2_{name}": value for name, value in parts.items()}


def why(strategy: Any, row: Any, inputs: Any) -> str:
    """What choosing an FSDP2 mode buys and costs."""
    n = inputs.world_size
    if not strategy.reshard_after_forward:
        return (
            f"{strategy.label} shards parameters, gradients and optimizer state {n} ways between "
            "steps and keeps each layer's parameters whole from its forward to its backward "
            "(torch fully_shard: an all-gather and a reduce-scatter per step, DDP's volume; no "
            "DeepSpeed engine): the least sharding dpkit runs that fits."
        )
    return (
        f"{strategy.label} also frees each layer's whole parameters after its forward and "
        "all-gathers them again in backward (1.5x DDP's communication), holding about two "
        "layers whole at a time: the least sharding dpkit runs that fits."
    )


def row_note(strategy: Any, row: Any) -> str:
    """What an FSDP2 row's buffers hold whole, for the notes under the plan's table."""
    from dpkit.core.units import format_gib

    parts = row.buffer_parts
    if "fsdp2_reduce_scatter" not in parts:
        return f"  {row.label}: a bare --params has no layout: " + (
            "whole gradients not counted"
            if "fsdp2_whole_params" in parts
            else "whole parameters and gradients not counted"
        )
    held = (
        "the root's and two layers'"
        if strategy.reshard_after_forward
        else "every layer's and the root's, each from its forward to its backward"
    )
    grads = parts["fsdp2_root_whole_grads"] + parts["fsdp2_reduce_scatter"]
    return (
        f"  {row.label}: whole parameters {format_gib(parts['fsdp2_whole_params'])} ({held}, "
        f"in the compute dtype), whole gradients and reduce-scatter input {format_gib(grads)} "
        "(dpkit.engines.fsdp2.layout)"
    )
