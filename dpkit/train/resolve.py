"""Run resolution: the one place a run is decided (strategy, precision, batch, DeepSpeed config), before any process group.

:func:`resolve` is pure (the launcher's environment is one of its inputs): every
conflict between the flags, the launcher and the DeepSpeed JSON is a one-line
:class:`~dpkit.errors.UsageError` here. Its :class:`Resolution` holds the one
resolved DeepSpeed dict; :func:`dpkit.train.run.start` hands it to accelerate and
nothing patches it afterwards.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dpkit.errors import UsageError
from dpkit.memory.settings import ddp_kwargs, zero_memory_settings
from dpkit.models import ModelSizes
from dpkit.strategy import Strategy
from dpkit.train.config import StrategyConfig
from dpkit.train.deepspeed_config import fill_deepspeed_config, optimizer_offload
from dpkit.train.launch import (
    check_accelerate_settings,
    fsdp_layer_classes_from_launcher,
    resolve_precision,
    resolve_strategy,
)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


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
    ds_config: Mapping[str, Any] | None
    """The DeepSpeed config with every value resolved (ZeRO only)."""
    ds_config_path: str | None
    """The JSON it was resolved from (ZeRO only)."""
    ddp_kwargs: Mapping[str, Any]
    """``DistributedDataParallelKwargs`` (DDP only; dpkit.memory.settings)."""
    on_cuda: bool
    """Processes run on CUDA devices (nccl); otherwise on CPU (gloo)."""
    collective_timeout_s: float
    """Seconds a collective may wait for the other ranks."""
    model_sizes: ModelSizes
    """The model's sizes the ZeRO settings were derived from."""
    learning_rate: float | None = None
    """The peak learning rate, scaled with the global batch if asked (None: not given)."""
    offload_optimizer: str | None = None
    """Where ZeRO keeps optimizer state and master weights off the device (``cpu``), or None."""
    notes: tuple[str, ...] = ()
    """What the run does otherwise than a flag reads (logged once by :func:`start`)."""
    fsdp_layer_classes: tuple[str, ...] = ()
    """FSDP2: the class names made sharding units before the root (empty otherwise, or
    when only the model's config was given: found when the model is sharded)."""
    fsdp_layer_override: tuple[str, ...] = ()
    """FSDP2: the classes the user named (``--fsdp-layer-classes`` or the accelerate
    YAML's ``fsdp_transformer_layer_cls_to_wrap``)."""
    ddp_forward_sync_buffers: bool = True
    """DDP: re-broadcast rank 0's buffers before every forward (DDP's
    ``forward_sync_buffers``); off when every buffer is a constant
    (:func:`buffers_need_forward_sync`). Init-time sync happens either way."""

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
) -> Resolution:
    """Resolve the run before any process group starts; bad input raises UsageError.

    Args:
        args: ``--strategy``, ``--deepspeed``, ``--mixed-precision``,
            ``--collective-timeout`` (:class:`StrategyConfig`; None: its defaults, i.e.
            whatever the launcher set up, else DDP).
        model: the model (a ``torch.nn.Module``), its transformers config, or
            :class:`~dpkit.models.ModelSizes`: ZeRO's buckets are sized to it.
        micro_batch_size: examples per process per forward/backward.
        gradient_accumulation_steps: micro-batches per optimizer update.
        max_grad_norm: the clipping norm the loop uses (0: none). DeepSpeed clips inside
            its step (accelerate's ``clip_grad_norm_`` does nothing under it), so this is
            written into the DeepSpeed config as ``gradient_clipping``.
        learning_rate: the peak learning rate of one process without accumulation
            (recorded, and written into a DeepSpeed JSON's own ``optimizer`` section).
        scale_lr: ``none``, ``linear`` or ``sqrt``: scale ``learning_rate`` with the global
            batch (:func:`scaled_learning_rate`).
        weight_decay: for a DeepSpeed JSON with its own ``optimizer`` section.
        env: the launcher's environment (default ``os.environ``).
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
    choice = resolve_strategy(args.strategy, args.deepspeed, env)
    precision = resolve_precision(args.mixed_precision, env, on_cuda=on_cuda)
    strategy = choice.strategy
    if strategy.uses_fsdp2 and precision == "fp16":
        raise UsageError(
            f"mixed_precision=fp16 with --strategy={strategy.name}: dpkit's FSDP2 runs bf16 "
            "(fp16 would need a sharded gradient scaler); use bf16"
        )
    layer_override = args.fsdp_layer_class_names or fsdp_layer_classes_from_launcher(env)
    if layer_override and not strategy.uses_fsdp2:
        # Only the flag gets here: an accelerate FSDP config always runs FSDP2 (or is refused).
        raise UsageError(
            f"--fsdp-layer-classes={','.join(layer_override)}: FSDP2's; "
            f"{strategy.name} shards no layers"
        )
    fsdp_layers: tuple[str, ...] = ()
    if strategy.uses_fsdp2 and _is_module(model):
        from dpkit.train.fsdp2 import layer_classes

        fsdp_layers = layer_classes(model, layer_override, asked_by=fsdp_asked_by(choice.source))
    check_accelerate_settings(
        env, gradient_accumulation_steps=gradient_accumulation_steps, max_grad_norm=max_grad_norm
    )
    sizes = ModelSizes.of(model)
    if learning_rate is not None:
        learning_rate = scaled_learning_rate(
            learning_rate, scale_lr, choice.expected_world_size, gradient_accumulation_steps
        )
    ds_config = offload = None
    if choice.strategy.uses_deepspeed:
        offload = optimizer_offload(choice.ds_template or {}, choice.ds_config_path or "")
        settings = zero_memory_settings(
            sizes.num_params,
            sizes.hidden_size,
            world_size=choice.expected_world_size,
            stage=choice.strategy.zero_stage,
            largest_param_numel=sizes.largest_param_numel,
            on_cuda=on_cuda,
        )
        ds_config = fill_deepspeed_config(
            choice.ds_template or {},
            micro_batch_size=micro_batch_size,
            gradient_accumulation_steps=gradient_accumulation_steps,
            world_size=choice.expected_world_size,
            max_grad_norm=max_grad_norm,
            precision=precision,
            zero_settings=settings,
            learning_rate=learning_rate,
            weight_decay=weight_decay,
        )
    notes = []
    if args.ddp_find_unused_parameters and strategy.engine != "ddp":
        notes.append(
            f"--ddp-find-unused-parameters: DDP's; {strategy.name} needs none "
            "(parameters the loss does not use simply get no gradient)"
        )
    state_dict_type = env.get("FSDP_STATE_DICT_TYPE")
    if strategy.uses_fsdp2 and state_dict_type:
        notes.append(
            f"accelerate config fsdp_state_dict_type={state_dict_type}: dpkit's checkpoints are "
            "its own portable layout (full fp32 weights and Adam moments) whatever the type"
        )
    return Resolution(
        strategy=choice.strategy,
        source=choice.source,
        precision=precision,
        world_size=choice.expected_world_size,
        micro_batch_size=micro_batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
        ds_config=ds_config,
        ds_config_path=choice.ds_config_path,
        ddp_kwargs={}
        if strategy.engine != "ddp"
        else {**ddp_kwargs(), "find_unused_parameters": args.ddp_find_unused_parameters},
        on_cuda=on_cuda,
        collective_timeout_s=args.collective_timeout,
        model_sizes=sizes,
        learning_rate=learning_rate,
        offload_optimizer=offload,
        notes=tuple(notes),
        fsdp_layer_classes=fsdp_layers,
        fsdp_layer_override=layer_override,
        ddp_forward_sync_buffers=buffers_need_forward_sync(model),
    )


def buffers_need_forward_sync(model: Any) -> bool:
    """Whether DDP must re-broadcast ``model``'s buffers before each forward.

    Only persistent buffers can carry state that training changes and that ranks must
    agree on (BatchNorm's running statistics). Non-persistent ones (transformers'
    ``position_ids``, ``token_type_ids``, rotary ``inv_freq``) are constants derived
    from the config, equal on every rank after DDP's init sync, and their broadcast is a
    collective that makes every forward wait for rank 0: skipping it measured 2.5%
    faster DDP steps on MiniLM, 2 CPU ranks (docs/bench.md, "DDP settings, measured").
    A model given only as a config or sizes cannot be inspected: keep DDP's default.
    """
    if not _is_module(model):
        return True
    return any(
        name not in module._non_persistent_buffers_set
        for module in model.modules()
        for name, _ in module.named_buffers(recurse=False)
    )


def fsdp_asked_by(source: str) -> str:
    """How a message names what asked for FSDP2: the flag as typed, or the launcher."""
    if source.startswith("--strategy "):
        return "--strategy=" + source.removeprefix("--strategy ")
    return source


def _is_module(model: Any) -> bool:
    import torch

    return isinstance(model, torch.nn.Module)


def scaled_learning_rate(base_lr: float, rule: str, world_size: int, accumulation: int) -> float:
    """Scale the lr with the global batch relative to one process without accumulation
    (``none``, ``linear`` or ``sqrt``)."""
    factor = world_size * accumulation
    if rule == "linear":
        return base_lr * factor
    if rule == "sqrt":
        return base_lr * math.sqrt(factor)
    return base_lr
