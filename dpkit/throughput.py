"""Throughput: tokens/s and samples/s per rank and in total, over logging windows."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Throughput:
    """Counts work between two ``rates()`` calls on this rank.

    Tokens are real (non-padding) input tokens; the total assumes every rank
    runs at the same rate, which data parallelism enforces at each all-reduce.
    """

    world_size: int
    _tokens: int = 0
    _samples: int = 0
    _start: float = field(default_factory=time.perf_counter)

    def update(self, tokens, samples: int) -> None:
        """``tokens`` may be a device tensor: it is summed on the device and read
        only in :meth:`rates`, so counting costs no host sync per micro-step."""
        self._tokens = self._tokens + tokens
        self._samples += int(samples)

    def rates(self) -> dict[str, float]:
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
