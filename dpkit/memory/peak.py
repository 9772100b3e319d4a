"""Peak memory of one rank: the CUDA allocator's on a GPU, the process's RSS high-water on a CPU.

On a CPU, tensors are not tracked by an allocator, so the only honest
process-level peak is the RSS high-water (``VmHWM``), which Linux can reset
(``/proc/self/clear_refs``); glibc's ``mallinfo2`` says how much of the heap is
in use right now.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import resource
import sys
from typing import Any

import torch

logger = logging.getLogger(__name__)


def _rss_high_water() -> tuple[float | None, str]:
    """The process's RSS high-water in bytes and where it came from."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return float(line.split()[1]) * 1024.0, "/proc/self/status VmHWM"
    except OSError:
        pass
    maxrss = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    # ru_maxrss is KiB on Linux, bytes on macOS.
    return (maxrss if sys.platform == "darwin" else maxrss * 1024.0), "getrusage ru_maxrss"


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _heap_in_use() -> float | None:
    """Bytes malloc has handed out now (glibc mallinfo2: arenas + mmapped), or None elsewhere."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return float(info.uordblks + info.hblkhd)


def peak_figures(
    device: torch.device | str | None = None, rss_reset: bool = False
) -> dict[str, Any]:
    """Peak memory of this rank: the CUDA allocator's on a GPU, the process's on a CPU.

    ``rss_reset``: whether :func:`reset_peak` reset the RSS high-water (else it runs
    from process start). ``headline`` names the figure a table should show as "the peak".
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    figures: dict[str, Any] = {}
    rss_peak, rss_source = _rss_high_water()
    figures["rss_high_water"] = rss_peak
    figures["rss_high_water_source"] = rss_source
    figures["rss_high_water_since"] = "reset_peak" if rss_reset else "process start"
    try:
        import psutil

        figures["rss_current"] = float(psutil.Process().memory_info().rss)
    except ImportError:
        figures["rss_current"] = None
    figures["heap_in_use"] = _heap_in_use()
    figures["headline"] = "rss_high_water"
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        stats = torch.cuda.memory_stats(index)
        capacity = float(torch.cuda.get_device_properties(index).total_memory)
        max_allocated = float(torch.cuda.max_memory_allocated(index))
        max_reserved = float(torch.cuda.max_memory_reserved(index))
        figures.update(
            max_allocated=max_allocated,
            max_reserved=max_reserved,
            allocated=float(torch.cuda.memory_allocated(index)),
            reserved=float(torch.cuda.memory_reserved(index)),
            device_capacity=capacity,
            max_allocated_pct=100.0 * max_allocated / capacity,
            max_reserved_pct=100.0 * max_reserved / capacity,
            num_alloc_retries=int(stats.get("num_alloc_retries", 0)),
            num_ooms=int(stats.get("num_ooms", 0)),
            headline="max_allocated",
        )
    return figures


def current_summary(device: torch.device | str | None = None) -> str:
    """This rank's memory in a few words, for the per-step log line (no collective)."""
    peak = peak_figures(device)
    if "max_allocated" in peak:
        return (
            f"mem {peak['allocated'] / 2**30:.2f} GiB, peak {peak['max_allocated'] / 2**30:.2f} GiB "
            f"({peak['max_allocated_pct']:.0f}% of device)"
        )
    current = peak.get("rss_current")
    now = f"rss {current / 2**30:.2f} GiB, " if current else ""
    return f"{now}rss high-water {peak['rss_high_water'] / 2**30:.2f} GiB"


def reset_peak(device: torch.device | str | None = None) -> bool:
    """Start a new peak window.

    CUDA: ``torch.cuda.reset_peak_memory_stats``. CPU: the process RSS high-water
    is reset through ``/proc/self/clear_refs`` (Linux); where that is refused the
    report says the high-water runs from process start. The step probes' category
    high-waters are reset by :meth:`StepProbes.reset`, not here, so that a report
    at step k still sees the gradients of the last step. Returns whether the RSS
    high-water was reset.
    """
    if device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(torch.device(device))
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # 5: reset the peak RSS (VmHWM) of this process
    except OSError:
        logger.debug("RSS high-water cannot be reset here; it runs from process start")
        return False
    return True
