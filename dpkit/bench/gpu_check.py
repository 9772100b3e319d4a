"""``make gpu-check``: dpkit's CUDA paths on one GPU, every figure asserted, in one script.

    python -m dpkit.bench.gpu_check                        # from the repository root, with CUDA
    python -m dpkit.bench.gpu_check --output-dir runs/gpu-check --time-budget-s 540

Every launch is ``torchrun --standalone --nproc_per_node 1`` (as ``python -m
torch.distributed.run``), world size 1: plain ``python recipe.py`` would run DDP with
no process group at all (dpkit names a backend only for several processes or DeepSpeed,
and accelerate starts one only under a launcher), so its run_info.json would say
nothing about nccl. In order:

1. ``recipes/finetune.py`` (MiniLM, classification), bf16, as DDP and as ZeRO-2, 20 steps;
2. ``recipes/train_lm.py`` (``dpkit bench``'s GPU workload: GPT-2 124M, 8 x 1024 tokens,
   synthetic ids), bf16, as DDP and as ZeRO-2, 5 untimed + 20 timed steps;
3. ``pytest -m gpu`` (tests/test_memory.py's CUDA report test).

Asserted, from each run's own files: run_info.json says nccl, a cuda device, the
strategy, bf16, world size 1; the finetune runs' memory_report.json has
``max_allocated`` as every rank's headline peak, the tensors counted at one moment fit
under it, params/optimizer/master within 1% of the prediction
(:func:`dpkit.memory.analytic.model_state_bytes`) and grads within 2% of ``dpkit plan
--against`` (:func:`dpkit.plan.check.check_run`, in process); the LM runs' tokens/s and
MFU (torchtitan's FLOPs per token against :data:`PEAK_BF16_FLOPS`) are positive and MFU
at most 1; ``pytest -m gpu`` passed at least one test and skipped none.

Without CUDA: one line, exit code 2, nothing launched or written. Otherwise every check
runs; each failed assertion prints one line (figure, value, bound), everything goes to
``<output-dir>/results.json`` with a short table on stdout, and the exit code is 1 if
anything failed. The assertions, the FLOP count, MFU and the peak table take plain values
(tests/test_gpu_check.py runs them on CPU).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dpkit.plan.check import PlanCheck

EXIT_FAILED = 1
EXIT_NO_CUDA = 2
NO_CUDA_LINE = (
    "gpu-check: no CUDA device (torch.cuda.is_available() is False); run it on a GPU machine"
)
MIB = 2**20

# The bounds: the analytic model is exact for these three categories (measured to
# 0.00% on CPU, docs/bench.md), so 1% leaves room for alignment padding only; gradients
# follow DeepSpeed's layout, which `dpkit plan` models within 2% (tests/test_trainer.py).
MODEL_STATE_TOLERANCE_PCT = 1.0
GRADS_PLAN_TOLERANCE_PCT = 2.0
PREDICTED_CATEGORIES = ("params", "optimizer", "master")

STRATEGIES = ("ddp", "zero2")
PRECISION = "bf16"
FINETUNE_ARGS = (
    "--max-steps", "20", "--max-train-samples", "1280", "--max-eval-samples", "256",
    "--logging-steps", "5", "--no-save-model", "--no-save-checkpoints",
)  # fmt: skip
# dpkit bench's GPU defaults (dpkit/bench/cli.py), so the figures compare with its runs;
# synthetic ids need no fetched text on an offline GPU machine.
LM_ARGS = ("--size", "gpt2", "--synthetic", "--seq-len", "1024", "--micro-batch-size", "8")
LM_WARMUP_STEPS = 5  # step 1 walks the tensors (memory probes); CUDA warms up after it
LM_TIMED_STEPS = 20
# Per step, in seconds: each launch is start-up bound (imports, NCCL, DeepSpeed: ~30-60 s);
# the default budget keeps the whole check under 10 minutes even if one launch hangs.
LAUNCH_LIMIT_S = 150.0
PYTEST_LIMIT_S = 150.0
DEFAULT_BUDGET_S = 540.0
MIN_LAUNCH_S = 20.0  # less than this left: the step is reported as not run


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
        """The one line the check prints for it."""
        return f"gpu-check: FAILED {self.run}: {self.figure} = {self.value} (bound: {self.bound})"


# ---- pure parts: tested on CPU ----------------------------------------------------------------


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


def _peak_failures(run: str, row: Mapping[str, Any]) -> list[Failure]:
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


def memory_failures(run: str, report: Mapping[str, Any], plan: PlanCheck) -> list[Failure]:
    """What is wrong with a CUDA run's memory report (``MemoryReport.to_dict()``) and its
    ``dpkit plan --against`` check; empty when every figure is within its bound."""
    failures = []
    if not str(report.get("device")).startswith("cuda"):
        failures.append(
            Failure(run, "memory_report.json device", str(report.get("device")), "cuda")
        )
    for row in report["ranks"]:
        failures += _peak_failures(run, row)
    for category in PREDICTED_CATEGORIES:
        failures += _bound_failures(
            run,
            f"{category} (worst rank) vs the prediction",
            float(report["measured"][category]),
            float(report["predicted"][category]),
            MODEL_STATE_TOLERANCE_PCT,
        )
    if report.get("grads_measured") is not True:
        # A floor, not a figure: the probes missed a point where gradients are held.
        failures.append(Failure(run, "grads_measured", str(report.get("grads_measured")), "True"))
    failures += _bound_failures(
        run,
        "grads (worst rank) vs dpkit plan --against",
        plan.measured["grads"],
        plan.predicted["grads"],
        GRADS_PLAN_TOLERANCE_PCT,
    )
    return failures


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


def throughput_failures(run: str, tokens_per_s: float, mfu: float | None) -> list[Failure]:
    """Tokens/s must be positive; MFU (where the peak is known) in (0, 1]: above 1 the
    FLOP count or the timing is wrong."""
    failures = []
    if not tokens_per_s > 0:
        failures.append(Failure(run, "tokens/s", f"{tokens_per_s}", "> 0"))
    if mfu is not None and not 0 < mfu <= 1:
        failures.append(Failure(run, "MFU", f"{mfu:.4f}", "in (0, 1]"))
    return failures


def junit_counts(xml_text: str) -> dict[str, int]:
    """Test counts of a pytest ``--junitxml`` report: tests, failures, errors, skipped, passed."""
    root = ElementTree.fromstring(xml_text)
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    counts = {
        key: sum(int(suite.get(key, 0)) for suite in suites)
        for key in ("tests", "failures", "errors", "skipped")
    }
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def pytest_failures(exit_code: int | None, counts: Mapping[str, int] | None) -> list[Failure]:
    """``pytest -m gpu`` on a CUDA machine: none failed, none skipped (a skipped GPU test
    checked nothing), at least one passed."""
    run = "pytest -m gpu"
    if counts is None:
        return [Failure(run, "junit report", f"none (exit code {exit_code})", "written")]
    failures = []
    if counts["failures"] + counts["errors"]:
        failed = counts["failures"] + counts["errors"]
        failures.append(Failure(run, "failed tests", str(failed), "0"))
    if counts["skipped"]:
        failures.append(Failure(run, "skipped tests", str(counts["skipped"]), "0"))
    if counts["passed"] < 1:
        failures.append(Failure(run, "passed tests", str(counts["passed"]), ">= 1"))
    if exit_code != 0 and not failures:
        failures.append(Failure(run, "exit code", str(exit_code), "0"))
    return failures


# ---- on the GPU machine -----------------------------------------------------------------------


@dataclass
class Budget:
    """The check's wall-clock budget: a step gets its own limit or what is left, if less."""

    total_s: float
    started: float = field(default_factory=time.perf_counter)

    def limit(self, step_limit_s: float) -> float:
        """Seconds the next step may take (0 or more)."""
        left = self.total_s - (time.perf_counter() - self.started)
        return max(0.0, min(step_limit_s, left))


def _launch(
    cmd: Sequence[str], log_path: Path, cwd: Path, env: Mapping[str, str], limit_s: float
) -> tuple[int | None, float]:
    """Run ``cmd`` in its own session, output to ``log_path``; (exit code or None when it
    was killed at ``limit_s``, wall seconds). Its whole process tree goes on a timeout or ^C."""
    started = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            list(cmd), cwd=cwd, env=dict(env), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            code: int | None = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return code, time.perf_counter() - started


def _read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _run_step(
    name: str,
    recipe: str,
    strategy: str,
    workload_args: Sequence[str],
    out: Path,
    env: Mapping[str, str],
    budget: Budget,
) -> tuple[dict[str, Any], list[Failure]]:
    """Launch ``recipe`` as ``strategy`` in bf16 on one GPU and check its run_info.json;
    the run's record and failures."""
    from dpkit import resources

    run_dir = out / name
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
        str(resources.recipe(recipe)), "--strategy", strategy, "--mixed-precision", PRECISION,
        *workload_args, "--output-dir", str(run_dir), "--overwrite-output-dir",
    ]  # fmt: skip
    record: dict[str, Any] = {"command": shlex.join(cmd), "log": str(out / f"{name}.log")}
    limit = budget.limit(LAUNCH_LIMIT_S)
    if limit < MIN_LAUNCH_S:
        record["exit_code"] = None
        return record, [Failure(name, "launch", "not run", "the time budget left room for it")]
    print(f"gpu-check: {name}: {record['command']}", file=sys.stderr, flush=True)
    code, wall = _launch(cmd, Path(record["log"]), out, env, limit)
    record.update(exit_code=code, wall_s=wall)
    if code != 0:
        value = f"killed after {wall:.0f} s" if code is None else f"exit code {code}"
        return record, [Failure(name, "launch", f"{value} (log {record['log']})", "exit code 0")]
    record["run_info"] = _read_json(run_dir / "run_info.json") or {}
    return record, run_info_failures(name, record["run_info"], strategy)


def check_finetune(name: str, run_dir: Path) -> tuple[dict[str, Any], list[Failure]]:
    """The memory report of a finished finetune.py run against the prediction and the plan."""
    from dpkit.errors import UsageError
    from dpkit.plan.check import check_dict, check_run

    report = _read_json(run_dir / "memory_report.json")
    if report is None:
        return {}, [Failure(name, "memory_report.json", "missing", "written at the end of the run")]
    try:
        plan = check_run(run_dir)
    except (UsageError, OSError, KeyError, ValueError) as err:
        return {}, [Failure(name, "dpkit plan --against", repr(err), "a plan of the run")]
    record = {
        "max_allocated": [r.get("peak", {}).get("max_allocated") for r in report["ranks"]],
        "measured": report["measured"],
        "predicted": report["predicted"],
        "deviation_pct": {
            c: deviation_pct(report["measured"][c], report["predicted"][c])
            for c in PREDICTED_CATEGORIES
        },
        "grads_vs_plan_pct": deviation_pct(plan.measured["grads"], plan.predicted["grads"]),
        "plan": check_dict(plan),
    }
    return record, memory_failures(name, report, plan)


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


def check_lm(
    name: str, run_dir: Path, peak: PeakFlops | None
) -> tuple[dict[str, Any], list[Failure]]:
    """Tokens/s after the warm-up and MFU of a finished train_lm.py run."""
    from dpkit.bench.results import summarize_steps
    from dpkit.train.output import read_jsonl

    steps = summarize_steps(read_jsonl(run_dir / "train_log.jsonl"), LM_WARMUP_STEPS, 1)
    tokens_per_s = steps["tokens_per_s_per_rank"]  # one GPU: per rank is per device
    per_token = lm_flops_per_token(run_dir)
    mfu = model_flops_utilization(per_token, tokens_per_s, peak.flops if peak else None)
    report = _read_json(run_dir / "memory_report.json") or {"ranks": []}
    record = {
        "tokens_per_s": tokens_per_s,
        "median_step_time_s": steps["median_step_time_s"],
        "timed_steps": steps["timed_steps"],
        "flops_per_token": per_token,
        "mfu": mfu,
        "max_allocated": [r.get("peak", {}).get("max_allocated") for r in report["ranks"]],
    }
    return record, throughput_failures(name, tokens_per_s, mfu)


def run_pytest(
    out: Path, env: Mapping[str, str], budget: Budget
) -> tuple[dict[str, Any], list[Failure]]:
    """``pytest -m gpu`` over the checkout's tests, read back from its junit report."""
    from dpkit.bench.launch import PACKAGE_PARENT

    tests = PACKAGE_PARENT / "tests"
    if not tests.is_dir():
        return {}, [Failure("pytest -m gpu", "tests folder", str(tests), "a checkout's tests/")]
    xml_path = out / "pytest-gpu.xml"
    xml_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", str(tests), "-q", "-p", "no:cacheprovider",
           f"--junitxml={xml_path}"]  # fmt: skip
    record: dict[str, Any] = {"command": shlex.join(cmd), "log": str(out / "pytest-gpu.log")}
    limit = budget.limit(PYTEST_LIMIT_S)
    if limit < MIN_LAUNCH_S:
        return record, [Failure("pytest -m gpu", "launch", "not run", "the time budget left room")]
    print(f"gpu-check: pytest -m gpu: {record['command']}", file=sys.stderr, flush=True)
    code, wall = _launch(cmd, Path(record["log"]), PACKAGE_PARENT, env, limit)
    counts = junit_counts(xml_path.read_text()) if xml_path.is_file() else None
    record.update(exit_code=code, wall_s=wall, counts=counts)
    return record, pytest_failures(code, counts)


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_summary(results: Mapping[str, Any]) -> str:
    """The results as a short table, then pytest's counts and the verdict."""
    peak = results["peak"]
    lines = [
        f"gpu-check: {results['device_name']}, bf16 peak "
        + (f"{peak['flops'] / 1e12:.0f} TFLOPS ({peak['label']})" if peak else "unknown (MFU -)")
        + f", {results['wall_s']:.0f} s",
        f"{'run':<16}{'exit':>5}{'backend':>9}{'device':>9}{'peak GiB':>10}"
        f"{'states err %':>14}{'grads vs plan %':>17}{'tokens/s':>11}{'MFU %':>7}",
    ]
    for name, run in results["runs"].items():
        info = run.get("run_info", {})
        peaks = [p for p in run.get("max_allocated", []) if p is not None]
        deviations = list(run.get("deviation_pct", {}).values())
        mfu = run.get("mfu")
        lines.append(
            f"{name:<16}{_cell(run.get('exit_code'), 'd'):>5}{str(info.get('backend', '-')):>9}"
            f"{str(info.get('device', '-')):>9}{_cell(max(peaks) / 2**30 if peaks else None, '.2f'):>10}"
            f"{_cell(max(deviations) if deviations else None, '.2f'):>14}"
            f"{_cell(run.get('grads_vs_plan_pct'), '.2f'):>17}"
            f"{_cell(run.get('tokens_per_s'), ',.0f'):>11}"
            f"{_cell(None if mfu is None else 100 * mfu, '.1f'):>7}"
        )
    counts = results["pytest_gpu"].get("counts")
    lines.append(
        "pytest -m gpu: "
        + (", ".join(f"{counts[k]} {k}" for k in ("passed", "skipped", "failures", "errors"))
           if counts else "no report")
    )  # fmt: skip
    lines += [f"note: {note}" for note in results.get("notes", [])]
    lines += [Failure(**f).line() for f in results["failures"]]
    verdict = "passed" if not results["failures"] else f"{len(results['failures'])} failed"
    lines.append(f"gpu-check: {verdict}; results in {results['results_path']}")
    return "\n".join(lines)


def run_check(out: Path, budget: Budget) -> dict[str, Any]:
    """Every launch and check on this CUDA machine; the results (failures included)."""
    import torch

    from dpkit.bench.launch import launch_env

    device_name = torch.cuda.get_device_name(0)
    peak = lookup_peak_flops(device_name)
    env = launch_env({"threads_per_process": None})
    runs: dict[str, dict[str, Any]] = {}
    failures: list[Failure] = []
    lm_args = (*LM_ARGS, "--max-steps", str(LM_WARMUP_STEPS + LM_TIMED_STEPS))
    for recipe, prefix, workload_args in (
        ("finetune.py", "finetune", FINETUNE_ARGS),
        ("train_lm.py", "lm", lm_args),
    ):
        for strategy in STRATEGIES:
            name = f"{prefix}-{strategy}"
            record, found = _run_step(name, recipe, strategy, workload_args, out, env, budget)
            if record.get("exit_code") == 0:  # a failed launch is one failure, not one per file
                try:
                    checked, more = (
                        check_finetune(name, out / name)
                        if prefix == "finetune"
                        else check_lm(name, out / name, peak)
                    )
                except Exception as err:  # a run's unreadable files must not stop the rest
                    checked, more = {}, [Failure(name, "reading its files", repr(err), "readable")]
                record.update(checked)
                found += more
            runs[name] = record
            failures += found
    pytest_record, found = run_pytest(out, env, budget)
    failures += found
    notes = [] if peak else [f"{device_name!r} is not in the peak-FLOPS table: MFU not computed"]
    return {
        "device_name": device_name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "peak": None if peak is None else asdict(peak),
        "tolerances_pct": {
            "params_optimizer_master_vs_prediction": MODEL_STATE_TOLERANCE_PCT,
            "grads_vs_plan": GRADS_PLAN_TOLERANCE_PCT,
        },
        "runs": runs,
        "pytest_gpu": pytest_record,
        "notes": notes,
        "failures": [asdict(f) for f in failures],
        "passed": not failures,
    }


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m dpkit.bench.gpu_check``."""
    parser = argparse.ArgumentParser(
        prog="python -m dpkit.bench.gpu_check",
        description="make gpu-check: dpkit's CUDA paths on one GPU, every figure asserted; "
        "exit 0 when all hold, 1 when any fails, 2 without CUDA.",
    )
    parser.add_argument("--output-dir", default="runs/gpu-check", help="runs, logs, results.json")
    parser.add_argument(
        "--time-budget-s",
        type=float,
        default=DEFAULT_BUDGET_S,
        help="wall-clock budget of all launches together (each step: at most 150 s)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the check: 0 when every figure is within its bound, 1 otherwise, 2 without CUDA."""
    args = build_parser().parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(NO_CUDA_LINE, file=sys.stderr, flush=True)
        return EXIT_NO_CUDA
    budget = Budget(args.time_budget_s)
    out = Path(args.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.json"
    results_path.unlink(missing_ok=True)  # a stale verdict must not outlive a crashed check
    results = run_check(out, budget)
    results.update(wall_s=time.perf_counter() - budget.started, results_path=str(results_path))
    results_path.write_text(json.dumps(results, indent=2) + "\n")
    print(format_summary(results), flush=True)
    return 0 if results["passed"] else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
