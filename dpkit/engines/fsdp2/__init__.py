"""torch FSDP2 (``fully_shard``), applied by dpkit: every model state sharded on dim 0, two modes.

Its engine (:class:`~dpkit.engines.fsdp2.engine.FSDP2Engine`) owns what differs under
FSDP2: which modules become units and the sharding itself (:mod:`.shard`), the check
after ``accelerator.prepare``, where its memory lives and how it is probed
(:mod:`.memory`), its padded layout and plan arithmetic (:mod:`.layout`, :mod:`.plan`)
and how its DTensor state is gathered and restored (:mod:`.checkpoint`).
"""

from dpkit.engines.fsdp2.engine import FSDP2Engine

ENGINE = FSDP2Engine()
"""The one FSDP2 engine (engines hold no state of a run)."""
