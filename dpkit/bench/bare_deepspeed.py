"""Bare baseline: the LM workload under plain ``deepspeed.initialize``, DeepSpeed's own defaults.

    deepspeed --num_gpus 2 --module dpkit.bench.bare_deepspeed --zero-stage 1 --output-dir runs/bare_zero1
    deepspeed --num_gpus 2 --module dpkit.bench.bare_deepspeed --zero-stage 3 --offload true --output-dir runs/bare_zero3_offload

Same model, data, batch order, seed and optimizer as ``recipes/train_lm.py``: torch
AdamW given as the client optimizer (nothing JIT-compiled), or with ``--offload``
DeepSpeed's CPU Adam in AdamW mode (decoupled weight decay: the same update as torch's
AdamW and as dpkit's offload runs), which is what DeepSpeed expects under
``offload_optimizer``. The DeepSpeed config names only what the workload needs (batch,
clipping, stage, the offload devices, and ``bf16`` with ``--mixed-precision bf16``);
buckets, overlap and contiguous gradients stay at DeepSpeed's defaults. At stage 3 the
model is built as transformers builds it for a DeepSpeed user: ``HfDeepSpeedConfig``
alive before ``from_config``, so it is partitioned under ``deepspeed.zero.Init`` as it
is built and initialised with its own init (:func:`dpkit.data.lm.build_lm`).
``dpkit bench`` divides dpkit's step time by this one's to show dpkit's overhead.
Writes train_log.jsonl in train_lm.py's format.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import deepspeed
import torch.distributed as dist
from deepspeed.ops.adam import DeepSpeedCPUAdam
from transformers.integrations import HfDeepSpeedConfig

from dpkit.data import lm as lm_data
from dpkit.engines.deepspeed.config import skip_deepspeed_cpu_shm_op
from dpkit.models import adamw, adamw_param_groups
from dpkit.train import guards
from dpkit.train.output import RunOutput
from dpkit.train.parsing import parse_args

STAGES = (1, 2, 3)


@dataclass
class BareOptions:
    """What a bare DeepSpeed run chooses: the stage and whether it offloads."""

    zero_stage: int = field(
        default=1, metadata={"help": "ZeRO stage: 1, 2 or 3.", "choices": list(STAGES)}
    )
    """``zero_optimization.stage``."""
    offload: bool = field(
        default=False,
        metadata={
            "help": "offload_optimizer to cpu (DeepSpeed's CPU Adam); at stage 3 offload_param too."
        },
    )
    """``offload_optimizer: {device: cpu}``, and at stage 3 ``offload_param: {device: cpu}``."""


def bare_ds_config(
    options: BareOptions, micro_batch_size: int, world_size: int, max_grad_norm: float, bf16: bool
) -> dict:
    """The DeepSpeed config a user writes for this job: batch, clipping, the stage, the
    offload devices where asked, nothing else of the ZeRO section."""
    zero: dict = {"stage": options.zero_stage}
    if options.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if options.zero_stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    ds_config = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro_batch_size * world_size,
        "gradient_clipping": max_grad_norm,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1_000_000,
    }
    if bf16:
        ds_config["bf16"] = {"enabled": True}
    return ds_config


def main() -> None:
    workload, options, precision = parse_args(
        lm_data.LMWorkload, BareOptions, lm_data.BarePrecision
    )
    # Not part of the measured baseline (training never uses it): on CPU DeepSpeed would
    # compile a shared-memory op and leak 66 MB of /dev/shm per rank and run.
    skip_deepspeed_cpu_shm_op()
    deepspeed.init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = Path(workload.output_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "train_log.jsonl").unlink(missing_ok=True)

    config = lm_data.lm_config(workload)
    dataset = lm_data.token_blocks(workload, config.vocab_size)
    lm_data.check_enough_blocks(dataset, workload, world_size)
    ds_config = bare_ds_config(
        options, workload.micro_batch_size, world_size, workload.max_grad_norm, precision.bf16
    )
    # Alive for the whole run, as accelerate keeps it for dpkit's: at stage 3 transformers'
    # from_config then builds the model under zero.Init with the model's own init (a GPT-2
    # built inside a bare zero.Init starts from loss ~43 instead of ~5.5). transformers
    # holds only a weak reference, hence the name. Below stage 3 it changes nothing.
    hf_ds_config = HfDeepSpeedConfig(ds_config)  # noqa: F841
    model = lm_data.build_lm(config, workload.seed)
    groups = adamw_param_groups(model, workload.weight_decay)
    if options.offload:
        # DeepSpeed steps an offloaded optimizer on the host with its own CPU Adam;
        # adamw_mode=True is AdamW's decoupled decay, the update of torch's AdamW.
        optimizer = DeepSpeedCPUAdam(
            groups, lr=workload.learning_rate, weight_decay=workload.weight_decay, adamw_mode=True
        )
    else:
        # dpkit's own AdamW (fused where torch has it): the ratio measures dpkit, not the kernel.
        optimizer = adamw(groups, lr=workload.learning_rate, weight_decay=workload.weight_decay)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    if rank == 0:
        RunOutput(str(out), is_main_process=True).write_json("ds_config.json", ds_config)

    tokens_per_rank = workload.micro_batch_size * workload.seq_len
    batches = lm_data.rank_batches(dataset, workload.micro_batch_size, rank, world_size)
    engine.train()
    last, last_cpu = time.perf_counter(), time.process_time()
    for step in range(1, workload.max_steps + 1):
        batch = {k: v.to(engine.device) for k, v in next(batches).items()}
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss = mean_loss.item() / world_size
        now, now_cpu = time.perf_counter(), time.process_time()
        if rank == 0:
            lm_data.log_bare_step(
                out,
                step=step,
                mean_loss=mean_loss,
                workload=workload,
                tokens_per_rank=tokens_per_rank,
                step_time_s=now - last,
                step_cpu_s=now_cpu - last_cpu,
            )
        last, last_cpu = time.perf_counter(), time.process_time()
    # Without the teardown, gloo's threads are still running at interpreter exit and a
    # rank can abort ("terminate called without an active exception"); without the
    # barrier first, a rank can tear down while its peer's last collective is in
    # flight, with the same abort (3 of 12 runs here; 0 of 12 with it).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    guards.run_and_exit(main)
