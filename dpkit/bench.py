"""``dpkit bench``: DDP, ZeRO-1 and ZeRO-2 side by side, each through a real launcher.

    dpkit bench                                   # CPU: 2 processes, ~23M-param GPT-2 shape
    dpkit bench --nproc 4 --synthetic --output-dir bench_results/cpu4
    dpkit bench --size gpt2-medium --strategies zero1,zero2   # GPUs: all of them by default
    dpkit bench --zero-override overlap_comm=true --zero-override reduce_bucket_size=5e8

Runs, one after another, at N processes: ``recipes/train_lm.py`` under
``accelerate launch`` with ``ds_configs/accelerate/<strategy>.yaml`` for each
strategy, and the bare baselines (``recipes/bare_ddp.py`` under ``torchrun``,
``recipes/bare_deepspeed.py`` under ``deepspeed``): same model, data, seed and
steps; then (N > 1) ``recipes/bench_collectives.py`` under ``torchrun`` times the
collectives each strategy adds, alone, for the same model. Every launch gets its own
session, a free port and a hard timeout; a launch that fails stops the bench with the
tail of its output.

Then, from each run's own files (:mod:`dpkit.bench_report`): the memory report
per rank, the median step time after the warm-up, tokens/s and samples/s per
rank and in total, the loss deviation from DDP, the dpkit/bare step-time ratio;
written to ``results.json`` (every raw number, the machine, the versions),
``results.md`` (the table, also printed) and ``chart.png`` (:mod:`dpkit.bench_chart`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from dpkit.bench_report import BARE_OF, COLLECTIVES_FILE
from dpkit.errors import UsageError

REPO = Path(__file__).resolve().parents[1]
STRATEGIES = ("ddp", "zero1", "zero2")
DEFAULT_CPU_PROCS = 2
# Per launch; the default bench needs about a minute per launch on 2 CPU cores.
DEFAULT_LAUNCH_TIMEOUT_S = 900
# Logs of a failed launch: enough lines to show the traceback.
FAILURE_TAIL_LINES = 60


class BenchError(RuntimeError):
    """A launch failed or timed out; the message carries its command and output tail."""


@dataclass
class Phase:
    """One launch of the bench."""

    name: str
    """``ddp``, ``zero1``, ``zero2`` (dpkit) or ``bare_ddp``, ``bare_zero1``, ``bare_zero2``."""
    strategy: str
    """The strategy it runs (the bare ones run the same three)."""
    bare: bool
    """A bare baseline (no accelerate, no dpkit strategy code)."""
    launcher: str
    """``accelerate launch``, ``torchrun`` or ``deepspeed``."""
    cmd: list[str]
    """The full command line, run from the repository root."""
    run_dir: Path
    """Where the run writes train_log.jsonl (and, for dpkit runs, the memory report)."""
    trains: bool = True
    """A training run (logs steps); False for the collectives phase (collectives.json)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nproc", type=int, default=None, help="processes per run (default: all GPUs, or 2 on CPU)"
    )
    model = parser.add_mutually_exclusive_group()
    model.add_argument(
        "--size",
        default=None,
        help="model shape: tiny, small, gpt2, gpt2-medium, gpt2-large "
        "(default: small on CPU, gpt2 on GPUs)",
    )
    model.add_argument("--model-config", default=None, help="a transformers config.json instead")
    parser.add_argument(
        "--synthetic", action="store_true", help="random tokens instead of Shakespeare bytes"
    )
    parser.add_argument(
        "--steps", type=int, default=10, help="timed optimizer steps after the warm-up"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps first")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence")
    parser.add_argument(
        "--micro-batch-size", type=int, default=None, help="sequences per process per step"
    )
    parser.add_argument(
        "--strategies", default=",".join(STRATEGIES), help="comma-separated: ddp,zero1,zero2"
    )
    parser.add_argument("--no-bare", action="store_true", help="skip the bare baselines")
    parser.add_argument(
        "--zero-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set zero_optimization.KEY in dpkit's ZeRO configs (JSON value), e.g. overlap_comm=true",
    )
    parser.add_argument(
        "--threads-per-process",
        type=int,
        default=None,
        help="OMP_NUM_THREADS of every process (default: usable cores / nproc)",
    )
    parser.add_argument(
        "--launch-timeout", type=int, default=DEFAULT_LAUNCH_TIMEOUT_S, help="seconds per launch"
    )
    parser.add_argument(
        "--output-dir", default=None, help="results folder (default: bench_results/<timestamp>)"
    )


# ---- what to run ----------------------------------------------------------------------------


def _parse_overrides(items: list[str]) -> dict:
    overrides = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--zero-override={item!r}: expected KEY=VALUE")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            raise UsageError(
                f"--zero-override={item!r}: VALUE must be JSON (true, 5e8, ...)"
            ) from None
        if key.strip() == "stage":
            raise UsageError(
                "--zero-override stage=...: the stage is the strategy; use --strategies"
            )
        # DeepSpeed wants integer sizes; 5e8 parses as a float.
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        overrides[key.strip()] = value
    return overrides


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bin(name: str) -> str:
    """A launcher of this Python's environment (the venv), else the one on PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else (shutil.which(name) or name)


def resolve_settings(args: argparse.Namespace, gpu_count: int) -> dict:
    """Defaults that depend on the machine, checked before anything is launched."""
    from dpkit.lm_data import MODEL_SIZES

    on_gpu = gpu_count > 0
    nproc = args.nproc if args.nproc is not None else (gpu_count or DEFAULT_CPU_PROCS)
    if nproc < 1:
        raise UsageError(f"--nproc={nproc}: must be >= 1")
    if on_gpu and nproc > gpu_count:
        raise UsageError(f"--nproc={nproc}: this machine has {gpu_count} GPUs")
    size = args.size or (None if args.model_config else ("gpt2" if on_gpu else "small"))
    if size is not None and size not in MODEL_SIZES:
        raise UsageError(f"--size={size!r}: one of {', '.join(MODEL_SIZES)}")
    if args.model_config is not None and not Path(args.model_config).is_file():
        raise UsageError(f"--model-config={args.model_config!r}: no such file")
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in strategies if s not in STRATEGIES]
    if not strategies or unknown or len(set(strategies)) != len(strategies):
        raise UsageError(f"--strategies={args.strategies!r}: a list of distinct ddp, zero1, zero2")
    if args.steps < 1:
        raise UsageError(f"--steps={args.steps}: must be >= 1")
    # The memory probes walk the tensors during step 1; that step must not be timed.
    if args.warmup < 1:
        raise UsageError(f"--warmup={args.warmup}: must be >= 1 (step 1 holds the memory probes)")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = args.threads_per_process
    if threads is None:
        # The launchers disagree (accelerate and torchrun set 1 thread per process,
        # deepspeed none, so torch takes every core): the bench sets it for all.
        threads = max(1, (cores or 1) // nproc)
    if threads is not None and threads < 1:
        raise UsageError(f"--threads-per-process={threads}: must be >= 1")
    seq_len = args.seq_len if args.seq_len is not None else (1024 if on_gpu else 128)
    micro_batch_size = (
        args.micro_batch_size if args.micro_batch_size is not None else (8 if on_gpu else 4)
    )
    if seq_len < 1 or micro_batch_size < 1:
        raise UsageError(f"--seq-len={seq_len} --micro-batch-size={micro_batch_size}: must be >= 1")
    if size is not None and seq_len > MODEL_SIZES[size]["n_positions"]:
        raise UsageError(
            f"--seq-len={seq_len}: over {size}'s {MODEL_SIZES[size]['n_positions']} positions"
        )
    return {
        "nproc": nproc,
        "device": "cuda" if on_gpu else "cpu",
        "size": size,
        "model_config": args.model_config,
        "synthetic": bool(args.synthetic),
        "seq_len": seq_len,
        "micro_batch_size": micro_batch_size,
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "total_steps": args.warmup + args.steps,
        "strategies": strategies,
        "bare": not args.no_bare,
        "zero_overrides": _parse_overrides(args.zero_override),
        "threads_per_process": threads,
        "launch_timeout_s": args.launch_timeout,
    }


def workload_args(settings: dict) -> list[str]:
    """The flags every run gets: the same model, data, batch and steps."""
    model = (
        ["--model-config", str(Path(settings["model_config"]).resolve())]
        if settings["model_config"]
        else ["--size", settings["size"]]
    )
    return [
        *model,
        *(["--synthetic"] if settings["synthetic"] else []),
        "--seq-len", str(settings["seq_len"]),
        "--micro-batch-size", str(settings["micro_batch_size"]),
        "--max-steps", str(settings["total_steps"]),
    ]  # fmt: skip


def _zero_config_with_overrides(strategy: str, overrides: dict, out: Path) -> Path:
    template = json.loads((REPO / "ds_configs" / f"{strategy}.json").read_text())
    template["zero_optimization"].update(overrides)
    path = out / f"ds_config_{strategy}_tuned.json"
    path.write_text(json.dumps(template, indent=2) + "\n")
    return path


def plan_phases(settings: dict, out: Path) -> list[Phase]:
    """dpkit run then its bare twin, strategy by strategy: the two runs whose step times
    are divided run next to each other, under the same load of the machine."""
    nproc = str(settings["nproc"])
    common = workload_args(settings)
    phases = []
    for strategy in settings["strategies"]:
        run_dir = out / "runs" / strategy
        extra = []
        if strategy != "ddp" and settings["zero_overrides"]:
            config = _zero_config_with_overrides(strategy, settings["zero_overrides"], out)
            extra = ["--deepspeed", str(config)]
        cmd = [
            _bin("accelerate"), "launch",
            "--config_file", str(REPO / "ds_configs" / "accelerate" / f"{strategy}.yaml"),
            "--num_processes", nproc,
            "--main_process_port", str(_free_port()),
            str(REPO / "recipes" / "train_lm.py"), *common, *extra,
            "--output-dir", str(run_dir), "--overwrite-output-dir",
        ]  # fmt: skip
        phases.append(Phase(strategy, strategy, False, "accelerate launch", cmd, run_dir))
        if not settings["bare"]:
            continue
        name = BARE_OF[strategy]
        run_dir = out / "runs" / name
        if strategy == "ddp":
            launcher = "torchrun"
            cmd = [
                _bin("torchrun"), "--nproc_per_node", nproc, "--master_port", str(_free_port()),
                str(REPO / "recipes" / "bare_ddp.py"), *common, "--output-dir", str(run_dir),
            ]  # fmt: skip
        else:
            launcher = "deepspeed"
            cmd = [
                _bin("deepspeed"), "--num_gpus", nproc, "--master_port", str(_free_port()),
                str(REPO / "recipes" / "bare_deepspeed.py"), "--zero-stage", strategy[-1],
                *common, "--output-dir", str(run_dir),
            ]  # fmt: skip
        phases.append(Phase(name, strategy, True, launcher, cmd, run_dir))
    if settings["nproc"] > 1:
        phases.append(collectives_phase(settings, out))
    return phases


def collectives_phase(settings: dict, out: Path) -> Phase:
    """The collectives each strategy adds, timed alone for the same model
    (``recipes/bench_collectives.py``): what the step times of the runs are made of."""
    run_dir = out / "runs" / "collectives"
    bucket = settings["zero_overrides"].get("reduce_bucket_size")
    extra = ["--zero-bucket", str(int(float(bucket)))] if bucket not in (None, "auto") else []
    cmd = [
        _bin("torchrun"), "--nproc_per_node", str(settings["nproc"]),
        "--master_port", str(_free_port()),
        str(REPO / "recipes" / "bench_collectives.py"), *workload_args(settings), *extra,
        "--output-dir", str(run_dir),
    ]  # fmt: skip
    return Phase("collectives", "-", True, "torchrun", cmd, run_dir, trains=False)


# ---- running --------------------------------------------------------------------------------


def launch_env(settings: dict) -> dict[str, str]:
    env = dict(os.environ)
    # Nothing here needs the network; offline fails fast instead of retrying.
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
    # A bench started from inside a launched job must not inherit that job's rendezvous.
    for key in [k for k in env if k.startswith("ACCELERATE_")]:
        env.pop(key)
    for key in (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        env.pop(key, None)
    if settings["threads_per_process"] is not None:
        env["OMP_NUM_THREADS"] = str(settings["threads_per_process"])
    return env


def _steps_done(run_dir: Path) -> tuple[int, float | None]:
    try:
        lines = (run_dir / "train_log.jsonl").read_text().splitlines()
    except OSError:
        return 0, None
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line being written
    return len(records), (records[-1]["loss"] if records else None)


# An exception line ("dpkit.errors.UsageError: ...") or a recipe's one-line error
# ("train_lm.py: error: ..."); the launchers' own ChildFailedError says nothing.
_ERROR_LINE = re.compile(r"^([\w.]+(Error|Exception)|[\w.-]+\.py: error): ")


def _tail(path: Path, lines: int) -> str:
    """The last lines of a launch log, led by the first error a process printed:
    a launcher's traceback about its failed children often fills the tail."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no output)"
    # Progress bars rewrite one line with carriage returns; keep the last state.
    kept = [line.rsplit("\r", 1)[-1] for line in text.splitlines()]
    errors = [line for line in kept if _ERROR_LINE.match(line) and "ChildFailedError" not in line]
    tail = "\n".join(kept[-lines:])
    return f"first error: {errors[0]}\n{tail}" if errors else tail


def run_phase(phase: Phase, index: int, count: int, settings: dict, env: dict) -> float:
    """Launch, show progress, wait; the wall time in seconds, or BenchError."""
    from tqdm.auto import tqdm

    if phase.run_dir.exists():
        shutil.rmtree(phase.run_dir)  # only the bench's own runs/<phase> folder
    phase.run_dir.mkdir(parents=True)
    log_path = phase.run_dir / "launch.log"
    (phase.run_dir / "command.txt").write_text(shlex.join(phase.cmd) + "\n")
    label = f"[{index}/{count}] {phase.name:<10} ({phase.launcher}, {settings['nproc']} procs)"
    print(f"{label}: starting", file=sys.stderr, flush=True)
    total = settings["total_steps"]
    # A bar on a terminal; in a log (make, CI) only the start and end lines.
    bar = tqdm(
        total=total,
        desc=f"  {phase.name}",
        unit="step",
        disable=None if phase.trains else True,
        leave=False,
    )
    started = time.perf_counter()
    timeout = settings["launch_timeout_s"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            phase.cmd,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # a timeout or ^C kills the whole process tree
        )
        try:
            while proc.poll() is None:
                if time.perf_counter() - started > timeout:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    raise BenchError(
                        f"{phase.name}: timed out after {timeout} s (--launch-timeout)\n"
                        f"command: {shlex.join(phase.cmd)}\n--- last lines of {log_path} ---\n"
                        f"{_tail(log_path, FAILURE_TAIL_LINES)}"
                    )
                done, loss = _steps_done(phase.run_dir)
                bar.update(done - bar.n)
                if loss is not None:
                    bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
                time.sleep(0.5)
        except BaseException:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            raise
        finally:
            bar.close()
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise BenchError(
            f"{phase.name}: exit code {proc.returncode} after {wall:.0f} s\n"
            f"command: {shlex.join(phase.cmd)}\n--- last lines of {log_path} ---\n"
            f"{_tail(log_path, FAILURE_TAIL_LINES)}"
        )
    if not phase.trains:
        if not (phase.run_dir / COLLECTIVES_FILE).is_file():
            raise BenchError(
                f"{phase.name}: exited 0 but wrote no {COLLECTIVES_FILE}\n"
                f"--- last lines of {log_path} ---\n{_tail(log_path, FAILURE_TAIL_LINES)}"
            )
        print(f"{label}: done in {wall:.0f} s", file=sys.stderr)
        return wall
    done, loss = _steps_done(phase.run_dir)
    if done != total:
        raise BenchError(
            f"{phase.name}: exited 0 but logged {done} of {total} steps\n"
            f"--- last lines of {log_path} ---\n{_tail(log_path, FAILURE_TAIL_LINES)}"
        )
    print(f"{label}: done, {total} steps in {wall:.0f} s (loss {loss:.4f})", file=sys.stderr)
    return wall


def main(args: argparse.Namespace) -> int:
    import torch

    from dpkit import bench_chart, bench_report

    settings = resolve_settings(args, torch.cuda.device_count())
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.output_dir or f"bench_results/{stamp}").resolve()
    if out.exists() and not out.is_dir():
        raise UsageError(f"--output-dir={args.output_dir!r}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("results.json", "results.md", "chart.png"):
        (out / stale).unlink(missing_ok=True)
    phases = plan_phases(settings, out)
    env = launch_env(settings)
    machine = bench_report.machine_description(env)
    command = "dpkit bench " + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else [])
    print(
        f"dpkit bench: {len(phases)} launches at {settings['nproc']} processes on "
        f"{settings['device']} ({machine['cpu_model'] if settings['device'] == 'cpu' else ', '.join(machine['gpus'])}), "
        f"{settings['warmup_steps']} warm-up + {settings['timed_steps']} timed steps each -> {out}",
        file=sys.stderr,
        flush=True,
    )
    started = time.perf_counter()
    walls = {}
    try:
        for index, phase in enumerate(phases, 1):
            walls[phase.name] = run_phase(phase, index, len(phases), settings, env)
    except BenchError as err:
        print(f"dpkit bench: error: {err}", file=sys.stderr)
        return 1
    results = bench_report.build_results(
        phases, walls, settings, machine, command, time.perf_counter() - started
    )
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    table = bench_report.format_markdown(results)
    (out / "results.md").write_text(table + "\n")
    bench_chart.write_chart(results, out / "chart.png")
    print(table)
    print(f"\nresults: {out / 'results.json'}, {out / 'results.md'}, {out / 'chart.png'}")
    return 0
