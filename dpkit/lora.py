"""LoRA through peft: low-rank adapters train, the pretrained weights stay frozen.

``--lora-r N`` (:class:`~dpkit.train.config.StrategyConfig`) makes :meth:`Run.apply_lora
<dpkit.train.run.Run.apply_lora>` wrap the model with ``peft.get_peft_model``: each
target layer gets a rank-N update ``alpha/r x B A`` (B starts at zero, so the wrapped
model computes what the pretrained one does), every other weight is frozen, and a
classifier's new head trains whole (peft's ``SEQ_CLS`` task keeps ``classifier``/``score``
trainable). Gradients and optimizer states then exist for the adapters only: under every
strategy the frozen weights are parameters and nothing else (DeepSpeed ZeRO partitions
only what the optimizer holds; FSDP2 shards frozen and trainable parameters of one
layer together).

Nothing here is peft reimplemented: the targets default to peft's own table for the
architecture; what this module adds is the checks a run needs before any process group
starts (a target that matches no layer, a model peft has no default for), in one line
that names the layers the model has.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from dpkit.core.params import whole_numel
from dpkit.errors import UsageError

ALL_LINEAR = "all-linear"
"""peft's value for every linear layer but the output head."""

# Layer types peft's LoRA can wrap, by class name (transformers' Conv1D is GPT-2's linear).
_ADAPTABLE = ("Linear", "Conv1D", "Embedding", "Conv2d", "Conv1d")

# peft's task types for the heads transformers' auto classes make: the classifiers' new
# heads (``classifier``, ``score``) are then trained whole, not frozen at their random init.
_TASK_TYPES = (
    ("ForSequenceClassification", "SEQ_CLS"),
    ("ForTokenClassification", "TOKEN_CLS"),
    ("ForQuestionAnswering", "QUESTION_ANS"),
    ("ForCausalLM", "CAUSAL_LM"),
    ("LMHeadModel", "CAUSAL_LM"),
)


@dataclass(frozen=True)
class LoraSettings:
    """The adapters a run asks for (``--lora-r``, ``--lora-alpha``, ``--lora-dropout``,
    ``--lora-target-modules``), checked when the flags were parsed."""

    r: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] | None = None
    """Layer names as given (None: peft's default for the architecture)."""

    @classmethod
    def from_args(cls, args: Any) -> LoraSettings | None:
        """The settings of a :class:`~dpkit.train.config.StrategyConfig`; None without ``--lora-r``."""
        return cls.from_flags(
            {
                name: getattr(args, name, None)
                for name in ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")
            }
        )

    @classmethod
    def from_flags(cls, flags: dict[str, Any]) -> LoraSettings | None:
        """The settings of a run's recorded ``StrategyConfig`` section
        (``run_config.json``); None for a run without ``--lora-r``."""
        if flags.get("lora_r") is None:
            return None
        r = int(flags["lora_r"])
        alpha = flags.get("lora_alpha")
        targets = flags.get("lora_target_modules")
        names = (
            None if targets is None else tuple(t.strip() for t in targets.split(",") if t.strip())
        )
        return cls(
            r=r,
            alpha=float(alpha) if alpha is not None else 2.0 * r,
            dropout=float(flags.get("lora_dropout") or 0.0),
            target_modules=names,
        )

    def as_dict(self) -> dict[str, Any]:
        """For ``run_info.json`` and checkpoints."""
        data = asdict(self)
        data["target_modules"] = None if self.target_modules is None else list(self.target_modules)
        return data


def is_lora_model(model: Any) -> bool:
    """Whether ``model`` (unwrapped) is a peft model (LoRA adapters or other)."""
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)


def adaptable_layer_names(model: Any) -> list[str]:
    """The last name component of every layer LoRA can wrap (sorted, each once): what
    ``--lora-target-modules`` can name."""
    return sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, module in model.named_modules()
            if name and type(module).__name__ in _ADAPTABLE
        }
    )


def task_type(model: Any) -> str | None:
    """peft's task type for a transformers model's class (None: a bare model)."""
    name = type(model).__name__
    return next((task for suffix, task in _TASK_TYPES if name.endswith(suffix)), None)


def _matches(module_name: str, target: str) -> bool:
    # peft's rule for a list of names: the whole name, or its last components.
    return module_name == target or module_name.endswith("." + target)


def target_modules(model: Any, settings: LoraSettings) -> list[str] | str:
    """The layers that get adapters: as given, or peft's default for the architecture.
    Refuses, in one line naming the layers the model has, a model peft has no default
    for and a name that matches no layer (a typo would otherwise leave a layer without
    its adapter, silently)."""
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    layers = ", ".join(adaptable_layer_names(model)) or "none"
    targets = list(settings.target_modules) if settings.target_modules is not None else None
    if targets is None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        targets = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type)
        if not targets:
            raise UsageError(
                f"--lora-r={settings.r}: peft has no default layers for "
                f"{model_type or type(model).__name__}; name them with --lora-target-modules "
                f"(its layers: {layers}; or {ALL_LINEAR})"
            )
        return list(targets)
    if targets == [ALL_LINEAR]:
        return ALL_LINEAR
    names = [name for name, _ in model.named_modules() if name]
    unmatched = [t for t in targets if not any(_matches(name, t) for name in names)]
    if unmatched:
        raise UsageError(
            f"--lora-target-modules={','.join(targets)}: {', '.join(unmatched)} matches no "
            f"layer of {type(model).__name__} (its layers: {layers}; or {ALL_LINEAR})"
        )
    return targets


def lora_config(model: Any, settings: LoraSettings) -> Any:
    """The ``peft.LoraConfig`` for ``model``: the targets checked, the task type from the
    model's head, GPT-2's transposed ``Conv1D`` layers declared as such."""
    from peft import LoraConfig

    targets = target_modules(model, settings)
    wanted = targets if isinstance(targets, list) else []
    conv1d = any(
        type(module).__name__ == "Conv1D" and any(_matches(name, t) for t in wanted)
        for name, module in model.named_modules()
    )
    return LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=targets,
        task_type=task_type(model),
        fan_in_fan_out=conv1d,
    )


def apply_lora(model: Any, settings: LoraSettings) -> Any:
    """``model`` wrapped with LoRA adapters (``peft.get_peft_model``; in place: the
    returned model shares ``model``'s weights). Works on a meta-device copy, which is
    how a run checks the flags before loading the weights. Refuses a model that already
    is a peft model."""
    from peft import get_peft_model

    if is_lora_model(model):
        raise UsageError(
            f"--lora-r={settings.r}: the model already is a peft model "
            f"({type(model).__name__}); drop --lora-r, or give the base model"
        )
    import warnings

    config = lora_config(model, settings)
    with warnings.catch_warnings():
        # peft asks transformers 5 for the deprecated is_gradient_checkpointing (its call,
        # nothing the user can change).
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        return get_peft_model(model, config)


def meta_copy_with_lora(model: Any, settings: LoraSettings) -> Any:
    """A meta-device copy of ``model`` with the adapters ``settings`` asks for, for the
    checks and sizes a run needs before any process group (ZeRO's buckets are sized to
    the trainable parameters; a resume compares parameter names). ``model`` is left as
    it is: a transformers model (or its config) is rebuilt from its config on the meta
    device; a module of one's own is copied to it."""
    import copy

    import torch

    from dpkit.models import build_meta_model

    if isinstance(model, torch.nn.Module):
        if is_lora_model(model):
            return apply_lora(model, settings)  # refuses, naming the model
        config = getattr(model, "config", None)
        if config is not None and hasattr(model, "_from_config"):
            meta = build_meta_model(config, task=type(model).__name__)
        else:
            meta = copy.deepcopy(model).to("meta")
    elif hasattr(model, "model_type"):  # a transformers config: the recipes' task heads
        meta = build_meta_model(model)
    else:
        raise UsageError(
            f"--lora-r={settings.r}: give setup the model or its transformers config "
            f"(got {type(model).__name__}), so the adapters can be placed and sized"
        )
    return apply_lora(meta, settings)


def lora_settings(model: Any) -> dict[str, Any] | None:
    """The LoRA settings a peft model carries (its active adapter's config), as
    :meth:`LoraSettings.as_dict` writes them; None for a model without LoRA. Read from
    the model, so a peft model a user built (a Trainer run) is recorded too."""
    if not is_lora_model(model):
        return None
    config = model.peft_config.get(getattr(model, "active_adapter", "default"))
    if config is None or not hasattr(config, "r"):
        return None
    targets = config.target_modules
    if targets is not None and not isinstance(targets, str):
        targets = sorted(targets)
    return {
        "r": int(config.r),
        "alpha": float(config.lora_alpha),
        "dropout": float(config.lora_dropout),
        "target_modules": targets,
    }


def frozen_and_trainable(model: Any) -> tuple[int, int]:
    """Frozen and trainable parameter elements of ``model`` (each parameter once)."""
    frozen = trainable = 0
    for param in model.parameters():
        if param.requires_grad:
            trainable += whole_numel(param)
        else:
            frozen += whole_numel(param)
    return frozen, trainable
