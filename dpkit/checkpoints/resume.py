"""Resuming: which checkpoint ``--resume`` names, whether this run can continue it, and what carries over."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

from dpkit.checkpoints.folder import CHECKPOINTS, TrainerState, list_checkpoints, verify_checkpoint
from dpkit.errors import UsageError

LORA_ADAPTER_CONFIG = "adapter_config.json"
"""peft's adapter folder marker: a checkpoint with it trained LoRA adapters."""


class Resume(NamedTuple):
    """A checkpoint to continue from, verified (:func:`find_resume`)."""

    path: Path
    state: TrainerState

    def check(
        self, *, global_batch_size: int, model: Any = None, model_name: str | None = None
    ) -> None:
        """Refuse what cannot be carried over (:func:`check_resumable`) or is not the
        checkpoint's model (:func:`check_same_model`)."""
        check_resumable(self.state, self.path, global_batch_size=global_batch_size)
        check_same_model(self.state, self.path, model=model, model_name=model_name)

    @property
    def is_lora(self) -> bool:
        """Whether the checkpoint trained LoRA adapters (it holds peft's adapter folder)."""
        return (self.path / LORA_ADAPTER_CONFIG).is_file()

    def weights_from(self, model_path: str | Path) -> str | Path:
        """What a script loads with ``from_pretrained`` before :meth:`Run.prepare
        <dpkit.train.run.Run.prepare>` restores every weight of the checkpoint: the
        checkpoint folder itself for a full checkpoint (a model folder), else
        ``model_path``, the model it was trained from (a sharded checkpoint is no model
        folder; for LoRA, ``run.apply_lora`` adds the adapters), which the restore
        overwrites."""
        from dpkit.core.shards import is_sharded

        return model_path if self.is_lora or is_sharded(self.path) else self.path


def find_resume(resume: str | None, output_dir: str) -> Resume | None:
    """``--resume``: ``latest`` (must exist), ``auto`` (latest if any, else a fresh
    start), or a checkpoint folder. Checked completely (manifest, sizes, hashes)
    before any process group starts."""
    if resume is None:
        return None
    if resume in ("latest", "auto"):
        found = list_checkpoints(output_dir)
        if not found:
            if resume == "auto":
                return None
            raise UsageError(
                f"--resume=latest: no checkpoint under {str(Path(output_dir) / CHECKPOINTS)!r} "
                "(use --resume auto to start fresh when there is none)"
            )
        path = found[-1]
    else:
        path = Path(resume)
    return Resume(path, verify_checkpoint(path))


def check_resumable(state: TrainerState, path: Path, *, global_batch_size: int) -> None:
    """Refuse what cannot be carried over, before any process group starts."""
    if state.global_batch_size != global_batch_size:
        raise UsageError(
            f"--resume={str(path)!r}: written with global batch {state.global_batch_size}, this "
            f"run's is {global_batch_size}; keep the global batch (micro batch x accumulation x "
            "processes) so the data position and the schedule carry over"
        )


def carry_over_note(state: TrainerState, *, strategy: str, world_size: int) -> str:
    """One line: what a resume carries over, and what it cannot."""
    parts = [f"resuming from {state.describe()}, as {strategy} on {world_size} process(es)"]
    parts.append("weights, optimizer moments, lr schedule and data position carried over")
    if state.world_size != world_size:
        parts.append(
            f"RNG streams not restored ({state.world_size} -> {world_size} ranks: dropout "
            "masks differ from an uninterrupted run)"
        )
    return "; ".join(parts)


def model_name(model: Any, configs: tuple[Any, ...] = ()) -> str | None:
    """What a run trains from, as the user named it: a flag dataclass's ``model`` field
    (the recipes' ``--model``), else the name ``from_pretrained`` was given (the model's
    config ``name_or_path``); a dpkit checkpoint folder stands for the model it was
    trained from. None when neither says."""
    named = next(
        (cfg.model for cfg in configs if isinstance(getattr(cfg, "model", None), str)), None
    )
    if named is None:
        config = getattr(model, "config", model)
        named = getattr(config, "name_or_path", None) or None
    if named is not None and (Path(named) / "trainer_state.json").is_file():
        state = json.loads((Path(named) / "trainer_state.json").read_text())
        return state.get("model")
    return named


def _same_name(recorded: str, current: str) -> bool:
    if recorded == current:
        return True
    # One folder named two ways (relative, absolute, a symlink).
    return (
        Path(recorded).is_dir()
        and Path(current).is_dir()
        and (Path(recorded).resolve() == Path(current).resolve())
    )


def _labels(config: dict[str, Any]) -> list[str] | None:
    id2label = config.get("id2label")
    if not isinstance(id2label, dict):
        return None
    return [str(id2label[k]) for k in sorted(id2label, key=int)]


def _config_dict(model: Any) -> dict[str, Any] | None:
    config = getattr(model, "config", model)
    to_dict = getattr(config, "to_dict", None)
    return to_dict() if callable(to_dict) else None


def saved_shapes(path: Path) -> dict[str, list[int]]:
    """name -> shape of every tensor a checkpoint saved: a sharded one's index, or the
    full one's safetensors header (nothing loaded either way)."""
    from dpkit.core.shards import TensorIndex, is_sharded

    if is_sharded(path):
        return TensorIndex.read(path).shapes
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as saved_file:
        names = saved_file.keys()  # noqa: SIM118 (safe_open is not iterable)
        return {name: list(saved_file.get_slice(name).get_shape()) for name in names}


def _shape_differences(path: Path, model: Any) -> list[str]:
    """Where the checkpoint's saved tensors and ``model``'s parameters disagree: names
    one has and the other lacks, shapes that differ (read from the safetensors header,
    nothing loaded). Tied parameters count once, under any of their names."""
    saved = saved_shapes(path)
    aliases: dict[int, list[str]] = {}
    shapes: dict[int, list[int]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
        shapes[id(param)] = list(param.shape)
    known = {name for names in aliases.values() for name in names}
    known |= {name for name, _ in model.named_buffers(remove_duplicate=False)}
    differences = []
    for key, names in aliases.items():
        found = next((n for n in names if n in saved), None)
        if found is None:
            differences.append(f"{names[0]} is not in the checkpoint")
        elif saved[found] != shapes[key]:
            differences.append(
                f"{found} is {saved[found]} in the checkpoint, {shapes[key]} in this model"
            )
    differences += [f"{name} is not in this model" for name in saved if name not in known]
    return differences


def _check_same_lora(path: Path, model: Any, where: str) -> None:
    """A LoRA checkpoint resumes into a LoRA run of the same rank and layers, a full one
    into a full run."""
    from dpkit.lora import is_lora_model, lora_settings

    adapter_file = path / LORA_ADAPTER_CONFIG
    saved = json.loads(adapter_file.read_text()) if adapter_file.is_file() else None
    run = lora_settings(model) if is_lora_model(model) else None
    if saved is None and run is None:
        return
    if saved is None:
        raise UsageError(
            f"{where}: the checkpoint trained the whole model, this run LoRA adapters "
            f"(--lora-r={run['r']}); resume without --lora-r"
        )
    saved_text = (
        f"LoRA r={saved.get('r')} on {', '.join(sorted(saved.get('target_modules') or []))}"
    )
    if run is None:
        raise UsageError(
            f"{where}: the checkpoint trained {saved_text}, this run the whole model; resume "
            f"with --lora-r={saved.get('r')}"
        )
    run_targets = run["target_modules"]
    run_text = f"LoRA r={run['r']} on {', '.join(run_targets or []) if not isinstance(run_targets, str) else run_targets}"
    if saved_text != run_text:
        raise UsageError(f"{where}: the checkpoint trained {saved_text}, this run {run_text}")


def check_same_model(
    state: TrainerState, path: Path, *, model: Any = None, model_name: str | None = None
) -> None:
    """Refuse, before any process group, a resume into another model: another name than
    the checkpoint was trained from (a resume trains the checkpoint's weights, whatever
    the run names), another label set, other parameter names or shapes. Each message
    names both sides.

    Args:
        model: the run's model (a module, possibly on the meta device, or its config).
        model_name: what the run names its model (:func:`model_name`).
    """
    from dpkit.core.shards import is_sharded

    where = f"--resume={str(path)!r}"
    if (
        state.model is not None
        and model_name is not None
        and not _same_name(state.model, model_name)
    ):
        raise UsageError(
            f"{where}: the checkpoint was trained from {state.model!r}, this run names "
            f"{model_name!r}; resume with the checkpoint's model (a resume trains its weights)"
        )
    if model is None:
        return
    _check_same_lora(path, model, where)
    saved_config_path = path / "config.json"
    saved_config = json.loads(saved_config_path.read_text()) if saved_config_path.is_file() else {}
    run_config = _config_dict(model)
    saved_labels = _labels(saved_config)
    run_labels = _labels(run_config) if run_config is not None else None
    if saved_labels is not None and run_labels is not None and saved_labels != run_labels:
        raise UsageError(
            f"{where}: the checkpoint classifies into {len(saved_labels)} labels "
            f"({', '.join(saved_labels)}), this run's data into {len(run_labels)} "
            f"({', '.join(run_labels)}); to start a new run from its weights with a new "
            "head, pass --init-from instead of --resume"
        )
    for key in ("model_type", "vocab_size"):
        if (
            run_config is not None
            and key in saved_config
            and key in run_config
            and saved_config[key] != run_config[key]
        ):
            raise UsageError(
                f"{where}: the checkpoint's {key} is {saved_config[key]!r}, this run's "
                f"model's is {run_config[key]!r}"
            )
    if hasattr(model, "named_parameters") and (
        (path / "model.safetensors").is_file() or is_sharded(path)
    ):
        differences = _shape_differences(path, model)
        if differences:
            more = f" (and {len(differences) - 3} more)" if len(differences) > 3 else ""
            raise UsageError(
                f"{where}: the checkpoint's parameters are not this model's: "
                f"{'; '.join(differences[:3])}{more}"
            )
