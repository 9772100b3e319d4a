"""The DeepSpeed config a Transformers ``Trainer`` run gets from dpkit: ZeRO's bucket and
gradient-layout keys filled as dpkit's recipes run them, the rest left to the Trainer
(:func:`dpkit.integrations.transformers.deepspeed_config` is the public front)."""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any

from dpkit import resources
from dpkit.engines.deepspeed.config import (
    config_leaves,
    optimizer_offload,
    read_ds_config,
    skip_deepspeed_cpu_shm_op,
    zero_stage_of,
)
from dpkit.engines.deepspeed.config_keys import check_ds_config_keys
from dpkit.engines.deepspeed.settings import fill_zero_settings, zero_memory_settings
from dpkit.errors import UsageError

logger = logging.getLogger("dpkit.integrations.transformers")

# What the Trainer (transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig) or
# accelerate fills in a DeepSpeed config: deepspeed_config() leaves these "auto".
TRAINER_FILLS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "bf16.enabled",
    "fp16.enabled",
    "optimizer.params.",
    "scheduler.params.",
)


def _read_config(config: str | Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """The config as a new dict, and what to call it in an error; a path is found as
    :func:`dpkit.config_files.find_config` finds it (here, or a shipped config's name),
    a missing one refused naming ``deepspeed_config(config=...)``."""
    if isinstance(config, Mapping):
        where = "<dict>"
        resolved = copy.deepcopy(dict(config))
        # The start of the message, as read_ds_config gives it for a file.
        check_ds_config_keys(resolved, f"deepspeed config {where!r}")
        return resolved, where
    from dpkit.config_files import find_config

    shipped = isinstance(config, str) and resources.deepspeed_config(config).is_file()
    path = str(resources.deepspeed_config(config)) if shipped else str(config)
    if not shipped:
        found = find_config(path, "deepspeed_config(config=...)")
        if found.note:
            logger.info("dpkit: %s", found.note)
        path = found.path
    return read_ds_config(path), path


def trainer_config(
    sizes: Any, config: str | Mapping[str, Any], *, world_size: int, on_cuda: bool
) -> dict[str, Any]:
    """``config`` (a shipped name, a JSON path or a dict) resolved for the Trainer at
    ``world_size`` ranks, for a model of ``sizes`` (:class:`dpkit.models.ModelSizes`)."""
    resolved, where = _read_config(config)
    stage = zero_stage_of(resolved, where)
    if stage == 3:
        # The Trainer builds a ZeRO-3 model under zero.Init only when TrainingArguments
        # exist before from_pretrained; dpkit's callback has not been checked on it.
        raise UsageError(
            f"deepspeed config {where!r}: zero_optimization.stage=3: dpkit's Trainer "
            "integration runs ZeRO stages 1 and 2 (ZeRO-3 runs in dpkit's recipes and "
            "run.prepare)"
        )
    offload = optimizer_offload(resolved, where)
    settings = zero_memory_settings(
        sizes.num_params,
        sizes.hidden_size,
        world_size=world_size,
        stage=stage,
        largest_param_numel=sizes.largest_param_numel,
        on_cuda=on_cuda,
        offload=offload is not None,
    )
    fill_zero_settings(resolved["zero_optimization"], settings)
    leftover = [
        path
        for path, value in config_leaves(resolved)
        if value == "auto" and not any(path.startswith(fill) for fill in TRAINER_FILLS)
    ]
    if leftover:
        raise UsageError(
            f"deepspeed config {where!r}: "
            f'{", ".join(leftover)}="auto": neither dpkit nor the Trainer fills it'
        )
    # Before TrainingArguments starts DeepSpeed's comm backend: on CPU it would otherwise
    # build and leak a shared-memory all-reduce op that training never uses.
    skip_deepspeed_cpu_shm_op()
    return resolved
