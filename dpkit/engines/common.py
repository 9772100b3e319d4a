"""Checks and readings more than one engine shares (each engine decides whether to call them)."""

from __future__ import annotations

from typing import Any

from dpkit.errors import UsageError


def is_module(model: Any) -> bool:
    """Whether ``model`` is a live ``torch.nn.Module`` (not a config or sizes)."""
    import torch

    return isinstance(model, torch.nn.Module)


def refuse_fsdp_layers(strategy: Any, request: Any) -> None:
    """FSDP2's layer classes given to a backend that shards no layers: refused rather
    than dropped."""
    override = request.fsdp_layer_override
    if override:
        # Only the flag gets here: an accelerate FSDP config always runs FSDP2 (or is refused).
        raise UsageError(
            f"--fsdp-layer-classes={','.join(override)}: FSDP2's; {strategy.name} shards no layers"
        )


def note_find_unused(strategy: Any, request: Any) -> tuple[str, ...]:
    """DDP's ``--ddp-find-unused-parameters`` under a backend that needs none: said, not refused."""
    if not request.args.ddp_find_unused_parameters:
        return ()
    return (
        f"--ddp-find-unused-parameters: DDP's; {strategy.name} needs none "
        "(parameters the loss does not use simply get no gradient)",
    )
