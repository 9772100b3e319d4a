"""DeepSpeed ZeRO stages 1 and 2 through accelerate: optimizer state (and gradients) sharded.

Its engine (:class:`~dpkit.engines.deepspeed.engine.DeepSpeedEngine`) owns what differs
under DeepSpeed: the JSON, read, checked and resolved once (:mod:`.config`,
:mod:`.config_keys`, with the bucket sizes of :mod:`.settings`), the check after
``accelerator.prepare``, where its memory lives and how it is probed (:mod:`.memory`),
its gradient layout and plan arithmetic (:mod:`.layout`, :mod:`.plan`) and how its
partitioned state is gathered and restored (:mod:`.checkpoint`).
"""

from dpkit.engines.deepspeed.engine import DeepSpeedEngine

ENGINE = DeepSpeedEngine()
"""The one DeepSpeed engine (engines hold no state of a run)."""
