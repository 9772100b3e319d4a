"""What the launcher asked for, as a value: the strategy, its source, precision and world size.

:func:`dpkit.train.launcher.read_launch` builds it from the flags and the launcher's
environment, asking each engine whether its launcher configuration is present
(:meth:`dpkit.engines.base.Engine.launched`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dpkit.core.strategy import Strategy


@dataclass(frozen=True)
class Launch:
    """What will run, decided from the recipe flags and the launcher's environment."""

    strategy: Strategy
    """The strategy."""
    source: str
    """Where the choice came from, for the log (a flag, a launcher, a config file)."""
    precision: str = "no"
    """``no``, ``bf16`` or ``fp16`` (accelerate's names)."""
    world_size: int = 1
    """Processes the launcher started (``WORLD_SIZE``), checked once the group is up."""
    config_path: str | None = None
    """The backend's config file the launch named (a DeepSpeed JSON), or None."""
    config_template: Mapping[str, Any] | None = None
    """That file as read, ``"auto"`` values still in it."""
    fsdp_layer_override: tuple[str, ...] = ()
    """FSDP2 layer classes the launcher named (``fsdp_transformer_layer_cls_to_wrap``)."""
    notes: tuple[str, ...] = ()
    """How a config file was found when not where it was named, for the run's log."""


def uses_accelerate_without_backend(env: Mapping[str, str]) -> bool:
    """``accelerate launch`` with no DeepSpeed or FSDP config (its env marks every launch
    with ``ACCELERATE_DYNAMO_BACKEND``)."""
    return (
        "ACCELERATE_DYNAMO_BACKEND" in env
        and env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true"
        and env.get("ACCELERATE_USE_FSDP", "false").lower() != "true"
    )
