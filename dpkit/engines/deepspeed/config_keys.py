"""Unknown keys in a DeepSpeed JSON, refused before anything starts.

DeepSpeed ignores a top-level key it does not read: a misspelled
``train_batch_sze`` is dropped without a word. Inside its pydantic-validated
sections (``zero_optimization``, ``fp16``, ...) an unknown key is an error, but
only once the engine starts, after the process group is up. Both are found here
from DeepSpeed's own definitions, so the known keys follow the installed version:

* top-level keys, and the keys of plain sections (``optimizer``, ``scheduler``,
  ``flops_profiler``, ...): the ones ``DeepSpeedConfig`` reads while it parses a
  probe config, recorded by a dict that notes every lookup;
* keys of a pydantic section: its model's field names and aliases, nested models
  (``zero_optimization.offload_optimizer``) included.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import json
import logging
import typing
from collections.abc import KeysView
from typing import Any

from dpkit.errors import UsageError

logger = logging.getLogger(__name__)

# Sections DeepSpeed validates with a pydantic model: (section, module, model).
# The monitor sections (tensorboard, wandb, ...) come from DeepSpeedMonitorConfig's fields.
PYDANTIC_SECTIONS = (
    ("zero_optimization", "deepspeed.runtime.zero.config", "DeepSpeedZeroConfig"),
    ("fp16", "deepspeed.runtime.precision_config", "DeepSpeedFP16Config"),
    ("bf16", "deepspeed.runtime.precision_config", "DeepSpeedBF16Config"),
    ("bfloat16", "deepspeed.runtime.precision_config", "DeepSpeedBF16Config"),
    ("comms_logger", "deepspeed.comm.config", "CommsLoggerConfig"),
    ("compile", "deepspeed.compile.config", "CompileConfig"),
    ("hybrid_engine", "deepspeed.runtime.config", "HybridEngineConfig"),
    ("tensor_parallel", "deepspeed.runtime.tensor_parallel.config", "TPTrainingConfig"),
)
MONITOR_MODEL = ("deepspeed.monitor.config", "DeepSpeedMonitorConfig")


class _ReadRecorder(dict):
    """A dict that notes the keys looked up in it; reading the whole dict counts every key."""

    def __init__(self, data: dict, read: set[str]):
        super().__init__(data)
        self.read = read  # shared with shallow copies (DeepSpeedConfig copies its input)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)

    def keys(self):
        return KeysView(self)  # `key in d.keys()` goes through __contains__

    def _read_all(self) -> None:
        self.read.update(dict.keys(self))

    def __iter__(self):
        self._read_all()
        return super().__iter__()

    def items(self):
        self._read_all()
        return super().items()

    def values(self):
        self._read_all()
        return super().values()


def _keys_read(section: str | None = None, value: dict | None = None) -> set[str] | None:
    """Keys ``DeepSpeedConfig`` looks up at the top level, or in ``section`` holding ``value``.

    ``None`` when DeepSpeed cannot parse the probe (then DeepSpeed itself reports
    the section when the engine starts).
    """
    from deepspeed.runtime.config import DeepSpeedConfig

    read: set[str] = set()
    if section is None:
        probe: dict = _ReadRecorder({"train_batch_size": 1}, read)
    else:
        probe = {"train_batch_size": 1, section: _ReadRecorder(value or {}, read)}
    try:
        DeepSpeedConfig(probe)
    except Exception:  # any parse failure of DeepSpeed's: no verdict from the probe
        return None
    return read


@functools.lru_cache(maxsize=1)
def top_level_keys() -> frozenset[str] | None:
    """``None`` if this DeepSpeed cannot parse the probe: then top-level keys go unchecked
    (a test holds this for the installed version) rather than valid configs refused."""
    keys = _keys_read()
    if keys is None:
        logger.warning("dpkit: cannot probe DeepSpeedConfig; top-level keys not checked")
        return None
    return frozenset(keys)


@functools.lru_cache(maxsize=1)
def _removed_top_level_keys() -> dict[str, str]:
    """Keys DeepSpeed refuses at engine start because the feature was removed, with its reason."""
    module = importlib.import_module("deepspeed.runtime.config")
    return dict(getattr(module, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {}))


def _nested_model(annotation: Any) -> type | None:
    """The pydantic model inside an annotation such as ``Optional[OffloadConfig]``."""
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    models = {m for arg in typing.get_args(annotation) if (m := _nested_model(arg)) is not None}
    return models.pop() if len(models) == 1 else None


@functools.cache
def model_keys(model: type) -> dict[str, type | None]:
    """Field names and aliases a pydantic model accepts, each with its nested model if any."""
    keys: dict[str, type | None] = {}
    for name, info in model.model_fields.items():
        nested = _nested_model(info.annotation)
        for key in (name, info.alias, info.validation_alias):
            if isinstance(key, str):
                keys[key] = nested
    return keys


@functools.lru_cache(maxsize=1)
def pydantic_sections() -> dict[str, type]:
    sections: dict[str, type] = {}
    for section, module_name, model_name in PYDANTIC_SECTIONS:
        try:
            model = getattr(importlib.import_module(module_name), model_name, None)
        except ImportError:
            model = None
        if model is not None:
            sections[section] = model
    monitor = getattr(importlib.import_module(MONITOR_MODEL[0]), MONITOR_MODEL[1], None)
    if monitor is not None:
        for section, nested in model_keys(monitor).items():
            if nested is not None:
                sections[section] = nested
    return sections


def _show(value: Any) -> str:
    """A value as the JSON the user wrote, short."""
    text = json.dumps(value)
    if len(text) <= 40:
        return text
    return {dict: "{...}", list: "[...]"}.get(type(value), text[:37] + "...")


def _unknown(where: str, key_path: str, value: Any, known, what: str) -> UsageError:
    parent, _, key = key_path.rpartition(".")
    close = difflib.get_close_matches(key, sorted(known), n=1)
    hint = f"; did you mean {parent + '.' if parent else ''}{close[0]}?" if close else ""
    return UsageError(f"{where}: {key_path}={_show(value)}: {what}{hint}")


def _check_model_section(where: str, path: str, value: Any, model: type) -> None:
    if not isinstance(value, dict):
        raise UsageError(f"{where}: {path}={_show(value)}: must be a JSON object")
    known = model_keys(model)
    for key, sub_value in value.items():
        if key not in known:
            raise _unknown(where, f"{path}.{key}", sub_value, known, f"not a key of {path}")
        nested = known[key]
        if nested is not None and isinstance(sub_value, dict):
            _check_model_section(where, f"{path}.{key}", sub_value, nested)


def check_ds_config_keys(config: dict, where: str) -> None:
    """Refuse any key, at any level DeepSpeed defines, that DeepSpeed would ignore or reject.

    ``where`` starts the message (``deepspeed config 'path'``); the message names
    the key path and its value and suggests the closest known key.
    """
    known_top = top_level_keys()
    removed = _removed_top_level_keys()
    sections = pydantic_sections()
    for key, value in config.items():
        if key in removed:
            raise UsageError(f"{where}: {key}={_show(value)}: {removed[key].split('. ')[0]}")
        if known_top is not None and key not in known_top:
            raise _unknown(
                where,
                key,
                value,
                known_top,
                "not a DeepSpeed key (DeepSpeed would silently ignore it)",
            )
        if key in sections:
            _check_model_section(where, key, value, sections[key])
        elif isinstance(value, dict) and value:
            read = _keys_read(key, value)
            for sub_key, sub_value in value.items():
                if read is not None and sub_key not in read:
                    raise _unknown(
                        where, f"{key}.{sub_key}", sub_value, read, f"not a key of {key}"
                    )
