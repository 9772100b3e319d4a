"""Run guards, agreed by every rank at each optimizer-step boundary.

* A stop request: SIGTERM (preemption, Slurm, a launcher shutting down) or SIGINT
  (Ctrl-C) only sets a flag; the run saves a checkpoint at the next step boundary
  and exits. Ranks receive the signal at different moments, so the flag travels in
  the step's one reduction and every rank stops at the same step.
* A non-finite loss: the step's loss, averaged over ranks in the same reduction, is
  NaN or inf on every rank together, so every rank stops together; nothing is saved.

The reduction is the one the loop already makes for the logged loss: no extra
collective per step.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import torch

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Exit codes: a clean stop on a signal follows the shell convention 128 + signal.
EXIT_NON_FINITE = 3


class StopRequest:
    """Records the first SIGTERM/SIGINT instead of dying mid-step (or mid-save)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._record)

    def _record(self, signum: int, frame) -> None:
        if self.signum is None:
            self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "a stop request"

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or signal.SIGTERM)


@dataclass(frozen=True)
class StepStatus:
    loss: float
    """Mean over ranks of each rank's mean micro-batch loss in this step."""
    stop: bool
    """Some rank was asked to stop."""

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss)


def step_status(accelerator, window_losses: list[torch.Tensor], stop: StopRequest) -> StepStatus:
    """One reduction per step: the loss for the log, the NaN check and the stop flag."""
    local = torch.stack(
        [
            torch.stack(window_losses).mean(),
            torch.tensor(float(stop.requested), device=window_losses[0].device),
        ]
    )
    total = accelerator.reduce(local, "sum")
    return StepStatus(loss=total[0].item() / accelerator.num_processes, stop=total[1].item() > 0)


class NonFiniteLossError(RuntimeError):
    def __init__(self, step: int, loss: float, last_checkpoint: str | None):
        resume = (
            f"the last checkpoint, {last_checkpoint}, was written before it"
            if last_checkpoint
            else "no checkpoint was written"
        )
        super().__init__(
            f"step {step}: the loss is {loss} (averaged over ranks); stopped on every rank "
            f"without saving; {resume}. Lower --learning-rate, check --max-grad-norm, or "
            "use --mixed-precision no"
        )


# What the run passed as --collective-timeout (set by strategy.build_accelerator, which
# applies it), for the message when it fires.
COLLECTIVE_TIMEOUT_S: float = 600.0


def collective_failure(err: BaseException) -> str | None:
    """One line for a collective that failed because a peer hung or died, else None."""
    text = str(err).lower()
    if "timed out" in text or "timeout" in text:
        return (
            f"a collective did not complete within {COLLECTIVE_TIMEOUT_S:g} s "
            "(--collective-timeout): another rank is hung or stopped"
        )
    if "connection closed by peer" in text or "connection reset" in text or "broken pipe" in text:
        return "lost the connection to another rank: it died (see the launcher's report above)"
    return None


def exit_process(code: int) -> NoReturn:
    """End a rank with ``code`` without running the interpreter's teardown.

    Call once the rank is done: after its last collective and every file written.
    Objects that hold the gloo process group (DDP's reducer and its pending work,
    DeepSpeed's engine) sit in reference cycles; freed during interpreter
    finalization, they abort the process ("terminate called without an active
    exception", SIGABRT: seen in about 1 of 100 finished CPU launches under torch
    2.13, which turns a finished run into a failed job). Teardown also makes ranks
    that stop together (a NaN, a signal) exit at different moments, and the launcher
    kills the slower ones with SIGTERM as soon as one has exited. So: free those
    objects now, while the interpreter is whole, flush what is buffered, and leave.
    """
    gc.collect()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_and_exit(main: Callable[[], None]) -> NoReturn:
    """A recipe's entry point: ``main()``, then :func:`exit_process` with 0, or with the
    code of the ``SystemExit`` it raised (a stop, a non-finite loss, bad input)."""
    try:
        main()
    except SystemExit as exiting:
        if not isinstance(exiting.code, int):
            raise
        exit_process(exiting.code)
    exit_process(0)
