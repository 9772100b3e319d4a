"""Bare baseline: the LM workload as a plain torch DDP loop, no accelerate, no dpkit strategy.

    torchrun --nproc_per_node 2 -m dpkit.bench.bare_ddp --size small --output-dir runs/bare_ddp

``--mixed-precision bf16`` autocasts the forward, as accelerate does for dpkit's DDP.

Same model, data, batch order, seed and optimizer as ``recipes/train_lm.py``
(both take them from :mod:`dpkit.data.lm`); everything else is what torch does
by default: DDP's own bucket size, no ``gradient_as_bucket_view``. ``dpkit bench``
divides dpkit's step time by this one's to show dpkit's overhead.
Writes train_log.jsonl in train_lm.py's format.

At one process (``--nproc_per_node 1``) the model is not wrapped at all: one rank
alone, the same per-rank batch, forward, backward and optimizer with no
communication. That is the bench's compute floor (``floor``), against which every
run's step time is a fraction: how much of a step is parallel overhead.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from dpkit.data import lm as lm_data
from dpkit.models import adamw, adamw_param_groups
from dpkit.train import guards
from dpkit.train.parsing import parse_args


def main() -> None:
    """The bare DDP loop (no wrapper at one process: the floor)."""
    workload, precision = parse_args(lm_data.LMWorkload, lm_data.BarePrecision)
    train_bare(workload, precision, wrap_ddp)


def wrap_ddp(model: torch.nn.Module, device: torch.device, bf16: bool) -> torch.nn.Module:
    """torch's DDP with its defaults, one device per process on GPUs."""
    if dist.get_world_size() == 1:
        return model
    return DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )


def train_bare(
    workload: lm_data.LMWorkload,
    precision: lm_data.BarePrecision,
    wrap: Callable[[torch.nn.Module, torch.device, bool], torch.nn.Module],
) -> None:
    """The LM workload's loop around ``wrap(model, device, bf16)``: the parallel wrapper
    is the only thing the bare loops (DDP, FSDP2) choose."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}" if backend == "nccl" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    out = Path(workload.output_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "train_log.jsonl").unlink(missing_ok=True)

    config = lm_data.lm_config(workload)
    dataset = lm_data.token_blocks(workload, config.vocab_size)
    lm_data.check_enough_blocks(dataset, workload, world_size)
    model = wrap(lm_data.build_lm(config, workload.seed).to(device), device, precision.bf16)
    # dpkit's own AdamW (fused where torch has it): the ratio measures dpkit, not the kernel.
    optimizer = adamw(
        adamw_param_groups(model, workload.weight_decay),
        lr=workload.learning_rate,
        weight_decay=workload.weight_decay,
    )

    tokens_per_rank = workload.micro_batch_size * workload.seq_len
    batches = lm_data.rank_batches(dataset, workload.micro_batch_size, rank, world_size)
    model.train()
    last, last_cpu = time.perf_counter(), time.process_time()
    for step in range(1, workload.max_steps + 1):
        batch = {k: v.to(device) for k, v in next(batches).items()}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision.bf16):
            loss = model(**batch).loss
        loss.backward()
        if workload.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), workload.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean_loss = loss.detach().clone()
        if world_size > 1:
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
    # A barrier before the teardown: see bare_deepspeed.py.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    guards.run_and_exit(main)
