"""Analytic per-rank model-state memory: the one source of truth for predictions.

The accounting follows the ZeRO paper (Rajbhandari et al., 2020, sections 3 and 5):
with Psi parameters and N data-parallel ranks, every rank of plain data
parallelism holds parameters, gradients, K bytes of optimizer state per
parameter and (in mixed precision) an fp32 master copy. ZeRO stage 1 shards
optimizer state and master weights over N, stage 2 also shards gradients,
stage 3 also shards parameters.

The byte counts are those of the engines dpkit drives (a :class:`~dpkit.strategy.Strategy`'s
``engine``), so that a prediction can be checked against a measurement:

* ``ddp`` is torch DDP through accelerate. Mixed precision there is autocast:
  parameters, gradients and optimizer state stay fp32 and there is no separate
  master copy (16 bytes/param for AdamW, the same total as the paper's 2+2+12).
* ``deepspeed`` (the ZeRO strategies): its ZeRO optimizer always keeps an fp32
  master partition, even when the module itself is fp32 (measured, STACK-NOTES);
  in bf16/fp16 the module's parameters and gradients are 2 bytes, and its step casts
  the rank's 16-bit gradient partition to an fp32 gradient for the master while the
  16-bit gradients are still held (``stage_1_and_2.py``, the step): gradients then
  peak at (2 + 4) x Psi/N, not the paper's 2 x Psi/N (:func:`paper_grad_bytes`).
* ``fsdp2`` (torch ``fully_shard``, both modes): parameters, gradients and optimizer
  state are all sharded over N and stay fp32 in bf16 runs too (the 16-bit copy the
  compute uses is transient: :mod:`dpkit.memory.fsdp2_layout`); no master copy. Per
  rank 4 + 4 + K bytes per parameter, over N: ZeRO-3's sharding even in
  shard-grad-op mode, which differs only in how long parameters stay whole. With the
  parameters' shapes known the figure is exact for the worst rank (each parameter's
  dim 0 padded to a multiple of N); from a bare count it is Psi/N.

The memory report (:mod:`dpkit.memory.report`) and the planner (``dpkit plan``)
both call :func:`model_state_bytes`; neither computes these figures itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from types import MappingProxyType

from dpkit.memory import fsdp2_layout
from dpkit.strategy import DDP, Strategy, get_strategy

PRECISIONS = ("fp32", "bf16", "fp16")
"""dpkit's precision names; accelerate's ``no`` (no mixed precision) is accepted as ``fp32``."""

# Optimizer state bytes per parameter (fp32 state): the paper's K without the
# master copy, which is counted separately as ``master``.
OPTIMIZER_STATE_BYTES: Mapping[str, int] = MappingProxyType(
    {
        "adamw": 8,  # exp_avg + exp_avg_sq
        "adam": 8,
        "sgd_momentum": 4,  # momentum buffer
        "sgd": 0,
        "cpu_adam": 8,  # DeepSpeed's CPU Adam: same state, held in host memory
    }
)


@dataclass(frozen=True)
class ModelStateBytes:
    """Per-rank bytes of model states on the accelerator, by category."""

    params: float
    grads: float
    optimizer: float
    master: float
    # Bytes moved to host memory by offload (optimizer state and master copy).
    offloaded_to_cpu: float = 0.0

    @property
    def total(self) -> float:
        """Model-state bytes on the device (offloaded bytes excluded)."""
        return self.params + self.grads + self.optimizer + self.master

    def as_dict(self) -> dict[str, float]:
        """Every category and the ``total``, for JSON."""
        return {**asdict(self), "total": self.total}


def canonical_precision(precision: str) -> str:
    """``precision`` as one of :data:`PRECISIONS`: accelerate calls fp32 training ``no``."""
    name = "fp32" if precision == "no" else precision
    if name not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return name


def dtype_bytes(precision: str) -> int:
    """Bytes per element of a tensor in ``precision``'s training dtype: 4 for fp32, 2 for
    bf16/fp16 (DeepSpeed's module, its reduce buckets, autocast's activations)."""
    return 4 if canonical_precision(precision) == "fp32" else 2


def model_state_bytes(
    num_params: int,
    strategy: str | Strategy,
    world_size: int,
    precision: str = "fp32",
    optimizer: str = "adamw",
    param_shapes: Sequence[Sequence[int]] | None = None,
) -> ModelStateBytes:
    """Per-rank model-state bytes for ``strategy`` at ``world_size`` ranks.

    Args:
        num_params: trainable parameter count (shared tensors counted once).
        strategy: a :class:`~dpkit.strategy.Strategy` or its name (``ddp``, ``zero1``...).
        world_size: data-parallel ranks N that shard the states.
        precision: ``fp32`` (or accelerate's ``no``), or ``bf16``/``fp16`` mixed precision.
        optimizer: a key of :data:`OPTIMIZER_STATE_BYTES`.
        param_shapes: every parameter's shape (tied ones once), if known: FSDP2 then gets
            its worst rank's exact figure, dim 0 of each parameter padded to a multiple of
            N; the other strategies do not depend on shapes.
    """
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
    psi, n = float(num_params), float(world_size)
    if strategy.uses_fsdp2:
        return _fsdp2_state_bytes(psi, world_size, optimizer, param_shapes)
    stage = strategy.zero_stage

    # ZeRO shards optimizer state and master weights from stage 1, gradients from
    # stage 2, parameters from stage 3; below its stage a state is replicated.
    def per_rank(total_bytes: float, sharded_from_stage: int) -> float:
        return total_bytes / (n if stage >= sharded_from_stage else 1)

    # DeepSpeed casts the module to the 16-bit dtype; torch DDP's mixed precision
    # is autocast, which keeps fp32 parameters and updates them in place.
    module_bytes = dtype_bytes(precision) if strategy.uses_deepspeed else 4
    params = per_rank(module_bytes * psi, 3)
    grads = per_rank(module_bytes * psi, 2)
    if strategy.zero_stage in (1, 2) and module_bytes != 4 and not strategy.offload:
        # The step's fp32 copy of the 16-bit partition, beside it (offload builds it in
        # host memory). Under ZeRO-1 the full 16-bit gradients of backward may be larger.
        grads = max(grads, (module_bytes + 4) * psi / n)
    optimizer_bytes = per_rank(OPTIMIZER_STATE_BYTES[optimizer] * psi, 1)
    master = per_rank(4 * psi, 1) if strategy.keeps_fp32_master else 0.0
    if strategy.offload:
        return ModelStateBytes(
            params=params,
            grads=grads,
            optimizer=0.0,
            master=0.0,
            offloaded_to_cpu=optimizer_bytes + master,
        )
    return ModelStateBytes(params=params, grads=grads, optimizer=optimizer_bytes, master=master)


def _fsdp2_state_bytes(
    psi: float, world_size: int, optimizer: str, shapes: Sequence[Sequence[int]] | None
) -> ModelStateBytes:
    """FSDP2's per-rank fp32 parameters, gradients and optimizer state: each parameter's
    ceil(d0/N) rows on rank 0 (:mod:`dpkit.memory.fsdp2_layout`), or Psi/N from a count."""
    if shapes:
        if fsdp2_layout.numel(shapes) != psi:
            raise ValueError(
                f"param_shapes hold {fsdp2_layout.numel(shapes)} elements, num_params is {psi:.0f}"
            )
        per_rank = float(fsdp2_layout.shard_numel(shapes, world_size))
    else:
        per_rank = psi / world_size
    return ModelStateBytes(
        params=4 * per_rank,
        grads=4 * per_rank,
        optimizer=OPTIMIZER_STATE_BYTES[optimizer] * per_rank,
        master=0.0,
    )


def paper_grad_bytes(
    num_params: int, strategy: str | Strategy, world_size: int, precision: str = "fp32"
) -> float:
    """The ZeRO paper's per-rank gradient bytes: the module dtype's gradients, sharded
    from stage 2 (2 x Psi/N in mixed precision). :func:`model_state_bytes` adds what
    DeepSpeed holds besides them at its step. FSDP2's gradients are fp32 in either mode:
    4 x Psi/N, which :func:`model_state_bytes` pads per parameter."""
    strategy = get_strategy(strategy)
    module_bytes = dtype_bytes(precision) if strategy.uses_deepspeed else 4
    shards = world_size if strategy.zero_stage >= 2 else 1
    return module_bytes * float(num_params) / shards


def full_replication_bytes(
    num_params: int, precision: str = "fp32", optimizer: str = "adamw"
) -> ModelStateBytes:
    """What every rank holds under plain data parallelism (the DDP figure)."""
    return model_state_bytes(num_params, DDP, 1, precision, optimizer)


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
