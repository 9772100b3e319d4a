"""A run's checkpoints from the training loop: when to save, where training stands, resuming.

:class:`Position` is where training stands in the data (step, epoch, micro-batches
of the epoch consumed); :class:`Checkpointer` saves it with the full training
state (:mod:`dpkit.train.checkpoint`) and restores it, so a resumed run continues
the same data order and schedule.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpkit.train.checkpoint import (
    Resume,
    TrainerState,
    carry_over_note,
    load_checkpoint,
    save_checkpoint,
)

logger = logging.getLogger("dpkit")


@dataclass
class Position:
    """Where training stands in the data: what a checkpoint records and a resume skips to."""

    step: int = 0
    """Optimizer steps done, skipped ones included (they count toward the step budget)."""
    epoch: int = 0
    """The epoch being trained."""
    batches_done: int = 0
    """Micro-batches of this epoch this rank has consumed."""
    first_step: int = 0
    """The step this process started from (0, or the resumed checkpoint's)."""
    batches_per_epoch: int = 0
    """Micro-batches of an epoch on this rank (set by :meth:`epochs`)."""
    skipped_steps: int = 0
    """Of ``step``, those whose update was skipped for a gradient overflow (fp16); counted
    by :class:`~dpkit.train.progress.TrainingLog`, saved with every checkpoint."""

    def epochs(
        self, accelerator, loader, num_epochs: int, micro_batches: int | None = None
    ) -> Iterator[tuple[int, Any]]:
        """``(epoch, batches)`` from the current epoch to ``num_epochs``, each epoch cut to
        its first ``micro_batches`` (default: the whole loader) so that every optimizer step
        accumulates as many micro-batches as asked; the first epoch skips what a resumed
        run already consumed (the seeded sampler replays the same order)."""
        first = self.epoch
        self.batches_per_epoch = len(loader) if micro_batches is None else micro_batches
        for epoch in range(first, num_epochs):
            self.epoch = epoch
            loader.set_epoch(epoch)
            skip = self.batches_done if epoch == first else 0
            self.batches_done = skip
            batches = accelerator.skip_first_batches(loader, skip) if skip else loader
            yield epoch, itertools.islice(batches, self.batches_per_epoch - skip)

    def batch_done(self) -> None:
        self.batches_done += 1


class Checkpointer:
    """Saves and restores one run's full training state under ``<output_dir>/checkpoints``.

    Every rank must make every call (saving gathers ZeRO's shards); only the main
    process writes. ``enabled=False`` (``--no-save-checkpoints``) writes nothing.
    """

    def __init__(
        self,
        accelerator,
        run_info,
        output_dir: str | Path,
        *,
        seed: int,
        keep_last: int = 0,
        tokenizer=None,
        enabled: bool = True,
    ) -> None:
        self.accelerator = accelerator
        self.run_info = run_info
        self.output_dir = Path(output_dir)
        self.seed = seed
        self.keep_last = keep_last
        self.tokenizer = tokenizer
        self.enabled = enabled
        self.last: Path | None = None
        """The newest complete checkpoint of this run (written, or resumed from)."""

    @property
    def _examples_per_batch(self) -> int:
        """Examples one micro-batch step consumes, all ranks together."""
        return self.run_info.micro_batch_size * self.run_info.world_size

    def restore(self, model, optimizer, lr_scheduler, resume: Resume | None) -> Position:
        """Load ``resume`` into the prepared objects (a fresh start without one) and return
        where training continues; logs what carries over."""
        if resume is None:
            return Position()
        state = load_checkpoint(self.accelerator, model, optimizer, lr_scheduler, resume.path)
        self.last = resume.path
        logger.info(
            "%s",
            carry_over_note(
                state, strategy=self.run_info.strategy, world_size=self.run_info.world_size
            ),
        )
        return Position(
            step=state.step,
            epoch=state.epoch,
            batches_done=state.samples_in_epoch // self._examples_per_batch,
            first_step=state.step,
            skipped_steps=state.skipped_steps,
        )

    def save(self, model, optimizer, lr_scheduler, position: Position) -> Path | None:
        """The full state after ``position.step`` (``lr_scheduler`` may be None); a collective.
        A ``Position`` that never went through :meth:`Position.epochs` (a loop of your
        own) records its step and epoch only."""
        if not self.enabled:
            return None
        known = position.batches_per_epoch > 0
        epoch_done = known and position.batches_done >= position.batches_per_epoch
        state = TrainerState.at(
            self.run_info,
            step=position.step,
            epoch=position.epoch + 1 if epoch_done else position.epoch,
            samples_in_epoch=0 if epoch_done else position.batches_done * self._examples_per_batch,
            seed=self.seed,
            skipped_steps=position.skipped_steps,
        )
        self.last = save_checkpoint(
            self.accelerator,
            model,
            optimizer,
            lr_scheduler,
            state,
            self.output_dir,
            tokenizer=self.tokenizer,
            keep_last=self.keep_last,
        )
        logger.info("checkpoint %s", self.last)
        return self.last

    def stop_note(self, signal_name: str, position: Position, total_steps: int) -> str:
        """The line a run stopped by a signal logs: where, and how to continue."""
        then = (
            f"resume with --resume latest (or --resume {self.last})"
            if self.enabled
            else "nothing saved (--no-save-checkpoints)"
        )
        return f"dpkit: stopped by {signal_name} after step {position.step}/{total_steps}; {then}"
