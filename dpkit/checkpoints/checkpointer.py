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
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from dpkit.checkpoints.folder import (
    LOSS_SCALE_FILE,
    TrainerState,
    checkpoint_dir,
    file_entry,
    fsync_dir,
    fsync_tree,
    list_checkpoints,
    write_manifest,
)
from dpkit.checkpoints.resume import Resume, carry_over_note, continue_schedule
from dpkit.checkpoints.state import (
    full_optimizer_state,
    load_optimizer_state,
    restore_lrs,
    rng_state,
    save_model,
    save_model_files,
    set_rng_state,
)
from dpkit.core.loss_scale import LossScaler
from dpkit.core.shards import (
    MOMENTS,
    SHARDS,
    TensorIndex,
    async_save_shards,
    is_sharded,
    load_shards,
    optimizer_step,
    save_shards,
    tensor_index,
)
from dpkit.core.walk import inner_torch_optimizer

logger = logging.getLogger("dpkit")

CHECKPOINT_LOG = "checkpoint_log.jsonl"
"""One line per save in the run folder: step, layout, seconds, bytes per rank, the main
process's RSS added at the save's peak."""


@dataclass
class PendingSave:
    """A save whose files may still be being written (``--async-save``): it becomes the
    checkpoint ``final`` in :func:`complete_save`."""

    final: Path
    tmp: Path
    output_dir: Path
    keep_last: int
    checkpoint_format: str
    upload: Any = None
    """DCP's future for the shards written in the background (None: written already)."""
    started: float = 0.0
    written_at: float | None = None
    """When the background write ended (``time.perf_counter``)."""


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
    checkpoint_format: str = "sharded",
    async_group: Any = None,
) -> PendingSave:
    """Write the full training state for ``state.step``; every rank must call this.

    ``sharded`` (the default): every rank writes its own part of the weights and moments
    (:mod:`dpkit.core.shards`), so the ranks must share a file system. ``full``:
    the state gathered, and written by the main process only (several nodes need no
    shared file system to save). Either way the folder appears under its final name only
    once complete: :func:`complete_save` (every rank calls it) finishes what this
    starts. ``async_group`` (``--async-save``, sharded only): each rank copies its shards
    to CPU memory and returns; DCP writes them in a thread over that process group while
    training goes on, until :func:`complete_save` waits for them.
    """
    import accelerate.utils
    import torch.distributed as dist

    started = time.perf_counter()
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
    pending = PendingSave(
        final,
        final.with_name(f".tmp-{final.name}"),
        Path(output_dir),
        keep_last,
        checkpoint_format,
        started=started,
    )
    tmp = pending.tmp
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    optimizer_state = None
    if checkpoint_format == "sharded":
        accelerator.wait_for_everyone()  # the folder is new before any rank writes into it
        shards = engine.checkpoints.own_shards(accelerator, module, optimizer)
        if async_group is not None:
            pending.upload = async_save_shards(
                shards,
                tmp / SHARDS,
                process_group=async_group if dist.is_initialized() else None,
            )
            pending.upload.add_done_callback(
                lambda _: setattr(pending, "written_at", time.perf_counter())
            )
        else:
            save_shards(shards, tmp / SHARDS, with_process_group=dist.is_initialized())
        del shards
        if accelerator.is_main_process:
            _write_index(module, optimizer, tmp, tokenizer)
    else:
        save_model(engine, accelerator, model, tmp, tokenizer, for_resume=True)
        optimizer_state = full_optimizer_state(engine, accelerator, model, optimizer)
    rng_states = accelerate.utils.gather_object([rng_state()])
    loss_scaler = engine.checkpoints.loss_scaler(
        accelerator
    )  # the same on every rank: the main one's is saved
    if accelerator.is_main_process:
        if optimizer_state is not None:
            torch.save(optimizer_state, tmp / "optimizer.pt")
        if lr_scheduler is not None:
            torch.save(lr_scheduler.state_dict(), tmp / "scheduler.pt")
        if loss_scaler is not None:
            (tmp / LOSS_SCALE_FILE).write_text(
                json.dumps(loss_scaler.state_dict(), indent=2) + "\n"
            )
        torch.save(rng_states, tmp / "rng.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(asdict(state), indent=2) + "\n")
    return pending


def complete_save(accelerator, pending: PendingSave) -> Path:
    """Finish ``pending`` on every rank: wait for its shards, each rank hashing the files
    it wrote; the main process writes the manifest, syncs, renames the folder to its
    final name and drops the checkpoints past ``keep_last``."""
    import accelerate.utils

    if pending.upload is not None:
        pending.upload.result()
    if pending.written_at is None:
        pending.written_at = time.perf_counter()
    hashed = {}
    if pending.checkpoint_format == "sharded":
        own = {
            str(p.relative_to(pending.tmp)): file_entry(p)
            for p in sorted((pending.tmp / SHARDS).glob(f"__{accelerator.process_index}_*"))
        }
        hashed = {k: v for part in accelerate.utils.gather_object([own]) for k, v in part.items()}
    final, tmp = pending.final, pending.tmp
    if accelerator.is_main_process:
        write_manifest(tmp, hashed)
        fsync_tree(tmp)
        if final.exists():  # a rerun of the same step: the new one replaces it
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(final.parent)  # the rename itself; the files were synced above
        if pending.keep_last > 0:
            for old in list_checkpoints(pending.output_dir)[: -pending.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def _write_index(module, optimizer, tmp: Path, tokenizer) -> None:
    """The main process's part of a sharded save: ``tensors.json`` and the model's small
    files (config, tokenizer, LoRA's adapter config)."""
    step = optimizer_step(optimizer)
    tensors = tensor_index(module)
    TensorIndex(
        shapes={name: shape for name, (shape, _, _) in tensors.items()},
        dtypes={name: dtype for name, (_, dtype, _) in tensors.items()},
        moments={
            name: list(MOMENTS)
            for name, (_, _, trainable) in tensors.items()
            if trainable and step > 0
        },
        step=step,
        param_group_lrs=[float(g["lr"]) for g in inner_torch_optimizer(optimizer).param_groups],
    ).write(tmp)
    save_model_files(module, tmp, tokenizer)


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
    # The weights are the checkpoint's whatever the model was built from (a script of
    # one's own may load the Hub model it started from); names and shapes were checked
    # before the process group started (Resume.check).
    if is_sharded(path):
        _load_sharded(engine, accelerator, model, optimizer, path)
    else:
        weights = load_file(str(path / "model.safetensors"))
        engine.checkpoints.load_weights(accelerator, accelerator.unwrap_model(model), weights)
        engine.checkpoints.load_fp32_masters(accelerator, accelerator.unwrap_model(model), weights)
        saved_optimizer = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
        load_optimizer_state(engine, accelerator, model, optimizer, saved_optimizer)
    if lr_scheduler is not None and (path / "scheduler.pt").is_file():
        lr_scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    _load_loss_scale(engine.checkpoints.loss_scaler(accelerator), path)
    rng_states = torch.load(path / "rng.pt", weights_only=True)
    if len(rng_states) == accelerator.num_processes:
        set_rng_state(rng_states[accelerator.process_index])
    accelerator.wait_for_everyone()
    return state


def _load_sharded(engine, accelerator, model, optimizer, path: Path) -> None:
    """Each rank reads the ranges of the weights and moments its layout holds, whatever
    strategy and world size wrote them; the optimizer's lrs as saved."""
    import torch.distributed as dist

    index = TensorIndex.read(path)
    restore_lrs(optimizer, index.param_group_lrs)
    engine.checkpoints.load_own_shards(
        accelerator,
        accelerator.unwrap_model(model),
        optimizer,
        lambda shards: load_shards(shards, path / SHARDS, with_process_group=dist.is_initialized()),
        torch.tensor(float(index.step)),
        with_moments=bool(index.moments),
    )


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


class SaveMeter:
    """What one save costs the process that makes it: seconds and the RSS it adds at its
    peak (sampled every millisecond by a thread: the state a full save gathers lives
    throughout the save, so sampling sees it). A context manager."""

    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval_s = interval_s
        self.seconds = 0.0
        self.rss_before = 0.0
        self.rss_peak = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> SaveMeter:
        import psutil

        process = psutil.Process()
        self.rss_before = self.rss_peak = float(process.memory_info().rss)

        def sample() -> None:
            while not self._stop.wait(self.interval_s):
                self.rss_peak = max(self.rss_peak, float(process.memory_info().rss))

        self._thread = threading.Thread(target=sample, name="dpkit-save-meter", daemon=True)
        self._started = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._started
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def rss_extra(self) -> float:
        """Bytes of RSS the save added at its peak, over what the process held before."""
        return max(0.0, self.rss_peak - self.rss_before)


def save_record(path: Path, pending: PendingSave, meter: SaveMeter) -> dict:
    """The checkpoint log's line for the save of ``path`` (read from its manifest): the
    bytes each rank wrote (sharded: its shard files; full: the main process wrote all),
    the seconds until complete and, for an async save, those training stalled."""
    files = json.loads((path / "manifest.json").read_text())["files"]
    total = sum(entry["bytes"] for entry in files.values())
    per_rank: dict[int, int] = {}
    for name, entry in files.items():
        if name.startswith(f"{SHARDS}/__") and name.endswith(".distcp"):
            rank = int(name.removeprefix(f"{SHARDS}/__").split("_")[0])
            per_rank[rank] = per_rank.get(rank, 0) + entry["bytes"]
    if pending.checkpoint_format == "full":
        per_rank = {0: total}
    state = json.loads((path / "trainer_state.json").read_text())
    written = pending.written_at if pending.written_at is not None else time.perf_counter()
    record = {
        "step": state["step"],
        "checkpoint_format": pending.checkpoint_format,
        "async": pending.upload is not None,
        "seconds": round(max(written - pending.started, meter.seconds), 3),
        "bytes_total": total,
        "bytes_per_rank": [per_rank.get(r, 0) for r in range(max(per_rank, default=0) + 1)],
        "main_rss_before_mib": round(meter.rss_before / 2**20, 1),
        "main_rss_added_mib": round(meter.rss_extra / 2**20, 1),
    }
    if pending.upload is not None:
        record["stall_seconds"] = round(meter.seconds, 3)
    return record


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

    Every rank must make every call: each writes its own shards (``sharded``), or the
    state is gathered and the main process writes (``full``). ``enabled=False`` (``--no-save-checkpoints``) writes nothing.
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
        checkpoint_format: str = "sharded",
        async_save: bool = False,
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
            checkpoint_format: ``sharded`` (every rank writes its part) or ``full``
                (gathered, written by the main process: for nodes without a shared file
                system).
            async_save: sharded saves written in the background (each rank copies its
                shards to CPU memory and trains on); completed by the next save,
                :meth:`wait` or the run's end.
        """
        self.run = run
        self.accelerator = run.accelerator
        self.engine = run.engine
        self.run_info = run.info
        self.output_dir = Path(output_dir)
        self.seed = seed
        self.keep_last = keep_last
        self.tokenizer = tokenizer
        self.enabled = enabled
        self.model_name = model_name
        self.checkpoint_format = checkpoint_format
        self.async_save = async_save
        self._pending: tuple[PendingSave, SaveMeter] | None = None
        self._async_process_group: Any = None
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
        # The schedule this run planned, from the checkpoint's step (a longer --max-steps
        # re-planned, not the checkpoint's lr for one step and this run's after).
        next_lr = None if lr_scheduler is None else continue_schedule(lr_scheduler, state.step)
        logger.info(
            "%s",
            carry_over_note(
                state,
                strategy=self.run_info.strategy,
                world_size=self.run_info.world_size,
                plan=getattr(self.run, "lr_plan", None),
                next_lr=next_lr,
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
            lr_plan=getattr(self.run, "lr_plan", None),
        )
        self.wait()  # the previous save, if it is still being written, completes first
        with SaveMeter() as meter:
            pending = save_checkpoint(
                self.engine,
                self.accelerator,
                model,
                optimizer,
                lr_scheduler,
                state,
                self.output_dir,
                tokenizer=self.tokenizer,
                keep_last=self.keep_last,
                checkpoint_format=self.checkpoint_format,
                async_group=self._async_group(),
            )
        self._pending = (pending, meter)
        if pending.upload is None:
            return self.wait()
        logger.info(
            "checkpoint %s: being written in the background (training stalled %.1f s for the copy)",
            pending.final.name,
            meter.seconds,
        )
        return pending.final

    def wait(self) -> Path | None:
        """Complete the save in progress, if any (``--async-save``: its shards written,
        then manifest and rename); log and record its figures. Every rank calls it; the
        next save, :meth:`Run.finish <dpkit.train.run.Run.finish>` and a stop do."""
        if self._pending is None:
            return None
        pending, meter = self._pending
        self._pending = None
        self.last = complete_save(self.accelerator, pending)
        if self.accelerator.is_main_process:
            record = save_record(self.last, pending, meter)
            if getattr(self.run, "output", None) is not None:
                self.run.output.append_jsonl(CHECKPOINT_LOG, record)
            stall = (
                f"; training stalled {record['stall_seconds']:.1f} s of it"
                if pending.upload is not None
                else ""
            )
            logger.info(
                "checkpoint %s (%s): %.1f MB in %.1f s%s, at most %.1f MB written by one rank; "
                "the main process's RSS rose by %.0f MiB while saving",
                self.last,
                pending.checkpoint_format,
                record["bytes_total"] / 1e6,
                record["seconds"],
                stall,
                max(record["bytes_per_rank"]) / 1e6,
                record["main_rss_added_mib"],
            )
        return self.last

    def _async_group(self) -> Any:
        """The gloo process group async saves write over (made at the first one, by every
        rank); None for synchronous saves. Without a process group: a marker only."""
        if not self.async_save:
            return None
        if self._async_process_group is None:
            import torch.distributed as dist

            self._async_process_group = (
                dist.new_group(backend="gloo") if dist.is_initialized() else "one process"
            )
        return self._async_process_group

    def stop_note(self, signal_name: str, position: Position, total_steps: int) -> str:
        """The line a run stopped by a signal logs: where, and how to continue."""
        then = (
            f"resume with --resume latest (or --resume {self.last})"
            if self.enabled
            else "nothing saved (--no-save-checkpoints)"
        )
        return f"dpkit: stopped by {signal_name} after step {position.step}/{total_steps}; {then}"
