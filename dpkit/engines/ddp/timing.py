"""DDP's own timing of a step, read from its logger, for ``train_summary.json``."""

from __future__ import annotations

from typing import Any


def ddp_timing(model: Any) -> dict[str, float] | None:
    """DDP's own averages, in seconds per iteration (its logger samples its first 10
    iterations and every 100th), or None when ``model`` is not DDP-wrapped:
    ``forward_compute_s``, ``backward_compute_s``, ``backward_comm_s`` (the allreduce,
    start of the first to end of the last) and ``backward_comm_exposed_s`` (the part of
    it not overlapped with backward compute: what the backward waits on)."""
    logging_data = getattr(model, "_get_ddp_logging_data", None)
    if logging_data is None:
        return None
    data = logging_data()
    if not data.get("avg_backward_comm_time"):
        return None  # no iteration recorded yet (DDP records one when the next forward starts)
    # DDP's logger sets the four averages together, in integer nanoseconds (c10d's logger).
    seconds = {
        "forward_compute_s": data["avg_forward_compute_time"] / 1e9,
        "backward_compute_s": data["avg_backward_compute_time"] / 1e9,
        "backward_comm_s": data["avg_backward_comm_time"] / 1e9,
    }
    overlap = data["avg_backward_compute_comm_overlap_time"] / 1e9
    seconds["backward_comm_exposed_s"] = max(seconds["backward_comm_s"] - overlap, 0.0)
    return seconds
