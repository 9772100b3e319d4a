"""The backends dpkit drives, one engine each: DDP, DeepSpeed ZeRO, FSDP2.

Everything that differs between backends is an :class:`~dpkit.engines.base.Engine`'s
to answer (settings, wrapping, the check after prepare, where memory lives, plan
arithmetic, checkpoints); :mod:`dpkit.strategy` maps each strategy name to its engine
and settings. ``docs/architecture.md`` shows how to add one.
"""

from dpkit.engines.base import Engine, EngineSettings, Prepared
from dpkit.engines.ddp import ENGINE as DDP_ENGINE
from dpkit.engines.deepspeed import ENGINE as DEEPSPEED_ENGINE
from dpkit.engines.fsdp2 import ENGINE as FSDP2_ENGINE

ENGINES: tuple[Engine, ...] = (FSDP2_ENGINE, DEEPSPEED_ENGINE, DDP_ENGINE)
"""Every engine, in the order they read a launch and recognise live objects: the one
with the most specific signs first (an FSDP launch or sharded parameters, a DeepSpeed
config or ZeRO optimizer), DDP (a plain launch, plain objects) last."""

__all__ = ["ENGINES", "Engine", "EngineSettings", "Prepared"]
