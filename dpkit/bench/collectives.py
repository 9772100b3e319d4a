"""The collectives each strategy adds to a step, timed alone on this machine's backend.

    torchrun --nproc_per_node 2 -m dpkit.bench.collectives --size small --output-dir runs/comm

``dpkit bench`` runs it beside the training runs to say what ZeRO costs in
communication against DDP, for the same model (built on the meta device: only the
parameter sizes are read). Three patterns, each over the model's own gradient or
parameter sizes, in the module dtype (fp32):

* ``ddp_allreduce``: DDP's reducer: allreduce in ``bucket_cap_mb`` buckets (torch's
  25 MiB; 1 MiB first), all issued before any is waited on; in training it runs
  while backward goes on.
* ``zero_reduce``: DeepSpeed ZeRO-1/2 with ``contiguous_gradients`` off: allreduce
  in ``reduce_bucket_size`` buckets (a gradient larger than the bucket alone), each
  waited before the next; on a CPU accelerator it runs on the compute thread.
* ``zero_allgather``: the all-gather of the updated parameter partitions after the
  ZeRO step, one per optimizer group; DDP has no counterpart.

Every pattern: one untimed round, then ``--repeats`` timed ones, each between
barriers; a round's time is the slowest rank's. Writes ``collectives.json``
(:data:`dpkit.bench.launch.COLLECTIVES_FILE`).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from dpkit.bench.launch import COLLECTIVES_FILE
from dpkit.data import lm as lm_data
from dpkit.engines.ddp.settings import ddp_kwargs
from dpkit.engines.deepspeed.settings import bucket_elements
from dpkit.errors import UsageError
from dpkit.models import adamw_param_groups, count_parameters, hidden_size_of
from dpkit.train import guards
from dpkit.train.parsing import parse_args

# DDP's buckets as dpkit configures them, and torch's smaller first bucket (backward's
# first gradients start reducing early).
DDP_BUCKET_BYTES = int(ddp_kwargs()["bucket_cap_mb"] * 1024**2)
DDP_FIRST_BUCKET_BYTES = dist._DEFAULT_FIRST_BUCKET_BYTES


@dataclass
class CollectiveOptions:
    """What to time, beyond the workload's model."""

    repeats: int = field(default=5, metadata={"help": "Timed rounds per pattern (median)."})
    zero_bucket: int | None = field(
        default=None,
        metadata={
            "help": "ZeRO reduce_bucket_size in elements (default: dpkit's rule for the model)."
        },
    )

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise UsageError(f"--repeats={self.repeats}: must be >= 1")
        if self.zero_bucket is not None and self.zero_bucket < 1:
            raise UsageError(f"--zero-bucket={self.zero_bucket}: must be >= 1")


def greedy_buckets(numels: Sequence[int], cap: int, first_cap: int | None = None) -> list[int]:
    """Bucket sizes (elements) when gradients arrive in ``numels`` order and a bucket
    is sent once the next gradient would overflow ``cap``; one larger than the cap
    goes alone."""
    buckets, current = [], 0
    limit = first_cap or cap
    for numel in numels:
        if current and current + numel > limit:
            buckets.append(current)
            current, limit = 0, cap
        current += numel
    if current:
        buckets.append(current)
    return buckets


def timed_rounds(fn: Callable[[], None], repeats: int, device: torch.device) -> list[float]:
    """Seconds per round, the slowest rank's, after one untimed round."""
    times = []
    for index in range(repeats + 1):
        dist.barrier()
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if index:
            times.append(float(elapsed.item()))
    return times


def main() -> None:
    workload, options = parse_args(lm_data.LMWorkload, CollectiveOptions)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(
        f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if backend == "nccl" else "cpu"
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)

    config = lm_data.lm_config(workload)
    with torch.device("meta"):
        model = lm_data.build_lm(config, workload.seed)
    num_params = count_parameters(model)
    groups = [
        [p.numel() for p in group["params"]]
        for group in adamw_param_groups(model, workload.weight_decay)
    ]
    # Gradients become ready roughly in reverse registration order.
    arrival = [p.numel() for p in reversed(list(model.parameters()))]
    zero_bucket = options.zero_bucket or bucket_elements(hidden_size_of(config), num_params)
    dtype = torch.float32
    element = torch.finfo(dtype).bits // 8

    flat = torch.ones(num_params, dtype=dtype, device=device)
    ddp_sizes = greedy_buckets(
        arrival, DDP_BUCKET_BYTES // element, first_cap=DDP_FIRST_BUCKET_BYTES // element
    )
    zero_sizes = greedy_buckets(arrival, zero_bucket)
    # Each group is padded to a multiple of the world size, as DeepSpeed flattens it.
    gather_sizes = [-(-sum(g) // world_size) * world_size for g in groups if sum(g)]

    def ddp_allreduce() -> None:
        works = [dist.all_reduce(chunk, async_op=True) for chunk in flat.split(ddp_sizes)]
        for work in works:
            work.wait()

    def zero_reduce() -> None:
        for chunk in flat.split(zero_sizes):
            dist.all_reduce(chunk)

    gathered = [torch.empty(n, dtype=dtype, device=device) for n in gather_sizes]
    # Each rank's own partition, made before the clock starts: only the collective is timed.
    shards = [out.chunk(world_size)[rank].clone() for out in gathered]

    def zero_allgather() -> None:
        for out, shard in zip(gathered, shards, strict=True):
            dist.all_gather_single(out, shard)

    patterns = {
        "ddp_allreduce": (ddp_allreduce, ddp_sizes),
        "zero_reduce": (zero_reduce, zero_sizes),
        "zero_allgather": (zero_allgather, gather_sizes),
    }
    results = {}
    for name, (fn, sizes) in patterns.items():
        times = timed_rounds(fn, options.repeats, device)
        results[name] = {
            "calls": len(sizes),
            "elements": int(sum(sizes)),
            "bytes": int(sum(sizes)) * element,
            "median_s": statistics.median(times),
            "times_s": times,
        }
    if rank == 0:
        out = Path(workload.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        record = {
            "backend": backend,
            "device": device.type,
            "world_size": world_size,
            "num_params": num_params,
            "dtype": str(dtype).removeprefix("torch."),
            "ddp_bucket_bytes": DDP_BUCKET_BYTES,
            "zero_bucket_elements": zero_bucket,
            "repeats": options.repeats,
            "patterns": results,
        }
        (out / COLLECTIVES_FILE).write_text(json.dumps(record, indent=2) + "\n")
        for name, result in results.items():
            print(
                f"{name}: {result['calls']} calls, {result['bytes'] / 1024**2:.1f} MiB, "
                f"median {result['median_s'] * 1e3:.1f} ms",
                flush=True,
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    guards.run_and_exit(main)
