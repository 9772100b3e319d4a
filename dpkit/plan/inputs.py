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
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from dpkit import resources
from dpkit.errors import UsageError
from dpkit.memory.analytic import PRECISIONS
from dpkit.models import adamw_param_groups, build_meta_model, max_positions

CONFIG_DIR = resources.model_configs_dir()

# DeepSpeed's default ``stage3_param_persistence_threshold``
# (deepspeed/runtime/zero/config.py): ZeRO-3 keeps tensors smaller than this
# whole on every rank (:attr:`ModelSpec.small_tensor_params`).
PERSISTENCE_THRESHOLD = 100_000

GIB = 2**30
OPTIMIZER_CHOICES = ("adamw", "sgd", "sgd_momentum", "cpu_adam")
ATTENTION_CHOICES = ("sdpa", "eager")
ACTIVATION_METHODS = ("trace", "formula")

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


@dataclass(frozen=True)
class ModelSpec:
    """What the plan knows about the model."""

    name: str
    """As given: a bundled name, a path, a Hub name, or the ``--params`` text."""
    source: str
    """``bundled``, ``path``, ``hub``, ``count`` (a bare ``--params``), ``recipe`` (a
    config a recipe built, for ``--against``) or ``trainer`` (the live model of a
    Transformers ``Trainer`` run, recorded in its memory report)."""
    num_params: int
    """Distinct parameters, tied weights counted once."""
    config: Any = field(default=None, repr=False, compare=False)
    """The transformers config (None for a bare count): the shapes activations come from."""
    largest_layer_params: int = 0
    """Most parameters held directly by one module: the layer ZeRO-3 gathers whole (DeepSpeed's term)."""
    small_tensor_params: int = 0
    """Parameters in tensors under ZeRO-3's persistence threshold, which every rank keeps whole."""
    gated_mlp: bool = False
    """Whether the MLP is gated (SwiGLU: gate and up projections), for the formula."""
    param_groups: tuple[tuple[int, ...], ...] = ()
    """Elements of each parameter, per optimizer group of the recipes, in order: the
    layout DeepSpeed partitions (:mod:`dpkit.engines.deepspeed.layout`). Empty for a bare count."""
    param_order: tuple[tuple[int, int], ...] = ()
    """(group, index in ``param_groups``) of every parameter in the model's own order:
    backward produces their gradients roughly in reverse. Empty for a bare count."""
    param_shapes: tuple[tuple[int, ...], ...] = ()
    """The shape of every parameter in the model's own order (tied ones once): FSDP2 shards
    each on dim 0 (:mod:`dpkit.engines.fsdp2.layout`). Empty for a bare count."""
    param_units: tuple[int, ...] = ()
    """For each of ``param_shapes``, the FSDP2 unit holding it: the index of the
    transformer layer (a module of a class in the model's ``_no_split_modules``) it is
    in, or -1 for the root (embeddings, head, final norm). Empty for a bare count."""
    module_buffer_bytes: int = 0
    """Bytes of the module's own buffers (position ids, rotary frequencies), which the
    memory report counts among its buffers."""
    task: str = "causal_lm"
    """The head the model is built with for the activation trace: the transformers class
    it was built as (``BertForSequenceClassification``), or ``causal_lm`` where that is
    unknown (a bare count, a class transformers does not export)."""
    frozen_params: int = 0
    """Parameters that do not train (LoRA's frozen weights): held, with no gradient and
    no optimizer state. ``num_params`` counts the ones that train."""
    trainable: tuple[bool, ...] = ()
    """For each of ``param_shapes``, whether it trains (empty: all do)."""
    lora: dict[str, Any] | None = field(default=None, compare=False)
    """The LoRA adapters the model carries (:func:`dpkit.lora.lora_settings`), which the
    activation trace puts back on the model it builds; None without."""

    def shapes_where(self, trains: bool) -> tuple[tuple[int, ...], ...]:
        """The shapes of the parameters that train (or, ``trains=False``, that do not)."""
        if not self.trainable:
            return self.param_shapes if trains else ()
        return tuple(
            s for s, t in zip(self.param_shapes, self.trainable, strict=True) if t == trains
        )

    @property
    def has_shapes(self) -> bool:
        return self.config is not None

    def shape(self, *names: str, default: Any = None) -> Any:
        """The first of ``names`` the config defines (configs name the same shape differently)."""
        for name in names:
            value = getattr(self.config, name, None)
            if value is not None:
                return value
        return default

    @property
    def hidden_size(self) -> int | None:
        return self.shape("hidden_size", "n_embd", "d_model")

    @property
    def max_positions(self) -> int | None:
        return max_positions(self.config) if self.config is not None else None


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
            return load_model_config(name)[1], "hub"
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
    from dpkit.lora import is_lora_model, lora_settings

    lora = lora_settings(model)
    head = model.get_base_model() if is_lora_model(model) else model
    threshold = PERSISTENCE_THRESHOLD
    # parameters() yields each Parameter once, so tied weights count once
    # (dpkit.models.count_parameters keys on data_ptr, which is 0 for every meta tensor).
    params = list(model.parameters())
    largest = max(
        (sum(p.numel() for p in module.parameters(recurse=False)) for module in model.modules()),
        default=0,
    )
    if param_groups is None:
        param_groups = [group["params"] for group in adamw_param_groups(model, 0.0)]
    where = {id(p): (g, i) for g, group in enumerate(param_groups) for i, p in enumerate(group)}
    unit_of = fsdp2_units(model)
    import transformers

    # The class itself, not the task asked for: activations follow the head it really has.
    class_name = type(head).__name__
    task = class_name if hasattr(transformers, class_name) else "causal_lm"
    frozen = any(not p.requires_grad for p in params)
    return ModelSpec(
        name=name,
        source=source,
        num_params=sum(p.numel() for p in params if p.requires_grad),
        frozen_params=sum(p.numel() for p in params if not p.requires_grad),
        trainable=tuple(p.requires_grad for p in params) if frozen else (),
        lora=lora,
        config=config if config is not None else getattr(model, "config", None),
        largest_layer_params=largest,
        small_tensor_params=sum(p.numel() for p in params if p.numel() < threshold),
        gated_mlp=any("gate_proj" in n or "gate_up_proj" in n for n, _ in model.named_parameters()),
        param_groups=tuple(tuple(p.numel() for p in group) for group in param_groups),
        param_order=tuple(where[id(p)] for p in params if id(p) in where),
        param_shapes=tuple(tuple(int(d) for d in p.shape) for p in params),
        param_units=tuple(unit_of.get(id(p), -1) for p in params),
        # init_empty_weights leaves buffers real, so their sizes are known on meta too.
        module_buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        task=task,
    )


def fsdp2_units(model: Any) -> dict[int, int]:
    """``id(parameter)`` -> the index of the layer dpkit's FSDP2 makes a unit of it in, for
    the parameters inside one (the innermost where they nest); the rest belong to the
    root. The layer classes are the ones a run picks by default
    (:func:`dpkit.engines.fsdp2.shard.layer_classes`); a model without any has only the root. A
    module ``fully_shard`` already wrapped keeps its class among its bases, so a live
    model reads the same."""
    from dpkit.engines.fsdp2.shard import layer_classes

    try:
        classes = set(layer_classes(model, asked_by="dpkit plan"))
    except UsageError:  # no recognisable layers: a run would need --fsdp-layer-classes
        classes = set()
    unit_of: dict[int, int] = {}
    index = 0
    for module in model.modules():  # parents first: an inner layer overrides its parent
        if module is model or not any(c.__name__ in classes for c in type(module).__mro__):
            continue
        for param in module.parameters():
            unit_of[id(param)] = index
        index += 1
    return unit_of


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


# --- the request --------------------------------------------------------------------


@dataclass(frozen=True)
class PlanInputs:
    """A validated request: the model, the machines and the training step."""

    model: ModelSpec
    """The model to plan for."""
    gpus_per_node: int = 8
    """GPUs in each node."""
    nodes: int = 1
    """Nodes; the data-parallel world size is ``gpus_per_node * nodes``."""
    gpu_memory: int = 80 * GIB
    """Bytes of memory on each GPU."""
    precision: str = "bf16"
    """``fp32``, or ``bf16``/``fp16`` mixed precision."""
    optimizer: str = "adamw"
    """``adamw``, ``sgd``, ``sgd_momentum``, or ``cpu_adam`` (offload only)."""
    micro_batch: int = 1
    """Samples per GPU per forward."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step (ZeRO-2 holds more gradients when above 1)."""
    seq_len: int = 1024
    """Tokens per sample."""
    activation_checkpointing: bool = False
    """Recompute each layer in backward, keeping only its input."""
    attention: str = "sdpa"
    """``sdpa`` (a fused kernel on GPUs) or ``eager`` (scores materialised)."""
    activation_method: str = "trace"
    """``trace`` the model on the meta device, or the paper ``formula``."""
    reserve: int = 2 * GIB
    """Bytes per GPU for the CUDA context, NCCL and allocator slack."""
    headroom: float = 0.10
    """Share of each GPU kept free: a plan fits if its total is within the rest."""

    def __post_init__(self) -> None:
        checks = (
            ("--gpus-per-node", self.gpus_per_node, self.gpus_per_node > 0, "must be positive"),
            ("--nodes", self.nodes, self.nodes > 0, "must be positive"),
            ("--gpu-memory", self.gpu_memory, self.gpu_memory > 0, "must be positive"),
            ("--micro-batch", self.micro_batch, self.micro_batch > 0, "must be positive"),
            (
                "--gradient-accumulation-steps",
                self.gradient_accumulation_steps,
                self.gradient_accumulation_steps > 0,
                "must be positive",
            ),
            ("--seq-len", self.seq_len, self.seq_len > 0, "must be positive"),
            ("--reserve", self.reserve, self.reserve >= 0, "must not be negative"),
            ("--headroom", self.headroom, 0 <= self.headroom < 1, "must be in [0, 1)"),
            ("--precision", self.precision, self.precision in PRECISIONS, "unknown"),
            ("--optimizer", self.optimizer, self.optimizer in OPTIMIZER_CHOICES, "unknown"),
            ("--attention", self.attention, self.attention in ATTENTION_CHOICES, "unknown"),
        )
        for flag, value, ok, problem in checks:
            if not ok:
                raise UsageError(f"{flag}={value!r}: {problem}")
        positions = self.model.max_positions
        if positions is not None and self.seq_len > positions:
            raise UsageError(
                f"--seq-len={self.seq_len}: longer than the model's {positions} positions"
            )
        if self.usable <= self.reserve:
            raise UsageError(
                f"--gpu-memory={self.gpu_memory / GIB:.1f}GiB: nothing left after --reserve "
                f"and --headroom"
            )

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def usable(self) -> float:
        """Bytes per GPU a plan may use: the GPU less the headroom."""
        return self.gpu_memory * (1 - self.headroom)


# --- buffers and step temporaries ---------------------------------------------------
