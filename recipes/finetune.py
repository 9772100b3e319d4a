"""Fine-tune a pretrained model for sequence classification as DDP, ZeRO-1 or ZeRO-2.

The same script, unchanged, under every launcher (run from the repository root):

    python recipes/finetune.py                                    # one process (CPU or one GPU)
    accelerate launch --config_file ds_configs/accelerate/ddp.yaml --num_processes 8 recipes/finetune.py
    accelerate launch --config_file ds_configs/accelerate/zero2.yaml --num_processes 8 recipes/finetune.py
    accelerate launch --multi_gpu --num_processes 8 recipes/finetune.py --strategy ddp
    accelerate launch --use_deepspeed --deepspeed_config_file ds_configs/zero1.json --num_processes 8 recipes/finetune.py
    deepspeed --num_gpus 8 recipes/finetune.py --deepspeed ds_configs/zero2.json
    torchrun --nproc_per_node 8 recipes/finetune.py --strategy zero1

On a machine without CUDA the same commands run the processes on CPU with gloo.
Default: all-MiniLM-L6-v2 on Rotten Tomatoes review snippets, both embedded
(offline). ``python recipes/finetune.py --help`` lists every flag.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from dpkit import checkpoint, guards, memory
from dpkit.config import config_dict, parse_finetune_args
from dpkit.data import check_classification_data, load_data_splits
from dpkit.errors import EXIT_USAGE, UsageError
from dpkit.models import (
    adamw_param_groups,
    count_parameters,
    load_model_config,
    max_positions,
)
from dpkit.run_output import RunOutput
from dpkit.strategy import (
    build_accelerator,
    resolve_precision,
    resolve_strategy,
    scaled_learning_rate,
)
from dpkit.throughput import Throughput

METRICS_DIR = Path(__file__).resolve().parents[1] / "dpkit" / "metrics"
logger = logging.getLogger("dpkit.finetune")


def get_dataloaders(loaded, data_cfg, model_cfg, tokenizer, accelerator, micro_batch_size):
    """Tokenize the splits the pre-flight loaded with ``datasets.map`` (cached) and
    batch them with a padding collator."""
    from transformers import DataCollatorWithPadding

    splits, label_names = loaded
    if data_cfg.max_train_samples:
        splits["train"] = splits["train"].select(
            range(min(data_cfg.max_train_samples, len(splits["train"])))
        )
    if data_cfg.max_eval_samples:
        for name in ("validation", "test"):
            splits[name] = splits[name].select(
                range(min(data_cfg.max_eval_samples, len(splits[name])))
            )

    def tokenize(batch):
        return tokenizer(batch["text"], truncation=True, max_length=model_cfg.max_seq_length)

    # Rank 0 tokenizes and writes datasets' cache; the others then read it.
    with accelerator.main_process_first():
        tokenized = splits.map(tokenize, batched=True, remove_columns=["text"], desc="tokenize")
    tokenized = tokenized.rename_column("label", "labels")

    collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)
    # The shuffle order is seeded by the Accelerator (use_seedable_sampler, data_seed):
    # the same for every strategy and world size, and reproducible on resume. The
    # loader's own generator keeps iterator creation from drawing on the global RNG
    # that dropout uses, so a resumed run continues the same dropout streams.
    train_loader = DataLoader(
        tokenized["train"],
        batch_size=micro_batch_size,
        shuffle=True,
        drop_last=True,
        collate_fn=collator,
        generator=torch.Generator(),
    )
    eval_loaders = {
        name: DataLoader(tokenized[name], batch_size=micro_batch_size, collate_fn=collator)
        for name in ("validation", "test")
    }
    return train_loader, eval_loaders, label_names


def evaluate_split(accelerator, model, loader, metrics) -> dict[str, float]:
    """Accuracy and F1; ``gather_for_metrics`` drops the samples that the last
    uneven batch duplicates, so 1 and N processes count every sample once."""
    model.eval()
    predictions, references = [], []
    for batch in loader:
        with torch.no_grad():
            logits = model(**batch).logits
        preds, labels = accelerator.gather_for_metrics((logits.argmax(dim=-1), batch["labels"]))
        predictions.append(preds.cpu())
        references.append(labels.cpu())
    model.train()
    predictions = torch.cat(predictions).tolist()
    references = torch.cat(references).tolist()
    average = "binary" if max(references + predictions) <= 1 else "macro"
    result = {"samples": len(references)}
    result.update(metrics["accuracy"].compute(predictions=predictions, references=references))
    result.update(
        metrics["f1"].compute(predictions=predictions, references=references, average=average)
    )
    return result


def quiet_libraries(is_main_process: bool) -> None:
    """One progress bar (ours, main process); library warnings from the main process only."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    if not is_main_process:
        datasets.logging.set_verbosity_error()
        transformers.logging.set_verbosity_error()


def exit_usage(err: UsageError) -> None:
    """One line for the job (not one per rank) and exit code 2."""
    if os.environ.get("RANK", "0") == "0":
        print(f"finetune.py: error: {err}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_USAGE) from None


def main() -> None:
    model_cfg, data_cfg, strategy_cfg, train_cfg = parse_finetune_args()
    try:
        # Everything that can be wrong with the input is found here, before any process group.
        choice = resolve_strategy(strategy_cfg.strategy, strategy_cfg.deepspeed)
        precision = resolve_precision(strategy_cfg.mixed_precision)
        model_path, hf_config = load_model_config(model_cfg.model)
        limit = max_positions(hf_config)
        if limit is not None and model_cfg.max_seq_length > limit:
            raise UsageError(
                f"--max-seq-length={model_cfg.max_seq_length}: over the model's limit of {limit} positions"
            )
        # Loaded once, here, so that bad data stops the job before any process group.
        data = load_data_splits(data_cfg)
        check_classification_data(model_cfg, data_cfg, train_cfg, hf_config, loaded=data)
        resume = checkpoint.resolve_resume(train_cfg.resume, train_cfg.output_dir)
        if resume is not None:
            checkpoint.check_resumable(
                resume[1],
                resume[0],
                global_batch_size=train_cfg.micro_batch_size
                * train_cfg.gradient_accumulation_steps
                * choice.expected_world_size,
            )
    except UsageError as err:
        exit_usage(err)

    import evaluate
    from accelerate.utils import set_seed
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    world_size = choice.expected_world_size
    learning_rate = scaled_learning_rate(
        train_cfg.learning_rate,
        train_cfg.scale_lr,
        world_size,
        train_cfg.gradient_accumulation_steps,
    )
    try:  # a DeepSpeed JSON value that contradicts the flags is found here, before the group
        strategy = build_accelerator(
            choice,
            precision=precision,
            micro_batch_size=train_cfg.micro_batch_size,
            gradient_accumulation_steps=train_cfg.gradient_accumulation_steps,
            max_grad_norm=train_cfg.max_grad_norm,
            hidden_size=getattr(hf_config, "hidden_size", None),
            learning_rate=learning_rate,
            weight_decay=train_cfg.weight_decay,
            data_seed=train_cfg.seed,
            collective_timeout_s=strategy_cfg.collective_timeout,
            log_with=None if train_cfg.report_to == "none" else train_cfg.report_to,
            project_dir=train_cfg.output_dir,
        )
    except UsageError as err:
        exit_usage(err)
    accelerator = strategy.accelerator
    logging.basicConfig(
        format="%(asctime)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        level=logging.INFO if accelerator.is_main_process else logging.WARNING,
    )
    # Per-rank seeds: dropout masks differ across ranks, as they would across a bigger batch.
    quiet_libraries(accelerator.is_main_process)
    set_seed(train_cfg.seed, device_specific=True)
    run = RunOutput(train_cfg.output_dir, accelerator.is_main_process)
    resume_dir, resume_state = resume if resume is not None else (None, None)
    run.start(
        config_dict(model_cfg, data_cfg, strategy_cfg, train_cfg),
        resume_step=resume_state.step if resume_state else None,
    )

    # Data.
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    train_loader, eval_loaders, label_names = get_dataloaders(
        data, data_cfg, model_cfg, tokenizer, accelerator, train_cfg.micro_batch_size
    )

    # Model: a fresh classification head on the pretrained encoder, the same on every
    # rank; or, on resume, the checkpoint's consolidated fp32 weights.
    set_seed(train_cfg.seed)
    model = AutoModelForSequenceClassification.from_pretrained(
        resume_dir or model_path,
        num_labels=len(label_names),
        id2label=dict(enumerate(label_names)),
        label2id={name: i for i, name in enumerate(label_names)},
        **model_cfg.dropout_overrides(hf_config),
    )
    set_seed(train_cfg.seed, device_specific=True)
    num_params = count_parameters(model)
    # ZeRO bucket and gradient-layout settings depend on the model's sizes.
    strategy.apply_model_settings(model)
    if strategy.ds_config is not None:
        run.write_json("ds_config.json", strategy.ds_config)

    # Optimizer and schedule: no decay on biases and LayerNorm weights.
    optimizer = strategy.make_optimizer(
        adamw_param_groups(model, train_cfg.weight_decay),
        lr=learning_rate,
        weight_decay=train_cfg.weight_decay,
    )
    steps_per_epoch = max(
        len(train_loader) // (world_size * train_cfg.gradient_accumulation_steps), 1
    )
    total_steps = (
        train_cfg.max_steps if train_cfg.max_steps > 0 else steps_per_epoch * train_cfg.num_epochs
    )
    num_epochs = math.ceil(total_steps / steps_per_epoch)
    warmup_steps = int(train_cfg.warmup_ratio * total_steps)
    lr_scheduler = strategy.make_scheduler(
        train_cfg.lr_scheduler, optimizer, warmup_steps, total_steps
    )

    (
        model,
        optimizer,
        train_loader,
        eval_loaders["validation"],
        eval_loaders["test"],
        lr_scheduler,
    ) = accelerator.prepare(
        model,
        optimizer,
        train_loader,
        eval_loaders["validation"],
        eval_loaders["test"],
        lr_scheduler,
    )
    run_info = strategy.verify_prepared(model, optimizer, learning_rate)
    # Probes that see gradients and buffers at their high-water during each step
    # (DeepSpeed frees them before a report taken after training could count them).
    memory.track(model, optimizer)
    run.write_json("run_info.json", {**run_info.as_dict(), "num_params": num_params})
    logger.info("dpkit: %s", run_info.describe())
    logger.info(
        "dpkit: model=%s (%.1fM params) | train=%d val=%d test=%d examples | %d steps (%d epochs)",
        model_cfg.model,
        num_params / 1e6,
        len(train_loader.dataset),
        len(eval_loaders["validation"].dataset),
        len(eval_loaders["test"].dataset),
        total_steps,
        num_epochs,
    )
    step, start_epoch, skip_batches = 0, 0, 0
    if resume_dir is not None:
        restored = checkpoint.load_checkpoint(
            accelerator, model, optimizer, lr_scheduler, resume_dir
        )
        step, start_epoch = restored.step, restored.epoch
        skip_batches = restored.samples_in_epoch // (train_cfg.micro_batch_size * world_size)
        logger.info(
            "dpkit: %s",
            checkpoint.carry_over_note(
                restored, strategy=strategy.choice.name, world_size=world_size
            ),
        )

    def save_checkpoint(epoch: int, batches_done: int) -> Path:
        """The full state after ``step``; collective (every rank calls it)."""
        epoch_done = batches_done >= len(train_loader)
        state = checkpoint.TrainerState.at(
            run_info,
            step=step,
            epoch=epoch + 1 if epoch_done else epoch,
            samples_in_epoch=0
            if epoch_done
            else batches_done * run_info.micro_batch_size * world_size,
            seed=train_cfg.seed,
        )
        path = checkpoint.save_checkpoint(
            accelerator,
            model,
            optimizer,
            lr_scheduler,
            state,
            run.path,
            tokenizer=tokenizer,
            keep_last=train_cfg.save_total_limit,
        )
        logger.info("dpkit: checkpoint %s", path)
        return path

    if train_cfg.report_to != "none":
        accelerator.init_trackers("dpkit-finetune", config=run_info.as_dict())
    metrics = {name: evaluate.load(str(METRICS_DIR / name)) for name in ("accuracy", "f1")}

    # Train.
    throughput = Throughput(world_size=accelerator.num_processes)
    progress = tqdm(total=total_steps, desc="train", disable=not accelerator.is_main_process)
    progress.update(step)
    # SIGTERM/SIGINT from here on: finish the step, save, exit (dpkit.guards).
    stop = guards.StopRequest()
    window_loss, started, last_checkpoint = [], time.perf_counter(), resume_dir
    batches_done, epoch = 0, start_epoch
    memory.reset_peak(accelerator)
    model.train()
    for epoch in range(start_epoch, start_epoch if train_cfg.eval_only else num_epochs):
        if step >= total_steps:
            break
        train_loader.set_epoch(epoch)
        skip = skip_batches if epoch == start_epoch else 0
        batches_done = skip
        batches = accelerator.skip_first_batches(train_loader, skip) if skip else train_loader
        for batch in batches:
            batches_done += 1
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
            throughput.update(batch["attention_mask"].sum(), batch["labels"].numel())
            window_loss.append(loss.detach().float())
            if not accelerator.sync_gradients:
                continue
            # One optimizer step done: the schedule advances once per step, for every strategy.
            step_lr = lr_scheduler.get_last_lr()[0]
            lr_scheduler.step()
            step += 1
            status = guards.step_status(accelerator, window_loss, stop)
            step_loss = status.loss
            window_loss = []
            record = {"step": step, "epoch": epoch, "loss": step_loss, "lr": step_lr}
            if grad_norm is not None:
                record["grad_norm"] = float(grad_norm)
            run.append_jsonl("train_log.jsonl", record)
            if not status.finite:  # the same verdict on every rank: all stop, none saves
                raise guards.NonFiniteLossError(step, step_loss, last_checkpoint)
            progress.update(1)
            if step % train_cfg.logging_steps == 0 or step == total_steps:
                record.update(throughput.rates())
                progress.set_postfix(loss=f"{step_loss:.4f}")
                logger.info(
                    "step %d/%d | loss %.4f | lr %.2e | %.0f tokens/s (%.0f per rank) | %s",
                    step,
                    total_steps,
                    step_loss,
                    record["lr"],
                    record["tokens_per_s"],
                    record["tokens_per_s_per_rank"],
                    memory.current_summary(accelerator),
                )
                accelerator.log(
                    {f"train/{k}": v for k, v in record.items() if k != "step"}, step=step
                )
            if train_cfg.memory_report_steps and step % train_cfg.memory_report_steps == 0:
                report = memory.collect_report(
                    accelerator,
                    model,
                    optimizer,
                    strategy=strategy.choice.name,
                    precision=strategy.analytic_precision,
                )
                if report is not None:
                    logger.info("memory at step %d\n%s", step, report.format_table())
            if train_cfg.eval_steps and step % train_cfg.eval_steps == 0:
                result = evaluate_split(accelerator, model, eval_loaders["validation"], metrics)
                run.append_jsonl("metrics.jsonl", {"step": step, "split": "validation", **result})
                accelerator.log({f"eval/{k}": v for k, v in result.items()}, step=step)
            scheduled = train_cfg.save_steps and step % train_cfg.save_steps == 0
            if train_cfg.save_checkpoints and (status.stop or (scheduled and step < total_steps)):
                last_checkpoint = save_checkpoint(epoch, batches_done)
            if status.stop:
                then = (
                    f"resume with --resume latest (or --resume {last_checkpoint})"
                    if train_cfg.save_checkpoints
                    else "nothing saved (--no-save-checkpoints)"
                )
                logger.info(
                    "dpkit: stopped by %s after step %d/%d; %s", stop.name, step, total_steps, then
                )
                accelerator.end_training()
                raise SystemExit(stop.exit_code)
            if step >= total_steps:
                break
        if not train_cfg.eval_steps:
            result = evaluate_split(accelerator, model, eval_loaders["validation"], metrics)
            run.append_jsonl("metrics.jsonl", {"step": step, "split": "validation", **result})
            accelerator.log({f"eval/{k}": v for k, v in result.items()}, step=step)
        if step >= total_steps:
            break
    progress.close()
    train_seconds = time.perf_counter() - started
    if train_cfg.save_checkpoints and not train_cfg.eval_only:
        save_checkpoint(epoch, batches_done)

    # Report: memory (gathered from every rank), then the final evaluations.
    memory.write_report(
        accelerator,
        model,
        optimizer,
        strategy=strategy.choice.name,
        precision=strategy.analytic_precision,
        path=run.path / "memory_report.json",
        step=step,
    )
    final = {
        split: evaluate_split(accelerator, model, eval_loaders[split], metrics)
        for split in ("validation", "test")
    }
    for split, result in final.items():
        run.append_jsonl("metrics.jsonl", {"step": step, "split": split, "final": True, **result})
        logger.info(
            "final %s: accuracy %.4f | f1 %.4f (%d samples)",
            split,
            result["accuracy"],
            result["f1"],
            result["samples"],
        )
    logger.info("dpkit: trained %d steps in %.1f s", step, train_seconds)

    # The final model as a Hugging Face folder in fp32, ZeRO shards consolidated; every
    # rank takes part (gathering them is collective).
    if train_cfg.save_model and not train_cfg.eval_only:
        checkpoint.save_model(accelerator, model, run.model_dir, tokenizer)
    accelerator.wait_for_everyone()
    accelerator.end_training()


def run_guarded() -> None:
    """``main`` with the failures every rank meets turned into one line and an exit code."""
    rank = os.environ.get("RANK", "0")
    try:
        main()
    except guards.NonFiniteLossError as err:
        if rank == "0":
            print(f"finetune.py: error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(guards.EXIT_NON_FINITE) from None
    except RuntimeError as err:
        line = guards.collective_failure(err)
        if line is None:
            raise
        print(f"finetune.py: error: rank {rank}: {line}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


if __name__ == "__main__":
    # Tokenizer worker threads inside each of N processes oversubscribe the CPU.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    guards.run_and_exit(run_guarded)
