"""``dpkit plan --against RUN_DIR``: the plan of a finished run beside what the run measured.

The run's own folder (``recipes/finetune.py``, ``recipes/train_lm.py``, a run of
``dpkit bench``, or a Transformers ``Trainer`` run with
:class:`~dpkit.integrations.transformers.MemoryReportCallback`) says what to plan for:
``run_config.json`` (model, micro-batch, sequence length, which recipe; a Trainer
run's report carries its live model's layout instead) and ``memory_report.json`` (strategy, world size,
precision, optimizer, the DeepSpeed settings in effect, and every rank's measured
bytes). The plan is made with those settings, so a disagreement is the model's, not
the inputs'. Per model-state category the plan's per-GPU figure (the worst rank) is
set against the largest measured rank, with the error in percent; for ZeRO the
paper's gradient figure is shown too, since that is what DeepSpeed's layout departs
from (:mod:`dpkit.engines.deepspeed.layout`). An FSDP2 run is planned as FSDP2 (its shards
padded per parameter, :mod:`dpkit.engines.fsdp2.layout`), never with DeepSpeed's layout.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from dpkit.core.categories import MODEL_STATES
from dpkit.core.spec import ModelSpec, PlanInputs
from dpkit.core.step import PeakPoint
from dpkit.core.units import canonical_precision
from dpkit.engines import ENGINES, engine_of, get_strategy
from dpkit.errors import UsageError
from dpkit.plan.activations import activation_profile, saved_bytes
from dpkit.plan.estimate import StrategyEstimate, buffer_settings, estimate
from dpkit.plan.inputs import load_model, spec_from_config, spec_from_record
from dpkit.plan.peak import StepPeak, peak_dict, step_peak, step_trace_for

CATEGORIES = MODEL_STATES
"""The model-state rows of the check, one by one (their sum is ``total``)."""
OTHER_ROWS = ("buffers", "activations")
"""The rows after ``total``: communication buffers, and the bytes saved for backward."""
HOST_ROWS = ("params", "grads", "optimizer", "master", "buffers")
"""Under offload, the categories the backend keeps in host memory: rows ``host <c>`` and
``host total`` after the device's (the rows above are then the device's); ``host params``
only where parameters are offloaded (FSDP2's offload, ZeRO-3 offload), planned or measured."""
MIB = 2**20


@dataclass(frozen=True)
class PlanCheck:
    """The plan of one run and the run's measurement, per category (bytes per GPU)."""

    run_dir: Path
    model: str
    strategy: str
    world_size: int
    precision: str
    predicted: dict[str, float]
    """Per category and ``total``: the plan's figure (its worst rank)."""
    measured: dict[str, float]
    """Per category and ``total``: the largest over the run's ranks."""
    grads_paper: float
    """The ZeRO paper's gradient figure, for comparison."""
    grads_where: str
    """The rank and moment the plan's gradient figure comes from."""
    planned_batch: str = ""
    """The batch the activations were planned for, and why that one."""
    not_predicted: dict[str, str] = field(default_factory=dict)
    """Rows the plan gives no number for, with the reason (the peak of a CPU run)."""
    not_checked: dict[str, str] = field(default_factory=dict)
    """Rows the plan predicts but the run cannot measure, with the reason (FSDP2's
    buffers): shown predicted, with no measured figure and no error."""
    logits_peak: float = 0.0
    """The loss's transient at the start of backward that the plan adds to activations
    and the report does not measure (not a saved tensor), shown beside the check."""
    gradient_checkpointing: bool = False
    """The run recomputed its layers in backward: planned so, the activations being each
    layer's inputs; the one layer recomputed at a time is a transient, like the logits'."""
    recomputed_layer: float = 0.0
    """Under checkpointing, the bytes the layer being recomputed saves (planned, in the
    peak; not in the forward's activations the report measures)."""
    activation_method: str = ""
    """How the activations were planned: ``trace`` (the model's forward on the meta
    device), or ``formula: <why the trace failed>``."""
    on_gpu: bool = False
    """The run ran on CUDA devices (else host and device are the same RAM)."""
    peak: StepPeak | None = None
    """The step's peak of live tensors, predicted for the batch the run measured it at
    (``predicted["peak"]`` is its first step's, what ``peak_live`` measures)."""
    peak_measured: dict[str, Any] | None = None
    """The largest rank's ``peak_live`` (its ``rank`` added)."""

    @property
    def error_pct(self) -> dict[str, float | None]:
        """(predicted - measured) / measured, in percent; None where nothing was measured."""
        return {
            key: None
            if not measured or key in self.not_checked
            else 100.0 * (self.predicted[key] - measured) / measured
            for key, measured in self.measured.items()
        }


def _read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise UsageError(f"--against={str(path.parent)!r}: no {path.name} ({what})")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UsageError(
            f"--against: {path} is not valid JSON ({err.msg}, line {err.lineno})"
        ) from None


def _run_settings(report: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The plan's buffer settings, with the DDP and DeepSpeed values the run really used."""
    settings = dict(defaults)
    for engine in ENGINES:  # each backend reads back the keys its live objects recorded
        settings.update(engine.plan.settings_from_run(report.get("settings", {})))
    return settings


def _trainer_model(report: dict[str, Any]) -> tuple[str, ModelSpec, int, int]:
    """The model a Trainer run trained, as its memory report recorded it."""
    record = report["model"]
    spec = spec_from_record(record)
    # Only where the report records no batch shapes (:func:`_measured_batch`): the
    # Trainer pads each batch to its own length, which the plan cannot know.
    seq_len = min(128, spec.max_positions or 128)
    return spec.name, spec, int(record.get("micro_batch_size") or 1), seq_len


# The run_config.json sections of dpkit's fine-tune recipes: (model flags, training flags,
# the task its model is built for).
RECIPE_SECTIONS = (
    ("ModelConfig", "TrainConfig", "sequence_classification"),  # recipes/finetune.py
    ("DecoderModelConfig", "CausalTrainConfig", "causal_lm"),  # recipes/finetune_lm.py
)


def recipe_model(config: dict[str, Any], where: str) -> tuple[str, ModelSpec, int, int]:
    """The model a dpkit recipe trains, its micro-batch and sequence length, from its
    ``run_config.json`` (or the same sections parsed from its flags: ``dpkit tune``);
    ``where`` names the source in the error for any other recipe."""
    from dpkit.lora import LoraSettings

    lora = LoraSettings.from_flags(config.get("StrategyConfig") or {})
    sections = next(
        (keys for keys in RECIPE_SECTIONS if keys[0] in config and keys[1] in config), None
    )
    if sections is not None:
        model_key, train_key, task = sections
        name = config[model_key]["model"]
        spec = load_model(name, task=task, lora=lora)
        dropout = config[model_key].get("dropout")
        if dropout is not None and spec.config is not None:
            # --dropout set every dropout field of the run's model (ModelConfig.
            # dropout_overrides); the activations saved depend on it (masks, kernels).
            for key, value in spec.config.to_dict().items():
                if "dropout" in key and isinstance(value, float):
                    setattr(spec.config, key, float(dropout))
        micro_batch = int(config[train_key]["micro_batch_size"])
        # Runs from before max_seq_length was recorded: the recipe's default, within the
        # model's positions (model states do not depend on it).
        default = min(128, spec.max_positions or 128)
        return name, spec, micro_batch, int(config[model_key].get("max_seq_length") or default)
    if "LMWorkload" in config:  # recipes/train_lm.py (and dpkit bench)
        from dpkit.data import lm as lm_data

        known = {f.name for f in fields(lm_data.LMWorkload)}
        workload = lm_data.LMWorkload(
            **{k: v for k, v in config["LMWorkload"].items() if k in known}
        )
        name = workload.model_config or f"train_lm --size {workload.size}"
        spec = spec_from_config(name, "recipe", lm_data.lm_config(workload), lora=lora)
        return name, spec, workload.micro_batch_size, workload.seq_len
    raise UsageError(
        f"{where}: not from recipes/finetune.py, recipes/finetune_lm.py or recipes/train_lm.py"
    )


def _measured_batch(report: dict[str, Any], micro_batch: int, seq_len: int) -> tuple[int, int, str]:
    """The batch to plan activations for: the shape of the forward at the largest
    rank's activation high-water, which the report records (dynamic padding makes most
    batches shorter than the run's longest allowed); the run's own micro-batch and
    longest sequence where it records none (a report from before, a model without
    token ids), a worst case. With the sentence saying which."""
    rows = [r for r in report["ranks"] if r.get("activations") is not None]
    largest = max(rows, key=lambda r: float(r["activations"]), default=None)
    seen = largest.get("activation_batch") if largest is not None else None
    if not seen or not seen.get("seq_len_at_high_water"):
        return (
            micro_batch,
            seq_len,
            (
                f"micro-batch {micro_batch} x {seq_len} tokens: the run's longest allowed "
                "(the report records no batch shapes), a worst case"
            ),
        )
    batch, tokens = int(seen["micro_batch_at_high_water"]), int(seen["seq_len_at_high_water"])
    return (
        batch,
        tokens,
        (
            f"micro-batch {batch} x {tokens} tokens: the batch of rank {largest['rank']}'s "
            f"activation high-water (its batches: {seen['seq_len_min']}-{seen['seq_len_max']} "
            f"tokens, mean {float(seen['seq_len_mean']):.1f}, over {seen['forwards']} forwards; "
            f"longest allowed {seq_len})"
        ),
    )


def _peak(
    report: dict[str, Any],
    inputs: PlanInputs,
    row: StrategyEstimate,
    settings: dict[str, Any],
    on_gpu: bool,
) -> tuple[StepPeak | None, dict[str, Any] | None, str]:
    """The first step's peak of live tensor bytes, predicted (:mod:`dpkit.plan.peak`) for
    the batch the run measured it at, and the largest rank's ``peak_live``; else None and
    the reason."""
    rows = [r for r in report["ranks"] if r.get("peak_live")]
    if not rows:
        return (
            None,
            None,
            ("the run measured no peak_live (--memory-probe-steps 0, or a report from before it)"),
        )
    largest = max(rows, key=lambda r: float(r["peak_live"]["bytes"]))
    measured = dict(largest["peak_live"], rank=largest.get("rank"))
    batch = measured.get("batch") or {}
    micro_batch = int(batch.get("micro_batch") or inputs.micro_batch)
    if batch.get("seq_len"):
        inputs = replace(inputs, seq_len=int(batch["seq_len"]))
    trace = step_trace_for(inputs, row.strategy, micro_batch, device="cuda" if on_gpu else "cpu")
    if trace is None:
        return None, measured, "the run's model has no shapes to trace"
    # The model states do not depend on the batch: the row's figures stand.
    return step_peak(inputs, row.strategy, row, trace, settings, on_gpu=on_gpu), measured, ""


def _watched(peak: StepPeak, measured: dict[str, Any]) -> PeakPoint:
    """The predicted peak of the step ``peak_live`` watched: the first, or a later one (an
    engine whose first step differs, ZeRO-3's, is watched at its second)."""
    return peak.first if int(measured.get("step") or 1) <= 1 else peak.later


def _accumulation(run_dir: Path, report: dict[str, Any]) -> int:
    """The run's micro-batches per step: a recipe's run_info.json, a Trainer report's
    model record; 1 where neither says (reports written before either recorded it)."""
    info_path = run_dir / "run_info.json"
    if isinstance(report.get("model"), dict):
        return int(report["model"].get("gradient_accumulation_steps") or 1)
    if info_path.is_file():
        info = _read_json(info_path, "written at the start of every run")
        return int(info.get("gradient_accumulation_steps") or 1)
    return 1


def check_run(run_dir: str | Path) -> PlanCheck:
    """Plan for the run in ``run_dir`` with its own inputs and compare with its report."""
    run_dir = Path(run_dir)
    if run_dir.is_file():
        # Someone pointing at the report itself means the folder around it.
        folder = (
            f"its folder, --against {str(run_dir.parent)!r}"
            if run_dir.name in ("memory_report.json", "run_config.json", "run_info.json")
            else "the run's output folder (the one holding memory_report.json)"
        )
        raise UsageError(f"--against={str(run_dir)!r}: a file, not a run folder; give {folder}")
    if not run_dir.is_dir():
        raise UsageError(f"--against={str(run_dir)!r}: no such run folder")
    report = _read_json(run_dir / "memory_report.json", "written at the end of every run")
    config_path = run_dir / "run_config.json"
    config = _read_json(config_path, "") if config_path.is_file() else {}
    from_recipe = "LMWorkload" in config or any(
        model_key in config and train_key in config for model_key, train_key, _ in RECIPE_SECTIONS
    )
    if isinstance(report.get("model"), dict) and not from_recipe:
        # A Trainer run, or a script of the user's own (dpkit.setup): the report says it all.
        model_name, spec, micro_batch, seq_len = _trainer_model(report)
    else:
        config = _read_json(config_path, "written at the start of every run")
        model_name, spec, micro_batch, seq_len = recipe_model(
            config, f"--against={str(run_dir)!r}: run_config.json"
        )
    try:  # the report may use accelerate's name for fp32, "no"
        precision = canonical_precision(report["precision"])
    except ValueError:
        raise UsageError(
            f"--against: unknown precision {report['precision']!r} in the report"
        ) from None
    world_size = int(report["world_size"])
    micro_batch, seq_len, planned_batch = _measured_batch(report, micro_batch, seq_len)
    # Recorded from the live model (dpkit's --gradient-checkpointing, the Trainer's own).
    checkpointing = bool(report.get("gradient_checkpointing", False))
    inputs = PlanInputs(
        model=spec,
        gpus_per_node=world_size,
        precision=precision,
        optimizer=report.get("optimizer", "adamw"),
        micro_batch=micro_batch,
        gradient_accumulation_steps=_accumulation(run_dir, report),
        seq_len=seq_len,
        activation_checkpointing=checkpointing,
    )
    on_gpu = str(report.get("device", "cpu")).startswith("cuda")
    # The kernels the run ran: a CPU saves other tensors for backward than a GPU does.
    profile = activation_profile(
        spec,
        seq_len,
        precision,
        checkpointing,
        inputs.attention,
        device="cuda" if on_gpu else "cpu",
    )
    settings = _run_settings(report, buffer_settings(spec, world_size))
    strategy = get_strategy(report["strategy"])
    row: StrategyEstimate = estimate(inputs, strategy, inputs.micro_batch, profile, settings)
    predicted = {c: float(getattr(row, c)) for c in CATEGORIES}
    predicted["total"] = sum(predicted.values())
    measured = {c: max(float(r[c]) for r in report["ranks"]) for c in CATEGORIES}
    measured["total"] = max(float(r["model_state_total"]) for r in report["ranks"])
    predicted["buffers"] = row.buffers
    measured["buffers"] = max(float(r.get("buffers_total", 0.0)) for r in report["ranks"])
    # Offload: what the backend keeps in host memory, per category, planned beside what
    # the walk placed there (on a CPU run too: same RAM, split by the backend's placement).
    measured_host = {
        c: max(float(r.get("host", {}).get(c, 0.0)) for r in report["ranks"]) for c in HOST_ROWS
    }
    if any(row.host.values()) or any(measured_host.values()):
        shown = [c for c in HOST_ROWS if c != "params" or row.host.get(c) or measured_host[c]]
        for category in shown:
            predicted[f"host {category}"] = float(row.host.get(category, 0.0))
            measured[f"host {category}"] = measured_host[category]
        predicted["host total"] = sum(float(row.host.get(c, 0.0)) for c in HOST_ROWS)
        measured["host total"] = max(float(r.get("host_total", 0.0)) for r in report["ranks"])
    not_predicted: dict[str, str] = {}
    estimated_by = ""
    activations = [float(r["activations"]) for r in report["ranks"] if r.get("activations")]
    if profile is None:
        not_predicted["activations"] = "the run's model has no shapes to trace"
    elif activations:
        predicted["activations"] = saved_bytes(row.activation_parts)
        estimated_by = profile.method + (f": {profile.note}" if profile.note else "")
        measured["activations"] = max(activations)
    else:
        not_predicted["activations"] = "the run did not count them (count_activations off)"
    not_checked: dict[str, str] = {}
    unprobed = engine_of(strategy).plan.unprobed_buffer_parts(strategy)
    if unprobed:
        # FSDP2: the whole parameters and gradients of the unit being computed live between
        # the report's probe points (end of forward, optimizer step); the timeline shows
        # part of them, the report's buffers none.
        not_checked["buffers"] = (
            f"not measured: {', '.join(unprobed)} live between the report's probe points"
        )
    peak, peak_measured, why_not = _peak(report, inputs, row, settings, on_gpu)
    if peak is None or peak_measured is None:
        not_predicted["peak"] = why_not
    else:
        predicted["peak"] = _watched(peak, peak_measured).bytes
        measured["peak"] = float(peak_measured["bytes"])
    return PlanCheck(
        run_dir=run_dir,
        model=model_name,
        strategy=report["strategy"],
        world_size=world_size,
        precision=precision,
        predicted=predicted,
        measured=measured,
        grads_paper=row.grads_paper,
        grads_where=row.grads_where,
        planned_batch=planned_batch,
        not_predicted=not_predicted,
        not_checked=not_checked,
        logits_peak=row.activation_parts.get("logits_peak", 0.0),
        gradient_checkpointing=checkpointing,
        recomputed_layer=row.activation_parts.get("one_layer", 0.0),
        activation_method=estimated_by,
        on_gpu=on_gpu,
        peak=peak,
        peak_measured=peak_measured,
    )


def format_check(check: PlanCheck) -> str:
    """The check as a table: per category, predicted and measured MiB and the error."""
    lines = [
        f"dpkit plan --against {check.run_dir}",
        f"  {check.model}: {check.strategy} on {check.world_size} ranks, {check.precision}"
        + (", gradient checkpointing" if check.gradient_checkpointing else "")
        + "; per GPU (plan: its worst rank; measured: the largest rank)",
    ]
    if check.planned_batch:
        lines.append(f"  activations planned for {check.planned_batch}")
    lines += ["", f"{'MiB per GPU':<14}{'predicted':>11}{'measured':>11}{'error':>9}"]
    errors = check.error_pct
    host_keys = [k for k in check.predicted if k.startswith("host ")]
    for key in (*CATEGORIES, "total", *OTHER_ROWS, "peak", *host_keys):
        if key in check.not_predicted:
            lines.append(f"{key:<14}{'-':>11}{'-':>11}{'-':>9}  {check.not_predicted[key]}")
            continue
        if key not in check.predicted:
            continue
        if key in check.not_checked:
            lines.append(
                f"{key:<14}{check.predicted[key] / MIB:>11.1f}{'-':>11}{'-':>9}  "
                + check.not_checked[key]
            )
            continue
        lines.append(
            f"{key:<14}{check.predicted[key] / MIB:>11.1f}{check.measured[key] / MIB:>11.1f}"
            + f"{_error_text(errors[key]):>9}"
        )
    lines.append(
        "total: the model states; activations: bytes saved for backward in one forward "
        "(the report's measure)"
    )
    if host_keys:
        lines.append(
            "host rows: what the backend keeps in host memory (offload); the rows above are "
            "the device's"
            + (
                ""
                if check.on_gpu
                else "; on this CPU run both are the same RAM, split by "
                "where the backend places them"
            )
        )
    if check.logits_peak >= 0.05 * MIB:  # a classifier's few logits: not worth a line
        lines.append(
            f"not in activations above: the loss's logits peak at the start of backward, "
            f"{check.logits_peak / MIB:.1f} MiB planned (transient, not a saved tensor; the "
            "report does not measure it)"
        )
    if check.activation_method.startswith("formula"):
        lines.append(f"activations planned by the formula, not a trace ({check.activation_method})")
    if check.gradient_checkpointing:
        lines.append(
            "gradient checkpointing: activations are each layer's inputs (what the forward "
            f"keeps); the layer recomputed in backward adds {check.recomputed_layer / MIB:.1f} "
            "MiB planned at a time (transient, not measured)"
        )
    lines += _peak_lines(check)
    if check.grads_where:
        lines += [
            "",
            f"grads: {check.grads_where}; the ZeRO paper's figure would be "
            f"{check.grads_paper / MIB:.1f} MiB (see dpkit.engines.deepspeed.layout)",
        ]
    return "\n".join(lines)


def _peak_lines(check: PlanCheck) -> list[str]:
    """Where the peak is, predicted and measured, and what is alive there."""
    peak, measured = check.peak, check.peak_measured
    if peak is None or measured is None:
        return []
    first, later = _watched(peak, measured), peak.later
    step = int(measured.get("step") or 1)
    trace = peak.trace
    parts = ", ".join(f"{k} {v / MIB:.1f}" for k, v in first.parts.items() if v >= 0.05 * MIB)
    seen = ", ".join(
        f"{k} {float(v) / MIB:.1f}"
        for k, v in (measured.get("by_category") or {}).items()
        if float(v) >= 0.05 * MIB
    )
    which = "the batch it measured" if measured.get("batch") else "its batch is not recorded"
    lines = [
        f"peak: live tensor bytes of the run's step {step} at micro-batch {trace.micro_batch} x "
        f"{trace.seq_len} tokens ({which}); no --reserve in it"
        + (
            "; host memory in it (offload on a CPU: one RAM)"
            if any(k.startswith("host ") for k in first.parts)
            else ""
        ),
        f"  predicted at {first.point}: {parts}",
        f"  measured on rank {measured.get('rank')} at {measured.get('point')} "
        f"({measured.get('op')}): {seen}",
    ]
    if not first.covers(measured.get("point")):
        lines.append(
            f"  the points differ: predicted {first.point}, measured {measured.get('point')}"
        )
    if step <= 1:
        lines.append(
            f"  later steps (AdamW's state alive from the start), predicted: "
            f"{later.bytes / MIB:.1f} MiB at {later.point} (not measured: peak_live watched "
            "the first step)"
        )
    return lines


def _error_text(error: float | None) -> str:
    """An error in percent for the table's column: ``-`` where nothing was measured,
    bounded at 999% so that the column holds."""
    if error is None:
        return "-"
    if abs(error) >= 1000:
        return ">+999%" if error > 0 else "<-999%"
    return f"{error:+.1f}%"


def check_dict(check: PlanCheck) -> dict[str, Any]:
    """The check for ``--against --json``: bytes as integers."""
    return {
        "run_dir": str(check.run_dir),
        "model": check.model,
        "strategy": check.strategy,
        "world_size": check.world_size,
        "precision": check.precision,
        "predicted_bytes": {k: round(v) for k, v in check.predicted.items()},
        "measured_bytes": {k: round(v) for k, v in check.measured.items()},
        "error_pct": check.error_pct,
        "grads_paper_bytes": round(check.grads_paper),
        "grads_where": check.grads_where,
        "planned_batch": check.planned_batch,
        "not_predicted": dict(check.not_predicted),
        "not_checked": dict(check.not_checked),
        "logits_peak_bytes": round(check.logits_peak),
        "gradient_checkpointing": check.gradient_checkpointing,
        "recomputed_layer_bytes": round(check.recomputed_layer),
        "activation_method": check.activation_method,
        "peak": None if check.peak is None else peak_dict(check.peak),
        "peak_measured": check.peak_measured,
    }
