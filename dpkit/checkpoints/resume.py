"""Resuming: which checkpoint ``--resume`` names, whether this run can continue it, and what carries over."""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from dpkit.checkpoints.folder import (
    CHECKPOINTS,
    LrPlan,
    TrainerState,
    list_checkpoints,
    verify_checkpoint,
)
from dpkit.errors import UsageError
from dpkit.models import local_model_path

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

    def check_schedule(self, plan: LrPlan, flags: Mapping[str, str]) -> None:
        """Refuse an lr schedule that cannot continue the checkpoint's
        (:func:`check_schedule`)."""
        check_schedule(self.state, self.path, plan, flags)

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


def check_schedule(state: TrainerState, path: Path, plan: LrPlan, flags: Mapping[str, str]) -> None:
    """Refuse, before any process group, a resume whose lr schedule cannot continue the
    checkpoint's.

    Another length (``--max-steps``, ``--num-epochs``) or warm-up is re-planned: the run
    follows the schedule planned for its new length from the checkpoint's step on
    (:func:`continue_schedule`), which is what extending a finished run asks for.
    Refused: a length the checkpoint has already passed (nothing could train), and, when
    the checkpoint records its plan, another scheduler or peak lr: the lr would jump onto
    another curve at the resumed step, a new experiment rather than a continuation, and
    most often a flag left out of the resume's command line.

    Args:
        plan: the schedule this run planned (:class:`~dpkit.checkpoints.folder.LrPlan`).
        flags: for ``total_steps``, ``scheduler`` and ``peak_lr``, the flag and value that
            set it, as a refusal names them (``{"scheduler": "--lr-scheduler=cosine"}``).
    """
    where = f"--resume={str(path)!r}"
    if plan.total_steps < state.step:
        raise UsageError(
            f"{flags['total_steps']}: plans {plan.total_steps} steps, but {where} has already "
            f"trained {state.step}; ask for more than {state.step} steps to train on (the lr "
            "schedule is re-planned for the new length), or --eval-only to evaluate it"
        )
    saved = state.planned
    if saved is None:  # an older dpkit's checkpoint: nothing to compare against
        return
    new_run = f"or start a new run from its weights with --init-from {path}"
    if plan.scheduler != saved.scheduler:
        flag = flags["scheduler"].split("=")[0]
        raise UsageError(
            f"{flags['scheduler']}: {where} trained with the {saved.scheduler!r} lr schedule; "
            f"a resume continues its schedule: pass {flag} {saved.scheduler}, {new_run}"
        )
    if not math.isclose(plan.peak_lr, saved.peak_lr, rel_tol=1e-9):
        raise UsageError(
            f"{flags['peak_lr']}: this run's lr schedule peaks at {plan.peak_lr:g}, the one "
            f"{where} trained with at {saved.peak_lr:g}; a resume continues its schedule: "
            f"keep its learning rate, {new_run}"
        )


def continue_schedule(lr_scheduler: Any, step: int) -> float | None:
    """Put ``lr_scheduler`` at ``step`` of this run's plan, with every parameter group's
    lr set to it; return the lr the next step trains at. A scheduler that is not a torch
    ``LambdaLR`` (transformers' all are; a DeepSpeed config's own is not) is left as
    restored: None.

    Why: ``LambdaLR.load_state_dict`` restores the base lrs, the step count and the last
    lr computed, but not the lambdas (transformers builds them as ``functools.partial``,
    whose arguments are not in ``__dict__``): those are this run's, planned for its
    length. Left at that, a resume with a longer ``--max-steps`` trained its first step
    at the lr the checkpoint's plan gave after its last step (0.0 at the end of a linear
    decay) and the following ones on this run's plan. Here every resumed step follows
    this run's plan, with its peak lr (:func:`check_schedule` refuses another).
    """
    from torch.optim.lr_scheduler import LambdaLR

    inner = getattr(lr_scheduler, "scheduler", lr_scheduler)  # accelerate's wrapper
    if not isinstance(inner, LambdaLR):
        return None
    inner.base_lrs = [group["initial_lr"] for group in inner.optimizer.param_groups]
    inner.last_epoch = step - 1
    with warnings.catch_warnings():
        # torch warns of a step before optimizer.step() when the scheduler has made none
        # (a checkpoint saved without scheduler.pt): this step only positions it.
        warnings.filterwarnings("ignore", message="Detected call of", category=UserWarning)
        inner.step()
    return float(inner.get_last_lr()[0])


def schedule_note(state: TrainerState, plan: LrPlan | None, next_lr: float | None) -> str:
    """What a resume does with the lr schedule, in words (part of :func:`carry_over_note`)."""
    if next_lr is None:
        return (
            "the optimizer's lr and any lr scheduler's state as saved (not re-planned: no "
            "scheduler from run.make_scheduler)"
        )
    step = state.step
    if plan is not None and plan.total_steps <= step:
        return (
            f"nothing left to train: the lr schedule ({plan.describe()}) ends at step "
            f"{plan.total_steps}, the checkpoint's step {step}"
        )
    at_next = f"step {step + 1} trains at lr {next_lr:.4g}"
    saved = state.planned
    if plan is None:
        return f"lr schedule: this run's scheduler, at step {step}; {at_next}"
    if saved == plan:
        return f"lr schedule carried over ({plan.describe()}); {at_next}"
    if saved is None:
        return (
            f"lr schedule planned for this run ({plan.describe()}; the checkpoint does not "
            f"record its own); {at_next}"
        )
    return (
        f"lr schedule re-planned for {plan.total_steps} steps ({plan.describe()}; the "
        f"checkpoint's: {saved.describe()}); {at_next}, as in a run planned for "
        f"{plan.total_steps} steps from the start"
    )


def schedule_record(plan: LrPlan | None, resume: Resume | None) -> dict[str, Any] | None:
    """``run_info.json``'s ``lr_schedule``: the plan this run follows and, when it
    resumed, from which step and what the checkpoint had planned. None without a plan."""
    if plan is None:
        return None
    record: dict[str, Any] = plan.as_dict()
    if resume is not None:
        saved = resume.state.planned
        record["resumed_at_step"] = resume.state.step
        record["checkpoint_lr_schedule"] = None if saved is None else saved.as_dict()
        record["replanned"] = None if saved is None else saved != plan
    return record


def carry_over_note(
    state: TrainerState,
    *,
    strategy: str,
    world_size: int,
    plan: LrPlan | None = None,
    next_lr: float | None = None,
) -> str:
    """One line: what a resume carries over, and what it cannot.

    Args:
        plan: the lr schedule this run follows (None: not built by ``make_scheduler``).
        next_lr: the lr the first resumed step trains at (:func:`continue_schedule`);
            None: the scheduler, if any, was left as restored.
    """
    parts = [f"resuming from {state.describe()}, as {strategy} on {world_size} process(es)"]
    parts.append("weights, optimizer moments and data position carried over")
    parts.append(schedule_note(state, plan, next_lr))
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
    """Whether two model names are one model: equal, one folder named two ways
    (relative, absolute, a symlink), or names that resolve to one folder (``minilm``,
    its Hub name and the bundled copy's folder: :func:`dpkit.models.local_model_path`)."""
    if recorded == current:
        return True
    folders = []
    for name in (recorded, current):
        try:
            folders.append(Path(local_model_path(name)))
        except UsageError:  # a path that is no longer there
            folders.append(Path(name))
    return all(folder.is_dir() for folder in folders) and (
        folders[0].resolve() == folders[1].resolve()
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
