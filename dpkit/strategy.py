"""The data-parallel strategies dpkit knows: one :class:`Strategy` value each, the only table of them.

Every module that needs to tell strategies apart (run setup, the memory
accounting, ``dpkit plan``, ``dpkit bench``) asks a ``Strategy`` what it does
(``zero_stage``, ``engine``, ``offload``) instead of comparing names. A new
strategy is one more value here (FSDP2's two modes were).

This module imports nothing heavy: ``dpkit plan`` reads it without torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True)
class Strategy:
    """One way of distributing training state over data-parallel ranks."""

    name: str
    """The flag value and file stem: ``ddp``, ``zero1``, ``zero2``, ``fsdp2_shard_grad_op``,
    ``fsdp2_full_shard`` (and, for ``dpkit plan`` only, ``zero2_offload``, ``zero3``)."""
    label: str
    """How tables and logs show it: ``DDP``, ``ZeRO-1``..."""
    engine: str
    """What runs it: ``ddp`` (torch DistributedDataParallel), ``deepspeed``, or ``fsdp2``
    (torch's ``fully_shard``, applied by dpkit on every device)."""
    zero_stage: int
    """What is sharded over the ranks, in ZeRO's terms: 0 nothing, 1 optimizer state and
    master weights, 2 also gradients, 3 also parameters."""
    offload: bool = False
    """Optimizer state and master weights live in host memory (DeepSpeed offload)."""
    runnable: bool = True
    """dpkit's recipes run it; ``False``: ``dpkit plan`` shows it for reference."""
    summary: str = ""
    """What it holds per rank, in a few words."""

    @property
    def uses_deepspeed(self) -> bool:
        return self.engine == "deepspeed"

    @property
    def uses_fsdp2(self) -> bool:
        return self.engine == "fsdp2"

    @property
    def reshard_after_forward(self) -> bool:
        """FSDP2: parameters are sharded again after each layer's forward (ZeRO-3's
        semantics); otherwise they stay whole until the backward (ZeRO-2's)."""
        return self.uses_fsdp2 and self.zero_stage == 3

    @property
    def keeps_fp32_master(self) -> bool:
        """Whether an fp32 master copy is kept beside the module's parameters: DeepSpeed's
        ZeRO optimizer keeps its fp32 partition even when the module is fp32 (measured);
        torch DDP and FSDP2 update the module's own fp32 parameters (FSDP2's mixed
        precision casts a copy for the compute)."""
        return self.engine == "deepspeed"

    def offloaded(self) -> Strategy:
        """The variant that keeps optimizer state and master weights in host memory
        (ZeRO-2 -> ZeRO-2 offload); the strategy itself where there is none."""
        for other in STRATEGIES.values():
            if other.offload and (other.engine, other.zero_stage) == (self.engine, self.zero_stage):
                return other
        return self

    def __str__(self) -> str:
        return self.name


DDP = Strategy("ddp", "DDP", "ddp", 0, summary="a full replica per rank")
ZERO1 = Strategy("zero1", "ZeRO-1", "deepspeed", 1, summary="optimizer state sharded")
ZERO2 = Strategy("zero2", "ZeRO-2", "deepspeed", 2, summary="optimizer state and gradients sharded")
ZERO2_OFFLOAD = Strategy(
    "zero2_offload",
    "ZeRO-2 offload",
    "deepspeed",
    2,
    offload=True,
    runnable=False,
    summary="ZeRO-2 with optimizer state and master weights in host memory",
)
ZERO3 = Strategy(
    "zero3",
    "ZeRO-3 (ref)",
    "deepspeed",
    3,
    runnable=False,
    summary="parameters sharded too",
)

FSDP2_SHARD_GRAD_OP = Strategy(
    "fsdp2_shard_grad_op",
    "FSDP2 shard-grad-op",
    "fsdp2",
    2,
    summary="torch FSDP2: gradients and optimizer state sharded, parameters whole in the step",
)
FSDP2_FULL_SHARD = Strategy(
    "fsdp2_full_shard",
    "FSDP2 full-shard",
    "fsdp2",
    3,
    summary="torch FSDP2: parameters, gradients and optimizer state sharded",
)

STRATEGIES: Mapping[str, Strategy] = MappingProxyType(
    {
        s.name: s
        for s in (DDP, ZERO1, ZERO2, ZERO2_OFFLOAD, ZERO3, FSDP2_SHARD_GRAD_OP, FSDP2_FULL_SHARD)
    }
)
"""Every strategy by name: DDP and DeepSpeed least sharding first, then FSDP2."""
RUNNABLE: tuple[Strategy, ...] = tuple(s for s in STRATEGIES.values() if s.runnable)
"""The strategies the recipes run."""
DDP_AND_ZERO: tuple[Strategy, ...] = (DDP, ZERO1, ZERO2)
"""The strategies the Transformers ``Trainer`` baseline of ``dpkit bench --workload
classification`` runs (the Trainer's FSDP path needs accelerator devices)."""


def get_strategy(name: str | Strategy) -> Strategy:
    """The strategy called ``name`` (a ``Strategy`` is returned as is)."""
    if isinstance(name, Strategy):
        return name
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; one of {', '.join(STRATEGIES)}") from None


def deepspeed_strategy(zero_stage: int) -> Strategy:
    """The runnable DeepSpeed strategy of a ZeRO stage (1 or 2)."""
    return _runnable(stage=zero_stage, engine="deepspeed")


def fsdp2_strategy(reshard_after_forward: bool) -> Strategy:
    """The FSDP2 strategy with or without resharding after the forward."""
    return FSDP2_FULL_SHARD if reshard_after_forward else FSDP2_SHARD_GRAD_OP


def _runnable(*, stage: int, engine: str) -> Strategy:
    for strategy in RUNNABLE:
        if strategy.engine == engine and strategy.zero_stage == stage:
            return strategy
    raise ValueError(f"no runnable {engine} strategy for ZeRO stage {stage}")
