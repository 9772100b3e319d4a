"""Resuming: which checkpoint ``--resume`` names, whether this run can continue it, and what carries over."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from dpkit.checkpoints.folder import CHECKPOINTS, TrainerState, list_checkpoints, verify_checkpoint
from dpkit.errors import UsageError


class Resume(NamedTuple):
    """A checkpoint to continue from, verified (:func:`find_resume`)."""

    path: Path
    state: TrainerState

    def check(self, *, global_batch_size: int) -> None:
        """Refuse what cannot be carried over (:func:`check_resumable`)."""
        check_resumable(self.state, self.path, global_batch_size=global_batch_size)


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
