"""Bare baseline: the LM workload under plain ``deepspeed.initialize``, DeepSpeed's own defaults.

    deepspeed --num_gpus 2 --module dpkit.bench.bare_deepspeed --zero-stage 1 --output-dir runs/bare_zero1

Same model, data, batch order, seed and optimizer (torch AdamW, given as the
client optimizer, so nothing is JIT-compiled) as ``recipes/train_lm.py``. The
DeepSpeed config names only what the workload needs (batch, clipping, stage, and
``bf16`` with ``--mixed-precision bf16``);
buckets, overlap and contiguous gradients stay at DeepSpeed's defaults.
``dpkit bench`` divides dpkit's step time by this one's to show dpkit's overhead.
Writes train_log.jsonl in train_lm.py's format.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import deepspeed
import torch.distributed as dist

from dpkit.data import lm as lm_data
from dpkit.engines.deepspeed.config import skip_deepspeed_cpu_shm_op
from dpkit.models import adamw, adamw_param_groups
from dpkit.train import guards
from dpkit.train.output import RunOutput
from dpkit.train.parsing import parse_args


@dataclass
class BareOptions:
    """The one thing a bare DeepSpeed run chooses."""

    zero_stage: int = field(default=1, metadata={"help": "ZeRO stage: 1 or 2."})
    """``zero_optimization.stage``; nothing else of the ZeRO section is set."""


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
    model = lm_data.build_lm(config, workload.seed)
    # dpkit's own AdamW (fused where torch has it): the ratio measures dpkit, not the kernel.
    optimizer = adamw(
        adamw_param_groups(model, workload.weight_decay),
        lr=workload.learning_rate,
        weight_decay=workload.weight_decay,
    )
    ds_config = {
        "train_micro_batch_size_per_gpu": workload.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "train_batch_size": workload.micro_batch_size * world_size,
        "gradient_clipping": workload.max_grad_norm,
        "zero_optimization": {"stage": options.zero_stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1_000_000,
    }
    if precision.bf16:
        ds_config["bf16"] = {"enabled": True}
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
