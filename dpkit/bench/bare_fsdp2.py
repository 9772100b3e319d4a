"""Bare baseline: the LM workload as a plain torch FSDP2 loop (``fully_shard``), no accelerate, no dpkit strategy.

    torchrun --nproc_per_node 2 -m dpkit.bench.bare_fsdp2 --reshard-after-forward false --output-dir runs/bare_fsdp2
    torchrun --nproc_per_node 2 -m dpkit.bench.bare_fsdp2 --offload true --output-dir runs/bare_fsdp2_offload

The loop of :mod:`dpkit.bench.bare_ddp` (same model, data, batch order, seed and
optimizer as ``recipes/train_lm.py``) around what a user writes from torch's FSDP2
tutorial: ``fully_shard`` on every block the model lists in ``_no_split_modules``,
then on the root, on a mesh of every rank; ``--mixed-precision bf16`` adds
``MixedPrecisionPolicy(bf16 params, fp32 reduce)``; ``--offload`` adds
``CPUOffloadPolicy`` to every ``fully_shard`` (the shards, their gradients and the
optimizer step in host memory). ``dpkit bench`` divides dpkit's FSDP2 step time by this
one's to show dpkit's overhead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dpkit.bench.bare_ddp import train_bare
from dpkit.data import lm as lm_data
from dpkit.train import guards
from dpkit.train.parsing import parse_args


@dataclass
class BareFsdp2Options:
    """What a bare FSDP2 run chooses: the reshard mode and whether it offloads."""

    reshard_after_forward: bool = field(
        default=True,
        metadata={"help": "Shard parameters again after each block's forward (ZeRO-3's layout)."},
    )
    offload: bool = field(
        default=False,
        metadata={"help": "torch's CPUOffloadPolicy on every fully_shard (shards in host memory)."},
    )


def main() -> None:
    workload, precision, options = parse_args(
        lm_data.LMWorkload, lm_data.BarePrecision, BareFsdp2Options
    )

    def wrap(model: torch.nn.Module, device: torch.device, bf16: bool) -> torch.nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        policy = MixedPrecisionPolicy()
        if bf16:
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        shard = {"mesh": mesh, "reshard_after_forward": options.reshard_after_forward}
        if options.offload:
            # Pinned host memory speeds copies to a GPU; with no GPU torch's default
            # pin_memory=True fails inside fully_shard, so it is pinned on CUDA only.
            shard["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
        blocks = set(model._no_split_modules or ())
        for module in model.modules():
            if type(module).__name__ in blocks:
                fully_shard(module, mp_policy=policy, **shard)
        return fully_shard(model, mp_policy=policy, **shard)

    train_bare(workload, precision, wrap)


if __name__ == "__main__":
    guards.run_and_exit(main)
