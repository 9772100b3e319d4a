"""A run's checkpoints from the training loop: saving and restoring the full training state, and where training stands.

:class:`Position` is where training stands in the data (step, epoch, micro-batches
of the epoch consumed); :class:`Checkpointer` saves it with the full training state
(:mod:`dpkit.checkpoints.state`, gathered by the run's engine) into a checkpoint folder
(:mod:`dpkit.checkpoints.folder`) and restores it, so a resumed run continues the same
data order and schedule. A checkpoint written under one strategy and world size resumes
under another: the weights and moments are stored whole, by parameter name.

Why not DeepSpeed's or accelerate's own checkpoint: a ZeRO checkpoint is sharded
by data-parallel rank, needs DeepSpeed to read and the same world size to resume
(or a conversion step), and a DDP run cannot load it at all. The cost: every save
gathers the full optimizer state on the main process's CPU (12 bytes per parameter),
fine for models that fit one GPU, the ones dpkit is for.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from dpkit.checkpoints.folder import (
    LOSS_SCALE_FILE,
    TrainerState,
    checkpoint_dir,
    fsync_dir,
    fsync_tree,
    list_checkpoints,
    write_manifest,
)
from dpkit.checkpoints.resume import Resume, carry_over_note
from dpkit.checkpoints.state import (
    LossScaler,
    full_optimizer_state,
    load_optimizer_state,
    rng_state,
    save_model,
    set_rng_state,
)

logger = logging.getLogger("dpkit")


def save_checkpoint(
    engine,
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

    # Every rank checks its own parameters (whole or a shard); the verdict is agreed over
    # the ranks, so none is left waiting in a collective another rank skipped.
    module = accelerator.unwrap_model(model)
    finite = torch.tensor(
        float(all(torch.isfinite(p).all() for p in module.parameters())), device=accelerator.device
    )
    if accelerator.num_processes > 1:
        finite = accelerator.reduce(finite, reduction="mean")
    if float(finite) < 1.0:
        raise RuntimeError(f"step {state.step}: non-finite weights; not saving a checkpoint")
    final = checkpoint_dir(output_dir, state.step)
    tmp = final.with_name(f".tmp-{final.name}")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    save_model(engine, accelerator, model, tmp, tokenizer, for_resume=True)
    optimizer_state = full_optimizer_state(engine, accelerator, model, optimizer)
    rng_states = accelerate.utils.gather_object([rng_state()])
    loss_scaler = engine.loss_scaler(accelerator)  # the same on every rank: the main one's is saved
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
        write_manifest(tmp)
        fsync_tree(tmp)
        if final.exists():  # a rerun of the same step: the new one replaces it
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(final.parent)  # the rename itself; the files were synced above
        if keep_last > 0:
            for old in list_checkpoints(output_dir)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(
    engine, accelerator, model, optimizer, lr_scheduler, path: Path
) -> TrainerState:
    """Restore a checkpoint into prepared objects (after ``accelerator.prepare``).

    This restores the weights (into a model built from any copy of the same model),
    ZeRO's fp32 masters, the optimizer
    moments re-sharded for this run, the scheduler (if any), fp16's loss scale (when this
    run scales the loss and the checkpoint has one) and, when the world size is the same,
    every rank's RNG streams.
    """
    from safetensors.torch import load_file

    state = TrainerState(**json.loads((path / "trainer_state.json").read_text()))
    weights = load_file(str(path / "model.safetensors"))
    # The weights are the checkpoint's whatever the model was built from (a script of
    # one's own may load the Hub model it started from); names and shapes were checked
    # before the process group started (Resume.check).
    engine.load_weights(accelerator, accelerator.unwrap_model(model), weights)
    engine.load_fp32_masters(accelerator, accelerator.unwrap_model(model), weights)
    saved_optimizer = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    load_optimizer_state(engine, accelerator, model, optimizer, saved_optimizer)
    if lr_scheduler is not None and (path / "scheduler.pt").is_file():
        lr_scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    _load_loss_scale(engine.loss_scaler(accelerator), path)
    rng_states = torch.load(path / "rng.pt", weights_only=True)
    if len(rng_states) == accelerator.num_processes:
        set_rng_state(rng_states[accelerator.process_index])
    accelerator.wait_for_everyone()
    return state


def _load_loss_scale(loss_scaler: LossScaler | None, path: Path) -> None:
    """Restore fp16's loss scale from ``path`` when this run scales the loss; say which."""
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
        run: Any,
        output_dir: str | Path,
        *,
        seed: int,
        keep_last: int = 0,
        tokenizer=None,
        enabled: bool = True,
        model_name: str | None = None,
    ) -> None:
        """
        Args:
            run: the prepared :class:`~dpkit.train.run.Run` (its accelerator, engine and
                :class:`~dpkit.train.run.RunInfo`).
            output_dir: checkpoints go to ``<output_dir>/checkpoints``.
            seed: the run's seed, recorded with each checkpoint.
            keep_last: keep only the newest N checkpoints (0: all).
            tokenizer: saved beside the weights (a checkpoint is a model folder).
            enabled: ``False`` (``--no-save-checkpoints``) writes nothing.
            model_name: what the run trains from, as named; recorded with each
                checkpoint so that a resume naming another model is refused.
        """
        self.run = run
        self.accelerator = run.accelerator
        self.engine = run.strategy.engine
        self.run_info = run.info
        self.output_dir = Path(output_dir)
        self.seed = seed
        self.keep_last = keep_last
        self.tokenizer = tokenizer
        self.enabled = enabled
        self.model_name = model_name
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
        state = load_checkpoint(
            self.engine, self.accelerator, model, optimizer, lr_scheduler, resume.path
        )
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
            model=self.model_name,
        )
        self.last = save_checkpoint(
            self.engine,
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
