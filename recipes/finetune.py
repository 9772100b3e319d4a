"""Fine-tune a pretrained model for sequence classification as DDP, ZeRO-1, ZeRO-2 or FSDP2.

The same script, unchanged, under every launcher (run from the repository root):

    python recipes/finetune.py                                    # one process (CPU or one GPU)
    accelerate launch --config_file ds_configs/accelerate/ddp.yaml --num_processes 8 recipes/finetune.py
    accelerate launch --config_file ds_configs/accelerate/zero2.yaml --num_processes 8 recipes/finetune.py
    accelerate launch --multi_gpu --num_processes 8 recipes/finetune.py --strategy ddp
    accelerate launch --use_deepspeed --deepspeed_config_file ds_configs/zero1.json --num_processes 8 recipes/finetune.py
    deepspeed --num_gpus 8 recipes/finetune.py --deepspeed ds_configs/zero2.json
    torchrun --nproc_per_node 8 recipes/finetune.py --strategy zero1
    torchrun --nproc_per_node 8 recipes/finetune.py --strategy fsdp2_full_shard

On a machine without CUDA the same commands run the processes on CPU with gloo.
Default: all-MiniLM-L6-v2 on Rotten Tomatoes review snippets, both embedded
(offline). ``python recipes/finetune.py --help`` lists every flag.
"""

from __future__ import annotations

import logging
import os
import time

import datasets
import torch
import transformers
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding

import dpkit
from dpkit import models
from dpkit.data import classification

logger = logging.getLogger("dpkit.finetune")


def get_dataloaders(splits, tokenizer, accelerator, micro_batch_size: int, max_length: int):
    """Tokenize the splits (``datasets.map``, cached) and batch them with a padding collator."""

    def tokenize(batch):
        return tokenizer(batch["text"], truncation=True, max_length=max_length)

    with accelerator.main_process_first():  # rank 0 writes datasets' cache, the others read it
        tokenized = splits.map(tokenize, batched=True, remove_columns=["text"])
    tokenized = tokenized.rename_column("label", "labels")
    collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)
    # The shuffle order comes from the Accelerator's seeded sampler: the same for every
    # strategy and world size. The loader's own generator keeps iterator creation off the
    # global RNG that dropout uses, so a resumed run continues the same dropout streams.
    train = DataLoader(tokenized["train"], batch_size=micro_batch_size, shuffle=True,
                       drop_last=True, collate_fn=collator, generator=torch.Generator())  # fmt: skip
    return train, *(
        DataLoader(tokenized[name], batch_size=micro_batch_size, collate_fn=collator)
        for name in ("validation", "test")
    )


def due(step: int, every: int) -> bool:
    """Whether a schedule of every N optimizer steps falls on ``step`` (0: never)."""
    return every > 0 and step % every == 0


def main() -> None:
    model_cfg, data_cfg, strategy_cfg, train_cfg = dpkit.parse_args(
        dpkit.ModelConfig, dpkit.DataConfig, dpkit.StrategyConfig, dpkit.TrainConfig
    )
    datasets.disable_progress_bars()  # one bar: the training's
    transformers.utils.logging.disable_progress_bar()
    # Pre-flight: everything that can be wrong with the input, before any process group.
    model_path, hf_config = models.load_model_config(model_cfg.model)
    model_cfg.check_positions(hf_config)
    resume = dpkit.find_resume(train_cfg.resume, train_cfg.output_dir)
    warm_start = train_cfg.init_from and dpkit.check_init_from(
        train_cfg.init_from, train_cfg.resume
    )
    splits, label_names = classification.load_data_splits(data_cfg)
    classification.check_classification_data(
        model_cfg, data_cfg, train_cfg, hf_config, loaded=(splits, label_names)
    )
    splits = data_cfg.truncate(splits)
    tokenizer = models.load_tokenizer(model_path, model_cfg.model, hf_config)  # can pad
    load_from = resume.weights_from(model_path) if resume else model_path
    load_kwargs = {
        **models.classifier_labels(label_names, tokenizer),
        **model_cfg.dropout_overrides(hf_config),
    }
    # The strategy, from the flags and the launcher; ZeRO's buckets sized to the model, whose
    # shapes are enough (meta device): a bad JSON, batch or launcher stops before the weights load.
    run = dpkit.setup(
        strategy_cfg, model=models.meta_classifier(model_path, **load_kwargs),
        **train_cfg.run_settings(), output_dir=train_cfg.output_dir,
        configs=(model_cfg, data_cfg, train_cfg), resume=resume, tokenizer=tokenizer,
        step_scheduler_with_optimizer=False,  # our schedule counts optimizer steps
        log_with=None if train_cfg.report_to == "none" else train_cfg.report_to,
    )  # fmt: skip
    schedule = train_cfg.schedule(len(splits["train"]), run.world_size)  # still no process group
    # A resume follows this schedule from the checkpoint's step (a longer --max-steps is
    # re-planned); another --lr-scheduler or peak lr is refused here.
    train_cfg.check_resumed_schedule(resume, schedule, run.learning_rate)
    set_seed(train_cfg.seed)  # a fresh head, the same on every rank; or the checkpoint's weights
    with run.building_model():  # ZeRO-3: the process group starts, weights load partitioned
        model = models.load_pretrained(  # from_pretrained; a new head said in one line
            AutoModelForSequenceClassification, load_from, **load_kwargs
        )
    if warm_start:  # --init-from: a checkpoint's weights under a new head, a new run
        logger.info("%s", dpkit.init_from(model, warm_start))
    model = run.apply_lora(model)  # --lora-r: adapters train, the pretrained weights frozen
    accelerator = run.accelerator  # the process group starts here
    set_seed(train_cfg.seed, device_specific=True)  # dropout differs across ranks, as in a batch
    train_loader, validation, test = get_dataloaders(
        splits, tokenizer, accelerator, train_cfg.micro_batch_size, model_cfg.max_seq_length
    )
    optimizer = run.make_optimizer(
        models.adamw_param_groups(model, train_cfg.weight_decay),
        lr=run.learning_rate,
        weight_decay=train_cfg.weight_decay,
    )
    lr_scheduler = run.make_scheduler(
        train_cfg.lr_scheduler, optimizer, schedule.warmup_steps, schedule.total_steps
    )
    # Wrapped as the strategy's engine does it (FSDP2 shards each layer); a real N-process
    # job or an error; run_info.json; a resumed checkpoint restored; memory tracked.
    model, optimizer, train_loader, validation, test, lr_scheduler = run.prepare(
        model, optimizer, train_loader, validation, test, lr_scheduler,
        schedule=schedule.as_dict(),
        labels=dict(enumerate(label_names)),  # run_info.json: which label each class id is
    )  # fmt: skip
    logger.info("%s | %s", model_cfg.model, schedule.describe())
    position = run.position
    if train_cfg.report_to != "none":
        accelerator.init_trackers("dpkit-finetune", config=run.info.as_dict())
    metrics = dpkit.ClassifierMetrics(num_labels=len(label_names))

    def evaluate(loader, split: str, final: bool = False) -> dict[str, float]:
        result = metrics.evaluate(run, model, loader)
        record = {"step": position.step, "split": split, **({"final": True} if final else {})}
        run.output.append_jsonl("metrics.jsonl", {**record, **result})
        accelerator.log({f"eval/{k}": v for k, v in result.items()}, step=position.step)
        return result

    # Train. From here on SIGTERM/SIGINT finish the step, save and exit (dpkit.StepGuard).
    guard = dpkit.StepGuard(accelerator)
    # The log counts skipped (fp16 overflow) steps into the run's position, so checkpoints
    # keep the count, and records where each step's time went (dpkit.StepPhases: data,
    # forward, backward, grad sync, optimizer, other).
    log = dpkit.TrainingLog(run, total_steps=schedule.total_steps,
                            logging_steps=train_cfg.logging_steps,
                            phases=dpkit.StepPhases(model, optimizer))  # fmt: skip
    started = time.perf_counter()
    model.train()
    num_epochs = position.epoch if train_cfg.eval_only else schedule.num_epochs
    micro_batches = schedule.micro_batches_per_epoch
    for epoch, batches in position.epochs(accelerator, train_loader, num_epochs, micro_batches):
        if position.step >= schedule.total_steps:
            break
        for batch in batches:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                grad_norm = None
                if accelerator.sync_gradients and train_cfg.max_grad_norm > 0:
                    grad_norm = accelerator.clip_grad_norm_(
                        model.parameters(), train_cfg.max_grad_norm
                    )
                optimizer.step()
                optimizer.zero_grad()
            position.batch_done()
            log.micro_batch(batch["attention_mask"].sum(), batch["labels"].numel())
            guard.add_loss(loss)
            if not accelerator.sync_gradients:
                continue
            step_lr = lr_scheduler.get_last_lr()[0]
            lr_scheduler.step()  # once per optimizer step, for every strategy
            step = position.step = position.step + 1
            status = guard.end_step()  # the loss over ranks, and whether any rank must stop
            record = {"step": step, "epoch": epoch, "loss": status.loss, "lr": step_lr}
            log.step(record if grad_norm is None else {**record, "grad_norm": float(grad_norm)})
            status.raise_if_non_finite(step, run.checkpoints.last)  # all ranks stop, none saves
            run.memory.step_done(step)
            if due(step, train_cfg.memory_report_steps):
                run.memory.log_report(step)
            # The last step's validation is the final one, below: not run twice.
            if due(step, train_cfg.eval_steps) and step < schedule.total_steps:
                evaluate(validation, "validation")
            if status.stop or (due(step, train_cfg.save_steps) and step < schedule.total_steps):
                run.save_checkpoint(model, optimizer, lr_scheduler)
            if status.stop:
                run.checkpoints.wait()  # with --async-save, written before the exit
                logger.info(
                    run.checkpoints.stop_note(guard.signal_name, position, schedule.total_steps)
                )
                accelerator.end_training()
                raise SystemExit(guard.exit_code)
            if step >= schedule.total_steps:
                break
        if not train_cfg.eval_steps and position.step < schedule.total_steps:
            evaluate(validation, "validation")
    log.close()
    train_seconds = time.perf_counter() - started
    if not train_cfg.eval_only:
        run.save_checkpoint(model, optimizer, lr_scheduler)

    # Report: memory (gathered from every rank), the final evaluations, the model.
    for split, loader in (("validation", validation), ("test", test)):
        result = evaluate(loader, split, final=True)
        logger.info("final %s: accuracy %.4f | %s %.4f (%d samples)", split, result["accuracy"],
                    metrics.f1_key, result[metrics.f1_key], result["samples"])  # fmt: skip
    logger.info("trained %d steps in %.1f s", position.step - position.first_step,
                train_seconds)  # fmt: skip
    if train_cfg.save_model and not train_cfg.eval_only:  # fp32, shards gathered (collective)
        run.save_model(model, run.output.model_dir)
    run.finish(step=position.step)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # N processes x tokenizer threads
    dpkit.run_and_exit(main)
