"""DeepSpeed JSON: read and checked (one-line errors), then resolved in one pass.

A template (``ds_configs/zero2.json``, or the user's own) may leave values
``"auto"`` or out altogether; :func:`fill_deepspeed_config` resolves all of them
at once from the run's own settings, so that:

* the batch identity holds by construction:
  ``train_batch_size = micro_batch x gradient_accumulation x world_size``;
* clipping, precision and a JSON optimizer's lr/decay are the run's;
* the ZeRO memory settings (buckets, ``contiguous_gradients``, ``overlap_comm``...)
  are sized to the model (:mod:`dpkit.engines.deepspeed.settings`) where the JSON leaves them
  ``"auto"`` or out; a value the user wrote stays.

A value the user wrote that contradicts the run is refused, naming both.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Mapping
from typing import Any

from dpkit.engines.deepspeed.settings import fill_zero_settings
from dpkit.errors import UsageError


class _DuplicateKeyError(ValueError):
    pass


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    """``json`` keeps the last of two equal keys; DeepSpeed would see one value of two."""
    config: dict = {}
    for key, value in pairs:
        if key in config:
            raise _DuplicateKeyError(
                f"{key}={json.dumps(config[key])} and {key}={json.dumps(value)}: "
                "the key is given twice; keep one"
            )
        config[key] = value
    return config


def read_ds_config(path: str) -> dict:
    """The JSON as written, refused (one line) if it is malformed or has a key DeepSpeed
    would ignore or reject (:mod:`dpkit.engines.deepspeed.config_keys`)."""
    from dpkit.engines.deepspeed.config_keys import check_ds_config_keys

    where = f"deepspeed config {path!r}"
    try:
        with open(path) as f:
            config = json.load(f, object_pairs_hook=_refuse_duplicate_keys)
    except FileNotFoundError:
        raise UsageError(f"{where}: no such file") from None
    except json.JSONDecodeError as err:
        raise UsageError(f"{where}: not valid JSON ({err})") from None
    except _DuplicateKeyError as err:
        raise UsageError(f"{where}: {err}") from None
    if not isinstance(config, dict):
        raise UsageError(f"{where}: must be a JSON object")
    check_ds_config_keys(config, where)
    return config


def zero_stage_of(config: Mapping, path: str) -> int:
    """``zero_optimization.stage``; dpkit runs stages 1, 2 and 3."""
    zero = config.get("zero_optimization", {})
    stage = zero.get("stage") if isinstance(zero, dict) else None
    if isinstance(stage, bool) or stage not in (1, 2, 3):
        raise UsageError(
            f"deepspeed config {path!r}: zero_optimization.stage={stage!r}; dpkit supports 1, 2 and 3"
        )
    return stage


def optimizer_offload(config: Mapping, path: str) -> str | None:
    """Where ZeRO keeps optimizer state and master weights: ``cpu``, or None on the
    device. Offload that DeepSpeed would not run as written is refused: under ZeRO-1/2 it
    runs an NVMe ``offload_optimizer`` as CPU offload without a word (NVMe is ZeRO-3's)
    and ignores ``offload_param`` (ZeRO-3's too). Under ZeRO-3 dpkit runs both offloads
    to the CPU together (``zero3_offload``) or neither (``zero3``): one alone, or NVMe,
    is refused with the field named (:func:`param_offload`)."""
    zero = config.get("zero_optimization", {})
    stage = zero.get("stage")
    where = f"deepspeed config {path!r}"
    param = (zero.get("offload_param") or {}).get("device", "none")
    if param not in (None, "none") and stage in (1, 2):
        raise UsageError(
            f"{where}: zero_optimization.offload_param.device={param!r}: parameter offload is "
            f"ZeRO-3's; under ZeRO-{stage} DeepSpeed ignores it"
        )
    device = (zero.get("offload_optimizer") or {}).get("device", "none")
    if device == "nvme" and stage in (1, 2):
        raise UsageError(
            f"{where}: zero_optimization.offload_optimizer.device='nvme': DeepSpeed offloads to "
            f"NVMe only under ZeRO-3; under ZeRO-{stage} it would run as CPU offload; use 'cpu'"
        )
    if device in (None, "none") and zero.get("cpu_offload") is True:
        device = "cpu"  # the older spelling of offload_optimizer.device = cpu
    device = None if device in (None, "none") else device
    if stage == 3:
        _check_zero3_offload(device, param_offload(config), where)
    return device


def param_offload(config: Mapping) -> str | None:
    """Where ZeRO-3 keeps its parameter partitions between uses (``offload_param.device``:
    ``cpu``), or None on the device."""
    zero = config.get("zero_optimization", {})
    device = (zero.get("offload_param") or {}).get("device", "none")
    return None if device in (None, "none") else device


def _check_zero3_offload(optimizer: str | None, param: str | None, where: str) -> None:
    """ZeRO-3 offload as dpkit runs it: both to the CPU, or neither. With the optimizer
    alone offloaded the parameter partitions and the gathered model stay on the device,
    a layout the plan and the memory walk do not model (and with parameters alone,
    DeepSpeed steps a device optimizer on host-resident partitions); NVMe swapping is
    untried."""
    for field, device in (("offload_optimizer", optimizer), ("offload_param", param)):
        if device not in (None, "cpu"):
            raise UsageError(
                f"{where}: zero_optimization.{field}.device={device!r}: dpkit runs ZeRO-3 "
                "offload to 'cpu' only"
            )
    if (optimizer is None) != (param is None):
        given, missing = (
            ("offload_optimizer", "offload_param")
            if param is None
            else ("offload_param", "offload_optimizer")
        )
        raise UsageError(
            f"{where}: zero_optimization.{missing} missing beside {given}: dpkit runs ZeRO-3 "
            f"with both offloaded to the CPU (zero3_offload) or neither (zero3); add "
            f'{missing}: {{"device": "cpu"}} or drop {given}'
        )


def _set_if_auto(config: dict, key: str, value: Any, where: str, why: str = "") -> None:
    """Fill ``"auto"`` (or a missing key); a value the user wrote must equal the run's."""
    current = config.get(key, "auto")
    if current == "auto":
        config[key] = value
    elif current != value:
        raise UsageError(
            f"deepspeed config {where}{key}={current!r} disagrees with the recipe's {value!r}"
            f'{why}: set it to "auto" or change the recipe flag'
        )


def fill_deepspeed_config(
    template: Mapping,
    *,
    micro_batch_size: int,
    gradient_accumulation_steps: int,
    world_size: int,
    max_grad_norm: float,
    precision: str,
    zero_settings: Mapping[str, Any],
    learning_rate: float | None = None,
    weight_decay: float | None = None,
) -> dict:
    """The template with every ``"auto"`` resolved; the template itself is not modified.

    Args:
        template: the JSON as read (:func:`read_ds_config`).
        micro_batch_size, gradient_accumulation_steps, world_size: the run's batch layout.
        max_grad_norm: DeepSpeed's ``gradient_clipping`` (it clips inside its step; 0: off).
        precision: ``no``, ``bf16`` or ``fp16`` (accelerate's names).
        zero_settings: the model-sized ``zero_optimization`` values
            (:func:`dpkit.engines.deepspeed.settings.zero_memory_settings`), applied where the
            template leaves a key of :data:`ZERO_MEMORY_KEYS` out or ``"auto"``.
        learning_rate, weight_decay: for a JSON ``optimizer`` section that leaves them
            ``"auto"`` (None: such a section is refused, there is nothing to fill it with).
    """
    config = copy.deepcopy(dict(template))
    _set_if_auto(config, "train_micro_batch_size_per_gpu", micro_batch_size, "")
    _set_if_auto(config, "gradient_accumulation_steps", gradient_accumulation_steps, "")
    _set_if_auto(
        config,
        "train_batch_size",
        micro_batch_size * gradient_accumulation_steps * world_size,
        "",
        f" (micro_batch {micro_batch_size} x accumulation {gradient_accumulation_steps} "
        f"x world_size {world_size})",
    )
    _set_if_auto(config, "gradient_clipping", float(max_grad_norm), "")
    for name in ("bf16", "fp16"):
        section = config.setdefault(name, {})
        _set_if_auto(section, "enabled", precision == name, f"{name}.")
        if not section["enabled"]:
            # DeepSpeed reads fp16's loss-scaling keys only when fp16 is on.
            config[name] = {"enabled": False}

    # Left out or "auto": sized to the model, not DeepSpeed's 5e8-element defaults (1.9 GiB
    # per bucket in fp32; dpkit.engines.deepspeed.settings.REASONS).
    fill_zero_settings(config.setdefault("zero_optimization", {}), zero_settings)

    params = config.get("optimizer", {}).get("params")
    if isinstance(params, dict):
        for key, value in (("lr", learning_rate), ("weight_decay", weight_decay)):
            if key in params and value is not None:
                _set_if_auto(params, key, value, "optimizer.params.")

    leftover = [path for path, value in config_leaves(config) if value == "auto"]
    if leftover:
        raise UsageError(f'deepspeed config: dpkit cannot fill {", ".join(leftover)}="auto"')
    return config


def config_leaves(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every leaf of a (nested) config as (dotted path, value)."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from config_leaves(value, f"{prefix}{key}.")
    else:
        yield prefix.rstrip("."), node


def skip_deepspeed_cpu_shm_op() -> None:
    """Keep DeepSpeed's CPU backend from building and mapping its shared-memory all-reduce.

    Training never calls it (only ``inference_all_reduce`` does), yet under the
    ``deepspeed`` launcher it JIT-compiles a C++ op on first use and writes a 66 MB
    ``/dev/shm/deepspeed_allreduce_buffer_*`` segment per rank that it never unlinks.
    Measured here: leaked segments filled a 24 GiB machine's RAM, a rank was killed
    while holding the compile lock, and every later DeepSpeed run hung in its init.
    Call before DeepSpeed's comm backend starts.
    """
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        # DeepSpeed's own switch: an op marked incompatible is never built or loaded.
        deepspeed.ops.__compatible_ops__[builder.NAME] = False
