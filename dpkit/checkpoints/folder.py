"""A checkpoint folder: its layout, the state file that says where training stands, and the manifest that lets a resume trust it.

A checkpoint is a folder ``<output_dir>/checkpoints/step-000120/``::

    shards/             sharded (the default): every rank's part of the fp32 weights
                        and Adam moments, written by torch Distributed Checkpoint
                        (:mod:`dpkit.core.shards`)
    tensors.json        sharded: every saved tensor's shape and dtype; step count; lrs
    config.json, tokenizer files   the model's (LoRA: adapter_config.json too)
    model.safetensors   --checkpoint-format full: the consolidated fp32 weights (a
                        Hugging Face folder: loads without DeepSpeed)
    optimizer.pt        --checkpoint-format full: Adam moments per parameter name,
                        consolidated; step count; lrs
    scheduler.pt        the lr scheduler's state_dict
    rng.pt              every rank's RNG states (python, numpy, torch, cuda)
    loss_scale.json     fp16 only: the dynamic loss scale and its growth counters
    trainer_state.json  step, epoch, position in the epoch, batch layout, strategy,
                        optimizer steps skipped for a gradient overflow, the model's name,
                        the lr schedule the run followed (:class:`LrPlan`)
    manifest.json       every file above with its size and sha256 (written last)

Saves are atomic (:mod:`dpkit.checkpoints.checkpointer`): everything is written into
``.tmp-step-*``, fsynced, then renamed; a folder named ``step-*`` is complete by
construction, and the manifest lets a resume refuse one that was truncated or altered
afterwards (:func:`verify_checkpoint`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dpkit.errors import UsageError

CHECKPOINTS = "checkpoints"
LOSS_SCALE_FILE = "loss_scale.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass(frozen=True)
class LrPlan:
    """The lr schedule a run follows: what each checkpoint records (``lr_plan`` in
    ``trainer_state.json``) and what a resume is checked against
    (:func:`dpkit.checkpoints.resume.check_schedule`)."""

    scheduler: str
    """transformers' ``get_scheduler`` name (``linear``, ``cosine``...)."""
    peak_lr: float
    """The lr at the end of warm-up: the optimizer's lr as built, after ``--scale-lr``."""
    warmup_steps: int
    """Optimizer steps of linear warm-up."""
    total_steps: int
    """Optimizer steps the schedule is planned for (it reaches its end there)."""

    def describe(self) -> str:
        """``linear, peak lr 0.0001, 3 warm-up of 6 steps``."""
        return (
            f"{self.scheduler}, peak lr {self.peak_lr:g}, {self.warmup_steps} warm-up of "
            f"{self.total_steps} steps"
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TrainerState:
    """Where training stands; enough to continue the same data order and schedule."""

    step: int
    """Optimizer updates done."""
    epoch: int
    """Epoch to continue in."""
    samples_in_epoch: int
    """Examples of that epoch already consumed (all ranks together)."""
    global_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    world_size: int
    strategy: str
    precision: str
    seed: int
    format_version: int = FORMAT_VERSION
    skipped_steps: int = 0
    """Of ``step``, the optimizer steps whose update was skipped for a gradient overflow
    (fp16). Checkpoints written before it was recorded read as 0."""
    model: str | None = None
    """The model the run trained from, as it was named (``--model``, or the folder or Hub
    name ``from_pretrained`` was given); None: not known, or written by an older dpkit."""
    lr_plan: dict[str, Any] | None = None
    """The lr schedule the run followed up to ``step`` (:class:`LrPlan` as a dict); None:
    no scheduler made by :meth:`Run.make_scheduler <dpkit.train.run.Run.make_scheduler>`,
    or written by an older dpkit."""

    @property
    def planned(self) -> LrPlan | None:
        """:attr:`lr_plan` as an :class:`LrPlan` (None when not recorded)."""
        return None if self.lr_plan is None else LrPlan(**self.lr_plan)

    @classmethod
    def at(
        cls,
        run_info,
        *,
        step: int,
        epoch: int,
        samples_in_epoch: int,
        seed: int,
        skipped_steps: int = 0,
        model: str | None = None,
        lr_plan: LrPlan | None = None,
    ) -> TrainerState:
        """The state at ``step`` of the run that ``run_info`` (a strategy.RunInfo) describes."""
        return cls(
            step=step,
            skipped_steps=skipped_steps,
            epoch=epoch,
            samples_in_epoch=samples_in_epoch,
            global_batch_size=run_info.global_batch_size,
            micro_batch_size=run_info.micro_batch_size,
            gradient_accumulation_steps=run_info.gradient_accumulation_steps,
            world_size=run_info.world_size,
            strategy=run_info.strategy,
            precision=run_info.precision,
            seed=seed,
            model=model,
            lr_plan=None if lr_plan is None else lr_plan.as_dict(),
        )

    def describe(self) -> str:
        return (
            f"step {self.step} (epoch {self.epoch}, {self.samples_in_epoch} examples in), "
            f"written by {self.strategy} on {self.world_size} process(es), global batch "
            f"{self.global_batch_size}"
        )


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / CHECKPOINTS / f"step-{step:06d}"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints under ``output_dir``, oldest first (``.tmp-*`` never counts)."""
    root = Path(output_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_checkpoint(path: str | Path, flag: str = "--resume") -> TrainerState:
    """The checkpoint's state if every file is there with its recorded size and hash;
    otherwise a one-line :class:`UsageError` that says what is wrong."""
    path = Path(path)
    where = f"{flag}={str(path)!r}"
    if not path.is_dir():
        raise UsageError(f"{where}: no such checkpoint folder")
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file() and _holds_checkpoints(path):
        raise UsageError(f"{where}: {_run_folder_hint(path, flag)}")
    if not manifest_path.is_file():
        raise UsageError(
            f"{where}: not a complete dpkit checkpoint (no manifest.json; an interrupted "
            "save leaves a .tmp-step-* folder, never a step-* one)"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise UsageError(f"{where}: manifest.json is unreadable ({err})") from None
    for name, expected in sorted(files.items()):
        file = path / name
        if not file.is_file():
            raise UsageError(f"{where}: {name} is missing")
        size = file.stat().st_size
        if size != expected["bytes"]:
            raise UsageError(
                f"{where}: {name} is {size} bytes, the manifest says {expected['bytes']} "
                "(truncated or partly written)"
            )
        if _sha256(file) != expected["sha256"]:
            raise UsageError(f"{where}: {name} does not match its sha256 in the manifest")
    state = json.loads((path / "trainer_state.json").read_text())
    if state.get("format_version") != FORMAT_VERSION:
        raise UsageError(
            f"{where}: format_version={state.get('format_version')!r}, this dpkit reads "
            f"{FORMAT_VERSION}"
        )
    return TrainerState(**state)


def _holds_checkpoints(path: Path) -> bool:
    """Whether ``path`` is a run folder (it has ``checkpoints/``) or that ``checkpoints/``
    folder itself, rather than one checkpoint."""
    return (path / CHECKPOINTS).is_dir() or (
        path.name == CHECKPOINTS and (path.parent / CHECKPOINTS).is_dir()
    )


def _run_folder_hint(path: Path, flag: str) -> str:
    """What to pass instead of a run folder (or its ``checkpoints/``): its latest
    checkpoint, or (``--resume``) ``latest`` with the run folder as output."""
    run_dir = path.parent if path.name == CHECKPOINTS else path
    found = list_checkpoints(run_dir)
    if not found:
        return (
            f"a run folder, not a checkpoint, and {str(run_dir / CHECKPOINTS)!r} holds no "
            "complete step-* checkpoint"
        )
    text = f"a run folder, not a checkpoint; pass one of its checkpoints: {flag} {found[-1]}"
    if flag == "--resume":
        text += f" (its latest), or --resume latest --output-dir {run_dir} to continue that run"
    return text


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            with open(Path(dirpath) / name, "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(dirpath))


def file_entry(path: Path) -> dict:
    """A file's manifest entry: its size and sha256."""
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def write_manifest(root: Path, hashed: dict[str, dict] | None = None) -> None:
    """``manifest.json``: every file under ``root``; ``hashed`` gives the entries already
    computed (each rank hashes the shards it wrote)."""
    hashed = hashed or {}
    files = {
        name: hashed[name] if name in hashed else file_entry(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and (name := str(p.relative_to(root)))
    }
    (root / "manifest.json").write_text(json.dumps({"files": files}, indent=1) + "\n")
