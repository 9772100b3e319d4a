"""The registry: the backends dpkit drives (DDP, DeepSpeed ZeRO, FSDP2) and the strategy table.

This is the one module that imports the concrete engines. Each engine declares its own
strategy rows (:attr:`~dpkit.engines.base.Engine.strategies`); the table here is their
union, and :func:`engine_of` answers which engine runs a strategy. Everything that
differs between backends is an :class:`~dpkit.engines.base.Engine`'s to answer
(settings, wrapping, the check after prepare, where memory lives, plan arithmetic,
checkpoints); the subsystems above ask it through this module and never which backend
it is. ``docs/architecture.md`` shows how to add one.

This module imports nothing heavy: ``dpkit plan`` reads it without torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from dpkit.core.strategy import Strategy
from dpkit.engines.base import Engine, EngineSettings, Prepared
from dpkit.engines.ddp import ENGINE as DDP_ENGINE
from dpkit.engines.deepspeed import ENGINE as DEEPSPEED_ENGINE
from dpkit.engines.fsdp2 import ENGINE as FSDP2_ENGINE

ENGINES: tuple[Engine, ...] = (FSDP2_ENGINE, DEEPSPEED_ENGINE, DDP_ENGINE)
"""Every engine, in the order they read a launch and recognise live objects: the one
with the most specific signs first (an FSDP launch or sharded parameters, a DeepSpeed
config or ZeRO optimizer), DDP (a plain launch, plain objects) last."""

_BY_BACKEND: Mapping[str, Engine] = MappingProxyType({engine.name: engine for engine in ENGINES})

STRATEGIES: Mapping[str, Strategy] = MappingProxyType(
    {
        s.name: s
        for engine in (DDP_ENGINE, DEEPSPEED_ENGINE, FSDP2_ENGINE)
        for s in engine.strategies
    }
)
"""Every strategy by name, in the order the plan recommends from: DDP, then DeepSpeed
least sharding first, then FSDP2."""
RUNNABLE: tuple[Strategy, ...] = tuple(s for s in STRATEGIES.values() if s.runnable)
"""The strategies the recipes run."""
BENCHABLE: tuple[Strategy, ...] = tuple(s for s in RUNNABLE if s.benched)
"""The strategies ``dpkit bench`` can run beside a bare twin and ``dpkit tune`` can try
when named (every runnable one, ZeRO-3 and the offloads included)."""
BENCHED_BY_DEFAULT: tuple[Strategy, ...] = tuple(s for s in BENCHABLE if not s.memory_fallback)
"""What ``dpkit bench`` runs without ``--strategies`` and ``dpkit tune`` tries first: DDP,
ZeRO-1, ZeRO-2, FSDP2's two modes. The rest (:data:`MEMORY_FALLBACKS`) pay in speed for
memory, so they run when named or, in a tune, when nothing lighter fits."""
MEMORY_FALLBACKS: tuple[Strategy, ...] = tuple(s for s in BENCHABLE if s.memory_fallback)
"""ZeRO-3 and the offloads (:attr:`Strategy.memory_fallback`): benched only when named,
tuned only where no candidate of :data:`BENCHED_BY_DEFAULT` fits the budget."""
REFERENCE: Strategy = DDP_ENGINE.strategies[0]
"""Full replication: what every saving is measured against and every loss compared with."""
TRAINER_STRATEGIES: tuple[Strategy, ...] = (
    REFERENCE,
    *(s for s in DEEPSPEED_ENGINE.strategies if s in BENCHED_BY_DEFAULT),
)
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


def engine_of(strategy: str | Strategy) -> Engine:
    """The engine that runs ``strategy`` (a :class:`Strategy` or its name)."""
    return _BY_BACKEND[get_strategy(strategy).backend]


def offloaded(strategy: Strategy) -> Strategy:
    """The variant of ``strategy`` that keeps optimizer state and master weights in host
    memory (ZeRO-2 -> ZeRO-2 offload); the strategy itself where there is none."""
    for other in STRATEGIES.values():
        if other.offload and (other.backend, other.zero_stage) == (
            strategy.backend,
            strategy.zero_stage,
        ):
            return other
    return strategy


__all__ = [
    "BENCHABLE",
    "BENCHED_BY_DEFAULT",
    "ENGINES",
    "MEMORY_FALLBACKS",
    "REFERENCE",
    "RUNNABLE",
    "STRATEGIES",
    "TRAINER_STRATEGIES",
    "Engine",
    "EngineSettings",
    "Prepared",
    "Strategy",
    "engine_of",
    "get_strategy",
    "offloaded",
]
