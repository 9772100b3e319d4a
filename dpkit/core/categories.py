"""The names every part of the memory accounting shares (walk, probes, report, plan, bench)."""

MODEL_STATES = ("params", "grads", "optimizer", "master")
"""The model states of the ZeRO paper: what data parallelism replicates and ZeRO shards."""
CATEGORIES = (*MODEL_STATES, "buffers")
"""Model states and the communication buffers beside them, as the walk counts them."""
PARTITION_SHARE = "(partition share)"
"""The suffix the walk gives a ZeRO rank's own gradient partition among the holders."""
