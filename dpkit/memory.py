"""Where the memory of a data-parallel run went, measured per rank and checked against ZeRO's accounting.

Use from a recipe (every rank runs every call; the report exists on the main process)::

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    memory.track(model, optimizer)           # probes where each strategy holds its gradients
    ...train...
    report = memory.collect_report(accelerator, model, optimizer, strategy="zero2", precision="fp32")
    if report is not None:
        print(report.format_table()); report.save(out / "memory_report.json")
        accelerator.log(report.tracker_scalars(), step=step)

What is measured (:mod:`dpkit.memory_walk`): parameters, gradients, optimizer
state, fp32 master copies and buffers (DDP's reducer buckets, DeepSpeed's ipg
bucket...), each storage counted once, with the name of what holds it; the
bytes autograd saved for backward (activations); and the peak, which on CUDA
is the caching allocator's and on CPU the process's RSS high-water (the only
honest process-level peak there: tensors are not tracked by an allocator).
What is predicted: :func:`dpkit.analytic.model_state_bytes`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import resource
import sys
from typing import Any

import torch

from dpkit.memory_probes import StepProbes
from dpkit.memory_report import MemoryReport
from dpkit.memory_settings import ddp_kwargs, zero_memory_settings
from dpkit.memory_walk import (
    MODEL_STATES,
    memory_settings_in_effect,
    unwrap_module,
    unwrap_optimizer,
    walk,
)
from dpkit.models import count_parameters

__all__ = [
    "MemoryReport",
    "collect_report",
    "count_params",
    "current_summary",
    "ddp_kwargs",
    "measure_rank",
    "peak_figures",
    "reset_peak",
    "track",
    "untrack",
    "zero_memory_settings",
]

logger = logging.getLogger(__name__)

_PROBES_ATTR = "_dpkit_memory_probes"
# Whether reset_peak managed to reset the process RSS high-water (Linux clear_refs).
_rss_reset_state = {"reset": False}


def track(model: torch.nn.Module, optimizer: Any, *, count_activations: bool = True) -> StepProbes:
    """Install the step probes on a prepared model and optimizer (idempotent).

    Call it once after ``accelerator.prepare``: without it a report taken after
    training sees no gradients under DeepSpeed (freed by its step) nor under DDP
    once ``zero_grad`` has released them.
    """
    probes = getattr(optimizer, _PROBES_ATTR, None)
    if probes is None:
        probes = StepProbes(model, optimizer, count_activations=count_activations)
        setattr(optimizer, _PROBES_ATTR, probes)
    return probes


def untrack(optimizer: Any) -> None:
    """Remove the probes :func:`track` installed."""
    probes = getattr(optimizer, _PROBES_ATTR, None)
    if probes is not None:
        probes.remove()
        delattr(optimizer, _PROBES_ATTR)


def count_params(model: torch.nn.Module) -> int:
    """Trainable parameters of the unwrapped module, each once (tied weights are one parameter)."""
    return count_parameters(unwrap_module(model), trainable_only=True)


def largest_param(model: torch.nn.Module) -> dict[str, Any] | None:
    """Name and size of the model's largest parameter."""
    named = list(unwrap_module(model).named_parameters())
    if not named:
        return None
    name, param = max(named, key=lambda item: item[1].numel())
    return {
        "name": name,
        "numel": int(param.numel()),
        "bytes": param.numel() * param.element_size(),
    }


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


def peak_figures(device: torch.device | str | None = None) -> dict[str, Any]:
    """Peak memory of this rank: the CUDA allocator's on a GPU, the process's on a CPU.

    ``headline`` names the figure a table should show as "the peak".
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    figures: dict[str, Any] = {}
    rss_peak, rss_source = _rss_high_water()
    figures["rss_high_water"] = rss_peak
    figures["rss_high_water_source"] = rss_source
    figures["rss_high_water_since"] = "reset_peak" if _rss_reset_state["reset"] else "process start"
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


def current_summary(accelerator: Any = None) -> str:
    """This rank's memory in a few words, for the per-step log line (no collective)."""
    device = getattr(accelerator, "device", None)
    peak = peak_figures(device)
    if "max_allocated" in peak:
        return (
            f"mem {peak['allocated'] / 2**30:.2f} GiB, peak {peak['max_allocated'] / 2**30:.2f} GiB "
            f"({peak['max_allocated_pct']:.0f}% of device)"
        )
    current = peak.get("rss_current")
    now = f"rss {current / 2**30:.2f} GiB, " if current else ""
    return f"{now}rss high-water {peak['rss_high_water'] / 2**30:.2f} GiB"


def reset_peak(accelerator: Any = None) -> None:
    """Start a new peak window.

    CUDA: ``torch.cuda.reset_peak_memory_stats``. CPU: the process RSS high-water
    is reset through ``/proc/self/clear_refs`` (Linux); where that is refused the
    report says the high-water runs from process start. The step probes' category
    high-waters are reset by :meth:`StepProbes.reset`, not here, so that a report
    at step k still sees the gradients of the last step.
    """
    device = getattr(accelerator, "device", None)
    if device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(torch.device(device))
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # 5: reset the peak RSS (VmHWM) of this process
        _rss_reset_state["reset"] = True
    except OSError:
        logger.debug("RSS high-water cannot be reset here; it runs from process start")


def measure_rank(accelerator: Any, model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """Bytes held on this rank by category, with the holder of each byte and the peak.

    Categories are high-waters over the steps the probes saw (see :func:`track`),
    or the tensors held right now when no probes are installed.
    """
    now = walk(model, optimizer)
    probes = getattr(optimizer, _PROBES_ATTR, None)
    row: dict[str, Any] = {"rank": int(getattr(accelerator, "process_index", 0))}
    holders: dict[str, dict[str, float]] = {}
    points: dict[str, str] = {}
    for category in (*MODEL_STATES, "buffers"):
        best = probes.high_water.get(category) if probes is not None else None
        if best is not None and best["bytes"] >= now[category]:
            value, holders[category], points[category] = (
                best["bytes"],
                best["holders"],
                best["point"],
            )
        else:
            value, holders[category], points[category] = (
                now[category],
                now["holders"].get(category, {}),
                "report",
            )
        row[category] = float(value)
    buffer_names = dict(holders.pop("buffers"))
    flat_copy = getattr(probes, "bucket_flat_copy_bytes", 0.0) if probes is not None else 0.0
    if flat_copy:
        # Sized, not walked (see StepProbes): counted as if it coexisted with the rest.
        buffer_names["zero_reduce_flat_copy (largest bucket copy, transient)"] = flat_copy
        row["buffers"] += flat_copy
    row["buffers_total"] = row.pop("buffers")
    row["buffers"] = buffer_names
    row["model_state_total"] = sum(row[c] for c in MODEL_STATES)
    row["holders"] = holders
    row["high_water_points"] = points
    row["measured_at"] = (
        "step probes" if probes is not None and probes.phases else "now (no probes)"
    )
    row["phases"] = dict(probes.phases) if probes is not None else {}
    # Category high-waters may come from different points; this is one real moment.
    row["largest_moment"] = dict(probes.largest_moment) if probes is not None else {}
    activations = getattr(probes, "activations", None) if probes is not None else None
    row["activations"] = activations.high_water if activations is not None else None
    row["probe_seconds"] = probes.probe_seconds if probes is not None else 0.0
    device = getattr(accelerator, "device", None)
    peak = peak_figures(device)
    counted = row["model_state_total"] + row["buffers_total"]
    headline = peak[peak["headline"]]
    # What the peak holds beyond the counted tensors: activations, workspace and, on
    # CPU, the interpreter and libraries. Categories peak at different moments, so
    # this is an estimate, named as one.
    peak["peak_minus_counted_tensors"] = None if headline is None else headline - counted
    baseline = getattr(probes, "baseline", None) if probes is not None else None
    if baseline and baseline.get("rss") is not None and peak.get("rss_high_water") is not None:
        # The CPU peak, decomposed: the runtime measured at track() (RSS minus the
        # tensors counted then), the counted tensors at their worst probe point, and the
        # rest (activations, workspace, allocator slack; activations are also measured
        # separately, at the end of forward, so they are not subtracted here).
        runtime = baseline["rss"] - baseline["counted_tensors"]
        worst = row["largest_moment"].get("total", counted)
        peak["rss_runtime_at_track"] = runtime
        peak["rss_rest_at_peak"] = peak["rss_high_water"] - runtime - worst
    row["peak"] = peak
    row["device"] = str(device) if device is not None else "cpu"
    row["settings"] = memory_settings_in_effect(model, optimizer)
    return row


def _gather_rows(row: dict[str, Any]) -> list[dict[str, Any]] | None:
    """All ranks' rows on rank 0, None elsewhere (works for gloo and nccl groups)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [row]
    rank = dist.get_rank()
    rows: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(row, rows, dst=0)
    return rows


def collect_report(
    accelerator: Any,
    model: torch.nn.Module,
    optimizer: Any,
    *,
    strategy: str,
    precision: str,
    optimizer_name: str = "adamw",
    step: int | None = None,
) -> MemoryReport | None:
    """Measure every rank and build the report on the main process (a collective: call it on all ranks)."""
    row = measure_rank(accelerator, model, optimizer)
    rows = _gather_rows(row)
    if rows is None:
        return None
    notes = []
    if getattr(optimizer, _PROBES_ATTR, None) is None:
        notes.append(
            "no step probes installed (dpkit.memory.track): gradients freed before this report are not counted"
        )
    device = rows[0].get("device", "cpu")
    if not device.startswith("cuda"):
        notes.append(
            "CPU run: tensor figures are allocated bytes; the peak is the process RSS high-water "
            "(it also holds the interpreter and libraries, and untouched allocations are not resident)"
        )
    owner = unwrap_optimizer(optimizer)
    world_size = len(rows)
    if strategy != "ddp" and owner is not None and not hasattr(owner, "bit16_groups_flat"):
        notes.append(f"strategy {strategy!r} but no ZeRO optimizer found: measured as plain torch")
    return MemoryReport(
        strategy=strategy,
        precision=precision,
        world_size=world_size,
        num_params=count_params(model),
        ranks=sorted(rows, key=lambda r: r["rank"]),
        optimizer_name=optimizer_name,
        device=device,
        step=step,
        notes=notes,
        largest_param=largest_param(model),
    )


def write_report(
    accelerator: Any,
    model: torch.nn.Module,
    optimizer: Any,
    *,
    strategy: str,
    precision: str,
    path: Any,
    step: int,
) -> MemoryReport | None:
    """The end-of-run report (a collective): gathered from every rank, then on the main
    process saved as JSON at ``path``, printed as a table and logged under ``memory/*``."""
    report = collect_report(
        accelerator, model, optimizer, strategy=strategy, precision=precision, step=step
    )
    if report is not None:
        report.save(path)
        logger.info("memory per rank\n%s", report.format_table())
        accelerator.log(report.tracker_scalars(), step=step)
    return report
