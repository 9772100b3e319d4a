"""The strategy table: each strategy dpkit knows, as a name, the engine that runs it and that engine's settings.

A :class:`Strategy` is one row. What differs between backends (settings, wrapping,
where memory lives, plan arithmetic, checkpoints) is its ``engine``'s to answer
(:mod:`dpkit.engines`); the row only says how the engine is set: what is sharded (the
ZeRO stage), whether optimizer state lives in host memory, whether FSDP2 reshards
after the forward. Code elsewhere asks ``strategy.engine`` and never compares names.
Adding a strategy of an existing backend is one row here (FSDP2's two modes were);
adding a backend is one engine package and one row (``docs/architecture.md``).

This module imports nothing heavy: ``dpkit plan`` reads it without torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from dpkit.engines.base import Engine
from dpkit.engines.ddp import ENGINE as DDP_ENGINE
from dpkit.engines.deepspeed import ENGINE as DEEPSPEED_ENGINE
from dpkit.engines.fsdp2 import ENGINE as FSDP2_ENGINE


@dataclass(frozen=True)
class Strategy:
    """One way of distributing training state over data-parallel ranks."""

    name: str
    """The flag value and file stem: ``ddp``, ``zero1``, ``zero2``, ``fsdp2_shard_grad_op``,
    ``fsdp2_full_shard`` (and, for ``dpkit plan`` only, ``zero2_offload``, ``zero3``)."""
    label: str
    """How tables and logs show it: ``DDP``, ``ZeRO-1``..."""
    engine: Engine
    """The backend that runs it (:mod:`dpkit.engines`)."""
    zero_stage: int
    """What is sharded over the ranks, in ZeRO's terms: 0 nothing, 1 optimizer state and
    master weights, 2 also gradients, 3 also parameters."""
    offload: bool = False
    """Optimizer state and master weights live in host memory (DeepSpeed offload)."""
    reshard_after_forward: bool = False
    """Parameters are sharded again after each layer's forward (FSDP2 full-shard,
    ZeRO-3's semantics); otherwise they stay whole until the backward."""
    runnable: bool = True
    """dpkit's recipes run it; ``False``: ``dpkit plan`` shows it for reference."""
    summary: str = ""
    """What it holds per rank, in a few words."""

    def offloaded(self) -> Strategy:
        """The variant that keeps optimizer state and master weights in host memory
        (ZeRO-2 -> ZeRO-2 offload); the strategy itself where there is none."""
        for other in STRATEGIES.values():
            if other.offload and (other.engine, other.zero_stage) == (self.engine, self.zero_stage):
                return other
        return self

    def __str__(self) -> str:
        return self.name


DDP = Strategy("ddp", "DDP", DDP_ENGINE, 0, summary="a full replica per rank")
ZERO1 = Strategy("zero1", "ZeRO-1", DEEPSPEED_ENGINE, 1, summary="optimizer state sharded")
ZERO2 = Strategy(
    "zero2", "ZeRO-2", DEEPSPEED_ENGINE, 2, summary="optimizer state and gradients sharded"
)
ZERO2_OFFLOAD = Strategy(
    "zero2_offload",
    "ZeRO-2 offload",
    DEEPSPEED_ENGINE,
    2,
    offload=True,
    runnable=False,
    summary="ZeRO-2 with optimizer state and master weights in host memory",
)
ZERO3 = Strategy(
    "zero3", "ZeRO-3 (ref)", DEEPSPEED_ENGINE, 3, runnable=False, summary="parameters sharded too"
)
FSDP2_SHARD_GRAD_OP = Strategy(
    "fsdp2_shard_grad_op",
    "FSDP2 shard-grad-op",
    FSDP2_ENGINE,
    2,
    summary="torch FSDP2: gradients and optimizer state sharded, parameters whole in the step",
)
FSDP2_FULL_SHARD = Strategy(
    "fsdp2_full_shard",
    "FSDP2 full-shard",
    FSDP2_ENGINE,
    3,
    reshard_after_forward=True,
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
REFERENCE: Strategy = DDP
"""Full replication: what every saving is measured against and every loss compared with."""
TRAINER_STRATEGIES: tuple[Strategy, ...] = (DDP, ZERO1, ZERO2)
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


def runnable_strategy(
    engine: Engine, *, zero_stage: int | None = None, reshard_after_forward: bool | None = None
) -> Strategy:
    """The runnable strategy of ``engine`` with the given settings (a DeepSpeed JSON's
    stage, an FSDP launch's resharding); :class:`ValueError` where the table has none."""
    for strategy in RUNNABLE:
        if (
            strategy.engine is engine
            and zero_stage in (None, strategy.zero_stage)
            and reshard_after_forward in (None, strategy.reshard_after_forward)
        ):
            return strategy
    raise ValueError(
        f"no runnable {engine.name} strategy with zero_stage={zero_stage}, "
        f"reshard_after_forward={reshard_after_forward}"
    )
