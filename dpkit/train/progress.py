"""Progress of a run: throughput, and what each optimizer step logs (file, bar, log line, trackers).

One progress bar and one log line per logging step, both from the main process;
every step's record goes to ``train_log.jsonl`` (:class:`~dpkit.train.run_output.RunOutput`
writes on the main process only).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

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
    the trackers' ``train/*`` scalars."""

    def __init__(
        self,
        accelerator: Any,
        output: Any,
        *,
        total_steps: int,
        logging_steps: int,
        initial_step: int = 0,
        memory: Any = None,
    ) -> None:
        """
        Args:
            accelerator: the run's Accelerator (main process, trackers).
            output: the run's :class:`~dpkit.train.run_output.RunOutput`.
            total_steps: optimizer steps the run makes (the bar's length).
            logging_steps: a log line every N steps.
            initial_step: where a resumed run starts.
            memory: a :class:`~dpkit.memory.MemoryTracker`, for the memory in the log line.
        """
        from tqdm.auto import tqdm

        self.accelerator = accelerator
        self.output = output
        self.total_steps = total_steps
        self.logging_steps = logging_steps
        self.memory = memory
        self.throughput = Throughput(world_size=accelerator.num_processes)
        self.progress = tqdm(
            total=total_steps,
            initial=initial_step,
            desc="train",
            disable=not accelerator.is_main_process,
        )

    def micro_batch(self, tokens: Any, samples: int) -> None:
        """Count one micro-batch's tokens (a device tensor is fine) and samples."""
        self.throughput.update(tokens, samples)

    def step(self, record: dict[str, Any]) -> None:
        """One optimizer step's record (``step`` and ``loss`` at least)."""
        step = record["step"]
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

    def close(self) -> None:
        self.progress.close()
