"""Analytic per-rank model-state memory: the one source of truth for predictions.

The accounting follows the ZeRO paper (Rajbhandari et al., 2020, sections 3 and 5):
with Psi parameters and N data-parallel ranks, every rank of plain data
parallelism holds parameters, gradients, K bytes of optimizer state per
parameter and (in mixed precision) an fp32 master copy. ZeRO stage 1 shards
optimizer state and master weights over N, stage 2 also shards gradients,
stage 3 also shards parameters.

The byte counts are those of the implementations dpkit drives, so that a
prediction can be checked against a measurement:

* ``ddp`` is torch DDP through accelerate. Mixed precision there is autocast:
  parameters, gradients and optimizer state stay fp32 and there is no separate
  master copy (16 bytes/param for AdamW, the same total as the paper's 2+2+12).
* ``zero*`` is DeepSpeed. Its ZeRO optimizer always keeps an fp32 master
  partition, even when the module itself is fp32 (measured, STACK-NOTES); in
  bf16/fp16 the module's parameters and gradients are 2 bytes.

The memory report (``dpkit.memory``) and the planner (``dpkit plan``) both
call :func:`model_state_bytes`; neither computes these figures itself.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

STRATEGIES = ("ddp", "zero1", "zero2", "zero2_offload", "zero3")
PRECISIONS = ("fp32", "bf16", "fp16")

# Optimizer state bytes per parameter (fp32 state): the paper's K without the
# master copy, which is counted separately as ``master``.
OPTIMIZER_STATE_BYTES = {
    "adamw": 8,  # exp_avg + exp_avg_sq
    "adam": 8,
    "sgd_momentum": 4,  # momentum buffer
    "sgd": 0,
    "cpu_adam": 8,  # DeepSpeed's CPU Adam: same state, held in host memory
}

ZERO_STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "zero2_offload": 2, "zero3": 3}


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
        return {**asdict(self), "total": self.total}


def _validate(num_params: int, strategy: str, world_size: int, precision: str, optimizer: str):
    if num_params <= 0:
        raise ValueError(f"num_params must be positive, got {num_params}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(
            f"optimizer must be one of {', '.join(OPTIMIZER_STATE_BYTES)}, got {optimizer!r}"
        )


def model_state_bytes(
    num_params: int,
    strategy: str,
    world_size: int,
    precision: str = "fp32",
    optimizer: str = "adamw",
) -> ModelStateBytes:
    """Per-rank model-state bytes for ``strategy`` at ``world_size`` ranks.

    Args:
        num_params: trainable parameter count (shared tensors counted once).
        strategy: one of :data:`STRATEGIES`.
        world_size: data-parallel ranks N that shard the states.
        precision: ``fp32``, or ``bf16``/``fp16`` mixed precision.
        optimizer: a key of :data:`OPTIMIZER_STATE_BYTES`.
    """
    _validate(num_params, strategy, world_size, precision, optimizer)
    psi, n = float(num_params), float(world_size)
    k = OPTIMIZER_STATE_BYTES[optimizer]
    if strategy == "ddp":
        # Autocast mixed precision keeps fp32 weights; the optimizer updates them in place.
        return ModelStateBytes(params=4 * psi, grads=4 * psi, optimizer=k * psi, master=0.0)

    stage = ZERO_STAGE[strategy]
    module_bytes = 4 if precision == "fp32" else 2
    params = module_bytes * psi / (n if stage >= 3 else 1)
    grads = module_bytes * psi / (n if stage >= 2 else 1)
    optimizer_bytes = k * psi / n
    master = 4 * psi / n
    if strategy == "zero2_offload":
        return ModelStateBytes(
            params=params,
            grads=grads,
            optimizer=0.0,
            master=0.0,
            offloaded_to_cpu=optimizer_bytes + master,
        )
    return ModelStateBytes(params=params, grads=grads, optimizer=optimizer_bytes, master=master)


def full_replication_bytes(
    num_params: int, precision: str = "fp32", optimizer: str = "adamw"
) -> ModelStateBytes:
    """What every rank holds under plain data parallelism (the DDP figure)."""
    return model_state_bytes(num_params, "ddp", 1, precision, optimizer)


def savings_vs_replication(
    num_params: int,
    strategy: str,
    world_size: int,
    precision: str = "fp32",
    optimizer: str = "adamw",
) -> dict[str, float]:
    """Bytes saved per rank against full replication, and the ratio of totals."""
    full = full_replication_bytes(num_params, precision, optimizer).total
    this = model_state_bytes(num_params, strategy, world_size, precision, optimizer).total
    return {"saved_bytes": full - this, "ratio": this / full}
