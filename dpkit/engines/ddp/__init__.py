"""torch DistributedDataParallel through accelerate: a full replica of every model state per rank.

Its engine (:class:`~dpkit.engines.ddp.engine.DDPEngine`) owns what differs under DDP:
the reducer's settings (:mod:`.settings`), the check after ``accelerator.prepare``, where
its memory lives (:mod:`.memory`), its plan arithmetic (:mod:`.plan`) and how its state is
read and restored (:mod:`.checkpoint`).
"""

from dpkit.engines.ddp.engine import DDPEngine

ENGINE = DDPEngine()
"""The one DDP engine (engines hold no state of a run)."""
