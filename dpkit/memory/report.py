"""The memory report: measured rows per rank against the analytic prediction.

A row is what :func:`dpkit.memory.measure_rank` returns on one rank. The report
adds the prediction (:func:`dpkit.memory.analytic.model_state_bytes`, never computed
here), full replication, the savings measured and predicted, the % error per
category, and for every category where the measurement exceeds the prediction
the holders of the excess, by name.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpkit.core.categories import MODEL_STATES, PARTITION_SHARE
from dpkit.core.units import ModelStateBytes
from dpkit.memory.analytic import full_replication_bytes, model_state_bytes, paper_grad_bytes

MIB = 1024.0**2
# 2: each rank's row has a ``timeline`` (docs/memory.md).
SCHEMA_VERSION = 2
# Buffers below this share of the predicted model states (DDP's 8 KiB of module
# buffers) are in the rows and the JSON but not called out as a residual.
BUFFER_NOTE_PCT = 0.1


def _mib(value: float | None) -> str:
    if value is None:
        return "-"
    mib = value / MIB
    return "0.0" if abs(mib) < 0.05 else f"{mib:,.1f}"  # no "-0.0" for a few stray bytes


def error_pct(predicted: float, measured: float) -> float | None:
    """(predicted - measured) / measured, in %; None where nothing was measured but something predicted."""
    if measured == 0:
        return 0.0 if predicted == 0 else None
    return 100.0 * (predicted - measured) / measured


@dataclass
class MemoryReport:
    """Per-rank measurements of one run, with the prediction they are checked against."""

    strategy: str
    precision: str
    world_size: int
    num_params: int
    ranks: list[dict[str, Any]]
    optimizer_name: str = "adamw"
    device: str = "cpu"
    # The class of the optimizer that ran (``AdamW``, ``DeepSpeedCPUAdam``), or "".
    optimizer_class: str = ""
    step: int | None = None
    # An excess smaller than this share of the prediction (alignment padding, the
    # optimizer's scalar `step` tensors) is reported in the % error, not as a residual.
    residual_tolerance_pct: float = 1.0
    notes: list[str] = field(default_factory=list)
    # The largest parameter (name, numel): it bounds the residuals ZeRO's bookkeeping
    # leaves (whole-gradient copies of boundary-straddling or late-reduced parameters).
    largest_param: dict[str, Any] | None = None
    # Where ZeRO offloaded optimizer state and master weights (``cpu``), or None.
    offload_optimizer: str | None = None
    # The model recomputed its layers in backward (activation checkpointing): the forward
    # kept each layer's inputs only.
    gradient_checkpointing: bool = False
    # What ``dpkit plan --against`` plans for, for a run without a recipe's run_config.json
    # (a Transformers Trainer run): dpkit.plan.inputs.spec_record of the live model, with
    # the optimizer's own parameter groups, and the micro-batch.
    model: dict[str, Any] | None = None
    # FSDP2: every trainable parameter's whole shape, so the prediction pads each dim 0 to
    # a multiple of N as fully_shard does (None: the count's Psi/N).
    param_shapes: list[list[int]] | None = None
    # Parameters that do not train (LoRA's frozen weights): counted as parameters only.
    frozen_params: int = 0
    frozen_param_shapes: list[list[int]] | None = None
    # The LoRA adapters the run trained (dpkit.lora.LoraSettings.as_dict), or None.
    lora: dict[str, Any] | None = None

    @property
    def predicted(self) -> ModelStateBytes:
        return model_state_bytes(
            self.num_params,
            self.strategy,
            self.world_size,
            self.precision,
            self.optimizer_name,
            param_shapes=self.param_shapes,
            frozen_params=self.frozen_params,
            frozen_param_shapes=self.frozen_param_shapes,
        )

    @property
    def paper_grads(self) -> float:
        """The ZeRO paper's per-rank gradient bytes; ``predicted.grads`` adds the fp32
        partition DeepSpeed's mixed-precision step casts beside them."""
        return paper_grad_bytes(self.num_params, self.strategy, self.world_size, self.precision)

    @property
    def full_replication(self) -> ModelStateBytes:
        return full_replication_bytes(
            self.num_params, self.precision, self.optimizer_name, self.frozen_params
        )

    @property
    def worst_rank(self) -> dict[str, Any]:
        """The rank with the most model-state bytes: the one that decides whether a run fits."""
        return max(self.ranks, key=lambda row: row["model_state_total"])

    @property
    def grads_measured(self) -> bool:
        """False where the probes could not see every point gradients are held at (a
        DeepSpeed without a method they rely on): the gradient figure is then a floor."""
        return all(r.get("grads_measured", True) for r in self.ranks)

    def _by_rank(self) -> list[dict[str, Any]]:
        return sorted(self.ranks, key=lambda r: r["rank"])

    def measured(self) -> dict[str, float]:
        """Per category, the largest device figure over ranks."""
        figures = {c: max(float(r[c]) for r in self.ranks) for c in MODEL_STATES}
        figures["model_state_total"] = max(float(r["model_state_total"]) for r in self.ranks)
        figures["buffers_total"] = max(float(r["buffers_total"]) for r in self.ranks)
        return figures

    def measured_host(self) -> dict[str, float]:
        """Per category (and buffers), the largest host figure over ranks (offload)."""
        return {
            c: max(float(r.get("host", {}).get(c, 0.0)) for r in self.ranks)
            for c in (*MODEL_STATES, "buffers")
        }

    def error_pct(self) -> dict[str, float | None]:
        predicted = self.predicted.as_dict()
        measured = self.measured()
        errors = {c: error_pct(predicted[c], measured[c]) for c in MODEL_STATES}
        errors["total"] = error_pct(predicted["total"], measured["model_state_total"])
        if not self.grads_measured:
            errors["grads"] = errors["total"] = None
        return errors

    def savings(self) -> dict[str, dict[str, float]]:
        full = self.full_replication.total
        measured = self.measured()
        predicted_total = self.predicted.total
        with_buffers = measured["model_state_total"] + measured["buffers_total"]
        return {
            # The worst rank: the one that decides whether a run fits.
            "measured": {
                "saved_bytes": full - measured["model_state_total"],
                "ratio": measured["model_state_total"] / full,
            },
            "measured_per_rank": {
                "saved_bytes": [full - r["model_state_total"] for r in self._by_rank()],
                "ratio": [r["model_state_total"] / full for r in self._by_rank()],
            },
            "predicted": {"saved_bytes": full - predicted_total, "ratio": predicted_total / full},
            # Buffers are not in the ZeRO accounting but take memory all the same: if
            # they eat the savings, this is the figure that shows it.
            "measured_with_buffers": {
                "saved_bytes": full - with_buffers,
                "ratio": with_buffers / full,
            },
        }

    def residuals(self) -> list[dict[str, Any]]:
        """Every category measured above its prediction, with the holders of its bytes."""
        predicted = self.predicted.as_dict()
        found = []
        for category in MODEL_STATES:
            if category == "grads" and not self.grads_measured:
                continue
            row = max(self.ranks, key=lambda r, c=category: r[c])
            excess = float(row[category]) - predicted[category]
            if excess <= self.residual_tolerance_pct / 100.0 * max(predicted[category], 1.0):
                continue
            holders = row.get("holders", {}).get(category, {})
            found.append(
                {
                    "category": category,
                    "rank": row["rank"],
                    "excess_bytes": excess,
                    "excess_pct_of_prediction": None
                    if predicted[category] == 0
                    else 100.0 * excess / predicted[category],
                    "held_by": dict(sorted(holders.items(), key=lambda kv: -kv[1])),
                    "at": row.get("high_water_points", {}).get(category),
                }
            )
        worst = max(self.ranks, key=lambda r: r["buffers_total"])
        # Buffers are outside ZeRO's accounting altogether; named once they are worth a line.
        if worst["buffers_total"] > BUFFER_NOTE_PCT / 100.0 * predicted["total"]:
            found.append(
                {
                    "category": "buffers",
                    "rank": worst["rank"],
                    "excess_bytes": float(worst["buffers_total"]),
                    # None where the device holds no model state (FSDP2's offload, ZeRO-3 offload).
                    "excess_pct_of_prediction": None
                    if predicted["total"] == 0
                    else 100.0 * worst["buffers_total"] / predicted["total"],
                    "held_by": dict(sorted(worst["buffers"].items(), key=lambda kv: -kv[1])),
                    "at": worst.get("high_water_points", {}).get("buffers"),
                }
            )
        return found

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA_VERSION,
            "strategy": self.strategy,
            "precision": self.precision,
            "optimizer": self.optimizer_name,
            "optimizer_class": self.optimizer_class,
            "world_size": self.world_size,
            "num_params": self.num_params,
            "device": self.device,
            "step": self.step,
            "residual_tolerance_pct": self.residual_tolerance_pct,
            "ranks": self.ranks,
            "measured": self.measured(),
            "measured_host": self.measured_host(),
            "predicted": self.predicted.as_dict(),
            "predicted_grads_paper": self.paper_grads,
            "full_replication": self.full_replication.as_dict(),
            "savings": self.savings(),
            "error_pct": self.error_pct(),
            "error_pct_definition": "(predicted - measured) / measured x 100, worst rank per category",
            "residuals": self.residuals(),
            "grads_measured": self.grads_measured,
            "settings": self.ranks[0].get("settings", {}),
            "largest_param": self.largest_param,
            "offload_optimizer": self.offload_optimizer,
            "gradient_checkpointing": self.gradient_checkpointing,
            "notes": list(self.notes),
            **({"model": self.model} if self.model is not None else {}),
            **({"param_shapes": self.param_shapes} if self.param_shapes is not None else {}),
            "frozen_params": self.frozen_params,
            **(
                {"frozen_param_shapes": self.frozen_param_shapes}
                if self.frozen_param_shapes is not None
                else {}
            ),
            "lora": self.lora,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryReport:
        return cls(
            strategy=data["strategy"],
            precision=data["precision"],
            world_size=int(data["world_size"]),
            num_params=int(data["num_params"]),
            ranks=list(data["ranks"]),
            optimizer_name=data.get("optimizer", "adamw"),
            optimizer_class=data.get("optimizer_class", ""),
            device=data.get("device", "cpu"),
            step=data.get("step"),
            residual_tolerance_pct=float(data.get("residual_tolerance_pct", 1.0)),
            notes=list(data.get("notes", [])),
            largest_param=data.get("largest_param"),
            offload_optimizer=data.get("offload_optimizer"),
            gradient_checkpointing=bool(data.get("gradient_checkpointing", False)),
            model=data.get("model"),
            param_shapes=data.get("param_shapes"),
            frozen_params=int(data.get("frozen_params", 0)),
            frozen_param_shapes=data.get("frozen_param_shapes"),
            lora=data.get("lora"),
        )

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> MemoryReport:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def tracker_scalars(self) -> dict[str, float]:
        """Flat ``memory/...`` scalars for accelerate trackers (MiB; ratios and % as is)."""
        measured = self.measured()
        scalars: dict[str, float] = {}
        for category in MODEL_STATES:
            scalars[f"memory/{category}_mib"] = measured[category] / MIB
        scalars["memory/model_state_mib"] = measured["model_state_total"] / MIB
        scalars["memory/buffers_mib"] = measured["buffers_total"] / MIB
        scalars["memory/predicted_model_state_mib"] = self.predicted.total / MIB
        scalars["memory/full_replication_mib"] = self.full_replication.total / MIB
        for kind, figures in self.savings().items():
            if kind == "measured_per_rank":
                continue  # per-rank figures are below, with each rank's model states
            scalars[f"memory/saved_mib_{kind}"] = figures["saved_bytes"] / MIB
            scalars[f"memory/saved_ratio_{kind}"] = figures["ratio"]
        for category, value in self.error_pct().items():
            if value is not None:
                scalars[f"memory/error_pct/{category}"] = value
        activations = [r["activations"] for r in self.ranks if r.get("activations") is not None]
        if activations:
            scalars["memory/activations_mib"] = max(activations) / MIB
        for row in self.ranks:
            peak = row.get("peak", {})
            headline = peak.get("headline")
            if headline and peak.get(headline) is not None:
                scalars[f"memory/rank{row['rank']}/peak_mib"] = peak[headline] / MIB
            scalars[f"memory/rank{row['rank']}/model_state_mib"] = row["model_state_total"] / MIB
            for key in ("max_allocated_pct", "num_alloc_retries", "num_ooms"):
                if peak.get(key) is not None:
                    scalars[f"memory/rank{row['rank']}/{key}"] = float(peak[key])
        return {k: v for k, v in scalars.items() if math.isfinite(v)}

    def _params_text(self) -> str:
        if not self.frozen_params:
            return f"{self.num_params:,} params"
        lora = f" (LoRA r={self.lora['r']})" if self.lora else ""
        return f"{self.num_params:,} trainable + {self.frozen_params:,} frozen params{lora}"

    def format_table(self) -> str:
        """The report as text for the log: one row per rank, then prediction, savings, residuals."""
        predicted = self.predicted.as_dict()
        full = self.full_replication.as_dict()
        peak_name = self.ranks[0].get("peak", {}).get("headline", "peak")
        columns = (*MODEL_STATES, "states", "buffers", "activations", "worst moment")
        lines = [
            f"memory: {self.strategy}"
            + (
                f" (optimizer offloaded to {self.offload_optimizer})"
                if self.offload_optimizer
                else ""
            )
            + f", {self.world_size} ranks, {self.precision}, "
            f"{self.optimizer_name}"
            + (f" ({self.optimizer_class})" if self.optimizer_class else "")
            + f", {self._params_text()}, {self.device}"
            + (f", step {self.step}" if self.step is not None else ""),
            _line("MiB", columns, peak_name),
        ]
        for row in sorted(self.ranks, key=lambda r: r["rank"]):
            peak = row.get("peak", {})
            peak_text = _mib(peak.get(peak.get("headline", "")))
            if peak.get("max_allocated_pct") is not None:
                peak_text += f" ({peak['max_allocated_pct']:.1f}% of device)"
            values = [row[c] for c in MODEL_STATES]
            values += [row["model_state_total"], row["buffers_total"], row.get("activations")]
            values.append(row.get("largest_moment", {}).get("total"))
            cells = [_mib(v) for v in values]
            if not row.get("grads_measured", True):
                cells[MODEL_STATES.index("grads")] = "unmeasured"
            lines.append(_line(f"rank {row['rank']}", cells, peak_text))
        if any(row.get("host_total") for row in self.ranks):
            # Offload: the rows above are the device's; what the backend keeps in host memory.
            for row in self._by_rank():
                host = row.get("host", {})
                values = [host.get(c, 0.0) for c in MODEL_STATES]
                values += [sum(values), host.get("buffers", 0.0)]
                lines.append(_line(f"rank {row['rank']} host", [_mib(v) for v in values]))
        for label, figures in (("predicted", predicted), ("full replication", full)):
            values = [figures[c] for c in (*MODEL_STATES, "total")]
            lines.append(_line(label, [_mib(v) for v in values]))
        errors = self.error_pct()
        error_cells = ["-" if errors[c] is None else f"{errors[c]:+.2f}" for c in errors]
        lines.append(_line("error % (pred.)", error_cells))
        if predicted["grads"] != self.paper_grads:
            lines.append(
                f"predicted grads {_mib(predicted['grads'])} MiB = the 16-bit gradients plus the "
                f"fp32 partition DeepSpeed's step casts from them for the master weights; "
                f"the ZeRO paper counts {_mib(self.paper_grads)} MiB"
            )
        savings = self.savings()
        per_rank = ", ".join(_mib(b) for b in savings.pop("measured_per_rank")["saved_bytes"])
        lines.append(
            "saved vs full replication (worst rank): "
            + ", ".join(
                f"{kind.replace('_', ' ')} {_mib(s['saved_bytes'])} MiB (x{s['ratio']:.3f})"
                for kind, s in savings.items()
            )
            + f"; measured per rank: {per_rank} MiB"
        )
        for residual in self.residuals():
            # Holders under 0.05 MiB (a straddling LayerNorm bias) stay in the JSON only.
            held = ", ".join(
                f"{name} {_mib(b)}" for name, b in residual["held_by"].items() if b >= 0.05 * MIB
            )
            where = f" at {residual['at']}" if residual.get("at") else ""
            lines.append(
                f"above prediction: {residual['category']} +{_mib(residual['excess_bytes'])} MiB "
                f"(rank {residual['rank']}{where}) held by: {held}"
            )
        if self.largest_param and any(r["category"] != "buffers" for r in self.residuals()):
            lines.append(
                f"largest parameter: {self.largest_param['name']}, "
                f"{self.largest_param['numel']:,} elements ({_mib(self.largest_param['bytes'])} MiB)"
            )
        moments = {r["rank"]: r.get("largest_moment", {}).get("point") for r in self.ranks}
        if any(moments.values()):
            lines.append(
                "worst moment = all counted tensors at the probe point where they peak: "
                + ", ".join(f"rank {rank} {point}" for rank, point in sorted(moments.items()))
            )
        for row in self._by_rank():
            peak = row.get("peak", {})
            if peak.get("allocated_rest_at_peak") is not None:
                lines.append(
                    f"rank {row['rank']} max allocated {_mib(peak['max_allocated'])} MiB = "
                    f"counted tensors at worst moment "
                    f"{_mib(row.get('largest_moment', {}).get('total'))} + rest "
                    f"{_mib(peak['allocated_rest_at_peak'])} (activations, workspace)"
                )
            if peak.get("rss_runtime_at_track") is None:
                continue
            lines.append(
                f"rank {row['rank']} {peak['headline'].replace('_', ' ')} "
                f"{_mib(peak['rss_high_water'])} MiB = runtime {_mib(peak['rss_runtime_at_track'])} "
                f"(RSS at track() minus its tensors) + counted tensors at worst moment "
                f"{_mib(row.get('largest_moment', {}).get('total'))} + rest "
                f"{_mib(peak['rss_rest_at_peak'])} (activations, workspace, allocator)"
            )
        lines.extend(peak_live_line(row) for row in self._by_rank() if row.get("peak_live"))
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)


def peak_live_line(row: dict[str, Any]) -> str:
    """One rank's live-tensor high-water (:mod:`dpkit.memory.live`) in a line: where in the
    step, and what was alive then by category."""
    peak = row["peak_live"]
    where = peak.get("point") or "?"
    detail = ", ".join(str(d) for d in (peak.get("module"), peak.get("op")) if d)
    split = ", ".join(
        f"{category} {_mib(nbytes)}" for category, nbytes in peak["by_category"].items() if nbytes
    )
    cuda = ""
    if peak.get("max_memory_allocated") is not None:
        cuda = (
            f"; max allocated {_mib(peak['max_memory_allocated'])}, "
            f"max reserved {_mib(peak['max_memory_reserved'])}"
        )
    return (
        f"rank {row['rank']} peak live tensors (step {peak.get('step')}) "
        f"{_mib(peak['bytes'])} MiB at {where}"
        + (f" ({detail})" if detail else "")
        + f" = {split}{cuda}"
    )


def _line(label: str, cells: Any, tail: str = "") -> str:
    """One table line: an 18-wide label, 13-wide right-aligned cells, then free text."""
    text = f"{label:<18}" + "".join(f"{cell:>13}" for cell in cells)
    return f"{text}  {tail}" if tail else text


def gradient_partition_bytes(row: dict[str, Any]) -> float | None:
    """A rank's own ZeRO gradient partition (what stage 2 shards), at the probe point where
    it is held, from a report row; None where no partition was seen (DDP)."""
    shares = [
        sum(
            b
            for name, b in phase["holders"].get("grads", {}).items()
            if name.endswith(PARTITION_SHARE)
        )
        for phase in row.get("phases", {}).values()
    ]
    return max(shares) if shares and max(shares) > 0 else None
