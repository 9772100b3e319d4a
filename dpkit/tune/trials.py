"""One trial of ``dpkit tune``: launch the recipe for a candidate, read what it measured.

A trial is a real launch under ``accelerate launch`` with dpkit's YAML for the
strategy (ZeRO: naming a DeepSpeed JSON with the candidate's ``zero_optimization`` keys;
FSDP2: ``fsdp_version: 2`` and the mode's ``fsdp_reshard_after_forward``), run by
``dpkit bench``'s launcher (:func:`dpkit.bench.launch.run_phase`: own session, free
port, timeout, the output tail on failure). Its figures are read from the run's own
files with ``dpkit bench``'s readers, and kept in ``trial.json`` beside a fingerprint
of everything that shaped the trial: a later tune of the same folder with the same
fingerprint reuses the trial instead of launching it again.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpkit.bench import launch
from dpkit.bench.machine import stack_versions
from dpkit.bench.results import summarize_memory, summarize_steps
from dpkit.engines import engine_of, get_strategy
from dpkit.train.output import read_json, read_jsonl
from dpkit.tune.config import TuneSettings
from dpkit.tune.space import Candidate

TRIAL_FILE = "trial.json"
# What a trial ends as.
OK, FAILED, PRUNED, NOT_RUN = "ok", "failed", "pruned", "not run"


@dataclass
class Trial:
    """A candidate and what became of it."""

    candidate: Candidate
    status: str = NOT_RUN
    """``ok``, ``failed`` (crashed, timed out, or not the job asked for), ``pruned``
    (predicted over the budget, not launched) or ``not run`` (time or trial budget)."""
    reason: str = ""
    """Why it failed, was pruned or did not run."""
    predicted_bytes: float | None = None
    """dpkit plan's peak per rank for it (None: no plan)."""
    figures: dict[str, Any] = field(default_factory=dict)
    """Step times, rates, memory (:func:`read_figures`)."""
    wall_s: float | None = None
    """The launch's wall time, start-up included."""
    reused: bool = False
    """Read from an earlier tune of the same folder, not launched this time."""
    command: str = ""

    @property
    def name(self) -> str:
        return self.candidate.name

    @property
    def step_time(self) -> float | None:
        """Median wall time of an optimizer step after the warm-up."""
        return self.figures.get("median_step_time_s")

    @property
    def memory_bytes(self) -> float | None:
        """The measured peak per rank that the budget is checked against."""
        return self.figures.get("memory_bytes")

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.candidate.as_dict(),
            "status": self.status,
            "reason": self.reason,
            "predicted_bytes": self.predicted_bytes,
            "wall_s": self.wall_s,
            "reused": self.reused,
            "command": self.command,
            "figures": self.figures,
        }


def trial_dir(settings: TuneSettings, candidate: Candidate) -> Path:
    return settings.output_dir / "trials" / candidate.name


def _file_digest(path: Path) -> str | None:
    """The recipe's bytes: an edited script is another trial."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    except OSError:
        return None


def fingerprint(settings: TuneSettings, candidate: Candidate) -> str:
    """Everything that shapes a trial's time or memory: the recipe (its name and its
    code), its arguments, processes, device, steps and threads, the candidate, and the
    versions of the libraries that run it; paths, ports and the tune's own settings that
    only judge a trial (the budgets, the tie tolerance) left out."""
    key = {
        "recipe": settings.recipe.path.name,
        "recipe_code": _file_digest(settings.recipe.path),
        "libraries": stack_versions(),  # what runs a trial: its kernels, engine, measure
        "recipe_args": list(settings.config.recipe_args),
        "nproc": settings.nproc,
        "device": settings.device,
        "warmup_steps": settings.config.warmup_steps,
        "steps": settings.config.steps,
        "threads_per_process": settings.threads_per_process,
        "candidate": candidate.as_dict(),
    }
    key["candidate"].pop("round")
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def recipe_command(settings: TuneSettings, candidate: Candidate) -> list[str]:
    """The recipe and its arguments for ``candidate`` (the launcher's part comes first)."""
    return [
        str(settings.recipe.path),
        *settings.config.recipe_args,
        "--micro-batch-size", str(candidate.micro_batch_size),
        "--gradient-accumulation-steps", str(candidate.gradient_accumulation_steps),
        *(["--gradient-checkpointing"] if candidate.gradient_checkpointing else []),
    ]  # fmt: skip


def phase(settings: TuneSettings, candidate: Candidate) -> launch.Phase:
    """The launch of ``candidate``: ``accelerate launch`` with the strategy's YAML (for
    FSDP2 the recipe reads the mode from it and applies ``fully_shard`` itself, on CPU
    and GPU alike)."""
    where = trial_dir(settings, candidate)
    run_dir = where / "run"
    strategy = get_strategy(candidate.strategy)
    config = launch.accelerate_config(strategy, candidate.zero_overrides, where)
    cmd = [
        launch.launcher_path("accelerate"), "launch",
        "--config_file", str(config),
        "--num_processes", str(settings.nproc),
        "--main_process_port", str(launch.free_port()),
        *recipe_command(settings, candidate),
        "--max-steps", str(settings.total_steps),
        "--output-dir", str(run_dir),
        *settings.recipe.extra_args(settings.probe_steps),
    ]  # fmt: skip
    return launch.Phase(candidate.name, strategy, False, "accelerate launch", cmd, run_dir)


def read_figures(settings: TuneSettings, candidate: Candidate, run_dir: Path) -> dict[str, Any]:
    """The trial's step times and rates, memory per rank, and the settings it ran with;
    :class:`ValueError` when the run is not the job asked for."""
    info = read_json(run_dir / "run_info.json")
    ran = (
        info.get("strategy"),
        int(info.get("world_size", 0)),
        int(info.get("micro_batch_size", 0)),
        int(info.get("gradient_accumulation_steps", 0)),
        bool(info.get("gradient_checkpointing", False)),
    )
    asked = (
        candidate.strategy,
        settings.nproc,
        candidate.micro_batch_size,
        candidate.gradient_accumulation_steps,
        candidate.gradient_checkpointing,
    )
    if ran != asked:
        raise ValueError(
            "ran as strategy/processes/micro-batch/accumulation/checkpointing "
            f"{'/'.join(map(str, ran))}, not {'/'.join(map(str, asked))}"
        )
    records = read_jsonl(run_dir / "train_log.jsonl")
    steps = summarize_steps(records, settings.config.warmup_steps, settings.nproc)
    memory = summarize_memory(read_json(run_dir / "memory_report.json"))
    on_cuda = str(info.get("device", "cpu")).startswith("cuda")
    # CUDA: the allocator's peak. CPU: the high-water of live tensor bytes of the watched
    # step (peak_live: temporaries included), what dpkit plan's peak predicts; the
    # process's RSS adds the interpreter and libraries, which differ by launcher, not by
    # strategy (it is kept in memory_ranks). A run without peak_live (a script that probes
    # no step) falls back on the counted tensors at their high-waters.
    counted = [
        r["model_states"] + r["buffers"] + float(r["activations"] or 0.0) for r in memory["ranks"]
    ]
    live = [r.get("peak_live") for r in read_json(run_dir / "memory_report.json")["ranks"]]
    live_bytes = [float(p["bytes"]) for p in live if p]
    if on_cuda and memory["peak_bytes"]:
        peak, kind, step = memory["peak_bytes"], "cuda max allocated", None
    elif live_bytes:
        peak, kind = max(live_bytes), "live tensors (temporaries included)"
        step = next(p.get("step") for p in live if p and float(p["bytes"]) == peak)
    else:
        peak, kind, step = max(counted), "counted tensors (with activations)", None
    # The backend's config as its engine got it: the settings the tune varies, as they
    # ran (DeepSpeed's resolved buckets feed the second round). A backend with none to
    # vary (DDP, FSDP2) writes no config: recorded as None.
    zero = None
    engine = engine_of(candidate.strategy)
    if engine.config_file:
        ran_with = run_dir / engine.config_file
        zero = engine.tunable_in_effect(read_json(ran_with) if ran_with.is_file() else {})
    return {
        **{k: v for k, v in steps.items() if k != "step_cpu_s"},
        "memory_bytes": float(peak),
        "memory_kind": kind,
        "memory_step": step,
        "memory_per_rank": memory["per_rank"],
        "model_states_per_rank": max(r["model_states"] for r in memory["ranks"]),
        "memory_ranks": [
            {
                **{k: r[k] for k in ("rank", "model_states", "buffers", "activations")},
                "counted": c,
                "peak_bytes": r["peak_bytes"],
                "peak_kind": r["peak_kind"],
            }
            for r, c in zip(memory["ranks"], counted, strict=True)
        ],
        "precision": memory["precision"],
        "zero_optimization": zero,
        "run_info": info,
    }


def load_previous(settings: TuneSettings, candidate: Candidate) -> Trial | None:
    """This candidate's trial from an earlier tune of the folder, if it is the same trial."""
    path = trial_dir(settings, candidate) / TRIAL_FILE
    try:
        saved = read_json(path)
    except (OSError, json.JSONDecodeError):
        return None
    if saved.get("fingerprint") != fingerprint(settings, candidate):
        return None
    if saved["status"] == FAILED and settings.config.retry_failed:
        return None
    return Trial(
        candidate,
        status=saved["status"],
        reason=saved.get("reason", ""),
        figures=saved.get("figures", {}),
        wall_s=saved.get("wall_s"),
        reused=True,
        command=saved.get("command", ""),
    )


def _first_error(message: str) -> str:
    """The one line of a launch failure worth showing in a table."""
    lines = message.splitlines()
    error = next((line for line in lines if line.startswith("first error: ")), "")
    head = lines[0] if lines else "failed"
    return f"{head}; {error.removeprefix('first error: ')}" if error else head


def run_trial(
    settings: TuneSettings, candidate: Candidate, index: int, count: int, env: dict[str, str]
) -> Trial:
    """Launch ``candidate`` and read its figures; a crash, a timeout or a run that is not
    the job asked for comes back as a failed trial with its reason."""
    step = phase(settings, candidate)
    trial = Trial(candidate, command=shlex.join(step.cmd))
    try:
        trial.wall_s = launch.run_phase(step, index, count, settings.launch_settings(), env)
        trial.figures = read_figures(settings, candidate, step.run_dir)
        trial.status = OK
    except launch.BenchError as err:
        message = str(err).removeprefix(f"{step.name}: ")
        trial.status, trial.reason = FAILED, _first_error(message)
    except (OSError, ValueError, KeyError) as err:
        trial.status, trial.reason = FAILED, f"its files: {err}"
    save(settings, trial)
    return trial


def save(settings: TuneSettings, trial: Trial) -> None:
    """``trial.json``: the trial and its fingerprint (what reuse compares)."""
    where = trial_dir(settings, trial.candidate)
    where.mkdir(parents=True, exist_ok=True)
    record = {**trial.as_dict(), "fingerprint": fingerprint(settings, trial.candidate)}
    (where / TRIAL_FILE).write_text(json.dumps(record, indent=2) + "\n")
