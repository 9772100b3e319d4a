"""The plain Transformers ``Trainer`` on the bench's classification workload: dpkit's baseline.

``dpkit bench --workload classification`` runs ``recipes/finetune.py`` and this module
side by side, under the same launcher (``torchrun``), on the same model, data, micro-batch
and hyper-parameters (the defaults of :class:`dpkit.TrainConfig`, given to
``TrainingArguments``). The Trainer keeps its own defaults otherwise: its optimizer
(fused AdamW), its data loader and sampler, its logging cadence, and under ZeRO the
DeepSpeed JSON as written (dpkit's packaged ``zero1.json``/``zero2.json``, whose
``"auto"`` bucket size the Trainer fills with hidden_size^2), as a Trainer user runs it.
The one argument beyond that is what a CPU machine needs
(:func:`dpkit.integrations.transformers.device_arguments`).

What the bench reads, written by rank 0 into ``--output-dir``:

* ``train_log.jsonl``: per optimizer step its wall and CPU time (from one step's end to
  the next, data loading included, as :class:`dpkit.TrainingLog` times dpkit's steps),
  tokens and samples of this rank, where the step's time went
  (:class:`dpkit.StepPhases`, as dpkit's recipes record it); no per-step loss (the Trainer's default logging
  reports one every 500 steps; asking it for one each step would add a gather);
* ``run_info.json``: the strategy and world size that actually run, checked on every
  rank after the first step. A run whose ranks train unconnected copies, or that asked
  for ZeRO and runs without it, stops there with one line and exit code 2: its figures
  would not be the job the bench compares. At the end it adds the training loss and
  DDP's own timing (``ddp_timing``, as dpkit's runs write it in ``train_summary.json``).

Launched as a module (``torchrun -m dpkit.bench.trainer_baseline``), never as a file
(see :mod:`dpkit.bench.launch`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

from dpkit.arguments import OneLineParser
from dpkit.engines import engine_of

TRAINER_RUN_PREFIX = "trainer_"
"""A Trainer run's name is this prefix and the strategy's: ``trainer_ddp``, ``trainer_zero2``."""


def _train_defaults() -> dict[str, Any]:
    """dpkit's fine-tuning defaults (:class:`dpkit.TrainConfig`), the job both sides run."""
    from dpkit.train.finetune_config import TrainConfig

    return {f.name: f.default for f in fields(TrainConfig) if f.init}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The baseline's flags: the bench's workload, nothing the Trainer would not take.
    Refused as every dpkit command refuses (:class:`dpkit.arguments.OneLineParser`)."""
    parser = OneLineParser(prog="dpkit.bench.trainer_baseline")
    parser.add_argument("--strategy", required=True, choices=("ddp", "zero1", "zero2"))
    parser.add_argument("--micro-batch-size", type=int, required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--max-seq-length", type=int, required=True)
    parser.add_argument("--max-eval-samples", type=int, default=None)
    parser.add_argument("--mixed-precision", default="no", choices=("no", "bf16"))
    parser.add_argument("--output-dir", required=True)
    return parser.parse_args(argv)


class _TokenCounter:
    """This rank's real tokens and samples per step, counted as the model's forward sees
    them (a pre-hook): the Trainer's loader fetches one batch ahead, so counting in the
    collator would credit each step with the next step's batch."""

    def __init__(self, model: Any):
        self.tokens = 0
        self.samples = 0
        model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        if module.training and kwargs.get("attention_mask") is not None:
            self.tokens += int(kwargs["attention_mask"].sum())
            self.samples += int(kwargs["attention_mask"].shape[0])

    def take(self) -> tuple[int, int]:
        counts, self.tokens, self.samples = (self.tokens, self.samples), 0, 0
        return counts


def _step_clock(strategy: str, output_dir: Path, counter: _TokenCounter) -> Any:
    """A callback timing each optimizer step and checking, after the first, that the
    Trainer runs the job the launcher started."""
    import torch.distributed as dist
    from transformers import TrainerCallback

    from dpkit.errors import UsageError
    from dpkit.integrations.transformers import check_trainer_run, strategy_running
    from dpkit.train.phases import StepPhases

    class StepClock(TrainerCallback):
        trainer: Any = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            check_trainer_run(args)
            # The same phase clock as dpkit's TrainingLog, on what the Trainer prepared.
            self.phases = StepPhases(self.trainer.model_wrapped, self.trainer.optimizer)
            self.last = (time.perf_counter(), time.process_time())

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            now = (time.perf_counter(), time.process_time())
            tokens, samples = counter.take()
            phases = self.phases.take()
            if state.global_step == 1:
                self.check()
            if state.is_world_process_zero:
                record = {
                    "step": state.global_step,
                    "step_time_s": now[0] - self.last[0],
                    "step_cpu_s": now[1] - self.last[1],
                    "tokens_per_rank": tokens,
                    "samples_per_rank": samples,
                    **phases,
                }
                with open(output_dir / "train_log.jsonl", "a") as log:
                    log.write(json.dumps(record) + "\n")
            self.last = (time.perf_counter(), time.process_time())

        def check(self) -> None:
            launched = int(os.environ.get("WORLD_SIZE", "1"))
            world = dist.get_world_size() if dist.is_initialized() else 1
            running = strategy_running(self.trainer.model_wrapped, self.trainer.optimizer)
            name = running.name if running is not None else None
            if world != launched or name != strategy:
                raise UsageError(
                    f"--strategy={strategy}: the Trainer runs {name or 'no known strategy'} "
                    f"over {world} of the {launched} processes launched "
                    f"({type(self.trainer.model_wrapped).__name__}): not the job to compare"
                )
            wrapped = self.trainer.model_wrapped
            self.info = {
                "strategy": name,
                "world_size": world,
                "wrapper": type(wrapped).__name__,
                "optimizer": type(self.trainer.optimizer).__name__,
            }
            # What the Trainer chose where dpkit chooses otherwise: DDP's unused-parameter
            # search (on unless gradient checkpointing) and per-forward buffer broadcast,
            # ZeRO's filled buckets.
            if hasattr(wrapped, "find_unused_parameters"):
                self.info["ddp_find_unused_parameters"] = wrapped.find_unused_parameters
                self.info["ddp_forward_sync_buffers"] = wrapped.forward_sync_buffers
            plugin = getattr(self.trainer.accelerator.state, "deepspeed_plugin", None)
            if plugin is not None:
                self.info["zero_optimization"] = plugin.deepspeed_config["zero_optimization"]
            if state_is_main():
                (output_dir / "run_info.json").write_text(json.dumps(self.info, indent=2) + "\n")

    def state_is_main() -> bool:
        return not dist.is_initialized() or dist.get_rank() == 0

    return StepClock()


def main() -> None:
    """Build the Trainer as a user would, train, write the step log and the run info."""
    import datasets
    import transformers
    from transformers import (
        AutoModelForSequenceClassification,
        DataCollatorWithPadding,
        Trainer,
        TrainingArguments,
    )

    import dpkit
    from dpkit import models, resources
    from dpkit.data import classification
    from dpkit.integrations.transformers import device_arguments
    from dpkit.train.logs import log_once_per_job

    args = parse_args()
    log_once_per_job()
    datasets.disable_progress_bars()
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    defaults = _train_defaults()
    model_path, hf_config = models.load_model_config(dpkit.ModelConfig.model)
    data_cfg = dpkit.DataConfig(max_eval_samples=args.max_eval_samples)
    splits, label_names = classification.load_data_splits(data_cfg)
    splits = data_cfg.truncate(splits)
    tokenizer = models.load_tokenizer(model_path, dpkit.ModelConfig.model, hf_config)
    transformers.set_seed(defaults["seed"])
    model = AutoModelForSequenceClassification.from_pretrained(
        model_path,
        **models.classifier_labels(label_names, tokenizer),
    )
    training = TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=args.micro_batch_size,
        max_steps=args.max_steps,
        learning_rate=defaults["learning_rate"],
        weight_decay=defaults["weight_decay"],
        warmup_steps=defaults["warmup_ratio"],  # transformers 5: a float in [0, 1) is a ratio
        lr_scheduler_type=defaults["lr_scheduler"],
        max_grad_norm=defaults["max_grad_norm"],
        seed=defaults["seed"],
        bf16=args.mixed_precision == "bf16",
        save_strategy="no",
        report_to="none",
        # The Trainer's own DeepSpeed integration reads the strategy's shipped JSON.
        deepspeed=(
            str(resources.deepspeed_config(args.strategy))
            if engine_of(args.strategy).reads_config_file
            else None
        ),
        **device_arguments(),
    )
    tokenized = splits["train"].map(
        lambda batch: tokenizer(batch["text"], truncation=True, max_length=args.max_seq_length),
        batched=True,
        remove_columns=["text"],
    )
    counter = _TokenCounter(model)
    clock = _step_clock(args.strategy, output_dir, counter)
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=tokenized,
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8),
        callbacks=[clock],
    )
    clock.trainer = trainer
    result = trainer.train()
    if trainer.is_world_process_zero():
        info = {
            **clock.info,
            "training_loss": result.training_loss,
            # DDP's own timing (its ddp_timing; None under a backend that times nothing)
            **engine_of(args.strategy).own_timing(trainer.model_wrapped),
        }
        (output_dir / "run_info.json").write_text(json.dumps(info, indent=2) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import dpkit

    dpkit.run_and_exit(main)
