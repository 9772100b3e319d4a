"""What every backend answers: the one interface between dpkit and DDP, DeepSpeed ZeRO or FSDP2.

An :class:`Engine` owns everything that differs by backend, so that no code outside
``dpkit/engines/`` asks which backend runs (the shape of Lightning Fabric's
``Strategy`` classes and torchtitan's ``parallelize``). Its questions are split by role,
one module each under :mod:`dpkit.engines.roles`:

* **settings** (:class:`~dpkit.engines.roles.settings.Settings`): the launch it reads,
  the flags it refuses and the configuration it builds before any process group, and
  what the Accelerator needs to run it;
* **wrapping** (:class:`~dpkit.engines.roles.wrapping.Wrapping`): what it does to the
  model before the optimizer exists and the check after ``accelerator.prepare``;
* **bench and tune knobs** (:class:`~dpkit.engines.roles.knobs.BenchKnobs`);
* **measured memory**, ``engine.memory`` (:class:`~dpkit.engines.roles.measured.MeasuredMemory`):
  where its training state lives, counted tensor by tensor, and the points of a step
  where it is probed;
* **plan arithmetic**, ``engine.plan`` (:class:`~dpkit.engines.roles.planned.PlanArithmetic`):
  the bytes it holds per rank, predicted, without torch;
* **checkpoint I/O**, ``engine.checkpoints`` (:class:`~dpkit.engines.roles.checkpoint_io.CheckpointIO`):
  full weights and Adam moments by parameter name, this rank's own shards, re-sharded
  on load.

The engine itself is the first three; the last three are objects it hands out, so that a
backend's memory walk and checkpoint code (which import torch) load only when used and
``dpkit plan`` reads the engines without torch.

A :class:`~dpkit.core.strategy.Strategy` is a row of the strategy table: a name, the
key of its engine and the engine's settings (ZeRO stage, offload, resharding); each
engine declares its own rows (:attr:`Engine.strategies`). Adding a backend is one engine
package under ``dpkit/engines/`` and one line in the registry (``docs/architecture.md``).
"""

from __future__ import annotations

from typing import ClassVar

from dpkit.core.strategy import Strategy
from dpkit.engines.roles.checkpoint_io import CheckpointIO
from dpkit.engines.roles.knobs import BenchKnobs
from dpkit.engines.roles.measured import MeasuredMemory
from dpkit.engines.roles.planned import PlanArithmetic
from dpkit.engines.roles.settings import EngineSettings, Settings
from dpkit.engines.roles.wrapping import Prepared, Wrapping

__all__ = ["Engine", "EngineSettings", "Prepared"]


class Engine(Settings, Wrapping, BenchKnobs):
    """One backend. Subclasses answer every question; the defaults are those of a
    backend that shards nothing and has no settings of its own."""

    name: ClassVar[str] = ""
    """``ddp``, ``deepspeed`` or ``fsdp2``: as ``run_info.json`` and the plan's JSON show it."""
    label: ClassVar[str] = ""
    """How the docs and logs name the backend: ``torch DDP``, ``DeepSpeed ZeRO``..."""
    strategies: ClassVar[tuple[Strategy, ...]] = ()
    """This backend's rows of the strategy table (:data:`dpkit.engines.STRATEGIES`), least
    sharding first."""

    def runnable(
        self, *, zero_stage: int | None = None, reshard_after_forward: bool | None = None
    ) -> Strategy:
        """This backend's runnable strategy with the given settings (a DeepSpeed JSON's
        stage, an FSDP launch's resharding); :class:`ValueError` where it has none."""
        for strategy in self.strategies:
            if (
                strategy.runnable
                and zero_stage in (None, strategy.zero_stage)
                and reshard_after_forward in (None, strategy.reshard_after_forward)
            ):
                return strategy
        raise ValueError(
            f"no runnable {self.name} strategy with zero_stage={zero_stage}, "
            f"reshard_after_forward={reshard_after_forward}"
        )

    @property
    def memory(self) -> MeasuredMemory:
        """Where this backend's training state lives, measured."""
        raise NotImplementedError

    @property
    def plan(self) -> PlanArithmetic:
        """The bytes this backend holds per rank, predicted."""
        raise NotImplementedError

    @property
    def checkpoints(self) -> CheckpointIO:
        """This backend's checkpoint I/O."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"
