"""The inputs of ``dpkit plan``: parsed flag values, and the model built on the meta device.

Split from :mod:`dpkit.plan` so that the parsing of sizes and counts and the
loading of a model (a bundled config, a local ``config.json`` or a Hub name,
its parameters counted on the meta device) each live in one small module that
:mod:`dpkit.plan` and :mod:`dpkit.activations` both use. transformers and
accelerate are imported inside the functions that need them, so importing
this module stays cheap (``dpkit plan --help``).
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpkit.errors import UsageError
from dpkit.models import adamw_param_groups, max_positions

CONFIG_DIR = Path(__file__).parent / "configs"

# DeepSpeed's default ``stage3_param_persistence_threshold``
# (deepspeed/runtime/zero/config.py): ZeRO-3 keeps tensors smaller than this
# whole on every rank (:attr:`ModelSpec.small_tensor_params`).
PERSISTENCE_THRESHOLD = 100_000

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


def _positive_int(text: Any, flag: str) -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        raise UsageError(f"{flag}={text!r}: not a whole number") from None
    if value <= 0:
        raise UsageError(f"{flag}={text!r}: must be positive")
    return value


def _fraction(text: Any, flag: str) -> float:
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


def _first_line(err: BaseException) -> str:
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
    """``bundled``, ``path``, ``hub``, ``count`` (a bare ``--params``) or ``recipe`` (a
    config a recipe built, for ``--against``)."""
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
    layout DeepSpeed partitions (:mod:`dpkit.zero_layout`). Empty for a bare count."""
    param_order: tuple[tuple[int, int], ...] = ()
    """(group, index in ``param_groups``) of every parameter in the model's own order:
    backward produces their gradients roughly in reverse. Empty for a bare count."""

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
        raise UsageError(f"--model={name!r}: cannot read its config ({_first_line(err)})") from None


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence transformers' warnings (config nits, loss-type notes): the plan's
    stderr is for its own one-line errors."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


def build_meta_model(
    config: Any, attn_implementation: str | None = None, task: str = "causal_lm"
) -> Any:
    """The model for ``config`` on the meta device: shapes and code, no memory, no weights.

    ``task`` picks the head: ``causal_lm`` (the bare model where the config has no
    causal-LM class) or ``sequence_classification`` (``recipes/finetune.py``'s model).
    """
    from accelerate import init_empty_weights
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with _quiet_transformers(), init_empty_weights():
        if task == "sequence_classification":
            model = AutoModelForSequenceClassification.from_config(config, **kwargs)
        else:
            try:
                model = AutoModelForCausalLM.from_config(config, **kwargs)
            except ValueError:  # not a causal LM (an encoder, say): the bare model
                model = AutoModel.from_config(config, **kwargs)
    # init_empty_weights re-registers every parameter on the meta device, which
    # leaves transformers 5's tied weights untied (GPT-2 would count 163M, not
    # 124M); tying again restores what a real load does (and honours
    # tie_word_embeddings=False).
    model.tie_weights()
    return model


def load_model(name: str, task: str = "causal_lm") -> ModelSpec:
    """Resolve ``--model`` and count its parameters on the meta device (``task``: see
    :func:`build_meta_model`)."""
    config, source = _load_config(name)
    return spec_from_config(name, source, config, task)


def spec_from_config(name: str, source: str, config: Any, task: str = "causal_lm") -> ModelSpec:
    """The :class:`ModelSpec` of ``config``, built on the meta device."""
    try:
        model = build_meta_model(config, task=task)
    except Exception as err:  # any model class may refuse a config; say which and why
        raise UsageError(
            f"--model={name!r}: cannot build it from its config ({_first_line(err)})"
        ) from None
    threshold = PERSISTENCE_THRESHOLD
    # parameters() yields each Parameter once, so tied weights count once
    # (dpkit.models.count_parameters keys on data_ptr, which is 0 for every meta tensor).
    params = list(model.parameters())
    largest = max(
        (sum(p.numel() for p in module.parameters(recurse=False)) for module in model.modules()),
        default=0,
    )
    groups = [group["params"] for group in adamw_param_groups(model, 0.0)]
    where = {id(p): (g, i) for g, group in enumerate(groups) for i, p in enumerate(group)}
    return ModelSpec(
        name=name,
        source=source,
        num_params=sum(p.numel() for p in params),
        config=config,
        largest_layer_params=largest,
        small_tensor_params=sum(p.numel() for p in params if p.numel() < threshold),
        gated_mlp=any("gate_proj" in n or "gate_up_proj" in n for n, _ in model.named_parameters()),
        param_groups=tuple(tuple(p.numel() for p in group) for group in groups),
        param_order=tuple(where[id(p)] for p in params if id(p) in where),
    )
