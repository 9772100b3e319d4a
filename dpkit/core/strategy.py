"""A strategy: one way of distributing training state over data-parallel ranks, as a value.

A :class:`Strategy` names its backend by key (``ddp``, ``deepspeed``, ``fsdp2``) and says
how that backend is set: what is sharded (the ZeRO stage), whether optimizer state lives
in host memory, whether parameters are resharded after the forward. Each engine declares
its own rows (``dpkit/engines/<backend>/engine.py``); the registry (:mod:`dpkit.engines`)
puts them in one table and answers which engine runs a strategy. Code elsewhere asks that
engine and never compares names.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Strategy:
    """One way of distributing training state over data-parallel ranks."""

    name: str
    """The flag value and file stem: ``ddp``, ``zero1``, ``zero2``, ``zero2_offload``,
    ``zero3``, ``zero3_offload``, ``fsdp2_shard_grad_op``, ``fsdp2_full_shard``,
    ``fsdp2_full_shard_offload``."""
    label: str
    """How tables and logs show it: ``DDP``, ``ZeRO-1``..."""
    backend: str
    """The key of the engine that runs it (:attr:`dpkit.engines.base.Engine.name`)."""
    zero_stage: int
    """What is sharded over the ranks, in ZeRO's terms: 0 nothing, 1 optimizer state and
    master weights, 2 also gradients, 3 also parameters."""
    offload: bool = False
    """Model state lives in host memory: the optimizer state and master weights (ZeRO-2
    offload), the parameter partitions too (ZeRO-3 offload, FSDP2's ``CPUOffloadPolicy``)."""
    reshard_after_forward: bool = False
    """Parameters are sharded again after each layer's forward (FSDP2 full-shard,
    ZeRO-3's semantics); otherwise they stay whole until the backward."""
    runnable: bool = True
    """dpkit's recipes run it; ``False``: ``dpkit plan`` shows it for reference."""
    benched: bool = True
    """``dpkit bench`` can run it beside a bare twin and ``dpkit tune`` can try it (a
    runnable strategy whose bare twin is not written yet: ``False``)."""
    memory_fallback: bool = False
    """Paid for in speed to save memory beyond what the lighter strategies save (ZeRO-3's
    per-layer gathers under DeepSpeed, host traffic and a CPU step under offload):
    ``dpkit tune`` tries it only where no lighter candidate fits the budget, and ``dpkit
    bench`` runs it only when ``--strategies`` names it."""
    summary: str = ""
    """What it holds per rank, in a few words."""

    @property
    def shards_optimizer(self) -> bool:
        """Optimizer state (and master weights) are split over the ranks (ZeRO-1 and up)."""
        return self.zero_stage >= 1

    @property
    def shards_gradients(self) -> bool:
        """Gradients are split over the ranks too (ZeRO-2, both FSDP2 modes and up)."""
        return self.zero_stage >= 2

    @property
    def shards_parameters(self) -> bool:
        """Parameters are split between steps too (ZeRO-3, FSDP2 full-shard)."""
        return self.zero_stage >= 3

    def __str__(self) -> str:
        return self.name
