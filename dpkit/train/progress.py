"""Progress of a run: throughput, and what each optimizer step logs (file, bar, log line, trackers).

One progress bar and one log line per logging step, both from the main process;
every step's record goes to ``train_log.jsonl`` (:class:`~dpkit.train.output.RunOutput`
writes on the main process only).

A step whose update was skipped for a gradient overflow (fp16's loss scaling, or
non-finite gradients under ZeRO) is still a step: it counts toward the step budget and
the lr schedule moves on, as the recipes count optimizer-step boundaries, not updates.
It is logged on its own line, marked in its record, and counted
(``skipped_steps``, also in ``train_summary.json`` and in every checkpoint).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dpkit.train.phases import StepPhases

logger = logging.getLogger("dpkit")


@dataclass
class Throughput:
    """Counts work between two ``rates()`` calls on this rank.

    Tokens are real (non-padding) input tokens; the total assumes every rank
    runs at the same rate, which data parallelism enforces at each all-reduce.
    """

    world_size: int
    _tokens: Any = 0
    _samples: int = 0
    _start: float = field(default_factory=time.perf_counter)

    def update(self, tokens: Any, samples: int) -> None:
        """``tokens`` may be a device tensor: it is summed on the device and read
        only in :meth:`rates`, so counting costs no host sync per micro-step."""
        self._tokens = self._tokens + tokens
        self._samples += int(samples)

    def rates(self) -> dict[str, float]:
        """Tokens/s and samples/s per rank and in total since the last call."""
        now = time.perf_counter()
        elapsed = max(now - self._start, 1e-9)
        per_rank_tokens = float(self._tokens) / elapsed
        per_rank_samples = self._samples / elapsed
        self._tokens, self._samples, self._start = 0, 0, now
        return {
            "tokens_per_s_per_rank": per_rank_tokens,
            "tokens_per_s": per_rank_tokens * self.world_size,
            "samples_per_s_per_rank": per_rank_samples,
            "samples_per_s": per_rank_samples * self.world_size,
        }


class TrainingLog:
    """What each optimizer step logs: its record in ``train_log.jsonl``, the progress bar,
    and every ``logging_steps`` steps (and the last) a log line with the throughput and
    the trackers' ``train/*`` scalars; a line for every step whose update was skipped, and
    at :meth:`close` the run's ``train_summary.json``."""

    def __init__(
        self,
        run: Any,
        *,
        total_steps: int,
        logging_steps: int,
        phases: StepPhases | None = None,
    ) -> None:
        """
        Args:
            run: the prepared :class:`~dpkit.train.run.Run`: its Accelerator (main process,
                trackers, whether the last optimizer step was skipped), its folder, its
                memory tracker (the memory in the log line), its engine (the fp16 loss
                scaler, the backend's own timing) and its ``position``, where a resumed run
                starts and whose ``skipped_steps`` this log counts on, so that
                checkpoints carry the count.
            total_steps: optimizer steps the run makes (the bar's length).
            logging_steps: a log line every N steps.
            phases: a :class:`~dpkit.train.phases.StepPhases` on the prepared model and
                optimizer: every record then says where its step's time went
                (``data_s``, ``forward_s``, ``backward_s``, ``optimizer_s``, ``other_s``),
                and ``train_summary.json`` holds the backend's own timing (DDP's:
                ``ddp_timing``).
        """
        from tqdm.auto import tqdm

        self.accelerator = run.accelerator
        self.output = run.output
        self.engine = run.engine
        self.total_steps = total_steps
        self.logging_steps = logging_steps
        self.memory = run.memory
        self.phases = phases
        self.position = run.position
        self.last_step = self.position.step
        # Found once (TrainingLog is made after prepare, when the scaler exists).
        self._scaler = self.engine.checkpoints.loss_scaler(self.accelerator)
        self._loss_scale = None if self._scaler is None else self._scaler.scale
        self.throughput = Throughput(world_size=self.accelerator.num_processes)
        # Per-step figures a record leaves out (a recipe may time its own steps): wall and
        # CPU time since the last step, and this rank's samples and tokens in the step.
        self._step_tokens: Any = 0
        self._step_samples = 0
        self._step_started = (time.perf_counter(), time.process_time())
        self.progress = tqdm(
            total=total_steps,
            initial=self.position.step,
            desc="train",
            disable=not self.accelerator.is_main_process,
        )

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps of the run (a resumed run's earlier ones too) whose update was
        skipped for a gradient overflow."""
        return self.position.skipped_steps

    def micro_batch(self, tokens: Any, samples: int) -> None:
        """Count one micro-batch's tokens (a device tensor is fine) and samples."""
        self.throughput.update(tokens, samples)
        self._step_tokens = self._step_tokens + tokens
        self._step_samples += int(samples)

    def step(self, record: dict[str, Any]) -> None:
        """One optimizer step's record (``step`` and ``loss`` at least); call it on every
        rank after every optimizer step (it also checks whether the update was skipped).

        A record without them gets ``step_time_s`` and ``step_cpu_s`` (this process's wall
        and CPU time since the previous step, or since the log was made: whatever ran
        between two steps, an evaluation too, counts in the next step) and
        ``tokens_per_rank``/``samples_per_rank`` (counted by :meth:`micro_batch`), and with
        ``phases`` the step's phase times: what ``dpkit tune`` and ``dpkit bench`` read."""
        step = self.last_step = record["step"]
        now = (time.perf_counter(), time.process_time())
        measured = {
            "step_time_s": now[0] - self._step_started[0],
            "step_cpu_s": now[1] - self._step_started[1],
            "tokens_per_rank": int(self._step_tokens),
            "samples_per_rank": self._step_samples,
        }
        if self.phases is not None:
            measured.update(self.phases.take())
        self._step_tokens, self._step_samples, self._step_started = 0, 0, now
        missing = {key: value for key, value in measured.items() if key not in record}
        record = {**record, **missing, **self._overflow_fields(step)}
        self.output.append_jsonl("train_log.jsonl", record)
        self.progress.update(1)
        self.progress.set_postfix(loss=f"{record['loss']:.4f}")
        if step % self.logging_steps and step != self.total_steps:
            return
        record = {**record, **self.throughput.rates()}
        parts = [f"step {step}/{self.total_steps}", f"loss {record['loss']:.4f}"]
        if "lr" in record:
            parts.append(f"lr {record['lr']:.2e}")
        if "step_time_s" in record:
            parts.append(f"{record['step_time_s']:.2f} s")
        parts.append(
            f"{record['tokens_per_s']:.0f} tokens/s ({record['tokens_per_s_per_rank']:.0f} per rank)"
        )
        if self.memory is not None:
            parts.append(self.memory.summary())
        logger.info(" | ".join(parts))
        self.accelerator.log({f"train/{k}": v for k, v in record.items() if k != "step"}, step=step)

    def _overflow_fields(self, step: int) -> dict[str, Any]:
        """Whether this step's update was skipped, counted and (main process) logged, with
        the loss scale the step ran at: the record's ``skipped``, ``skipped_steps`` and
        ``loss_scale`` (the last two in every record of an fp16 run).

        accelerate answers for both strategies: its GradScaler wrapper under DDP, the
        ZeRO optimizer's ``overflow`` flag (agreed by every rank) under DeepSpeed.
        """
        fields: dict[str, Any] = {}
        scaler = self._scaler
        ran_at = self._loss_scale
        if scaler is not None:
            self._loss_scale = scaler.scale  # after the step: what the next one runs at
            fields["loss_scale"] = ran_at
        if self.accelerator.optimizer_step_was_skipped:
            self.position.skipped_steps += 1
            fields["skipped"] = True
            if self.accelerator.is_main_process:
                cause = (
                    "non-finite gradients"
                    if scaler is None or ran_at is None
                    else f"gradients overflowed at loss scale {ran_at:g}, now {self._loss_scale:g}"
                )
                logger.warning(
                    "step %d/%d: update skipped (%s); %d skipped so far",
                    step,
                    self.total_steps,
                    cause,
                    self.position.skipped_steps,
                )
        if scaler is not None or self.position.skipped_steps:
            fields["skipped_steps"] = self.position.skipped_steps
        return fields

    def close(self) -> None:
        """Close the bar and write ``train_summary.json``: the last step, how many of the
        run's steps were skipped (they count in ``last_step``), the final loss scale, and
        with ``phases`` the backend's own timing (DDP's of its forward, backward and
        allreduce: ``ddp_timing``, None under the other engines)."""
        self.progress.close()
        summary = {
            "last_step": self.last_step,
            "skipped_steps": self.position.skipped_steps,
            "loss_scale": self._loss_scale,
        }
        if self.phases is not None:
            summary.update(self.engine.own_timing(self.phases.model))
            self.phases.remove()
        self.output.write_json("train_summary.json", summary)
        if self.position.skipped_steps and self.accelerator.is_main_process:
            logger.info(
                "%d of %d optimizer steps skipped for a gradient overflow (counted in the steps)",
                self.position.skipped_steps,
                self.last_step,
            )
