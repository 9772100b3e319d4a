"""``dpkit bench``: DDP, ZeRO and FSDP2 side by side, each through a real launcher.

    dpkit bench                                   # CPU: 2 processes, ~23M-param GPT-2 shape
    dpkit bench --strategies zero3,zero2_offload,zero3_offload,fsdp2_full_shard_offload
    dpkit bench --nproc 4 --synthetic --output-dir bench_results/cpu4
    dpkit bench --size gpt2-medium --strategies zero1,zero2   # GPUs: all of them by default
    dpkit bench --zero-override overlap_comm=true --zero-override reduce_bucket_size=5e8
    dpkit bench --workload classification        # dpkit against the plain Trainer, 3 repeats

Runs, one after another at N processes, dpkit's recipe for each strategy and its
baseline: on the LM workload the bare twin (a plain torch DDP or DeepSpeed loop), then
the compute floor and the collectives phase; on the classification workload the plain
Transformers ``Trainer`` on the same job (:mod:`dpkit.bench.trainer_baseline`), dpkit
and baseline interleaved ``--repeats`` times (:mod:`dpkit.bench.launch`); reads each run's
own files and compares them (:mod:`dpkit.bench.results`); writes ``results.json``
(every raw number, the machine, the versions), ``results.md`` (the tables, also
printed; :mod:`dpkit.bench.markdown`), ``chart.png`` and ``timelines.png`` (each
strategy's memory over one step, its worst rank; :mod:`dpkit.bench.chart`).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from datetime import datetime
from pathlib import Path

from dpkit.bench.launch import DEFAULT_LAUNCH_TIMEOUT_S
from dpkit.engines import BENCHABLE, BENCHED_BY_DEFAULT, RUNNABLE, TRAINER_STRATEGIES
from dpkit.errors import UsageError

# Not 4: on the 2-core CPU machine the default bench at 4 processes took 13.7 min
# (docs/bench-cpu-4proc.md, a shared machine) against 2.2 at 2 (docs/bench-cpu-2proc.md),
# and 4 ranks on 2 cores make the step times swing (3.9-7.0 s within one run).
DEFAULT_CPU_PROCS = 2
# fp16 is left out: its bare twins would need loss scaling of their own (a GradScaler,
# DeepSpeed's fp16 section), and the bench compares like with like.
BENCH_PRECISIONS = ("no", "bf16")
WORKLOADS = ("lm", "classification")
# The classification workload is the side-by-side job: MiniLM, micro-batch 32,
# max length 128, DDP and ZeRO-2 against the Trainer; 3 interleaved repeats because
# four identical 40-step runs on this machine spread from 76 to 90 s.
CLASSIFICATION_STRATEGIES = "ddp,zero2"
BENCHED_NAMES = tuple(s.name for s in BENCHABLE)
# ZeRO-3 and the offloads run when named: the default bench keeps its five strategies.
DEFAULT_NAMES = tuple(s.name for s in BENCHED_BY_DEFAULT)
CLASSIFICATION_REPEATS = 3
CLASSIFICATION_MICRO_BATCH = 32
CLASSIFICATION_SEQ_LEN = 128
OUTPUTS = ("results.json", "results.md", "chart.png", "timelines.png")
"""What a bench writes into its output folder (a stale one is removed first)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``dpkit bench``."""
    parser.add_argument(
        "--workload",
        default="lm",
        choices=WORKLOADS,
        help="lm: train_lm.py against bare torch/DeepSpeed loops; classification: "
        "finetune.py (MiniLM, Rotten Tomatoes) against the plain Transformers Trainer",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="dpkit and its baseline run this many times, interleaved; the ratios are "
        f"medians over the repeats (default: 1 for lm, {CLASSIFICATION_REPEATS} for "
        "classification)",
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        help=f"processes per run (default: all GPUs, or {DEFAULT_CPU_PROCS} on CPU)",
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
    parser.add_argument(
        "--mixed-precision",
        default="no",
        choices=BENCH_PRECISIONS,
        help="no (fp32) or bf16: dpkit's runs get --mixed-precision, the bare DDP loop "
        "autocast, the bare DeepSpeed runs DeepSpeed's bf16 section",
    )
    parser.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="lm: also run each strategy's dpkit run with --gradient-checkpointing, next to "
        "it: activations and step time with and without",
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="tokens per sequence (classification: the most, batches padded to their longest)",
    )
    parser.add_argument(
        "--micro-batch-size", type=int, default=None, help="sequences per process per step"
    )
    names = ",".join(s.name for s in BENCHABLE)
    parser.add_argument(
        "--strategies",
        default=None,
        help=f"comma-separated: {names} (default for lm: {','.join(DEFAULT_NAMES)}, ZeRO-3 "
        f"and the offloads when named; {CLASSIFICATION_STRATEGIES} for classification, which "
        "runs DDP and ZeRO only)",
    )
    parser.add_argument(
        "--no-bare",
        action="store_true",
        help="skip the baselines (the bare loops, or the Trainer) and the compute floor",
    )
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


def _parse_overrides(items: list[str]) -> dict:
    overrides = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError(f"--zero-override={item!r}: expected KEY=VALUE")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            raise UsageError(
                f"--zero-override={item!r}: VALUE must be JSON (true, 5e8, ...)"
            ) from None
        if key == "stage":
            raise UsageError(
                "--zero-override stage=...: the stage is the strategy; use --strategies"
            )
        # DeepSpeed wants integer sizes; 5e8 parses as a float.
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        overrides[key] = value
    return overrides


def _parse_strategies(text: str, classification: bool) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    allowed = [s.name for s in (TRAINER_STRATEGIES if classification else BENCHABLE)]
    if classification and any(n in BENCHED_NAMES and n not in allowed for n in names):
        raise UsageError(
            f"--strategies={text!r}: the classification workload's Trainer baseline runs "
            f"{', '.join(allowed)}; the others run in --workload lm"
        )
    not_benched = [n for n in names if n in {s.name for s in RUNNABLE} - set(BENCHED_NAMES)]
    if not_benched:
        raise UsageError(
            f"--strategies={text!r}: dpkit bench does not run {', '.join(not_benched)} yet "
            "(the recipes do); one of " + ", ".join(allowed)
        )
    if not names or set(names) - set(allowed) or len(set(names)) != len(names):
        raise UsageError(f"--strategies={text!r}: a list of distinct {', '.join(allowed)}")
    return names


def bench_settings(args: argparse.Namespace, gpu_count: int) -> dict:
    """Defaults that depend on the machine, checked before anything is launched."""
    from dpkit.bench.machine import usable_cores
    from dpkit.data.lm import MODEL_SIZES

    on_gpu = gpu_count > 0
    classification = args.workload == "classification"
    if classification:
        # The classification job is the recipe's model and data; the LM's model flags
        # would be ignored, so they are refused.
        for flag, value in (
            ("--size", args.size),
            ("--model-config", args.model_config),
            ("--synthetic", args.synthetic or None),
            ("--gradient-checkpointing", args.gradient_checkpointing or None),
        ):
            if value is not None:
                raise UsageError(
                    f"{flag}={value!r}: the classification workload runs MiniLM on Rotten "
                    "Tomatoes; model flags (and --gradient-checkpointing) are for --workload lm"
                )
    repeats = args.repeats
    if repeats is None:
        repeats = CLASSIFICATION_REPEATS if classification else 1
    if repeats < 1:
        raise UsageError(f"--repeats={repeats}: must be >= 1")
    nproc = args.nproc if args.nproc is not None else (gpu_count or DEFAULT_CPU_PROCS)
    if nproc < 1:
        raise UsageError(f"--nproc={nproc}: must be >= 1")
    if on_gpu and nproc > gpu_count:
        raise UsageError(f"--nproc={nproc}: this machine has {gpu_count} GPUs")
    size = (
        None
        if classification or args.model_config
        else (args.size or ("gpt2" if on_gpu else "small"))
    )
    if size is not None and size not in MODEL_SIZES:
        raise UsageError(f"--size={size!r}: one of {', '.join(MODEL_SIZES)}")
    if args.model_config is not None and not Path(args.model_config).is_file():
        raise UsageError(f"--model-config={args.model_config!r}: no such file")
    strategies = _parse_strategies(
        args.strategies
        if args.strategies is not None
        else (CLASSIFICATION_STRATEGIES if classification else ",".join(DEFAULT_NAMES)),
        classification,
    )
    if args.steps < 1:
        raise UsageError(f"--steps={args.steps}: must be >= 1")
    # The memory probes walk the tensors during step 1; that step must not be timed.
    if args.warmup < 1:
        raise UsageError(f"--warmup={args.warmup}: must be >= 1 (step 1 holds the memory probes)")
    threads = args.threads_per_process
    if threads is None:
        # The launchers disagree (accelerate and torchrun set 1 thread per process,
        # deepspeed none, so torch takes every core): the bench sets it for all.
        threads = max(1, usable_cores() // nproc)
    if threads < 1:
        raise UsageError(f"--threads-per-process={threads}: must be >= 1")
    if classification:
        default_seq_len, default_micro_batch = CLASSIFICATION_SEQ_LEN, CLASSIFICATION_MICRO_BATCH
    else:
        default_seq_len, default_micro_batch = (1024, 8) if on_gpu else (128, 4)
    seq_len = args.seq_len if args.seq_len is not None else default_seq_len
    micro_batch_size = (
        args.micro_batch_size if args.micro_batch_size is not None else default_micro_batch
    )
    if seq_len < 1 or micro_batch_size < 1:
        raise UsageError(f"--seq-len={seq_len} --micro-batch-size={micro_batch_size}: must be >= 1")
    if size is not None and seq_len > MODEL_SIZES[size]["n_positions"]:
        raise UsageError(
            f"--seq-len={seq_len}: over {size}'s {MODEL_SIZES[size]['n_positions']} positions"
        )
    return {
        "workload": args.workload,
        "repeats": repeats,
        "nproc": nproc,
        "device": "cuda" if on_gpu else "cpu",
        "size": size,
        "model_config": args.model_config,
        "synthetic": bool(args.synthetic),
        "seq_len": seq_len,
        "micro_batch_size": micro_batch_size,
        "mixed_precision": args.mixed_precision,
        "gradient_checkpointing": bool(args.gradient_checkpointing),
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "total_steps": args.warmup + args.steps,
        "strategies": strategies,
        "bare": not args.no_bare,
        "zero_overrides": _parse_overrides(args.zero_override),
        "threads_per_process": threads,
        "launch_timeout_s": args.launch_timeout,
    }


def _output_dir(given: str | None) -> Path:
    """The results folder, created, without a previous bench's results in it."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(given or f"bench_results/{stamp}").resolve()
    if out.exists() and not out.is_dir():
        raise UsageError(f"--output-dir={given!r}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    for stale in OUTPUTS:
        (out / stale).unlink(missing_ok=True)
    return out


def main(args: argparse.Namespace) -> int:
    """Run the bench; 0 when every launch succeeded, 1 when one failed."""
    import torch

    from dpkit.bench import chart, launch, markdown, results
    from dpkit.bench.machine import machine_description

    settings = bench_settings(args, torch.cuda.device_count())
    out = _output_dir(args.output_dir)
    phases = launch.plan_phases(settings, out)
    env = launch.launch_env(settings)
    machine = machine_description(env)
    # As run by this interpreter: the command works without the virtualenv on PATH.
    command = f"{shlex.quote(sys.executable)} -m dpkit bench " + shlex.join(
        sys.argv[2:] if sys.argv[1:2] == ["bench"] else []
    )
    on = machine["cpu_model"] if settings["device"] == "cpu" else ", ".join(machine["gpus"])
    print(
        f"dpkit bench: {len(phases)} launches at {settings['nproc']} processes on "
        f"{settings['device']} ({on}), {settings['warmup_steps']} warm-up + "
        f"{settings['timed_steps']} timed steps each -> {out}",
        file=sys.stderr,
        flush=True,
    )
    started = time.perf_counter()
    walls = {}
    try:
        for index, phase in enumerate(phases, 1):
            walls[phase.name] = launch.run_phase(phase, index, len(phases), settings, env)
    except launch.BenchError as err:
        print(f"dpkit bench: error: {err}", file=sys.stderr)
        return 1
    found = results.build_results(
        phases, walls, settings, machine, command, time.perf_counter() - started
    )
    (out / "results.json").write_text(json.dumps(found, indent=2) + "\n")
    table = markdown.format_markdown(found)
    (out / "results.md").write_text(table + "\n")
    chart.write_chart(found, out / "chart.png")
    written = ["results.json", "results.md", "chart.png"]
    if chart.has_timelines(found):
        chart.write_timelines_chart(found, out / "timelines.png")
        written.append("timelines.png")
    print(table)
    print(f"\nresults: {', '.join(str(out / name) for name in written)}")
    return 0
