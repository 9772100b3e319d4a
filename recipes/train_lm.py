"""Train a GPT-2-family causal LM from scratch as DDP, ZeRO-1, ZeRO-2 or FSDP2: the workload of ``dpkit bench``.

The same script, unchanged, under every launcher (run from the repository root):

    python recipes/train_lm.py                                    # one process (CPU or one GPU)
    accelerate launch --config_file ds_configs/accelerate/ddp.yaml --num_processes 8 recipes/train_lm.py
    accelerate launch --config_file ds_configs/accelerate/zero1.yaml --num_processes 8 recipes/train_lm.py --size gpt2
    deepspeed --num_gpus 8 recipes/train_lm.py --deepspeed ds_configs/zero2.json
    torchrun --nproc_per_node 8 recipes/train_lm.py --strategy zero2 --synthetic
    torchrun --nproc_per_node 8 recipes/train_lm.py --strategy fsdp2_shard_grad_op

On a machine without CUDA the same commands run the processes on CPU with gloo.
Default: the ``small`` shape (~23M params) on Shakespeare read as bytes (token
id = byte value, see ``dpkit/data/lm.py``), micro-batch 4 x 128 tokens, torch
AdamW under every strategy, dropout 0. ``python recipes/train_lm.py --help``
lists every flag.

Writes to ``--output-dir``: run_config.json, run_info.json, ds_config.json (ZeRO),
train_log.jsonl (per optimizer step: loss averaged over ranks, lr, step time on
the main process, tokens) and memory_report.json (per rank, from dpkit.memory).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from torch.utils.data import DataLoader

import dpkit
from dpkit import models
from dpkit.data import lm as lm_data
from dpkit.train.output import check_output_dir

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
            "help": "Walk the tensors during the first N steps only (-1: every step, 0: never); "
            "the live-tensor peak is watched in step N (-1: the first)."
        },
    )
    """The memory probes (:class:`dpkit.memory.MemoryTracker`) run during the first N optimizer steps and are
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
            raise dpkit.UsageError(
                f"--gradient-accumulation-steps={self.gradient_accumulation_steps}: must be > 0"
            )
        if self.logging_steps <= 0:
            raise dpkit.UsageError(f"--logging-steps={self.logging_steps}: must be > 0")
        if self.memory_probe_steps < -1:
            raise dpkit.UsageError(f"--memory-probe-steps={self.memory_probe_steps}: must be >= -1")


def main() -> None:
    workload, strategy_cfg, options = dpkit.parse_args(
        lm_data.LMWorkload, dpkit.StrategyConfig, LMTrainOptions
    )
    # Pre-flight: everything that can be wrong with the input, before any process group.
    check_output_dir(workload.output_dir, overwrite=options.overwrite_output_dir)
    hf_config = lm_data.lm_config(workload)
    run = dpkit.setup(
        strategy_cfg,
        model=models.build_meta_model(hf_config),  # ZeRO's buckets are sized to its shapes
        micro_batch_size=workload.micro_batch_size,
        gradient_accumulation_steps=options.gradient_accumulation_steps,
        max_grad_norm=workload.max_grad_norm,
        learning_rate=workload.learning_rate,
        weight_decay=workload.weight_decay,
        output_dir=workload.output_dir,
        configs=(workload, options),
        seed=workload.seed,
        data_seed=workload.seed,
        save_checkpoints=False,
        memory_probe_steps=options.memory_probe_steps,
        step_scheduler_with_optimizer=False,  # the schedule counts optimizer steps
        log_with=None if options.report_to == "none" else options.report_to,
    )
    # Blocks in a fixed seeded order; accelerate hands micro-batch i to rank i % N.
    dataset = lm_data.token_blocks(workload, hf_config.vocab_size)
    lm_data.check_enough_blocks(
        dataset, workload, run.world_size, options.gradient_accumulation_steps
    )  # still no process group
    with run.building_model():  # ZeRO-3: partitioned as it is built (zero.Init)
        model = lm_data.build_lm(hf_config, workload.seed)  # the same weights every rank and run
    accelerator = run.accelerator  # the process group starts here (ZeRO-3: above)
    train_loader = DataLoader(dataset, batch_size=workload.micro_batch_size, drop_last=True)
    model = run.apply_lora(model)  # --lora-r: adapters train, the other weights frozen
    optimizer = run.make_optimizer(
        models.adamw_param_groups(model, workload.weight_decay),
        lr=workload.learning_rate,
        weight_decay=workload.weight_decay,
    )
    lr_scheduler = run.make_scheduler("constant", optimizer, 0, workload.max_steps)
    # Wrapped as the strategy's engine does it, checked, recorded, memory tracked.
    model, optimizer, train_loader, lr_scheduler = run.prepare(
        model, optimizer, train_loader, lr_scheduler
    )
    tokens_per_step = (
        workload.micro_batch_size * workload.seq_len * options.gradient_accumulation_steps
    )
    logger.info(
        "%s (%.1fM params) | %s | %d steps of %d tokens per rank",
        workload.model_config or workload.size,
        (run.info.num_params + run.info.frozen_params) / 1e6,  # LoRA's frozen weights too
        "synthetic tokens" if workload.synthetic else "Shakespeare bytes",
        workload.max_steps,
        tokens_per_step,
    )
    if options.report_to != "none":
        accelerator.init_trackers("dpkit-train-lm", config=run.info.as_dict())

    # Train. The step time is the main process's wall time from one optimizer step's
    # end to the next: data, forward, backward, reduction, update and the loss reduce.
    guard = dpkit.StepGuard(accelerator)
    log = dpkit.TrainingLog(
        run,
        total_steps=workload.max_steps,
        logging_steps=options.logging_steps,
        phases=dpkit.StepPhases(model, optimizer),
    )
    step = 0
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
        log.micro_batch(batch["input_ids"].numel(), batch["input_ids"].shape[0])
        guard.add_loss(loss)
        if not accelerator.sync_gradients:
            continue
        step_lr = lr_scheduler.get_last_lr()[0]
        lr_scheduler.step()
        step += 1
        status = guard.end_step()
        now, now_cpu = time.perf_counter(), time.process_time()
        log.step(
            {
                "step": step,
                "loss": status.loss,
                "lr": step_lr,
                "step_time_s": now - last,
                # This process's CPU time (all its threads): on a CPU shared with other
                # work it moves far less than the wall time does.
                "step_cpu_s": now_cpu - last_cpu,
                "tokens_per_rank": tokens_per_step,
                "samples_per_rank": workload.micro_batch_size * options.gradient_accumulation_steps,
            }
        )
        status.raise_if_non_finite(step, None)
        # Keep the high-waters, stop walking tensors: the steps after this are timed clean.
        run.memory.step_done(step)
        if status.stop or step >= workload.max_steps:
            break
        last, last_cpu = time.perf_counter(), time.process_time()
    log.close()

    # Memory, gathered from every rank (a collective), reported by the main process.
    run.finish(step=step)
    if status.stop:
        raise SystemExit(guard.exit_code)


if __name__ == "__main__":
    dpkit.run_and_exit(main)
