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
    # ZeRO-3's, from the model's hidden size (HfTrainerDeepSpeedConfig.trainer_config_finalize).
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
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
    if offload is not None and resolved.get("zero_force_ds_cpu_optimizer", "auto") == "auto":
        # Left true (DeepSpeed's default), accelerate replaces the Trainer's optimizer with
        # a new DeepSpeedCPUAdam, in L2 mode for anything but a torch AdamW
        # (accelerate/utils/deepspeed.py, map_pytorch_optim_to_deepspeed): a silent change
        # of optimizer and weight decay. False: the Trainer's own optimizer steps the
        # host partitions, as built (as the shipped zero2_offload.json says).
        resolved["zero_force_ds_cpu_optimizer"] = False
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


def trainer_refusal(model: Any = None, optimizer: Any = None) -> str | None:
    """What a Trainer run under DeepSpeed must not train with, as one line; None: nothing.

    ``model`` (the one handed to the ``Trainer``, before it is prepared): under ZeRO-3 a
    model built before ``TrainingArguments(deepspeed=...)`` was loaded whole on every rank
    (transformers builds it under ``deepspeed.zero.Init``, partitioned as it loads, only
    once the arguments exist: ``HfDeepSpeedConfig``); DeepSpeed would partition it only
    at ``prepare``, after every rank held it whole.

    ``optimizer`` (prepared): DeepSpeed's CPU Adam in L2 mode with weight decay, which
    accelerate builds in place of any Trainer optimizer but a torch ``AdamW`` when the
    config offloads the optimizer with ``zero_force_ds_cpu_optimizer`` true: the decay
    is added to the gradient, not decoupled (docs/offload.md, the optimizer trap).
    """
    if model is not None:
        from transformers.integrations import is_deepspeed_zero3_enabled

        whole = [name for name, p in model.named_parameters() if getattr(p, "ds_id", None) is None]
        if is_deepspeed_zero3_enabled() and whole:
            return (
                f"ZeRO-3: the Trainer's model was loaded whole on every rank ({whole[0]} is "
                "not partitioned): create TrainingArguments(deepspeed=...) before "
                "from_pretrained, so that it loads partitioned under deepspeed.zero.Init"
            )
    if optimizer is not None:
        from dpkit.engines.deepspeed.memory import zero_optimizer

        inner = getattr(zero_optimizer(optimizer), "optimizer", None)
        decays = [g.get("weight_decay", 0) for g in getattr(inner, "param_groups", [])]
        l2_mode = getattr(inner, "adam_w_mode", True) is False
        if type(inner).__name__ == "DeepSpeedCPUAdam" and l2_mode and any(decays):
            return (
                f"offload_optimizer: the Trainer's optimizer runs as DeepSpeedCPUAdam in L2 "
                f"mode (adamw_mode=False) with weight_decay={max(decays)}: the decay is not "
                "decoupled as in AdamW; set zero_force_ds_cpu_optimizer: false in the "
                "DeepSpeed config (the Trainer's own optimizer then runs as built), or "
                "optim='adamw_torch'"
            )
    return None


def start_comm_for_zero3(config: str | Mapping[str, Any]) -> bool:
    """Start DeepSpeed's comm (gloo) now when ``config`` is ZeRO-3; whether it did.

    Under ZeRO-3 ``from_pretrained`` builds the model under ``deepspeed.zero.Init``, which
    reads the world size from DeepSpeed's comm. On CUDA the Trainer's arguments start it
    (accelerate's ``PartialState``, DeepSpeed path); on CPU, ``use_cpu=True`` starts
    torch's group only, and zero.Init sizes the batch for one rank (measured: DeepSpeed's
    ``train_batch_size ... 16 != 8 * 1 * 1`` inside ``from_pretrained``). Started here,
    before ``TrainingArguments``, accelerate takes the group as it finds it.
    """
    resolved, where = _read_config(config)
    if zero_stage_of(resolved, where) != 3:
        return False
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    return True
