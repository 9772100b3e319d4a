"""Run resolution: the one place a run is decided (strategy, precision, batch, the engine's settings), before any process group.

:func:`resolve` is pure (the launcher's environment is one of its inputs) and makes
one pass: the launcher and the flags give the strategy and precision
(:func:`~dpkit.train.launcher.read_launch`), the batch and learning rate are checked
and scaled, and the strategy's engine builds its own settings from the
:class:`Request` (:meth:`~dpkit.engines.base.Engine.configure`: DDP's kwargs, the
resolved DeepSpeed JSON, FSDP2's units). Every conflict is a one-line
:class:`~dpkit.errors.UsageError` here. Nothing patches the :class:`Resolution`
afterwards: :func:`dpkit.train.run.start` hands it to accelerate as it is.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dpkit.core.strategy import Strategy
from dpkit.engines import engine_of
from dpkit.engines.base import EngineSettings
from dpkit.errors import UsageError
from dpkit.lora import LoraSettings
from dpkit.models import ModelSizes
from dpkit.train.config import StrategyConfig
from dpkit.train.launcher import check_accelerate_settings, read_launch


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@dataclass(frozen=True)
class Request:
    """What a run asks for, as every engine reads it: the flags, the launcher and the model
    (the strategy itself is ``configure``'s first argument)."""

    source: str
    """Where the strategy came from, for the log and messages."""
    args: StrategyConfig
    env: Mapping[str, str]
    precision: str
    on_cuda: bool
    world_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    max_grad_norm: float
    learning_rate: float | None
    """Scaled with the global batch if asked."""
    weight_decay: float | None
    model: Any
    """A ``torch.nn.Module``, a transformers config, or :class:`~dpkit.models.ModelSizes`."""
    model_sizes: ModelSizes
    ds_config_path: str | None = None
    """The backend config file the launch named (a DeepSpeed JSON)."""
    ds_template: Mapping[str, Any] | None = None
    """That file as read."""
    fsdp_layer_override: tuple[str, ...] = ()
    """FSDP2 layer classes a flag or the launcher named."""


@dataclass(frozen=True)
class Resolution:
    """What will run, resolved once from the flags, the launcher and the model."""

    strategy: Strategy
    """DDP, ZeRO-1, ZeRO-2 or one of FSDP2's two modes."""
    source: str
    """Where the strategy came from (a flag, a launcher, a config file), for the log."""
    precision: str
    """``no``, ``bf16`` or ``fp16`` (accelerate's names)."""
    world_size: int
    """Processes the launcher started (``WORLD_SIZE``)."""
    micro_batch_size: int
    """Examples per process per forward/backward."""
    gradient_accumulation_steps: int
    """Micro-batches accumulated into one optimizer update."""
    on_cuda: bool
    """Processes run on CUDA devices (nccl); otherwise on CPU (gloo)."""
    collective_timeout_s: float
    """Seconds a collective may wait for the other ranks."""
    model_sizes: ModelSizes
    """The model's sizes the engine's settings were derived from."""
    settings: EngineSettings
    """The engine's own settings (:meth:`~dpkit.engines.base.Engine.configure`)."""
    learning_rate: float | None = None
    """The peak learning rate, scaled with the global batch if asked (None: not given)."""
    gradient_checkpointing: bool = False
    """The model's layers recompute their activations in backward (``--gradient-checkpointing``)."""
    lora: LoraSettings | None = None
    """LoRA adapters train instead of the whole model (``--lora-r``), or None."""

    @property
    def engine(self) -> Any:
        """The backend that runs :attr:`strategy`."""
        return engine_of(self.strategy)

    @property
    def notes(self) -> tuple[str, ...]:
        """What the run does otherwise than a flag reads (logged once by :func:`start`)."""
        return self.settings.notes

    @property
    def global_batch_size(self) -> int:
        """Examples per optimizer update, all ranks together."""
        return self.micro_batch_size * self.gradient_accumulation_steps * self.world_size

    @property
    def backend(self) -> str:
        return "nccl" if self.on_cuda else "gloo"


def resolve(
    args: StrategyConfig | None = None,
    *,
    model: Any,
    micro_batch_size: int,
    gradient_accumulation_steps: int = 1,
    max_grad_norm: float = 0.0,
    learning_rate: float | None = None,
    scale_lr: str = "none",
    weight_decay: float | None = None,
    env: Mapping[str, str] | None = None,
    lora: LoraSettings | None = None,
) -> Resolution:
    """Resolve the run before any process group starts; bad input raises UsageError.

    Args:
        args: ``--strategy``, ``--deepspeed``, ``--mixed-precision``,
            ``--collective-timeout`` (:class:`StrategyConfig`; None: its defaults, i.e.
            whatever the launcher set up, else DDP).
        model: the model (a ``torch.nn.Module``), its transformers config, or
            :class:`~dpkit.models.ModelSizes`: the engine sizes its settings to it.
        micro_batch_size: examples per process per forward/backward.
        gradient_accumulation_steps: micro-batches per optimizer update.
        max_grad_norm: the clipping norm the loop uses (0: none). DeepSpeed clips inside
            its step (accelerate's ``clip_grad_norm_`` does nothing under it), so its
            engine writes this into the config as ``gradient_clipping``.
        learning_rate: the peak learning rate of one process without accumulation
            (recorded, and written into a DeepSpeed JSON's own ``optimizer`` section).
        scale_lr: ``none``, ``linear`` or ``sqrt``: scale ``learning_rate`` with the global
            batch (:func:`scaled_learning_rate`).
        weight_decay: for a DeepSpeed JSON with its own ``optimizer`` section.
        env: the launcher's environment (default ``os.environ``).
        lora: the LoRA settings as :func:`dpkit.setup` read them from ``args`` (None: read
            here).
    """
    args = args or StrategyConfig()
    env = os.environ if env is None else env
    for name, value in (
        ("micro_batch_size", micro_batch_size),
        ("gradient_accumulation_steps", gradient_accumulation_steps),
    ):
        if not isinstance(value, int) or value <= 0:
            raise UsageError(f"--{name.replace('_', '-')}={value!r}: must be > 0")
    on_cuda = _cuda_available()
    launch = read_launch(args, env, on_cuda=on_cuda)
    check_accelerate_settings(
        env, gradient_accumulation_steps=gradient_accumulation_steps, max_grad_norm=max_grad_norm
    )
    if learning_rate is not None:
        learning_rate = scaled_learning_rate(
            learning_rate, scale_lr, launch.world_size, gradient_accumulation_steps
        )
    request = Request(
        source=launch.source,
        args=args,
        env=env,
        precision=launch.precision,
        on_cuda=on_cuda,
        world_size=launch.world_size,
        micro_batch_size=micro_batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
        max_grad_norm=max_grad_norm,
        learning_rate=learning_rate,
        weight_decay=weight_decay,
        model=model,
        model_sizes=ModelSizes.of(model),
        ds_config_path=launch.config_path,
        ds_template=launch.config_template,
        fsdp_layer_override=args.fsdp_layer_class_names or launch.fsdp_layer_override,
    )
    settings = engine_of(launch.strategy).configure(launch.strategy, request)
    if launch.notes:  # said once, with the engine's own notes, when the run starts
        settings = dataclasses.replace(settings, notes=(*launch.notes, *settings.notes))
    return Resolution(
        strategy=launch.strategy,
        source=launch.source,
        precision=launch.precision,
        world_size=launch.world_size,
        micro_batch_size=micro_batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
        on_cuda=on_cuda,
        collective_timeout_s=args.collective_timeout,
        model_sizes=request.model_sizes,
        settings=settings,
        learning_rate=learning_rate,
        gradient_checkpointing=args.gradient_checkpointing,
        lora=lora if lora is not None else LoraSettings.from_args(args),
    )


def check_launch(args: StrategyConfig, env: Mapping[str, str] | None = None) -> None:
    """What can be checked of the launch before the model exists: the DeepSpeed JSON
    (found, read, its keys and stage), the launcher against the flags, the precision.

    :func:`dpkit.train.parsing.parse_args` calls it, so that a bad ``--deepspeed`` file is
    refused before a script loads its model; :func:`resolve` does it all again with the
    model.

    Raises:
        UsageError: one line, as :func:`resolve` would.
    """
    read_launch(args, os.environ if env is None else env, on_cuda=_cuda_available())


def scaled_learning_rate(base_lr: float, rule: str, world_size: int, accumulation: int) -> float:
    """Scale the lr with the global batch relative to one process without accumulation
    (``none``, ``linear`` or ``sqrt``)."""
    factor = world_size * accumulation
    if rule == "linear":
        return base_lr * factor
    if rule == "sqrt":
        return base_lr * math.sqrt(factor)
    if rule == "none":
        return base_lr
    # An API caller's typo would otherwise train at the unscaled rate without a word.
    raise UsageError(f"scale_lr={rule!r}: want 'none', 'linear' or 'sqrt'")
