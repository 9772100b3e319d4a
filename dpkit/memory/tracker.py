"""Where the memory of a data-parallel run went, measured per rank and checked against ZeRO's accounting.

Use from a training script (every rank makes every call; the report exists on the
main process)::

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    tracker = MemoryTracker(accelerator, model, optimizer, strategy="zero2", precision="no")
    ...train...
    report = tracker.write_report("out/memory_report.json", step=step)   # a collective

(:meth:`dpkit.Run.prepare` starts one with the run's strategy and precision, and
:meth:`dpkit.Run.finish` writes its report.)

What is measured (:mod:`dpkit.core.walk`): parameters, gradients, optimizer
state, fp32 master copies and buffers (DDP's reducer buckets, DeepSpeed's ipg
bucket...), each storage counted once, with the name of what holds it; the
bytes autograd saved for backward (activations); and the peak
(:mod:`dpkit.memory.peak`). Gradients live for a fraction of each step and,
under DeepSpeed, not in ``param.grad``: the probes (:mod:`dpkit.memory.probes`)
catch them where each strategy's engine holds them. What is predicted:
:func:`dpkit.memory.analytic.model_state_bytes`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from dpkit.core.categories import MODEL_STATES
from dpkit.core.params import whole_numel, whole_shape
from dpkit.core.strategy import Strategy
from dpkit.core.units import canonical_precision
from dpkit.core.walk import inner_torch_optimizer, unwrap_module, walk
from dpkit.engines import engine_of, get_strategy
from dpkit.lora import lora_settings
from dpkit.memory.live import PeakLive
from dpkit.memory.peak import current_summary, peak_figures, reset_peak
from dpkit.memory.probes import StepProbes
from dpkit.memory.report import MemoryReport
from dpkit.models import count_parameters, is_gradient_checkpointing

logger = logging.getLogger(__name__)


def count_params(model: torch.nn.Module) -> int:
    """Trainable parameters of the unwrapped module, each once (tied weights are one parameter)."""
    return count_parameters(unwrap_module(model), trainable_only=True)


def param_shapes(model: torch.nn.Module, trainable: bool = True) -> list[list[int]]:
    """The whole shape of every trainable (or, ``trainable=False``, frozen) parameter,
    each once (``parameters()`` yields a tied one once; an FSDP2 shard reports its whole
    tensor's shape)."""
    return [
        list(whole_shape(p))
        for p in unwrap_module(model).parameters()
        if p.requires_grad == trainable
    ]


def count_frozen_params(model: torch.nn.Module) -> int:
    """Parameters of the unwrapped module that do not train (LoRA's frozen weights)."""
    return sum(whole_numel(p) for p in unwrap_module(model).parameters() if not p.requires_grad)


def largest_param(model: torch.nn.Module) -> dict[str, Any] | None:
    """Name and size of the model's largest parameter."""
    named = list(unwrap_module(model).named_parameters())
    if not named:
        return None
    name, param = max(named, key=lambda item: whole_numel(item[1]))
    return {
        "name": name,
        "numel": whole_numel(param),
        "bytes": whole_numel(param) * param.element_size(),
    }


def peak_breakdown(
    peak: dict[str, Any], baseline: dict[str, Any] | None, counted_at_worst: float
) -> dict[str, float]:
    """The peak split into what the counted tensors explain and the rest.

    ``peak``: :func:`~dpkit.memory.peak.peak_figures`; ``baseline``: what
    :class:`StepProbes` measured at track() (RSS and the tensors counted then);
    ``counted_at_worst``: all counted tensors at their largest probe point.
    """
    if peak.get("max_allocated") is not None:
        # On a GPU the tensors live in device memory: the allocator's peak holds them
        # with activations and workspace, while host RSS holds none of them.
        return {"allocated_rest_at_peak": peak["max_allocated"] - counted_at_worst}
    if baseline and baseline.get("rss") is not None and peak.get("rss_high_water") is not None:
        # The CPU peak, decomposed: the runtime measured at track() (RSS minus the
        # tensors counted then), the counted tensors at their worst probe point, and the
        # rest (activations, workspace, allocator slack; activations are also measured
        # separately, at the end of forward, so they are not subtracted here).
        runtime = baseline["rss"] - baseline["counted_tensors"]
        return {
            "rss_runtime_at_track": runtime,
            "rss_rest_at_peak": peak["rss_high_water"] - runtime - counted_at_worst,
        }
    return {}


def measure_rank(
    accelerator: Any,
    engine: Any,
    model: torch.nn.Module,
    optimizer: Any,
    probes: StepProbes | None = None,
    rss_reset: bool = False,
    peak_live: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Bytes held on this rank by category, with the holder of each byte and the peak.

    Categories are high-waters over the steps ``probes`` saw, or the tensors held
    right now when there are none. ``engine`` knows where the backend keeps its state.
    ``rss_reset``: whether the RSS high-water was reset
    (:func:`dpkit.memory.peak.reset_peak`) rather than running from process start.
    ``peak_live``: the measured step's live-bytes high-water
    (:attr:`dpkit.memory.live.PeakLive.result`), or None.
    """
    now = walk(engine, model, optimizer)
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
    # What the backend keeps in host memory (offload), by category, at each one's
    # high-water; the figures above are the device's.
    host: dict[str, float] = {}
    host_holders: dict[str, dict[str, float]] = {}
    for category in (*MODEL_STATES, "buffers"):
        best = probes.host_high_water.get(category) if probes is not None else None
        current = now["host"].get(category, 0.0)
        if best is not None and best["bytes"] >= current:
            host[category], host_holders[category] = best["bytes"], best["holders"]
        elif current:
            host[category] = current
            host_holders[category] = now["host_holders"].get(category, {})
    row["host"] = {c: float(host.get(c, 0.0)) for c in (*MODEL_STATES, "buffers")}
    row["host_total"] = sum(row["host"].values())
    row["host_holders"] = host_holders
    buffer_names = dict(holders.pop("buffers"))
    sized = getattr(probes, "sized_buffers", {}) if probes is not None else {}
    for name, nbytes in sized.items():
        # Sized, not walked (see StepProbes): counted as if it coexisted with the rest.
        buffer_names[name] = nbytes
        row["buffers"] += nbytes
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
    # The batch shapes behind that figure: dpkit plan --against plans for the high-water's.
    row["activation_batch"] = activations.batch_record() if activations is not None else None
    row["probe_seconds"] = probes.probe_seconds if probes is not None else 0.0
    timeline = getattr(probes, "timeline", None) if probes is not None else None
    recorded = timeline.current() if timeline is not None else None
    if recorded is not None:
        row["timeline"] = recorded
    # False once MemoryTracker.step_done took them off: later steps ran without them.
    row["probes_in_place"] = probes is not None and probes.installed
    device = getattr(accelerator, "device", None)
    peak = peak_figures(device, rss_reset)
    counted = row["model_state_total"] + row["buffers_total"]
    headline = peak[peak["headline"]]
    # What the peak holds beyond the counted tensors: activations, workspace and, on
    # CPU, the interpreter and libraries. Categories peak at different moments, so
    # this is an estimate, named as one.
    peak["peak_minus_counted_tensors"] = None if headline is None else headline - counted
    baseline = getattr(probes, "baseline", None) if probes is not None else None
    worst = row["largest_moment"].get("total", counted)
    peak.update(peak_breakdown(peak, baseline, worst))
    row["peak"] = peak
    row["peak_live"] = peak_live
    row["device"] = str(device) if device is not None else "cpu"
    row["settings"] = engine.memory.settings_in_effect(model, optimizer)
    # A probe point this DeepSpeed lacks: gradients held only there were not seen.
    row["unprobed"] = list(probes.missing) if probes is not None else []
    row["grads_measured"] = probes is not None and not probes.missing
    return row


def _gather_rows(accelerator: Any, row: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's row, on every rank (accelerate's ``gather_object``; one row without
    a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [row]
    from accelerate.utils import gather_object

    return gather_object([row])


class MemoryTracker:
    """The per-rank memory of one training run: probes inside each step, and the report.

    Create it after ``accelerator.prepare`` (it resets the peak and installs the probes
    on the prepared model and optimizer); every rank must create it and every rank must
    call :meth:`report` / :meth:`write_report` (they gather from all ranks).
    """

    def __init__(
        self,
        accelerator: Any,
        model: torch.nn.Module,
        optimizer: Any,
        *,
        strategy: Strategy | str,
        precision: str = "no",
        optimizer_name: str = "adamw",
        offload_optimizer: str | None = None,
        probe_steps: int = -1,
        count_activations: bool = True,
        model_record: dict[str, Any] | None = None,
    ) -> None:
        """
        Args:
            accelerator: the run's Accelerator (its device and rank).
            model, optimizer: as ``accelerator.prepare`` returned them.
            strategy: what runs (a :class:`~dpkit.core.strategy.Strategy` or its name): the
                prediction the measurement is checked against.
            precision: ``no``/``fp32``, ``bf16`` or ``fp16``.
            optimizer_name: for the prediction (``adamw``: 8 bytes of state per parameter).
            offload_optimizer: where ZeRO offloads optimizer state (``cpu``), or None.
            probe_steps: probe the first N optimizer steps (see :meth:`step_done`) and
                keep their high-waters; -1 every step; 0 installs no probes (a report then
                sees only what is held when it is taken). The live tensor bytes
                (``peak_live``) are watched in the last step probed (with -1, the first).
            count_activations: count the bytes autograd saves for backward.
            model_record: the model as ``dpkit plan --against`` reads it
                (:func:`model_record`), saved with the report; None: not recorded.
        """
        self.accelerator = accelerator
        self.model = model
        self.optimizer = optimizer
        self.strategy = get_strategy(strategy)
        self.precision = canonical_precision(precision)
        # The optimizer that runs: a backend may build its own (DeepSpeed's CPU Adam
        # under offload), whatever the caller assumed.
        self.optimizer_class = type(inner_torch_optimizer(optimizer) or optimizer).__name__
        chosen = engine_of(get_strategy(strategy)).memory.optimizer_in_effect(optimizer)
        self.optimizer_name = chosen or optimizer_name
        self.offload_optimizer = offload_optimizer
        # A backend whose first step is not yet its steady one (ZeRO-3 records its
        # parameter trace in step 1 and gathers ahead only from step 2) is probed up to
        # the steady step, and its live bytes are watched there.
        self.steady_step = engine_of(self.strategy).memory.steady_step(optimizer)
        self.probe_steps = max(probe_steps, self.steady_step) if probe_steps > 0 else probe_steps
        # The live bytes are watched in the last probed step (its walks name them): the
        # first by default; a later one holds AdamW's moments from its start, the run's
        # peak (dpkit tune probes two warm-up steps for it).
        self.watched_step = self.probe_steps if self.probe_steps > 0 else self.steady_step
        self.model_record = model_record
        self._steps_seen = 0
        self.rss_reset = reset_peak(getattr(accelerator, "device", None))
        self.probes = (
            StepProbes(
                model, optimizer, engine_of(self.strategy), count_activations=count_activations
            )
            if probe_steps != 0
            else None
        )
        # The live tensor bytes of the first step (one step: a dispatch mode costs every
        # operator a Python call), named by the probes' walks; none without probes.
        self.peak_live = (
            PeakLive(
                model,
                optimizer,
                engine_of(self.strategy),
                getattr(accelerator, "device", None),
                from_step=self.watched_step,
            )
            if self.probes is not None
            else None
        )
        if self.peak_live is not None:
            assert self.probes is not None
            self.probes.peak_live = self.peak_live
            if self.probes.activations is not None:
                self.probes.activations.on_saved = self.peak_live.saved
        if self.probes is not None and self.probes.missing and _is_main(accelerator):
            logger.warning(
                "dpkit: this DeepSpeed has no %s: the memory report marks gradients as unmeasured",
                ", ".join(self.probes.missing),
            )

    def step_done(self, step: int) -> None:
        """Call after each optimizer step: after ``probe_steps`` steps of this process
        (``step`` is the run's count; a resumed run starts past 1) the walks are removed,
        their high-waters kept, so later steps run, and are timed, without them. The
        activation count (a saved-tensor hook, a few ms a step) stays: batches of
        another length (dynamic padding) save more or less for backward."""
        self._steps_seen += 1
        if self.peak_live is not None:
            self.peak_live.close(step)
            activations = self.probes.activations if self.probes is not None else None
            if self.peak_live.result is not None and activations is not None:
                activations.on_saved = None  # nothing of it runs after the measured step
        if self.probes is not None and self.probes.installed:
            self.probes.end_step(step)
        if (
            self.probes is not None
            and self.probe_steps > 0
            and self._steps_seen == self.probe_steps
        ):
            self.probes.remove(keep_activations=True)

    def stop(self) -> None:
        """Remove the probes now (their high-waters are kept for the report)."""
        if self.peak_live is not None:
            self.peak_live.remove()
        if self.probes is not None:
            self.probes.remove()

    def measure(self) -> dict[str, Any]:
        """This rank's row (no collective)."""
        if self.peak_live is not None:
            self.peak_live.close()  # a step still running: measured up to here
        return measure_rank(
            self.accelerator,
            engine_of(self.strategy),
            self.model,
            self.optimizer,
            self.probes,
            self.rss_reset,
            self.peak_live.result if self.peak_live is not None else None,
        )

    def summary(self) -> str:
        """This rank's memory in a few words, for a per-step log line (no collective)."""
        return current_summary(getattr(self.accelerator, "device", None))

    def report(self, step: int | None = None) -> MemoryReport | None:
        """Measure every rank and build the report on the main process, None elsewhere
        (a collective: every rank must call it)."""
        rows = _gather_rows(self.accelerator, self.measure())
        if not _is_main(self.accelerator):
            return None
        notes = []
        if self.probes is None:
            notes.append(
                "no step probes installed: gradients freed before this report are not counted"
            )
        elif self.probes.missing:
            notes.append(
                f"this DeepSpeed has no {', '.join(self.probes.missing)}: gradients held only "
                "there were not seen, so the gradient figure is marked unmeasured"
            )
        device = rows[0].get("device", "cpu")
        if any(r.get("host_total") for r in rows) and not device.startswith("cuda"):
            notes.append(
                "CPU run: host and device bytes are the same RAM, split by where the backend "
                "places them (device: the categories; host: the offloaded ones)"
            )
        if not device.startswith("cuda"):
            notes.append(
                "CPU run: tensor figures are allocated bytes; the peak is the process RSS "
                "high-water (it also holds the interpreter and libraries, and untouched "
                "allocations are not resident)"
            )
        notes += engine_of(self.strategy).memory.report_notes(
            self.strategy, self.model, self.optimizer
        )
        frozen = count_frozen_params(self.model)
        return MemoryReport(
            strategy=self.strategy.name,
            precision=self.precision,
            world_size=len(rows),
            num_params=count_params(self.model),
            ranks=sorted(rows, key=lambda r: r["rank"]),
            optimizer_name=self.optimizer_name,
            optimizer_class=self.optimizer_class,
            device=device,
            step=step,
            notes=notes,
            largest_param=largest_param(self.model),
            offload_optimizer=self.offload_optimizer,
            gradient_checkpointing=is_gradient_checkpointing(unwrap_module(self.model)),
            param_shapes=(
                param_shapes(self.model)
                if engine_of(self.strategy).memory.report_param_shapes()
                else None
            ),
            model=self.model_record,
            frozen_params=frozen,
            frozen_param_shapes=(
                param_shapes(self.model, trainable=False)
                if frozen and engine_of(self.strategy).memory.report_param_shapes()
                else None
            ),
            lora=lora_settings(unwrap_module(self.model)),
        )

    def log_report(self, step: int | None = None) -> MemoryReport | None:
        """:meth:`report`, printed as a table on the main process (an intermediate report)."""
        report = self.report(step)
        if report is not None:
            logger.info("memory at step %s\n%s", step, report.format_table())
        return report

    def write_report(self, path: str | Path | None, step: int | None = None) -> MemoryReport | None:
        """:meth:`report`, then on the main process: saved as JSON at ``path`` (None: not
        saved) with the timeline chart beside it (``memory_timeline.png``), printed as a table, and logged under ``memory/*`` to the accelerator's
        trackers."""
        report = self.report(step)
        if report is not None:
            if path is not None:
                report.save(path)
                write_timeline_next_to(report, Path(path))
            logger.info("memory per rank\n%s", report.format_table())
            self.accelerator.log(report.tracker_scalars(), step=step)
        return report


def model_record(
    model: torch.nn.Module,
    optimizer: Any,
    micro_batch_size: int,
    name: str | None = None,
    gradient_accumulation_steps: int = 1,
    strategy: Strategy | None = None,
) -> dict[str, Any]:
    """What ``dpkit plan --against`` needs of a run that is not one of dpkit's recipes
    (a Trainer run, a script of the user's own): the live model's layout
    (:func:`dpkit.plan.inputs.spec_record`) with the optimizer's own groups (the layout
    ZeRO partitions), the micro-batch and the accumulation."""
    from dpkit.plan.inputs import spec_from_model, spec_record

    config = getattr(model, "config", None)
    name = name or getattr(config, "_name_or_path", "") or type(model).__name__
    from dpkit.engines import REFERENCE

    groups = engine_of(strategy or REFERENCE).memory.optimizer_groups(optimizer)
    spec = spec_from_model(name, "trainer", model, param_groups=groups)
    record = spec_record(spec)
    record["class"] = type(model).__name__
    record["micro_batch_size"] = int(micro_batch_size)
    record["gradient_accumulation_steps"] = int(gradient_accumulation_steps)
    return record


def write_timeline_next_to(report: MemoryReport, report_path: Path) -> Path | None:
    """``memory_timeline.png`` beside a saved report, when its ranks recorded a timeline
    (main process only; the chart is drawn from the report's JSON, as ``dpkit report``
    draws it)."""
    from dpkit.memory.chart import CHART_FILE, has_timeline, write_timeline_chart

    data = report.to_dict()
    if not has_timeline(data):
        return None
    return write_timeline_chart(data, report_path.with_name(CHART_FILE))


def _is_main(accelerator: Any) -> bool:
    return int(getattr(accelerator, "process_index", 0)) == 0
