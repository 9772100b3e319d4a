"""Fine-tune a pretrained decoder (Llama, Qwen, GPT-style) on your own text as DDP, ZeRO-1, ZeRO-2 or FSDP2.

The same script, unchanged, under every launcher (run from the repository root):

    python recipes/finetune_lm.py --model DECODER --dataset data.jsonl --prompt-field prompt --response-field response
    accelerate launch --config_file ds_configs/accelerate/zero2.yaml --num_processes 8 recipes/finetune_lm.py --model DECODER
    deepspeed --num_gpus 8 recipes/finetune_lm.py --deepspeed ds_configs/zero2.json --model DECODER
    torchrun --nproc_per_node 8 recipes/finetune_lm.py --strategy fsdp2_full_shard --model DECODER

DECODER is a Hub name or a folder (``docs/finetune_lm.md`` builds a small one offline).
The data: plain text (``--dataset notes.txt``), JSON/JSONL or CSV with a text field, or
prompt/response fields (the loss on the response tokens only), or conversations (a
``messages`` field, rendered with the tokenizer's chat template; the loss on the
assistant's turns), or a ``datasets`` name; padded per batch, or ``--packing`` into
blocks of ``--max-seq-length``. Held-out loss and perplexity are evaluated on every
rank; checkpoints resume under any strategy and world size; ``--lora-r`` trains
adapters that ``dpkit consolidate --merge-lora`` merges. ``--help`` lists every flag.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import datasets
import torch
import transformers
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

import dpkit
from dpkit import models
from dpkit.data import causal, causal_tokens

logger = logging.getLogger("dpkit.finetune_lm")


def due(step: int, every: int) -> bool:
    """Whether a schedule of every N optimizer steps falls on ``step`` (0: never)."""
    return every > 0 and step % every == 0


def main() -> None:
    model_cfg, data_cfg, strategy_cfg, train_cfg = dpkit.parse_args(
        dpkit.DecoderModelConfig, dpkit.CausalDataConfig, dpkit.StrategyConfig,
        dpkit.CausalTrainConfig,
    )  # fmt: skip
    datasets.disable_progress_bars()  # one bar: the training's
    transformers.utils.logging.disable_progress_bar()
    # Pre-flight: the model's config and tokenizer, the data read, checked and tokenised,
    # before any weights load or process group starts.
    model_path, hf_config = models.load_model_config(model_cfg.model)
    models.check_causal_lm(model_cfg.model, hf_config)
    max_seq_length, chosen = model_cfg.resolve_max_seq_length(hf_config)
    if chosen:
        logger.info("%s", chosen)
    resume = dpkit.find_resume(train_cfg.resume, train_cfg.output_dir)
    warm_start = train_cfg.init_from and dpkit.check_init_from(
        train_cfg.init_from, train_cfg.resume
    )
    tokenizer = models.load_tokenizer(model_path, model_cfg.model, hf_config)  # can pad
    splits, data_format = causal.load_causal_splits(data_cfg)
    tokenized, counts = causal_tokens.tokenize_causal(
        splits, tokenizer, data_cfg, data_format, max_seq_length
    )
    logger.info("%s", counts.describe())
    load_from = resume.weights_from(model_path) if resume else model_path
    load_kwargs = {
        "pad_token_id": tokenizer.pad_token_id,  # the config matches the padding id
        **model_cfg.dropout_overrides(hf_config),
    }
    # The strategy, from the flags and the launcher; ZeRO's buckets sized to the model, whose
    # shapes are enough (meta device): a bad JSON, batch or launcher stops before the weights load.
    run = dpkit.setup(
        strategy_cfg, model=models.meta_pretrained(model_path, "causal_lm", **load_kwargs),
        **train_cfg.run_settings(), output_dir=train_cfg.output_dir,
        configs=(model_cfg, data_cfg, train_cfg), resume=resume, tokenizer=tokenizer,
        step_scheduler_with_optimizer=False,  # our schedule counts optimizer steps
        log_with=None if train_cfg.report_to == "none" else train_cfg.report_to,
    )  # fmt: skip
    schedule = train_cfg.schedule(len(tokenized["train"]), run.world_size)
    train_cfg.check_resumed_schedule(resume, schedule, run.learning_rate)
    set_seed(train_cfg.seed)
    with run.building_model():  # ZeRO-3: the process group starts, weights load partitioned
        model = models.load_pretrained(AutoModelForCausalLM, load_from, **load_kwargs)  # fp32
    if warm_start:  # --init-from: a checkpoint's weights, a new run
        logger.info("%s", dpkit.init_from(model, warm_start))
    model = run.apply_lora(model)  # --lora-r: adapters train, the pretrained weights frozen
    accelerator = run.accelerator  # the process group starts here
    set_seed(train_cfg.seed, device_specific=True)  # dropout differs across ranks
    collator = causal_tokens.CausalCollator(tokenizer.pad_token_id, max_length=max_seq_length)
    # The shuffle order comes from the Accelerator's seeded sampler: the same for every
    # strategy and world size; the loader's own generator keeps the global RNG for dropout.
    train_loader = DataLoader(
        tokenized["train"], batch_size=train_cfg.micro_batch_size, shuffle=True,
        drop_last=True, collate_fn=collator, generator=torch.Generator(),
    )  # fmt: skip
    validation = DataLoader(
        tokenized["validation"], batch_size=train_cfg.micro_batch_size, collate_fn=collator
    )
    optimizer = run.make_optimizer(
        models.adamw_param_groups(model, train_cfg.weight_decay),
        lr=run.learning_rate,
        weight_decay=train_cfg.weight_decay,
    )
    lr_scheduler = run.make_scheduler(
        train_cfg.lr_scheduler, optimizer, schedule.warmup_steps, schedule.total_steps
    )
    model, optimizer, train_loader, validation, lr_scheduler = run.prepare(
        model, optimizer, train_loader, validation, lr_scheduler,
        schedule=schedule.as_dict(), data=dataclasses.asdict(counts),
    )  # fmt: skip
    logger.info("%s | %s", model_cfg.model, schedule.describe())
    position = run.position
    if train_cfg.report_to != "none":
        accelerator.init_trackers("dpkit-finetune-lm", config=run.info.as_dict())
    metrics = dpkit.CausalLMMetrics()

    def evaluate(split: str, final: bool = False) -> dict[str, float]:
        result = metrics.evaluate(run, model, validation)
        record = {"step": position.step, "split": split, **({"final": True} if final else {})}
        run.output.append_jsonl("metrics.jsonl", {**record, **result})
        accelerator.log({f"eval/{k}": v for k, v in result.items()}, step=position.step)
        return result

    # Train. From here on SIGTERM/SIGINT finish the step, save and exit (dpkit.StepGuard).
    guard = dpkit.StepGuard(accelerator)
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
                loss = model(**batch).loss  # mean over this micro-batch's loss tokens
                accelerator.backward(loss)
                grad_norm = None
                if accelerator.sync_gradients and train_cfg.max_grad_norm > 0:
                    grad_norm = accelerator.clip_grad_norm_(
                        model.parameters(), train_cfg.max_grad_norm
                    )
                optimizer.step()
                optimizer.zero_grad()
            position.batch_done()
            log.micro_batch(batch["attention_mask"].sum(), batch["input_ids"].shape[0])
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
            # The last step's evaluation is the final one, below: not run twice.
            if due(step, train_cfg.eval_steps) and step < schedule.total_steps:
                evaluate("validation")
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
            evaluate("validation")
    log.close()
    train_seconds = time.perf_counter() - started
    if not train_cfg.eval_only:
        run.save_checkpoint(model, optimizer, lr_scheduler)

    # Report: the held-out loss and perplexity, memory (from every rank), the model.
    result = evaluate("validation", final=True)
    logger.info("final validation: loss %.4f | perplexity %.2f (%d examples, %d tokens)",
                result["loss"], result["perplexity"], result["samples"],
                result["tokens"])  # fmt: skip
    logger.info("trained %d steps in %.1f s", position.step - position.first_step,
                train_seconds)  # fmt: skip
    if train_cfg.save_model and not train_cfg.eval_only:  # fp32, shards gathered (collective)
        run.save_model(model, run.output.model_dir)
    run.finish(step=position.step)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # N processes x tokenizer threads
    dpkit.run_and_exit(main)
