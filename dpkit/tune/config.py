"""What ``dpkit tune`` is asked (:class:`TuneConfig`) and what that resolves to on this
machine, once, before anything launches (:class:`TuneSettings`, :func:`tune_settings`).

The recipe is any script built on dpkit's API that takes ``--micro-batch-size``,
``--gradient-accumulation-steps``, ``--max-steps`` and ``--output-dir`` (dpkit's
``train_lm.py`` and ``finetune.py`` do); its own ``--help`` says which flags it has and
its default micro-batch, so a script of the user's is checked the same way as ours.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dpkit import resources
from dpkit.engines import (
    BENCHABLE,
    BENCHED_BY_DEFAULT,
    ENGINES,
    MEMORY_FALLBACKS,
    RUNNABLE,
    engine_of,
    get_strategy,
)
from dpkit.errors import UsageError

DEFAULT_RECIPE = "train_lm.py"
DEFAULT_CPU_PROCS = 2
# Flags every trial is given; a recipe without them cannot be tuned.
REQUIRED_FLAGS = ("micro-batch-size", "gradient-accumulation-steps", "max-steps", "output-dir")
# Flags the tune owns: given in the recipe's arguments they would fight the trial's own.
OWNED_FLAGS = (*REQUIRED_FLAGS, "strategy", "deepspeed", "overwrite-output-dir")
# Flags passed when the recipe has them: a trial writes no model and reuses its folder.
OPTIONAL_FLAGS = {
    "overwrite-output-dir": [],
    "no-save-model": [],
    "no-save-checkpoints": [],
    # Walk the tensors in the warm-up steps only; the live-tensor peak is watched in the
    # last one walked (TuneSettings.probe_steps).
    "memory-probe-steps": [],
}
HELP_TIMEOUT_S = 300
CHECKPOINTING_MODES = ("auto", "off", "on", "both")
"""How the tune searches activation checkpointing (:data:`TuneConfig.gradient_checkpointing`)."""
CHECKPOINTING_FLAG = "gradient-checkpointing"
TUNABLE = tuple(s.name for s in BENCHABLE)
"""The strategies a tune may try: every one dpkit's recipes run, ZeRO-3 and the
offloads included."""
DEFAULT_STRATEGIES = tuple(s.name for s in BENCHED_BY_DEFAULT)
"""What a tune tries by default: DDP, ZeRO-1, ZeRO-2, FSDP2 shard-grad-op, FSDP2
full-shard, least sharding first."""
FALLBACK_STRATEGIES = tuple(s.name for s in MEMORY_FALLBACKS)
"""What a tune tries only where nothing lighter fits the budget: ZeRO-2 offload, ZeRO-3,
ZeRO-3 offload, FSDP2 full-shard offload (each pays in speed for memory: per-layer
gathers, or host traffic and a CPU optimizer step)."""


def _flag_name(text: str) -> str:
    """``--micro_batch_size`` and ``--micro-batch-size`` as one name, without dashes."""
    return text.lstrip("-").replace("_", "-")


@dataclass
class TuneConfig:
    """A tune: which recipe, which candidates, what budget. Checked when built (one
    line naming the field, :class:`~dpkit.errors.UsageError`); what depends on the
    machine or the recipe is checked by :func:`tune_settings`, still before any launch."""

    recipe: str = DEFAULT_RECIPE
    """A recipe of dpkit's (``train_lm.py``, ``finetune.py``) or a path to your script."""
    recipe_args: tuple[str, ...] = ()
    """Arguments every trial passes to the recipe (the model, data, precision...)."""
    nproc: int | None = None
    """Processes per trial (default: every GPU, or 2 on CPU)."""
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    """The strategies tried (default: :data:`DEFAULT_STRATEGIES`, FSDP2's two modes
    included: an FSDP2 trial costs about what a ZeRO one does, docs/tune.md); any of
    :data:`TUNABLE`, ZeRO-3 and the offloads too."""
    fallback_strategies: tuple[str, ...] = FALLBACK_STRATEGIES
    """Tried only where no candidate of ``strategies`` fits (every one predicted over the
    budget, measured over it, or out of memory), as ``auto`` checkpointing is; one named
    in ``strategies`` too is tried from the start; ``()``: never."""
    micro_batch_size: int | None = None
    """The current configuration's micro-batch (default: the recipe's own default)."""
    gradient_accumulation_steps: int = 1
    """The current configuration's accumulation."""
    baseline_strategy: str = "ddp"
    """The current configuration's strategy: the tune reports its speedup over it."""
    global_batch_size: int | None = None
    """Samples per optimizer step, the same for every candidate (default: the current
    configuration's micro-batch x accumulation x processes)."""
    micro_batch_sizes: tuple[int, ...] | None = None
    """Micro-batches tried (default: the powers of two dividing the per-rank batch, the
    three largest)."""
    zero_bucket_sizes: tuple[int, ...] | None = None
    """ZeRO reduce/all-gather bucket sizes (elements) tried on the best ZeRO candidates
    (default: dpkit's size, a quarter of it and four times it); needs a DeepSpeed strategy
    among ``strategies``."""
    gradient_checkpointing: str = "auto"
    """Activation checkpointing as a dimension: ``auto`` tries a candidate checkpointed
    only where it does not fit plain (predicted or measured over the budget, or out of
    memory: checkpointed, the same candidate is only slower); ``both`` every candidate
    both ways; ``on`` checkpointed only; ``off`` never. The recipe needs a
    ``--gradient-checkpointing`` flag for any but ``off``."""
    zero_variants: bool = True
    """A second round: the best DeepSpeed ZeRO candidates with other bucket sizes and
    ``contiguous_gradients`` flipped (``overlap_comm`` too on CUDA). FSDP2 has no such
    settings: it gets no second round."""
    memory_budget: int | None = None
    """Bytes per rank a candidate may use (default: the GPU's memory less dpkit plan's 2 GiB
    reserve for the CUDA context and allocator slack; none on CPU)."""
    warmup_steps: int = 2
    """Untimed optimizer steps per trial (step 1 holds the memory probes)."""
    steps: int = 4
    """Timed optimizer steps per trial."""
    time_budget_s: float | None = None
    """Stop launching trials after this many seconds."""
    max_trials: int | None = None
    """Measure at most this many candidates (reused trials count)."""
    trial_timeout_s: float = 900.0
    """A trial running longer is stopped and recorded as timed out."""
    tie_tolerance: float = 0.02
    """Step times within this fraction of the fastest are a tie, which less sharding wins."""
    threads_per_process: int | None = None
    """OMP_NUM_THREADS of every process (default: usable cores / processes)."""
    output_dir: str = "tune_results"
    """Where trials, results and the winner's files go; a second tune there reuses trials."""
    retry_failed: bool = False
    """Launch again the trials that failed in an earlier tune of this folder."""

    def __post_init__(self) -> None:
        self.recipe_args = tuple(self.recipe_args)
        self.strategies = tuple(self.strategies)
        unknown = [name for name in self.strategies if name not in TUNABLE]
        if not self.strategies or unknown:
            runs = unknown and unknown[0] in {s.name for s in RUNNABLE}
            found = (
                f"dpkit tune does not try {unknown[0]} yet (the recipes run it); "
                if runs
                else f"{unknown[0]} is not run by dpkit's recipes; "
                if unknown
                else ""
            )
            raise UsageError(
                f"strategies={','.join(self.strategies)!r}: {found}a list of {', '.join(TUNABLE)}"
            )
        if len(set(self.strategies)) != len(self.strategies):
            raise UsageError(f"strategies={','.join(self.strategies)!r}: listed twice")
        self.fallback_strategies = tuple(self.fallback_strategies)
        fallbacks = ",".join(self.fallback_strategies)
        unknown = [name for name in self.fallback_strategies if name not in TUNABLE]
        if unknown:
            raise UsageError(
                f"fallback_strategies={fallbacks!r}: {unknown[0]} is not one of "
                f"{', '.join(TUNABLE)}"
            )
        if len(set(self.fallback_strategies)) != len(self.fallback_strategies):
            raise UsageError(f"fallback_strategies={fallbacks!r}: listed twice")
        if self.baseline_strategy not in TUNABLE:
            raise UsageError(
                f"baseline_strategy={self.baseline_strategy!r}: one of {', '.join(TUNABLE)}"
            )
        if self.zero_bucket_sizes is not None and not any(
            engine_of(name).tunable for name in self.strategies
        ):
            # Buckets are DeepSpeed's; FSDP2 and DDP have none, so the sizes would go unused.
            raise UsageError(
                f"zero_bucket_sizes={self.zero_bucket_sizes}: no DeepSpeed strategy among "
                f"strategies={','.join(self.strategies)!r} (FSDP2 and DDP have no ZeRO buckets)"
            )
        positive = {
            "nproc": self.nproc,
            "micro_batch_size": self.micro_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "global_batch_size": self.global_batch_size,
            "memory_budget": self.memory_budget,
            "warmup_steps": self.warmup_steps,
            "steps": self.steps,
            "max_trials": self.max_trials,
            "threads_per_process": self.threads_per_process,
        }
        for name, value in positive.items():
            if value is not None and value < 1:
                raise UsageError(f"{name}={value}: must be >= 1")
        for name, values in (
            ("micro_batch_sizes", self.micro_batch_sizes),
            ("zero_bucket_sizes", self.zero_bucket_sizes),
        ):
            if values is not None and (not values or min(values) < 1):
                raise UsageError(f"{name}={values}: positive integers")
        for engine in ENGINES:
            refusal = next(
                filter(None, map(engine.bucket_refusal, self.zero_bucket_sizes or ())), None
            )
            if refusal:
                raise UsageError(f"zero_bucket_sizes: {refusal}")
        for name, value in (
            ("time_budget_s", self.time_budget_s),
            ("trial_timeout_s", self.trial_timeout_s),
        ):
            if value is not None and not value > 0:
                raise UsageError(f"{name}={value}: must be > 0 seconds")
        if not 0 <= self.tie_tolerance < 1:
            raise UsageError(f"tie_tolerance={self.tie_tolerance}: must be in [0, 1)")
        if self.gradient_checkpointing not in CHECKPOINTING_MODES:
            raise UsageError(
                f"gradient_checkpointing={self.gradient_checkpointing!r}: one of "
                f"{', '.join(CHECKPOINTING_MODES)}"
            )
        for arg in self.recipe_args:
            name = _flag_name(arg.split("=", 1)[0]) if arg.startswith("--") else None
            if name == CHECKPOINTING_FLAG:
                raise UsageError(
                    f"recipe argument {arg!r}: dpkit tune decides checkpointing per trial; "
                    "use dpkit tune --gradient-checkpointing on (or both, auto, off)"
                )
            if name in OWNED_FLAGS:
                raise UsageError(
                    f"recipe argument {arg!r}: dpkit tune sets --{name} for every trial "
                    "(see dpkit tune --help)"
                )


@dataclass(frozen=True)
class RecipeInfo:
    """The recipe as found and checked: its path and the flags its ``--help`` lists."""

    path: Path
    flags: frozenset[str]
    default_micro_batch: int | None

    def extra_args(self, probe_steps: int = 1) -> list[str]:
        """The optional flags this recipe has (:data:`OPTIONAL_FLAGS`), with their values;
        ``--memory-probe-steps`` gets ``probe_steps``."""
        extra: list[str] = []
        for name, values in OPTIONAL_FLAGS.items():
            if name in self.flags:
                given = [str(probe_steps)] if name == "memory-probe-steps" else values
                extra += [f"--{name}", *given]
        return extra


@dataclass(frozen=True)
class TuneSettings:
    """A :class:`TuneConfig` resolved against the machine and the recipe: every default
    filled, every value checked. Made once, by :func:`tune_settings`."""

    config: TuneConfig
    recipe: RecipeInfo
    nproc: int
    device: str
    global_batch_size: int
    per_rank_batch: int
    baseline_micro_batch: int
    micro_batch_sizes: tuple[int, ...]
    precision: str
    memory_budget: int | None
    threads_per_process: int
    output_dir: Path
    plan_model: dict[str, Any] | None = field(default=None)
    """The recipe's run-config sections the plan reads (None: not a recipe of dpkit's)."""

    @property
    def checkpointing_note(self) -> str:
        """How checkpointing is searched, for the tune's first line."""
        if CHECKPOINTING_FLAG not in self.recipe.flags:
            name = self.recipe.path.name
            return f"checkpointing not searched ({name} has no --{CHECKPOINTING_FLAG})"
        return {
            "auto": "checkpointed where plain does not fit",
            "off": "no checkpointing",
            "on": "every candidate checkpointed",
            "both": "every candidate with and without checkpointing",
        }[self.config.gradient_checkpointing]

    @property
    def probe_steps(self) -> int:
        """Warm-up steps whose tensors a trial walks: two where there are two, so the
        live-tensor peak is watched in the second, which holds AdamW's moments from its
        start (the run's peak; the first step makes them inside its update)."""
        return min(2, self.config.warmup_steps)

    @property
    def total_steps(self) -> int:
        return self.config.warmup_steps + self.config.steps

    def launch_settings(self) -> dict[str, Any]:
        """What :func:`dpkit.bench.launch.run_phase` and ``launch_env`` read."""
        return {
            "nproc": self.nproc,
            "total_steps": self.total_steps,
            "launch_timeout_s": self.config.trial_timeout_s,
            "launch_timeout_flag": "--trial-timeout",
            "threads_per_process": self.threads_per_process,
        }


def find_recipe(name: str) -> Path:
    """A path to a script, or the name of one of dpkit's recipes (``.py`` optional)."""
    path = Path(name)
    if path.is_file():
        return path.resolve()
    filename = name if name.endswith(".py") else f"{name}.py"
    packaged = resources.recipe(filename)
    if "/" not in name and packaged.is_file():
        return packaged
    raise UsageError(
        f"--recipe={name!r}: no such file, and not one of dpkit's recipes "
        "(train_lm.py, finetune.py, finetune_lm.py)"
    )


def read_recipe(path: Path, env: dict[str, str]) -> RecipeInfo:
    """Run ``recipe --help`` (a single process, no process group) and read its flags."""
    try:
        done = subprocess.run(
            [sys.executable, str(path), "--help"],
            capture_output=True,
            text=True,
            env=env,
            timeout=HELP_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise UsageError(
            f"--recipe={str(path)!r}: --help did not answer in {HELP_TIMEOUT_S} s"
        ) from None
    if done.returncode != 0:
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise UsageError(f"--recipe={str(path)!r}: --help failed: {last[0]}")
    text = done.stdout
    flags = frozenset(_flag_name(f) for f in re.findall(r"(?<![\w-])--[A-Za-z][\w-]*", text))
    missing = [f"--{f}" for f in REQUIRED_FLAGS if f not in flags]
    if missing:
        raise UsageError(
            f"--recipe={str(path)!r}: has no {', '.join(missing)} (dpkit tune sets them per trial)"
        )
    # HfArgumentParser and argparse print "(default: 4)" in the flag's help.
    block = re.search(r"^\s+--micro[-_]batch[-_]size\b(.*?)(?=^\s+-|\Z)", text, re.S | re.M)
    found = re.search(r"\(default:\s*(\d+)\)", block.group(1)) if block else None
    return RecipeInfo(path, flags, int(found.group(1)) if found else None)


def _recipe_precision(args: tuple[str, ...]) -> str:
    """The ``--mixed-precision`` the recipe arguments ask for (``no`` when none)."""
    value = "no"
    for index, arg in enumerate(args):
        name, _, inline = arg.partition("=")
        if arg.startswith("--") and _flag_name(name) == "mixed-precision":
            value = inline or (args[index + 1] if index + 1 < len(args) else value)
    return value


def _plan_model(recipe: Path, args: tuple[str, ...]) -> dict[str, Any] | None:
    """The run-config sections :func:`dpkit.plan.check.recipe_model` reads, parsed from
    the recipe's arguments as the recipe itself parses them (dpkit's recipes only)."""
    from transformers import HfArgumentParser

    if recipe.name == "train_lm.py":
        from dpkit.data.lm import LMWorkload

        (workload, _) = HfArgumentParser(LMWorkload).parse_args_into_dataclasses(
            args=list(args), return_remaining_strings=True
        )
        return {"LMWorkload": asdict(workload)}
    if recipe.name == "finetune.py":
        from dpkit.train.finetune_config import ModelConfig

        # The model and its sequence length; the training section's own checks (its
        # output folder, say) belong to the trials. The micro-batch is each candidate's.
        (model, _) = HfArgumentParser(ModelConfig).parse_args_into_dataclasses(
            args=list(args), return_remaining_strings=True
        )
        return {"ModelConfig": asdict(model), "TrainConfig": {"micro_batch_size": 1}}
    if recipe.name == "finetune_lm.py":
        from dpkit.models import load_model_config
        from dpkit.train.causal_config import DecoderModelConfig

        (model, _) = HfArgumentParser(DecoderModelConfig).parse_args_into_dataclasses(
            args=list(args), return_remaining_strings=True
        )
        model.resolve_max_seq_length(load_model_config(model.model)[1])  # as the recipe does
        return {"DecoderModelConfig": asdict(model), "CausalTrainConfig": {"micro_batch_size": 1}}
    return None


def _powers_of_two(per_rank: int, keep: int = 3) -> tuple[int, ...]:
    sizes = [m for m in (1 << i for i in range(per_rank.bit_length())) if per_rank % m == 0]
    return tuple(sizes[-keep:])


def tune_settings(config: TuneConfig, gpu_count: int, env: dict[str, str]) -> TuneSettings:
    """Fill the defaults and check everything that can be wrong, before any launch."""
    from dpkit.bench.machine import usable_cores
    from dpkit.core.spec import PlanInputs
    from dpkit.core.units import GIB

    path = find_recipe(config.recipe)
    nproc = config.nproc or gpu_count or DEFAULT_CPU_PROCS
    if gpu_count and nproc > gpu_count:
        raise UsageError(f"--nproc={nproc}: this machine has {gpu_count} GPUs")
    recipe = read_recipe(path, env)
    if config.gradient_checkpointing in ("on", "both") and CHECKPOINTING_FLAG not in recipe.flags:
        raise UsageError(
            f"--gradient-checkpointing={config.gradient_checkpointing}: {path.name}'s --help "
            f"lists no --{CHECKPOINTING_FLAG}"
        )
    micro = config.micro_batch_size or recipe.default_micro_batch
    if micro is None:
        raise UsageError(
            f"--micro-batch-size: {path.name}'s --help shows no default; give the current one"
        )
    accumulation = config.gradient_accumulation_steps
    global_batch = config.global_batch_size or micro * accumulation * nproc
    if global_batch % nproc:
        raise UsageError(
            f"--global-batch-size={global_batch}: not divisible by the {nproc} processes"
        )
    per_rank = global_batch // nproc
    if per_rank % micro:
        raise UsageError(
            f"--micro-batch-size={micro}: does not divide the {per_rank} samples per rank "
            f"(global batch {global_batch} / {nproc} processes)"
        )
    if micro * accumulation != per_rank:
        if accumulation != 1:  # given, and not the global batch's: say so, do not guess
            raise UsageError(
                f"--gradient-accumulation-steps={accumulation}: micro-batch {micro} x "
                f"{accumulation} x {nproc} processes is not --global-batch-size={global_batch}"
            )
        accumulation = per_rank // micro  # the current micro-batch at the tuned batch
    sizes = config.micro_batch_sizes or _powers_of_two(per_rank)
    for size in sizes:
        if per_rank % size:
            raise UsageError(
                f"--micro-batch-sizes={','.join(map(str, sizes))}: {size} does not divide the "
                f"{per_rank} samples per rank (global batch {global_batch} / {nproc} processes)"
            )
    sizes = tuple(sorted(set(sizes) | {micro}))
    budget = config.memory_budget
    if budget is None and gpu_count:
        import torch

        # The allocator's peak is checked against it: leave dpkit plan's default reserve
        # for the CUDA context, NCCL and allocator slack, which that peak does not count.
        budget = torch.cuda.get_device_properties(0).total_memory - PlanInputs.reserve
    if budget is not None and budget < GIB // 1024:
        raise UsageError(f"--memory-budget={budget} bytes: under 1 MiB per rank")
    threads = config.threads_per_process or max(1, usable_cores() // nproc)
    precision = _recipe_precision(config.recipe_args)
    for name in (*config.strategies, config.baseline_strategy):
        get_strategy(name)
    output_dir = Path(config.output_dir).resolve()
    if output_dir.exists() and not output_dir.is_dir():
        raise UsageError(f"--output-dir={config.output_dir!r}: exists and is not a directory")
    try:
        plan_model = _plan_model(path, config.recipe_args)
    except (SystemExit, ValueError) as err:
        raise UsageError(f"recipe arguments {' '.join(config.recipe_args)!r}: {err}") from None
    resolved = TuneConfig(
        **{
            **config.__dict__,
            "micro_batch_size": micro,
            "gradient_accumulation_steps": accumulation,
            # A recipe without the flag cannot be checkpointed: auto searches nothing
            # then, and the tune's first line says so (TuneSettings.checkpointing_note).
            "gradient_checkpointing": config.gradient_checkpointing
            if CHECKPOINTING_FLAG in recipe.flags
            else "off",
        }
    )
    return TuneSettings(
        config=resolved,
        recipe=recipe,
        nproc=nproc,
        device="cuda" if gpu_count else "cpu",
        global_batch_size=global_batch,
        per_rank_batch=per_rank,
        baseline_micro_batch=micro,
        micro_batch_sizes=sizes,
        precision=precision,
        memory_budget=budget,
        threads_per_process=threads,
        output_dir=output_dir,
        plan_model=plan_model,
    )
