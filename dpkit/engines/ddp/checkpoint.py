"""DDP's training state by parameter name: read from the module and the torch optimizer
directly (every rank holds all of it), restored the same way."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dpkit.core.walk import inner_torch_optimizer
from dpkit.engines.roles.checkpoint_io import CheckpointIO

if TYPE_CHECKING:
    from accelerate import Accelerator

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def has_moments(optimizer: Any) -> bool:
    """Whether the optimizer has stepped (AdamW's state exists only after its first step)."""
    torch_opt = inner_torch_optimizer(optimizer)
    return any(isinstance(s, dict) and "step" in s for s in torch_opt.state.values())


class DDPCheckpoints(CheckpointIO):
    """DDP's checkpoint I/O: every rank holds every tensor whole, so gathering is reading."""

    def full_weights(self, accelerator: Accelerator, module: torch.nn.Module) -> dict[str, Any]:
        """The module's state on the main process (a copy: the live parameters keep training)."""
        if not accelerator.is_main_process:
            return {}
        return {
            name: value.detach().to("cpu").clone() for name, value in module.state_dict().items()
        }

    def full_moments(
        self, accelerator: Accelerator, module: torch.nn.Module, optimizer: Any
    ) -> dict | None:
        """Adam moments per parameter name, on the main process (None before the first step)."""
        if not has_moments(optimizer):
            return None
        torch_opt = inner_torch_optimizer(optimizer)
        if not accelerator.is_main_process:
            return {}
        return {
            name: {
                k: torch_opt.state[param][k].to("cpu", torch.float32).clone() for k in ADAM_MOMENTS
            }
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
        """Whole moments by name into the torch optimizer's state."""
        torch_opt = inner_torch_optimizer(optimizer)
        for name, param in module.named_parameters():
            if not param.requires_grad:
                continue
            torch_opt.state[param] = {
                "step": step.clone(),
                **{k: moments[name][k].to(param.device, param.dtype) for k in ADAM_MOMENTS},
            }
