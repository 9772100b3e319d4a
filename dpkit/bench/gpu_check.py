"""The figures ``make gpu-check`` asserts, taken as plain values.

``make gpu-check`` is ``pytest -m gpu`` (Makefile): tests/test_gpu_runs.py launches
``recipes/finetune.py`` and ``recipes/train_lm.py`` on one GPU (bf16, DDP and ZeRO-2) and
applies these helpers to each run's own files; tests/test_gpu_check.py runs them on CPU.
Before pytest, ``python -m dpkit.bench.gpu_check`` (:func:`main`) stops the check with one
line and exit code 2 where there is no CUDA.

- FLOPs per token as torchtitan counts them, MFU against :data:`PEAK_BF16_FLOPS`;
- the ``*_failures`` helpers: each checks one figure (or one file's few fields) against its
  bound and returns a :class:`Failure` per figure off it, empty when all hold; a test
  asserts the list is empty, the failures' one-line descriptions as its message.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dpkit.plan.check import PlanCheck

EXIT_NO_CUDA = 2
NO_CUDA_LINE = (
    "gpu-check: no CUDA device (torch.cuda.is_available() is False); run it on a GPU machine"
)
MIB = 2**20

PRECISION = "bf16"
PREDICTED_CATEGORIES = ("params", "optimizer", "master")
"""The categories the analytic model predicts exactly (gradients follow the backend's layout)."""
LM_WARMUP_STEPS = 5  # step 1 walks the tensors (memory probes); CUDA warms up after it
LM_TIMED_STEPS = 20


@dataclass(frozen=True)
class PeakFlops:
    """A device's dense bf16 tensor-core peak, and how to recognise it by name."""

    label: str
    all_of: tuple[str, ...]
    """Words the device name must contain (``torch.cuda.get_device_name``, upper-cased)."""
    none_of: tuple[str, ...]
    """Words that mark a different part under the same family name."""
    flops: float


# NVIDIA's datasheet figures without sparsity. The SXM H100 reports itself as "NVIDIA
# H100 80GB HBM3"; the PCIe (756 TFLOPS) and NVL parts peak lower and are left unknown
# rather than credited with the SXM figure, as is the H200 NVL (835 TFLOPS).
PEAK_BF16_FLOPS: tuple[PeakFlops, ...] = (
    PeakFlops("H200", ("H200",), ("NVL",), 989e12),
    PeakFlops("H100 SXM", ("H100", "HBM3"), ("PCIE", "NVL"), 989e12),
    PeakFlops("H100 SXM", ("H100", "SXM5"), ("PCIE", "NVL"), 989e12),
    PeakFlops("A100", ("A100",), (), 312e12),
)


@dataclass(frozen=True)
class Failure:
    """One failed assertion: the run, the figure, its value and the bound it broke."""

    run: str
    figure: str
    value: str
    bound: str

    def line(self) -> str:
        """The one line a test reports for it."""
        return f"gpu-check: FAILED {self.run}: {self.figure} = {self.value} (bound: {self.bound})"


def failure_lines(failures: list[Failure]) -> str:
    """A failing test's message: one line per failure."""
    return "\n".join(failure.line() for failure in failures)


# ---- FLOPs, MFU, peaks --------------------------------------------------------------------------


def lookup_peak_flops(device_name: str) -> PeakFlops | None:
    """The entry of :data:`PEAK_BF16_FLOPS` for ``device_name``, or None for a device not in it."""
    words = set(re.split(r"[\s_-]+", device_name.upper()))
    for entry in PEAK_BF16_FLOPS:
        if set(entry.all_of) <= words and not set(entry.none_of) & words:
            return entry
    return None


def flops_per_token(
    non_embedding_params: int, layers: int, heads: int, head_dim: int, seq_len: int
) -> int:
    """Training FLOPs per token as torchtitan's ``get_num_flop_per_token`` counts them.

    6 per parameter (a multiply-add forward, two backward) plus ``12 x layers x heads x
    head_dim x seq_len`` for attention's two matmuls, forward and backward: the causal
    mask's skipped half counted as done, flash attention's recomputation not counted.
    """
    shape = {"layers": layers, "heads": heads, "head_dim": head_dim, "seq_len": seq_len}
    for name, value in {"non_embedding_params": non_embedding_params, **shape}.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    return 6 * non_embedding_params + 12 * layers * heads * head_dim * seq_len


def non_embedding_param_count(model: Any) -> int:
    """Parameters that do matmul work for every token, each once: all of them less the
    embedding tables that are only looked up (positions; tokens when the output head has
    its own weight).

    torchtitan subtracts Llama's token embedding and counts its separate output head; a
    head tied to the token embedding (GPT-2) does that same matmul with the table, so a
    tied table stays in (as nanoGPT counts it).
    """
    import torch

    held_elsewhere = {
        id(p)
        for module in model.modules()
        if not isinstance(module, torch.nn.Embedding)
        for p in module.parameters(recurse=False)
    }
    lookups = {
        id(p): p.numel()
        for module in model.modules()
        if isinstance(module, torch.nn.Embedding)
        for p in module.parameters(recurse=False)
        if id(p) not in held_elsewhere
    }
    return sum(p.numel() for p in model.parameters()) - sum(lookups.values())


def model_flops_utilization(
    flops_per_token: float, tokens_per_s: float, peak_flops: float | None
) -> float | None:
    """Model FLOPs per second over the device's peak; None when the peak is unknown."""
    if peak_flops is None:
        return None
    if flops_per_token <= 0 or tokens_per_s <= 0 or peak_flops <= 0:
        raise ValueError(
            f"flops_per_token {flops_per_token}, tokens_per_s {tokens_per_s} and "
            f"peak_flops {peak_flops} must be positive"
        )
    return flops_per_token * tokens_per_s / peak_flops


def lm_flops_per_token(run_dir: Path) -> int:
    """FLOPs per token of the model a train_lm.py run trained (its run_config.json)."""
    from dataclasses import fields

    from dpkit.data import lm as lm_data
    from dpkit.models import build_meta_model, hidden_size_of

    recorded = json.loads((run_dir / "run_config.json").read_text())["LMWorkload"]
    known = {f.name for f in fields(lm_data.LMWorkload)}
    workload = lm_data.LMWorkload(**{k: v for k, v in recorded.items() if k in known})
    config = lm_data.lm_config(workload)
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or hidden_size_of(config) // heads
    return flops_per_token(
        non_embedding_param_count(build_meta_model(config)),
        int(config.num_hidden_layers),
        heads,
        int(head_dim),
        workload.seq_len,
    )


def lm_figures(run_dir: Path, peak: PeakFlops | None) -> dict[str, Any]:
    """Tokens/s after the warm-up, the FLOP count and MFU (None for a device not in
    :data:`PEAK_BF16_FLOPS`) of a finished train_lm.py run on one GPU, from its own files."""
    from dpkit.bench.results import summarize_steps
    from dpkit.train.output import read_jsonl

    steps = summarize_steps(read_jsonl(run_dir / "train_log.jsonl"), LM_WARMUP_STEPS, 1)
    tokens_per_s = steps["tokens_per_s_per_rank"]  # one GPU: per rank is per device
    per_token = lm_flops_per_token(run_dir)
    return {
        "tokens_per_s": tokens_per_s,
        "median_step_time_s": steps["median_step_time_s"],
        "timed_steps": steps["timed_steps"],
        "flops_per_token": per_token,
        "mfu": model_flops_utilization(per_token, tokens_per_s, peak.flops if peak else None),
    }


# ---- the assertions -----------------------------------------------------------------------------


def deviation_pct(measured: float, predicted: float) -> float:
    """The memory report's error (:func:`dpkit.memory.report.error_pct`), unsigned:
    infinite when only the prediction is non-zero."""
    from dpkit.memory.report import error_pct

    error = error_pct(predicted, measured)
    return math.inf if error is None else abs(error)


def _bound_failures(
    run: str, figure: str, measured: float, predicted: float, tolerance_pct: float
) -> list[Failure]:
    """One failure if ``measured`` is more than ``tolerance_pct`` from ``predicted``."""
    error = deviation_pct(measured, predicted)
    if error <= tolerance_pct:
        return []
    return [
        Failure(
            run,
            f"{figure} {_mib(predicted)}",
            f"{_mib(measured)} ({error:.2f}% off)",
            f"within {tolerance_pct:g}%",
        )
    ]


def _mib(value: float) -> str:
    return f"{value / MIB:,.1f} MiB"


def _rank_peak_failures(run: str, row: Mapping[str, Any]) -> list[Failure]:
    """A rank's CUDA peak: the allocator's ``max_allocated`` as the headline, consistent
    with the allocator's other figures, and at least what the probes saw held at once."""
    rank = f"rank {row.get('rank')}"
    peak = row.get("peak", {})
    if peak.get("headline") != "max_allocated":
        return [Failure(run, f"{rank} headline peak", str(peak.get("headline")), "max_allocated")]
    failures = []
    allocated = float(peak.get("max_allocated") or 0.0)
    reserved = float(peak.get("max_reserved") or 0.0)
    capacity = float(peak.get("device_capacity") or 0.0)
    if not 0 < allocated <= reserved <= capacity:
        failures.append(
            Failure(
                run,
                f"{rank} max_allocated, max_reserved, device_capacity",
                f"{_mib(allocated)}, {_mib(reserved)}, {_mib(capacity)}",
                "0 < max_allocated <= max_reserved <= device_capacity",
            )
        )
    moment = row.get("largest_moment", {}).get("total")
    if moment is None:
        failures.append(
            Failure(run, f"{rank} tensors held at the worst moment", "none", "step probes ran")
        )
    elif moment > allocated:
        # Everything the probes counted at one point was allocated at once.
        failures.append(
            Failure(
                run,
                f"{rank} tensors held at the worst moment",
                _mib(moment),
                f"<= max_allocated {_mib(allocated)}",
            )
        )
    if peak.get("num_ooms"):
        failures.append(Failure(run, f"{rank} num_ooms", str(peak["num_ooms"]), "0"))
    return failures


def cuda_peak_failures(run: str, report: Mapping[str, Any]) -> list[Failure]:
    """A CUDA run's memory report (``MemoryReport.to_dict()``): made on a cuda device, and
    every rank's peak the allocator's, consistent, above what was held at once, no OOM."""
    failures = []
    if not str(report.get("device")).startswith("cuda"):
        failures.append(
            Failure(run, "memory_report.json device", str(report.get("device")), "cuda")
        )
    for row in report["ranks"]:
        failures += _rank_peak_failures(run, row)
    return failures


def model_state_failures(
    run: str, report: Mapping[str, Any], category: str, tolerance_pct: float
) -> list[Failure]:
    """``category`` (one of :data:`PREDICTED_CATEGORIES`) on the worst rank against the
    report's prediction (:func:`dpkit.memory.analytic.model_state_bytes`)."""
    return _bound_failures(
        run,
        f"{category} (worst rank) vs the prediction",
        float(report["measured"][category]),
        float(report["predicted"][category]),
        tolerance_pct,
    )


def grads_failures(
    run: str, report: Mapping[str, Any], plan: PlanCheck, tolerance_pct: float
) -> list[Failure]:
    """Gradients on the worst rank, measured (the probes saw a point where they are held)
    and against ``dpkit plan --against`` (:func:`dpkit.plan.check.check_run`), which
    models the backend's gradient layout."""
    failures = []
    if report.get("grads_measured") is not True:
        # A floor, not a figure: the probes missed a point where gradients are held.
        failures.append(Failure(run, "grads_measured", str(report.get("grads_measured")), "True"))
    return failures + _bound_failures(
        run,
        "grads (worst rank) vs dpkit plan --against",
        plan.measured["grads"],
        plan.predicted["grads"],
        tolerance_pct,
    )


def run_info_failures(
    run: str, info: Mapping[str, Any], strategy: str, world_size: int = 1
) -> list[Failure]:
    """What run_info.json says ran, against an nccl job on CUDA of ``strategy`` in bf16."""
    from dpkit.engines import get_strategy

    expected = {
        "backend": "nccl",
        "strategy": strategy,
        "zero_stage": get_strategy(strategy).zero_stage,
        "precision": PRECISION,
        "world_size": world_size,
    }
    failures = [
        Failure(run, f"run_info.json {key}", repr(info.get(key)), repr(value))
        for key, value in expected.items()
        if info.get(key) != value
    ]
    if not str(info.get("device")).startswith("cuda"):
        failures.append(Failure(run, "run_info.json device", repr(info.get("device")), "cuda:N"))
    return failures


def tokens_per_s_failures(run: str, tokens_per_s: float) -> list[Failure]:
    """Tokens/s must be positive."""
    return [] if tokens_per_s > 0 else [Failure(run, "tokens/s", f"{tokens_per_s}", "> 0")]


def mfu_failures(run: str, mfu: float) -> list[Failure]:
    """MFU in (0, 1]: above 1 the FLOP count or the timing is wrong."""
    return [] if 0 < mfu <= 1 else [Failure(run, "MFU", f"{mfu:.4f}", "in (0, 1]")]


# ---- before pytest ------------------------------------------------------------------------------


def main() -> int:
    """``make gpu-check``'s first step: without CUDA one line and exit code 2; with it, the
    device and its bf16 peak in one line and exit code 0."""
    import torch

    if not torch.cuda.is_available():
        print(NO_CUDA_LINE, file=sys.stderr, flush=True)
        return EXIT_NO_CUDA
    name = torch.cuda.get_device_name(0)
    peak = lookup_peak_flops(name)
    known = f"{peak.flops / 1e12:.0f} TFLOPS ({peak.label})" if peak else "unknown (no MFU)"
    print(f"gpu-check: {name}, bf16 peak {known}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
