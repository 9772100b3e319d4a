"""Checkpoints: the full training state in one portable layout, for every strategy and world size.

A checkpoint is a folder ``<output_dir>/checkpoints/step-000120/``::

    model.safetensors, config.json, tokenizer files   the consolidated fp32 weights
                                                        (a Hugging Face folder: loads
                                                        without DeepSpeed)
    optimizer.pt        Adam moments per parameter name, consolidated; step count; lrs
    scheduler.pt        the lr scheduler's state_dict
    rng.pt              every rank's RNG states (python, numpy, torch, cuda)
    loss_scale.json     fp16 only: the dynamic loss scale and its growth counters
    trainer_state.json  step, epoch, position in the epoch, batch layout, strategy,
                        optimizer steps skipped for a gradient overflow
    manifest.json       every file above with its size and sha256 (written last)

Why not DeepSpeed's or accelerate's own checkpoint: a ZeRO checkpoint is sharded
by data-parallel rank, needs DeepSpeed to read and the same world size to resume
(or a conversion step), and a DDP run cannot load it at all. Here the ZeRO shards
are gathered per parameter with DeepSpeed's tensor-fragment API (the mechanism of
its universal checkpoint), so a checkpoint written by ZeRO-2 on 2 processes
resumes as DDP on 1 or ZeRO-1 on 4, and the weights load with ``from_pretrained``.
The cost: every save gathers the full optimizer state on the main process's CPU
(12 bytes per parameter), fine for models that fit one GPU, the ones dpkit is for.

Saves are atomic: everything is written into ``.tmp-step-*``, fsynced, then renamed;
a folder named ``step-*`` is complete by construction, and the manifest lets a
resume refuse one that was truncated or altered afterwards.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from dpkit.errors import UsageError
from dpkit.train.full_state import (
    FORMAT_VERSION,
    LossScaler,
    full_optimizer_state,
    load_fp32_masters,
    load_optimizer_state,
    save_model,
)

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
LOSS_SCALE_FILE = "loss_scale.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


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
        )

    def describe(self) -> str:
        return (
            f"step {self.step} (epoch {self.epoch}, {self.samples_in_epoch} examples in), "
            f"written by {self.strategy} on {self.world_size} process(es), global batch "
            f"{self.global_batch_size}"
        )


# ---------------------------------------------------------------------------
# Finding and checking checkpoints (no process group needed)
# ---------------------------------------------------------------------------


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


class Resume(NamedTuple):
    """A checkpoint to continue from, verified (:func:`resolve_resume`)."""

    path: Path
    state: TrainerState

    def check(self, *, global_batch_size: int) -> None:
        """Refuse what cannot be carried over (:func:`check_resumable`)."""
        check_resumable(self.state, self.path, global_batch_size=global_batch_size)


def resolve_resume(resume: str | None, output_dir: str) -> Resume | None:
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


# ---------------------------------------------------------------------------
# RNG
# ---------------------------------------------------------------------------


def _rng_state() -> dict:
    """This rank's RNG states as plain lists (they travel through ``gather_object``)."""
    import numpy as np

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def _set_rng_state(state: dict) -> None:
    import numpy as np

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


# ---------------------------------------------------------------------------
# Save and load
# ---------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            with open(Path(dirpath) / name, "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(dirpath))


def _write_manifest(root: Path) -> None:
    files = {
        str(p.relative_to(root)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }
    (root / "manifest.json").write_text(json.dumps({"files": files}, indent=1) + "\n")


def save_checkpoint(
    accelerator,
    model,
    optimizer,
    lr_scheduler,
    state: TrainerState,
    output_dir: str | Path,
    *,
    tokenizer=None,
    keep_last: int = 0,
) -> Path:
    """Write the full training state for ``state.step``; every rank must call this.

    Only the main process writes (so several nodes need no shared file system to
    save); the folder appears under its final name only once complete.
    """
    import accelerate.utils

    # Every rank holds the full (ZeRO-1/2) or replicated (DDP) weights, so every rank
    # reaches the same verdict and none is left waiting in a collective.
    module = accelerator.unwrap_model(model)
    if not all(torch.isfinite(p).all() for p in module.parameters()):
        raise RuntimeError(f"step {state.step}: non-finite weights; not saving a checkpoint")
    final = checkpoint_dir(output_dir, state.step)
    tmp = final.with_name(f".tmp-{final.name}")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    save_model(accelerator, model, tmp, tokenizer)
    optimizer_state = full_optimizer_state(accelerator, model, optimizer)
    rng_states = accelerate.utils.gather_object([_rng_state()])
    loss_scaler = LossScaler.of(accelerator)  # the same on every rank: the main one's is saved
    if accelerator.is_main_process:
        torch.save(optimizer_state, tmp / "optimizer.pt")
        if lr_scheduler is not None:
            torch.save(lr_scheduler.state_dict(), tmp / "scheduler.pt")
        if loss_scaler is not None:
            (tmp / LOSS_SCALE_FILE).write_text(
                json.dumps(loss_scaler.state_dict(), indent=2) + "\n"
            )
        torch.save(rng_states, tmp / "rng.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(asdict(state), indent=2) + "\n")
        _write_manifest(tmp)
        _fsync_tree(tmp)
        if final.exists():  # a rerun of the same step: the new one replaces it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(final.parent)  # the rename itself; the files were synced above
        if keep_last > 0:
            for old in list_checkpoints(output_dir)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, model, optimizer, lr_scheduler, path: Path) -> TrainerState:
    """Restore a checkpoint into prepared objects (after ``accelerator.prepare``).

    The model must have been built from ``path`` itself (``from_pretrained``: the folder
    is a Hugging Face model folder); this restores ZeRO's fp32 masters, the optimizer
    moments re-sharded for this run, the scheduler (if any), fp16's loss scale (when this
    run scales the loss and the checkpoint has one) and, when the world size is the same,
    every rank's RNG streams.
    """
    from safetensors.torch import load_file

    state = TrainerState(**json.loads((path / "trainer_state.json").read_text()))
    weights = load_file(str(path / "model.safetensors"))
    load_fp32_masters(accelerator, model, weights)
    saved_optimizer = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    load_optimizer_state(accelerator, model, optimizer, saved_optimizer)
    if lr_scheduler is not None and (path / "scheduler.pt").is_file():
        lr_scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    _load_loss_scale(accelerator, path)
    rng_states = torch.load(path / "rng.pt", weights_only=True)
    if len(rng_states) == accelerator.num_processes:
        _set_rng_state(rng_states[accelerator.process_index])
    accelerator.wait_for_everyone()
    return state


def _load_loss_scale(accelerator, path: Path) -> None:
    """Restore fp16's loss scale from ``path`` when this run scales the loss; say which."""
    loss_scaler = LossScaler.of(accelerator)
    if loss_scaler is None:  # fp32/bf16 now: a saved scale has nothing to drive
        return
    saved = path / LOSS_SCALE_FILE
    if saved.is_file():
        restored = loss_scaler.load_state_dict(json.loads(saved.read_text()))
        logger.info("%s restored from %s", restored, path.name)
    else:
        logger.info(
            "%s has no fp16 loss scale (written in fp32/bf16 or by an older dpkit): it "
            "starts at %g, and the first steps may overflow and be skipped",
            path.name,
            loss_scaler.scale,
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
