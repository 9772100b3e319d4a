"""Train a GPT-2-family causal LM from scratch as DDP, ZeRO-1 or ZeRO-2: the workload of ``dpkit bench``.

The same script, unchanged, under every launcher (run from the repository root):

    python recipes/train_lm.py                                    # one process (CPU or one GPU)
    accelerate launch --config_file ds_configs/accelerate/ddp.yaml --num_processes 8 recipes/train_lm.py
    accelerate launch --config_file ds_configs/accelerate/zero1.yaml --num_processes 8 recipes/train_lm.py --size gpt2
    deepspeed --num_gpus 8 recipes/train_lm.py --deepspeed ds_configs/zero2.json
    torchrun --nproc_per_node 8 recipes/train_lm.py --strategy zero2 --synthetic

On a machine without CUDA the same commands run the processes on CPU with gloo.
Default: the ``small`` shape (~23M params) on Shakespeare read as bytes (token
id = byte value, see ``dpkit/lm_data.py``), micro-batch 4 x 128 tokens, torch
AdamW under every strategy, dropout 0. ``python recipes/train_lm.py --help``
lists every flag.

Writes to ``--output-dir``: run_config.json, run_info.json, ds_config.json (ZeRO),
train_log.jsonl (per optimizer step: loss averaged over ranks, lr, step time on
the main process, tokens) and memory_report.json (per rank, from dpkit.memory).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from dpkit import guards, lm_data, memory
from dpkit.config import StrategyConfig, config_dict
from dpkit.errors import EXIT_USAGE, UsageError
from dpkit.models import adamw_param_groups, count_parameters
from dpkit.run_output import RunOutput
from dpkit.strategy import build_accelerator, resolve_precision, resolve_strategy
from dpkit.throughput import Throughput

logger = logging.getLogger("dpkit.train_lm")


@dataclass
class LMTrainOptions:
    """dpkit's side of the run beyond the strategy (StrategyConfig): accumulation, probes,
    logging. The workload is in LMWorkload."""

    gradient_accumulation_steps: int = field(
        default=1, metadata={"help": "Micro-steps per optimizer step."}
    )
    """Micro-batches accumulated into one optimizer update."""
    memory_probe_steps: int = field(
        default=1,
        metadata={
            "help": "Walk the tensors during the first N steps only (-1: every step, 0: never)."
        },
    )
    """The memory probes (``dpkit.memory.track``) run during the first N optimizer steps and are
    then removed, keeping their high-waters: model states are the same every step, and later
    steps then time the training alone. -1 probes every step; 0 installs none."""
    logging_steps: int = field(default=1, metadata={"help": "Log every N optimizer steps."})
    """One log line every N optimizer steps (main process)."""
    report_to: str = field(
        default="none",
        metadata={"help": "Tracker: none or tensorboard.", "choices": ["none", "tensorboard"]},
    )
    """Experiment tracker, through accelerate's ``log_with``."""
    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Allow writing into a directory that holds another run."}
    )
    """Without it, a directory that already holds a run is refused."""

    def __post_init__(self) -> None:
        if self.gradient_accumulation_steps <= 0:
            raise UsageError(
                f"--gradient-accumulation-steps={self.gradient_accumulation_steps}: must be > 0"
            )
        if self.logging_steps <= 0:
            raise UsageError(f"--logging-steps={self.logging_steps}: must be > 0")
        if self.memory_probe_steps < -1:
            raise UsageError(f"--memory-probe-steps={self.memory_probe_steps}: must be >= -1")


def check_output_dir(workload: lm_data.LMWorkload, options: LMTrainOptions) -> None:
    holds_run = (Path(workload.output_dir) / "run_config.json").exists()
    if holds_run and not options.overwrite_output_dir:
        raise UsageError(
            f"--output-dir={workload.output_dir!r}: holds another run; pass "
            "--overwrite-output-dir or choose a new directory"
        )


def main() -> None:
    workload, strategy_cfg, options = lm_data.parse_args(
        (lm_data.LMWorkload, StrategyConfig, LMTrainOptions)
    )
    try:
        # Everything that can be wrong with the input is found here, before any process group.
        choice = resolve_strategy(strategy_cfg.strategy, strategy_cfg.deepspeed)
        precision = resolve_precision(strategy_cfg.mixed_precision)
        hf_config = lm_data.model_config(workload)
        check_output_dir(workload, options)
    except UsageError as err:
        if os.environ.get("RANK", "0") == "0":  # one line for the job, not one per rank
            print(f"train_lm.py: error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USAGE) from None

    import transformers

    world_size = choice.expected_world_size
    accumulation = options.gradient_accumulation_steps
    try:
        # The DeepSpeed config's values are checked against the recipe's here.
        strategy = build_accelerator(
            choice,
            precision=precision,
            micro_batch_size=workload.micro_batch_size,
            gradient_accumulation_steps=accumulation,
            max_grad_norm=workload.max_grad_norm,
            hidden_size=lm_data.hidden_size(hf_config),
            learning_rate=workload.learning_rate,
            weight_decay=workload.weight_decay,
            data_seed=workload.seed,
            collective_timeout_s=strategy_cfg.collective_timeout,
            log_with=None if options.report_to == "none" else options.report_to,
            project_dir=workload.output_dir,
        )
    except UsageError as err:
        if os.environ.get("RANK", "0") == "0":
            print(f"train_lm.py: error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USAGE) from None
    accelerator = strategy.accelerator
    logging.basicConfig(
        format="%(asctime)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        level=logging.INFO if accelerator.is_main_process else logging.WARNING,
    )
    if not accelerator.is_main_process:
        transformers.logging.set_verbosity_error()
    run = RunOutput(workload.output_dir, accelerator.is_main_process)
    run.start(config_dict(workload, strategy_cfg, options))

    # Data: blocks in a fixed seeded order; accelerate hands micro-batch i to rank i % N.
    dataset = lm_data.token_blocks(workload, hf_config.vocab_size)
    try:
        lm_data.check_enough_blocks(dataset, workload, world_size, accumulation)
    except UsageError as err:
        raise SystemExit(f"train_lm.py: error: {err}") from None
    train_loader = DataLoader(dataset, batch_size=workload.micro_batch_size, drop_last=True)

    # Model: random weights from the seed, identical on every rank and in every run.
    model = lm_data.build_model(hf_config, workload.seed)
    num_params = count_parameters(model)
    # ZeRO bucket and gradient-layout settings depend on the model's sizes.
    strategy.apply_model_settings(model)
    if strategy.ds_config is not None:
        run.write_json("ds_config.json", strategy.ds_config)
    optimizer = strategy.make_optimizer(
        adamw_param_groups(model, workload.weight_decay),
        lr=workload.learning_rate,
        weight_decay=workload.weight_decay,
    )
    lr_scheduler = strategy.make_scheduler("constant", optimizer, 0, workload.max_steps)
    model, optimizer, train_loader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_loader, lr_scheduler
    )
    run_info = strategy.verify_prepared(model, optimizer, workload.learning_rate)
    run.write_json("run_info.json", {**run_info.as_dict(), "num_params": num_params})
    logger.info("dpkit: %s", run_info.describe())
    tokens_per_step = workload.micro_batch_size * workload.seq_len * accumulation
    logger.info(
        "dpkit: %s (%.1fM params) | %s | %d steps of %d tokens per rank",
        workload.model_config or workload.size,
        num_params / 1e6,
        "synthetic tokens" if workload.synthetic else "Shakespeare bytes",
        workload.max_steps,
        tokens_per_step,
    )
    if options.report_to != "none":
        accelerator.init_trackers("dpkit-train-lm", config=run_info.as_dict())

    # Train. The step time is the main process's wall time from one optimizer step's
    # end to the next: data, forward, backward, reduction, update and the loss reduce.
    throughput = Throughput(world_size=accelerator.num_processes)
    progress = tqdm(total=workload.max_steps, desc="train", disable=not accelerator.is_main_process)
    memory.reset_peak(accelerator)
    probes = memory.track(model, optimizer) if options.memory_probe_steps != 0 else None
    step, window_loss = 0, []
    model.train()
    last, last_cpu = time.perf_counter(), time.process_time()
    for batch in train_loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients and workload.max_grad_norm > 0:
                accelerator.clip_grad_norm_(model.parameters(), workload.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad()
        throughput.update(batch["input_ids"].numel(), batch["input_ids"].shape[0])
        window_loss.append(loss.detach())
        if not accelerator.sync_gradients:
            continue
        step_lr = lr_scheduler.get_last_lr()[0]
        lr_scheduler.step()
        step += 1
        step_loss = accelerator.reduce(torch.stack(window_loss).mean(), "mean").item()
        window_loss = []
        now, now_cpu = time.perf_counter(), time.process_time()
        record = {
            "step": step,
            "loss": step_loss,
            "lr": step_lr,
            "step_time_s": now - last,
            # This process's CPU time (all its threads): on a CPU shared with other
            # work it moves far less than the wall time does.
            "step_cpu_s": now_cpu - last_cpu,
            "tokens_per_rank": tokens_per_step,
            "samples_per_rank": workload.micro_batch_size * accumulation,
        }
        if probes is not None and step == options.memory_probe_steps:
            # Keep the high-waters, stop walking tensors: the steps after this are timed clean.
            probes.remove()
        run.append_jsonl("train_log.jsonl", record)
        progress.update(1)
        progress.set_postfix(loss=f"{step_loss:.4f}")
        if step % options.logging_steps == 0 or step == workload.max_steps:
            record.update(throughput.rates())
            logger.info(
                "step %d/%d | loss %.4f | %.2f s | %.0f tokens/s (%.0f per rank)",
                step,
                workload.max_steps,
                step_loss,
                record["step_time_s"],
                record["tokens_per_s"],
                record["tokens_per_s_per_rank"],
            )
            accelerator.log({f"train/{k}": v for k, v in record.items() if k != "step"}, step=step)
        if step >= workload.max_steps:
            break
        last, last_cpu = time.perf_counter(), time.process_time()
    progress.close()

    # Memory, gathered from every rank (a collective), reported by the main process.
    memory.write_report(
        accelerator,
        model,
        optimizer,
        strategy=strategy.choice.name,
        precision=strategy.analytic_precision,
        path=run.path / "memory_report.json",
        step=step,
    )
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    guards.run_and_exit(main)
