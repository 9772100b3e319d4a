"""The launches of ``dpkit bench``: what each phase runs, under which launcher, and running it.

The LM workload, at N processes, strategy by strategy: ``train_lm.py`` (dpkit's
recipe, found with :func:`dpkit.resources.recipe`) under ``accelerate launch`` with
dpkit's accelerate YAML for the strategy, then its bare twin (:mod:`dpkit.bench.bare_ddp`
under ``torchrun``, :mod:`dpkit.bench.bare_deepspeed` under ``deepspeed``); then (N > 1)
the compute floor and :mod:`dpkit.bench.collectives` under ``torchrun``.

The classification workload, strategy by strategy: ``finetune.py --strategy S`` and the
plain Trainer (:mod:`dpkit.bench.trainer_baseline`), both under ``torchrun``; then the
floor (``finetune.py`` at one process).

With ``--repeats R`` each dpkit run and its baseline run R times, interleaved (dpkit,
baseline, dpkit, ...): the ratio of each pair is taken under the same load of the
machine. Every launch gets its own session, a free port and a hard timeout; a launch
that fails, or whose ``run_info.json`` shows another strategy or world size than
launched (ranks training unconnected copies), raises :class:`BenchError` with the tail
of its output.

The bench's own scripts are launched as modules (``-m dpkit.bench.bare_ddp``): as a
file, its folder would come first on ``sys.path`` and ``dpkit/bench/markdown.py`` would
hide the ``markdown`` package from everything the script imports.
"""

from __future__ import annotations

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
from pathlib import Path

from dpkit import resources
from dpkit.bench.trainer_baseline import TRAINER_RUN_PREFIX
from dpkit.core.strategy import Strategy
from dpkit.engines import REFERENCE, engine_of, get_strategy

# The folder holding the dpkit package (a checkout or site-packages): launched
# processes import dpkit from it even when dpkit is not installed.
PACKAGE_PARENT = Path(__file__).resolve().parents[2]
# Per launch; the default bench needs one to two minutes per launch on 2 CPU cores.
DEFAULT_LAUNCH_TIMEOUT_S = 900
# Logs of a failed launch: enough lines to show the traceback.
FAILURE_TAIL_LINES = 60
RENDEZVOUS_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
"""The torch.distributed rendezvous a launcher sets for its children."""
CLASSIFICATION_EVAL_SAMPLES = 64
"""Validation examples a classification run evaluates after its timed steps: kept short."""
FLOOR_RUN = "floor"
"""The run name of the compute floor (:func:`floor_phase`), a key of results.json's ``runs``."""
COLLECTIVES_FILE = "collectives.json"
"""What the collectives phase writes (:mod:`dpkit.bench.collectives`)."""


class BenchError(RuntimeError):
    """A launch failed or timed out; the message carries its command and output tail."""


@dataclass
class Phase:
    """One launch of the bench."""

    name: str
    """``ddp``, ``zero1``, ``zero2`` (dpkit), ``bare_ddp``... (:func:`bare_run_name`),
    or ``collectives``."""
    strategy: Strategy | None
    """The strategy it runs (a bare twin runs its dpkit run's); None for the collectives
    phase. A name is looked up with :func:`~dpkit.engines.get_strategy`."""
    bare: bool
    """A bare baseline (no accelerate, no dpkit strategy code)."""
    launcher: str
    """``accelerate launch``, ``torchrun`` or ``deepspeed``."""
    cmd: list[str]
    """The full command line, run from ``run_dir``."""
    run_dir: Path
    """Where the run writes train_log.jsonl (and, for dpkit runs, the memory report)."""
    trains: bool = True
    """A training run (logs steps); False for the collectives phase (collectives.json)."""
    nproc: int | None = None
    """Its processes, where not the bench's (the compute floor runs one)."""
    repeat: int = 1
    """Which repeat of the pair (dpkit run, baseline) this is (``--repeats``)."""
    checkpointed: bool = False
    """dpkit's run again with ``--gradient-checkpointing`` (``dpkit bench
    --gradient-checkpointing``): what checkpointing costs the step, beside the run."""

    def __post_init__(self) -> None:
        if isinstance(self.strategy, str):
            self.strategy = get_strategy(self.strategy)


def bare_run_name(strategy: str | Strategy) -> str:
    """The run name of ``strategy``'s bare twin, the run its step time is divided by:
    ``bare_ddp``, ``bare_zero1``, ``bare_zero2`` (keys of results.json's ``runs``)."""
    return f"bare_{get_strategy(strategy).name}"


def checkpointed_run_name(strategy: str | Strategy) -> str:
    """The run name of dpkit's run of ``strategy`` with gradient checkpointing:
    ``ddp_checkpointed``, ``zero2_checkpointed``."""
    return f"{get_strategy(strategy).name}_checkpointed"


def trainer_run_name(strategy: str | Strategy) -> str:
    """The run name of the plain Trainer on ``strategy``: ``trainer_ddp``, ``trainer_zero2``."""
    return f"{TRAINER_RUN_PREFIX}{get_strategy(strategy).name}"


def repeat_name(name: str, repeat: int) -> str:
    """A run's name in repeat ``repeat``: the name itself for the first, ``ddp.r2`` after."""
    return name if repeat == 1 else f"{name}.r{repeat}"


# ---- what to run ----------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port free on this host now, for a launch's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_path(name: str) -> str:
    """A launcher of this Python's environment (the venv), else the one on PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else (shutil.which(name) or name)


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


def accelerate_config(
    strategy: Strategy, overrides: dict, out: Path, backend_config: Path | None = None
) -> Path:
    """The accelerate YAML of ``strategy`` for this bench, written into ``out/configs``
    (:meth:`~dpkit.engines.base.Engine.accelerate_yaml`: a YAML that names a backend config
    names it by its absolute path, ``backend_config`` or dpkit's packaged copy with
    ``overrides`` applied, so the launch works from any folder)."""
    configs = out / "configs"
    configs.mkdir(parents=True, exist_ok=True)
    try:
        text = engine_of(strategy).accelerate_yaml(strategy, configs, overrides, backend_config)
    except ValueError as err:
        raise BenchError(str(err)) from None
    path = configs / f"{strategy.name}.yaml"
    path.write_text(text)
    return path


def dpkit_phase(
    strategy: Strategy, settings: dict, out: Path, repeat: int = 1, checkpointed: bool = False
) -> Phase:
    """dpkit's recipe for ``strategy`` under ``accelerate launch`` (``checkpointed``: with
    ``--gradient-checkpointing``)."""
    name = repeat_name(checkpointed_run_name(strategy) if checkpointed else strategy.name, repeat)
    run_dir = out / "runs" / name
    config = accelerate_config(strategy, settings["zero_overrides"], out)
    cmd = [
        launcher_path("accelerate"), "launch",
        "--config_file", str(config),
        "--num_processes", str(settings["nproc"]),
        "--main_process_port", str(free_port()),
        str(resources.recipe("train_lm.py")), *workload_args(settings),
        "--mixed-precision", settings["mixed_precision"],
        "--output-dir", str(run_dir), "--overwrite-output-dir",
        *(["--gradient-checkpointing"] if checkpointed else []),
    ]  # fmt: skip
    return Phase(
        name, strategy, False, "accelerate launch", cmd, run_dir, repeat=repeat,
        checkpointed=checkpointed,
    )  # fmt: skip


def bare_phase(strategy: Strategy, settings: dict, out: Path, repeat: int = 1) -> Phase:
    """The bare twin of ``strategy``: plain torch DDP or FSDP2 (``fully_shard``, same
    mode) under ``torchrun``, or plain ``deepspeed.initialize`` at the same ZeRO stage
    under ``deepspeed``."""
    name = repeat_name(bare_run_name(strategy), repeat)
    run_dir = out / "runs" / name
    nproc, port = str(settings["nproc"]), str(free_port())
    tail = [
        *workload_args(settings),
        "--mixed-precision", settings["mixed_precision"],
        "--output-dir", str(run_dir),
    ]  # fmt: skip
    launcher, processes, module = engine_of(strategy).bare_baseline(strategy)
    cmd = [
        launcher_path(launcher), processes, nproc, "--master_port", port, *module, *tail,
    ]  # fmt: skip
    return Phase(name, strategy, True, launcher, cmd, run_dir, repeat=repeat)


def floor_phase(settings: dict, out: Path) -> Phase:
    """The compute floor: the bare DDP loop at one process (no wrapper, no communication),
    the same per-rank batch and threads per process; each run's step time is set against
    it (:mod:`dpkit.bench.results`)."""
    run_dir = out / "runs" / FLOOR_RUN
    cmd = [
        launcher_path("torchrun"), "--nproc_per_node", "1", "--master_port", str(free_port()),
        "--module", "dpkit.bench.bare_ddp", *workload_args(settings),
        "--mixed-precision", settings["mixed_precision"],
        "--output-dir", str(run_dir),
    ]  # fmt: skip
    return Phase(FLOOR_RUN, REFERENCE, True, "torchrun", cmd, run_dir, nproc=1)


def collectives_phase(settings: dict, out: Path) -> Phase:
    """The collectives each strategy adds, timed alone for the same model
    (:mod:`dpkit.bench.collectives`): what the step times of the runs are made of."""
    run_dir = out / "runs" / "collectives"
    bucket = settings["zero_overrides"].get("reduce_bucket_size")
    extra = ["--zero-bucket", str(int(float(bucket)))] if bucket not in (None, "auto") else []
    cmd = [
        launcher_path("torchrun"), "--nproc_per_node", str(settings["nproc"]),
        "--master_port", str(free_port()),
        "--module", "dpkit.bench.collectives", *workload_args(settings), *extra,
        "--output-dir", str(run_dir),
    ]  # fmt: skip
    return Phase("collectives", None, True, "torchrun", cmd, run_dir, trains=False)


def classification_args(settings: dict) -> list[str]:
    """The flags both sides of the classification workload get: batch, length, steps."""
    return [
        "--micro-batch-size", str(settings["micro_batch_size"]),
        "--max-seq-length", str(settings["seq_len"]),
        "--max-eval-samples", str(CLASSIFICATION_EVAL_SAMPLES),
        "--max-steps", str(settings["total_steps"]),
        "--mixed-precision", settings["mixed_precision"],
    ]  # fmt: skip


def _torchrun(nproc: int) -> list[str]:
    return [
        launcher_path("torchrun"), "--nproc_per_node", str(nproc),
        "--master_port", str(free_port()),
    ]  # fmt: skip


def finetune_phase(
    strategy: Strategy, settings: dict, out: Path, repeat: int = 1, nproc: int | None = None
) -> Phase:
    """dpkit's ``finetune.py`` for ``strategy`` under ``torchrun`` (the Trainer's launcher)."""
    name = FLOOR_RUN if nproc == 1 else repeat_name(strategy.name, repeat)
    run_dir = out / "runs" / name
    cmd = [
        *_torchrun(nproc or settings["nproc"]),
        str(resources.recipe("finetune.py")), "--strategy", strategy.name,
        *classification_args(settings),
        "--no-save-checkpoints", "--no-save-model",
        "--output-dir", str(run_dir), "--overwrite-output-dir",
    ]  # fmt: skip
    bare = nproc == 1  # the floor is not one of dpkit's strategy runs
    return Phase(name, strategy, bare, "torchrun", cmd, run_dir, nproc=nproc, repeat=repeat)


def trainer_phase(strategy: Strategy, settings: dict, out: Path, repeat: int = 1) -> Phase:
    """The plain Transformers Trainer on the same job (:mod:`dpkit.bench.trainer_baseline`)."""
    name = repeat_name(trainer_run_name(strategy), repeat)
    run_dir = out / "runs" / name
    cmd = [
        *_torchrun(settings["nproc"]),
        "--module", "dpkit.bench.trainer_baseline", "--strategy", strategy.name,
        *classification_args(settings), "--output-dir", str(run_dir),
    ]  # fmt: skip
    return Phase(name, strategy, True, "torchrun", cmd, run_dir, repeat=repeat)


def plan_phases(settings: dict, out: Path) -> list[Phase]:
    """Each dpkit run then its baseline (bare twin or Trainer), ``repeats`` times,
    strategy by strategy: the two runs whose step times are divided run next to each
    other, under the same load of the machine (with ``gradient_checkpointing``, dpkit's
    checkpointed run comes between them)."""
    classification = settings["workload"] == "classification"
    phases = []
    for strategy in map(get_strategy, settings["strategies"]):
        for repeat in range(1, settings["repeats"] + 1):
            if classification:
                phases.append(finetune_phase(strategy, settings, out, repeat))
                if settings["bare"]:
                    phases.append(trainer_phase(strategy, settings, out, repeat))
                continue
            phases.append(dpkit_phase(strategy, settings, out, repeat))
            if settings.get("gradient_checkpointing"):
                phases.append(dpkit_phase(strategy, settings, out, repeat, checkpointed=True))
            if settings["bare"]:
                phases.append(bare_phase(strategy, settings, out, repeat))
    if settings["nproc"] > 1 and settings["bare"]:
        phases.append(
            finetune_phase(REFERENCE, settings, out, nproc=1)
            if classification
            else floor_phase(settings, out)
        )
    if settings["nproc"] > 1 and not classification:
        # The collectives of the LM model; the classification workload's floor and
        # Trainer runs explain its steps.
        phases.append(collectives_phase(settings, out))
    return phases


# ---- running --------------------------------------------------------------------------------


def launch_env(settings: dict) -> dict[str, str]:
    """The environment of every launch: offline, dpkit importable, this venv's launchers
    first, no rendezvous inherited, the same threads per process for every launcher."""
    env = dict(os.environ)
    # Nothing here needs the network; offline fails fast instead of retrying.
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(PACKAGE_PARENT), env.get("PYTHONPATH")) if p
    )
    env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
    # A bench started from inside a launched job must not inherit that job's rendezvous.
    for key in [k for k in env if k.startswith("ACCELERATE_")]:
        env.pop(key)
    for key in RENDEZVOUS_VARS:
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
    # The Trainer baseline logs no per-step loss (the Trainer's own cadence).
    return len(records), (records[-1].get("loss") if records else None)


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


def _failure(phase: Phase, what: str, log_path: Path) -> BenchError:
    return BenchError(
        f"{phase.name}: {what}\ncommand: {shlex.join(phase.cmd)}\n"
        f"--- last lines of {log_path} ---\n{_tail(log_path, FAILURE_TAIL_LINES)}"
    )


def _wait(phase: Phase, proc: subprocess.Popen, settings: dict, log_path: Path) -> None:
    """Wait for the launch, showing its steps on a bar; kill its whole session on a
    timeout or an interrupt."""
    from tqdm.auto import tqdm

    # A bar on a terminal; in a log (make, CI) only the start and end lines.
    bar = tqdm(
        total=settings["total_steps"],
        desc=f"  {phase.name}",
        unit="step",
        disable=None if phase.trains else True,
        leave=False,
    )
    started = time.perf_counter()
    timeout = settings["launch_timeout_s"]
    try:
        while proc.poll() is None:
            if time.perf_counter() - started > timeout:
                flag = settings.get("launch_timeout_flag", "--launch-timeout")
                raise _failure(phase, f"timed out after {timeout} s ({flag})", log_path)
            done, loss = _steps_done(phase.run_dir)
            bar.update(done - bar.n)
            if loss is not None:
                bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            time.sleep(0.5)
    finally:
        bar.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_phase(phase: Phase, index: int, count: int, settings: dict, env: dict) -> float:
    """Launch, show progress, wait; the wall time in seconds, or :class:`BenchError`."""
    if phase.run_dir.exists():
        shutil.rmtree(phase.run_dir)  # only the bench's own runs/<phase> folder
    phase.run_dir.mkdir(parents=True)
    log_path = phase.run_dir / "launch.log"
    (phase.run_dir / "command.txt").write_text(shlex.join(phase.cmd) + "\n")
    nproc = phase.nproc or settings["nproc"]
    label = f"[{index}/{count}] {phase.name:<10} ({phase.launcher}, {nproc} procs)"
    print(f"{label}: starting", file=sys.stderr, flush=True)
    started = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            phase.cmd,
            cwd=phase.run_dir,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # a timeout or ^C kills the whole process tree
        )
        _wait(phase, proc, settings, log_path)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise _failure(phase, f"exit code {proc.returncode} after {wall:.0f} s", log_path)
    if not phase.trains:
        if not (phase.run_dir / COLLECTIVES_FILE).is_file():
            raise _failure(phase, f"exited 0 but wrote no {COLLECTIVES_FILE}", log_path)
        print(f"{label}: done in {wall:.0f} s", file=sys.stderr)
        return wall
    total = settings["total_steps"]
    done, loss = _steps_done(phase.run_dir)
    if done != total:
        raise _failure(phase, f"exited 0 but logged {done} of {total} steps", log_path)
    _check_job(phase, nproc, log_path)
    shown = "" if loss is None else f" (loss {loss:.4f})"
    print(f"{label}: done, {total} steps in {wall:.0f} s{shown}", file=sys.stderr)
    return wall


def _check_job(phase: Phase, nproc: int, log_path: Path) -> None:
    """The run's own ``run_info.json`` (dpkit's recipes, the Trainer baseline) names the
    strategy and world size it ran: figures of another job (unconnected copies, ZeRO
    silently off) must not count."""
    path = phase.run_dir / "run_info.json"
    if not path.is_file():
        if phase.name.startswith(TRAINER_RUN_PREFIX):
            raise _failure(phase, "exited 0 but wrote no run_info.json", log_path)
        return
    info = json.loads(path.read_text())
    ran = (info.get("strategy"), info.get("world_size"))
    if ran != (phase.strategy.name, nproc):
        raise _failure(
            phase,
            f"ran {ran[0]} over {ran[1]} processes, launched as {phase.strategy.name} over "
            f"{nproc}: not the job to compare",
            log_path,
        )
