"""``dpkit tune``: the fastest configuration that fits, found by measuring.

    dpkit tune                                        # train_lm.py, 2 CPU processes
    dpkit tune --memory-budget 200MiB --output-dir tune_results/small
    dpkit tune --gradient-checkpointing both -- --size gpt2 --seq-len 512
    dpkit tune --recipe finetune.py -- --max-eval-samples 64 --max-seq-length 64
    dpkit tune --recipe my_train.py --nproc 8 --global-batch-size 256 -- --model my/model

Arguments after ``--`` go to the recipe in every trial. Writes ``results.json``,
``results.md``, ``chart.png`` and ``winner/`` (accelerate YAML, a ZeRO winner's
DeepSpeed JSON, ``command.sh``) into ``--output-dir``; a second tune of the same folder
reuses its trials. See docs/tune.md.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from dpkit.errors import UsageError
from dpkit.tune.config import (
    CHECKPOINTING_MODES,
    DEFAULT_RECIPE,
    DEFAULT_STRATEGIES,
    FALLBACK_STRATEGIES,
    TUNABLE,
    TuneConfig,
)


def _sizes(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(float(v)) for v in text.split(",") if v.strip())
    except ValueError:
        raise UsageError(f"{flag}={text!r}: comma-separated positive integers") from None
    if not values or min(values) < 1:
        raise UsageError(f"{flag}={text!r}: comma-separated positive integers")
    return values


def _seconds(text: str, flag: str) -> float:
    """``600``, ``600s``, ``10m`` or ``1h``."""
    units = {"s": 1, "m": 60, "h": 3600}
    number, unit = (text[:-1], text[-1]) if text and text[-1] in units else (text, "s")
    try:
        value = float(number) * units[unit]
    except ValueError:
        raise UsageError(f"{flag}={text!r}: seconds, or a number with s, m or h") from None
    if not value > 0:
        raise UsageError(f"{flag}={text!r}: must be > 0")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``dpkit tune``."""
    names = ",".join(TUNABLE)
    parser.add_argument(
        "--recipe",
        default=DEFAULT_RECIPE,
        help="train_lm.py, finetune.py, finetune_lm.py, or the path of a script built on dpkit's API "
        f"(default: {DEFAULT_RECIPE})",
    )
    parser.add_argument("--nproc", type=int, default=None, help="processes (default: GPUs, or 2)")
    parser.add_argument(
        "--strategies",
        default=",".join(DEFAULT_STRATEGIES),
        help=f"comma-separated, of {names} (default: {','.join(DEFAULT_STRATEGIES)})",
    )
    parser.add_argument(
        "--fallback-strategies",
        default=",".join(FALLBACK_STRATEGIES),
        help="tried only where no candidate of --strategies fits the memory budget, as "
        f"checkpointing is under auto; 'none': never (default: {','.join(FALLBACK_STRATEGIES)})",
    )
    parser.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help="the current configuration's micro-batch (default: the recipe's)",
    )
    parser.add_argument(
        "--gradient-accumulation-steps",
        type=int,
        default=1,
        help="the current configuration's accumulation",
    )
    parser.add_argument(
        "--baseline-strategy",
        default="ddp",
        help=f"the current configuration's strategy, one of {names} (the speedup is "
        "measured against it; default: ddp)",
    )
    parser.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="samples per optimizer step for every candidate (default: the current "
        "configuration's micro-batch x accumulation x processes)",
    )
    parser.add_argument(
        "--micro-batch-sizes",
        default=None,
        help="micro-batches to try (default: the three largest powers of two dividing the "
        "per-rank batch)",
    )
    parser.add_argument(
        "--zero-bucket-sizes",
        default=None,
        help="ZeRO bucket sizes (elements) to try on the best DeepSpeed ZeRO candidates "
        "(default: dpkit's size / 4 and x 4; FSDP2 has no buckets)",
    )
    parser.add_argument(
        "--gradient-checkpointing",
        choices=CHECKPOINTING_MODES,
        default="auto",
        help="activation checkpointing as a dimension: auto tries a candidate checkpointed "
        "only where it does not fit plain (over the budget or out of memory); both, on, off "
        "(default: auto)",
    )
    parser.add_argument(
        "--no-zero-variants",
        action="store_true",
        help="no second round (the best DeepSpeed ZeRO candidates with other bucket sizes "
        "and contiguous_gradients, and overlap_comm on CUDA, flipped; FSDP2 has none)",
    )
    parser.add_argument(
        "--memory-budget",
        "--gpu-memory",
        default=None,
        help="per-rank memory a candidate may use, e.g. 80GiB, 300MiB (default: the GPU's "
        "memory less 2 GiB for the CUDA context; none on CPU)",
    )
    parser.add_argument("--warmup-steps", type=int, default=2, help="untimed steps per trial")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per trial")
    parser.add_argument(
        "--time-budget", default=None, help="stop launching trials after this long (10m, 600)"
    )
    parser.add_argument("--max-trials", type=int, default=None, help="measure at most N trials")
    parser.add_argument(
        "--trial-timeout", default="15m", help="a trial running longer fails (default 15m)"
    )
    parser.add_argument(
        "--tie-tolerance",
        type=float,
        default=0.02,
        help="step times within this fraction of the fastest tie; less sharding wins",
    )
    parser.add_argument(
        "--threads-per-process", type=int, default=None, help="OMP_NUM_THREADS per process"
    )
    parser.add_argument(
        "--retry-failed", action="store_true", help="launch again trials that failed before"
    )
    parser.add_argument(
        "--output-dir", default="tune_results", help="trials, results, winner files"
    )
    parser.add_argument(
        "recipe_args", nargs=argparse.REMAINDER, help="after --: arguments for the recipe"
    )


def config_from_args(args: argparse.Namespace) -> TuneConfig:
    """The :class:`TuneConfig` of a command line (checked when built)."""
    from dpkit.plan.inputs import parse_memory

    recipe_args = list(args.recipe_args)
    if recipe_args[:1] == ["--"]:
        recipe_args = recipe_args[1:]
    return TuneConfig(
        recipe=args.recipe,
        recipe_args=tuple(recipe_args),
        nproc=args.nproc,
        strategies=tuple(s.strip() for s in args.strategies.split(",") if s.strip()),
        fallback_strategies=()
        if args.fallback_strategies.strip() == "none"
        else tuple(s.strip() for s in args.fallback_strategies.split(",") if s.strip()),
        micro_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        baseline_strategy=args.baseline_strategy,
        global_batch_size=args.global_batch_size,
        micro_batch_sizes=None
        if args.micro_batch_sizes is None
        else _sizes(args.micro_batch_sizes, "--micro-batch-sizes"),
        zero_bucket_sizes=None
        if args.zero_bucket_sizes is None
        else _sizes(args.zero_bucket_sizes, "--zero-bucket-sizes"),
        gradient_checkpointing=args.gradient_checkpointing,
        zero_variants=not args.no_zero_variants,
        memory_budget=None
        if args.memory_budget is None
        else parse_memory(args.memory_budget, "--memory-budget"),
        warmup_steps=args.warmup_steps,
        steps=args.steps,
        time_budget_s=None
        if args.time_budget is None
        else _seconds(args.time_budget, "--time-budget"),
        max_trials=args.max_trials,
        trial_timeout_s=_seconds(args.trial_timeout, "--trial-timeout"),
        tie_tolerance=args.tie_tolerance,
        threads_per_process=args.threads_per_process,
        output_dir=args.output_dir,
        retry_failed=args.retry_failed,
    )


def main(args: argparse.Namespace) -> int:
    """Run the tune; 0 with a winner, 1 without one (every trial failed or none fits)."""
    from dpkit.tune.run import run_tune

    config = config_from_args(args)
    # As run by this interpreter: the command works without the virtualenv on PATH.
    command = f"{shlex.quote(sys.executable)} -m dpkit tune " + shlex.join(
        sys.argv[2:] if sys.argv[1:2] == ["tune"] else []
    )
    results = run_tune(config, command=command)
    return 0 if results["winner"] is not None else 1
