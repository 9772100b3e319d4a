"""Units and byte types every layer shares: precisions, optimizer-state bytes per
parameter, the per-rank model-state figure, and how bytes are shown.

The ground floor (:mod:`dpkit.core`): no torch, nothing of dpkit's above it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from types import MappingProxyType

GIB = 2**30
"""Bytes in a GiB."""

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


@dataclass(frozen=True)
class GradientHighWater:
    """One rank's gradient bytes at the moments its backend holds the most (DeepSpeed's
    ZeRO layout: :mod:`dpkit.engines.deepspeed.layout`)."""

    rank: int
    backward: float
    """Largest holding during backward (activations are still alive then)."""
    step: float
    """Largest holding during the optimizer step (activations are freed)."""
    moment: str
    """Where the larger of the two happens."""
    partition_bytes: float
    """The paper's share: this rank's partitions in the module dtype."""

    @property
    def bytes(self) -> float:
        return max(self.backward, self.step)


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


def format_gib(value: float) -> str:
    """Bytes as GiB with one decimal: ``5.3 GiB``."""
    return f"{value / GIB:.1f} GiB"
