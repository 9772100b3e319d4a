"""Analytic per-rank model-state memory: the one source of truth for predictions.

The accounting follows the ZeRO paper (Rajbhandari et al., 2020, sections 3 and 5):
with Psi parameters and N data-parallel ranks, every rank of plain data
parallelism holds parameters, gradients, K bytes of optimizer state per
parameter and (in mixed precision) an fp32 master copy. ZeRO stage 1 shards
optimizer state and master weights over N, stage 2 also shards gradients,
stage 3 also shards parameters.

What each backend holds is its engine's arithmetic (``dpkit/engines/*/plan.py``:
DDP replicates everything in fp32, DeepSpeed keeps an fp32 master partition beside a
16-bit module, FSDP2 shards every state on dim 0); this module holds the accounting's
common terms and the checked entry points, so that a prediction can be checked against
a measurement.

The memory report (:mod:`dpkit.memory.report`) and the planner (``dpkit plan``)
both call :func:`model_state_bytes`; neither computes these figures itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from dpkit.core.strategy import Strategy
from dpkit.core.units import (
    OPTIMIZER_STATE_BYTES,
    ModelStateBytes,
    canonical_precision,
)
from dpkit.engines import engine_of


def model_state_bytes(
    num_params: int,
    strategy: str | Strategy,
    world_size: int,
    precision: str = "fp32",
    optimizer: str = "adamw",
    param_shapes: Sequence[Sequence[int]] | None = None,
    frozen_params: int = 0,
    frozen_param_shapes: Sequence[Sequence[int]] | None = None,
) -> ModelStateBytes:
    """Per-rank model-state bytes for ``strategy`` at ``world_size`` ranks: its engine's
    arithmetic (:meth:`dpkit.engines.base.Engine.model_state_bytes`), on checked inputs.

    Frozen parameters (LoRA's pretrained weights) are parameters and nothing else: no
    gradient, no optimizer state, no master copy. Each engine stores them as it stores a
    trainable one (DDP and ZeRO-1/2 whole on every rank, in the module's dtype; FSDP2
    sharded, padded per parameter), so they add that engine's ``params`` figure for them.

    Args:
        num_params: trainable parameter count (shared tensors counted once).
        strategy: a :class:`~dpkit.core.strategy.Strategy` or its name (``ddp``, ``zero1``...).
        world_size: data-parallel ranks N that shard the states.
        precision: ``fp32`` (or accelerate's ``no``), or ``bf16``/``fp16`` mixed precision.
        optimizer: a key of :data:`OPTIMIZER_STATE_BYTES`.
        param_shapes: every parameter's shape (tied ones once), if known: FSDP2 then gets
            its worst rank's exact figure, dim 0 of each parameter padded to a multiple of
            N; the other strategies do not depend on shapes.
        frozen_params, frozen_param_shapes: the same for parameters that do not train.
    """
    from dpkit.engines import get_strategy

    if num_params <= 0:
        raise ValueError(f"num_params must be positive, got {num_params}")
    strategy = get_strategy(strategy)
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    precision = canonical_precision(precision)
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(
            f"optimizer must be one of {', '.join(OPTIMIZER_STATE_BYTES)}, got {optimizer!r}"
        )
    states = engine_of(strategy).plan.model_state_bytes(
        strategy, float(num_params), world_size, precision, optimizer, param_shapes
    )
    if frozen_params < 0:
        raise ValueError(f"frozen_params must be >= 0, got {frozen_params}")
    if frozen_params == 0:
        return states
    frozen = engine_of(strategy).plan.model_state_bytes(
        strategy, float(frozen_params), world_size, precision, optimizer, frozen_param_shapes
    )
    return dataclasses.replace(states, params=states.params + frozen.params)


def paper_grad_bytes(
    num_params: int, strategy: str | Strategy, world_size: int, precision: str = "fp32"
) -> float:
    """The ZeRO paper's per-rank gradient bytes: the module dtype's gradients, sharded
    from stage 2 (2 x Psi/N in mixed precision). :func:`model_state_bytes` adds what
    DeepSpeed holds besides them at its step. FSDP2's gradients are fp32 in either mode:
    4 x Psi/N, which :func:`model_state_bytes` pads per parameter."""
    from dpkit.engines import get_strategy

    strategy = get_strategy(strategy)
    return engine_of(strategy).plan.paper_grad_bytes(
        strategy, float(num_params), world_size, canonical_precision(precision)
    )


def full_replication_bytes(
    num_params: int, precision: str = "fp32", optimizer: str = "adamw", frozen_params: int = 0
) -> ModelStateBytes:
    """What every rank holds under plain data parallelism (the DDP figure)."""
    from dpkit.engines import REFERENCE

    return model_state_bytes(
        num_params, REFERENCE, 1, precision, optimizer, frozen_params=frozen_params
    )


def savings_vs_replication(
    num_params: int,
    strategy: str | Strategy,
    world_size: int,
    precision: str = "fp32",
    optimizer: str = "adamw",
) -> dict[str, float]:
    """Bytes saved per rank against full replication, and the ratio of totals."""
    full = full_replication_bytes(num_params, precision, optimizer).total
    this = model_state_bytes(num_params, strategy, world_size, precision, optimizer).total
    return {"saved_bytes": full - this, "ratio": this / full}
