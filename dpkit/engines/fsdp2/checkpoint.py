"""FSDP2's training state by parameter name: parameters and moments are DTensors sharded on
dim 0; torch distributed checkpoint's state-dict API (``get_model_state_dict`` /
``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` with full state dicts)
gathers them by name and puts them back as each rank's rows."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dpkit.core.walk import inner_torch_optimizer
from dpkit.engines.fsdp2.shard import reshard
from dpkit.engines.roles.checkpoint_io import CheckpointIO

if TYPE_CHECKING:
    from collections.abc import Callable

    from accelerate import Accelerator

    from dpkit.core.shards import FlatShard

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def _full_on_main() -> Any:
    """DCP's options for a whole state dict, on CPU, kept by rank 0 only."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


class FSDP2Checkpoints(CheckpointIO):
    """FSDP2's checkpoint I/O: each rank's own rows of every parameter and moment (DTensor shards), gathered whole or read back as any layout's ranges."""

    def full_weights(self, accelerator: Accelerator, module: torch.nn.Module) -> dict[str, Any]:
        """The whole parameters and buffers, gathered (a collective); on the main process.
        An evaluation may have left shard-grad-op's parameters whole: sharded again first."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        reshard(module)
        state = get_model_state_dict(module, options=_full_on_main())
        return state if accelerator.is_main_process else {}

    def full_moments(
        self, accelerator: Accelerator, module: torch.nn.Module, optimizer: Any
    ) -> dict | None:
        """Adam moments by parameter name, whole, on the main process (a collective); None
        before the first step."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        reshard(module)
        torch_opt = inner_torch_optimizer(optimizer)
        if not any(isinstance(s, dict) and "step" in s for s in torch_opt.state.values()):
            return None
        state = get_optimizer_state_dict(module, torch_opt, options=_full_on_main()).get("state")
        if not accelerator.is_main_process:
            return {}
        return {
            name: {k: state[name][k].to("cpu", torch.float32) for k in ADAM_MOMENTS}
            for name, param in module.named_parameters()
            if param.requires_grad  # a frozen weight (LoRA's) has no moments
        }

    def load_moments(
        self,
        accelerator: Accelerator,
        module: torch.nn.Module,
        optimizer: Any,
        moments: dict,
        step: int | None,
    ) -> None:
        """Whole moments by name (the same on every rank) into FSDP2's sharded state: DCP
        keeps each rank's rows of each; the parameter groups (their lrs already restored) are
        the optimizer's own, named."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        reshard(module)
        torch_opt = inner_torch_optimizer(optimizer)
        name_of = {id(p): n for n, p in module.named_parameters()}
        groups = [
            {**{k: v for k, v in group.items() if k != "params"},
             "params": [name_of[id(p)] for p in group["params"]]}
            for group in torch_opt.param_groups
        ]  # fmt: skip
        state = {
            name: {"step": step.clone(), **{k: moments[name][k] for k in ADAM_MOMENTS}}
            for name in name_of.values()
            if name in moments  # trainable parameters; frozen ones have none
        }
        set_optimizer_state_dict(
            module,
            torch_opt,
            {"state": state, "param_groups": groups},
            options=StateDictOptions(full_state_dict=True),
        )

    def load_weights(
        self, accelerator: Accelerator, module: torch.nn.Module, weights: dict
    ) -> None:
        """Whole weights by name (the same on every rank) into FSDP2's sharded parameters:
        DCP keeps each rank's rows. Tied parameters are saved once (``strict=False``)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        reshard(module)
        set_model_state_dict(
            module, weights, options=StateDictOptions(full_state_dict=True, strict=False)
        )

    def own_shards(
        self, accelerator: Accelerator, module: torch.nn.Module, optimizer: Any
    ) -> dict[str, Any]:
        """Each parameter's and moment's own rows (an evaluation may have left
        shard-grad-op's parameters whole: sharded again first)."""
        from dpkit.engines.fsdp2.shard import reshard

        reshard(module)
        return super().own_shards(accelerator, module, optimizer)

    def load_own_shards(
        self,
        accelerator: Accelerator,
        module: torch.nn.Module,
        optimizer: Any,
        read: Callable[[dict[str, FlatShard]], None],
        step: int | None,
        *,
        with_moments: bool,
    ) -> None:
        from dpkit.engines.fsdp2.shard import reshard

        reshard(module)
        super().load_own_shards(
            accelerator, module, optimizer, read, step, with_moments=with_moments
        )
