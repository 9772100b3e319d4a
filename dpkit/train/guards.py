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

import contextlib
import gc
import json
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch

from dpkit.errors import EXIT_USAGE, UsageError, training_failure

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Exit codes: a clean stop on a signal follows the shell convention 128 + signal.
EXIT_NON_FINITE = 3
# How long a rank other than 0 waits, on bad input, for rank 0 to print the one line and
# the launcher to end the job (it stops every rank once one has failed). Only an input
# that rank 0 does not see waits it out; on a loaded machine rank 0 can reach its check
# well over 10 s after another rank (seen in CI: two lines, rank 0 killed first).
USAGE_ERROR_GRACE_S = 60.0


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

    def raise_if_non_finite(self, step: int, last_checkpoint: str | Path | None) -> None:
        """Stop on a NaN/inf loss: the verdict is the same on every rank (the loss is the
        mean over ranks), so every rank stops at this step, and none saves."""
        if not self.finite:
            raise NonFiniteLossError(
                step, self.loss, None if last_checkpoint is None else str(last_checkpoint)
            )


class StepGuard:
    """Agreed by every rank at each optimizer-step boundary, in one reduction per step:
    the step's loss averaged over ranks, whether it is finite, whether any rank was asked
    to stop.

    Create it once the loop is about to start (from then on SIGTERM/SIGINT finish the
    step instead of killing the rank); :meth:`add_loss` every micro-batch; :meth:`end_step`
    after every optimizer step, on every rank.
    """

    def __init__(self, accelerator) -> None:
        self.accelerator = accelerator
        self.stop_request = StopRequest()
        self._losses: list[torch.Tensor] = []

    def add_loss(self, loss: torch.Tensor) -> None:
        """The loss of one micro-batch (detached; no host sync)."""
        self._losses.append(loss.detach().float())

    def end_step(self) -> StepStatus:
        """The step's status: the mean over ranks of each rank's mean micro-batch loss,
        and the stop flag; the reduction is the one the log needs anyway."""
        if not self._losses:
            raise RuntimeError("StepGuard.end_step() before any add_loss() in this step")
        device = self._losses[0].device
        local = torch.stack(
            [
                torch.stack(self._losses).mean(),
                torch.tensor(float(self.stop_request.requested), device=device),
            ]
        )
        self._losses = []
        total = self.accelerator.reduce(local, "sum")
        return StepStatus(
            loss=total[0].item() / self.accelerator.num_processes, stop=total[1].item() > 0
        )

    @property
    def signal_name(self) -> str:
        return self.stop_request.name

    @property
    def exit_code(self) -> int:
        return self.stop_request.exit_code


class NonFiniteLossError(RuntimeError):
    """The step's loss, averaged over ranks, is NaN or inf: every rank stops at this step."""

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


def _collective_timeout_s() -> float | None:
    """The timeout of the live default process group, as torch applies it (None when
    there is no group or this torch does not expose it)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))
        return backend.options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        try:  # NCCL keeps its options on the CUDA backend
            backend = dist.group.WORLD._get_backend(torch.device("cuda"))
            return backend.options._timeout.total_seconds()
        except (AttributeError, RuntimeError):
            return None


def collective_failure(err: BaseException) -> str | None:
    """One line for a collective that failed because a peer hung or died, else None."""
    text = str(err).lower()
    if "timed out" in text or "timeout" in text:
        timeout = _collective_timeout_s()
        within = f"within {timeout:g} s " if timeout is not None else ""
        return (
            f"a collective did not complete {within}(--collective-timeout): another rank is "
            "hung or stopped"
        )
    if "connection closed by peer" in text or "connection reset" in text or "broken pipe" in text:
        return "lost the connection to another rank: it died (see the launcher's report above)"
    return None


def _torch_env_bool(env: Mapping[str, str], names: tuple[str, ...]) -> bool:
    """A boolean ProcessGroupNCCL setting as torch 2.13 parses it (``c10d/Utils.hpp``,
    ``getCvarBool``): the first name set wins; y/yes/1/t/true, case-insensitive."""
    for name in names:
        if name in env:
            return env[name].lower() in ("y", "yes", "1", "t", "true")
    return False


def _torch_env_int(env: Mapping[str, str], names: tuple[str, ...], default: int) -> int:
    """An integer ProcessGroupNCCL setting as torch parses it (``getCvarInt``)."""
    for name in names:
        if name in env:
            try:
                return int(env[name])
            except ValueError:
                return default  # torch itself refuses it when the group starts
    return default


def nccl_timeout_notice(
    backend: str, env: Mapping[str, str], collective_timeout_s: float
) -> str | None:
    """The one line that tells, at start-up, how a collective timeout ends this run when
    :func:`collective_failure`'s line cannot; None when it can.

    Under gloo, and under NCCL with ``TORCH_NCCL_BLOCKING_WAIT`` set, a timeout raises in
    the waiting thread and :func:`run_and_exit` prints dpkit's line. Under NCCL's default
    (``TORCH_NCCL_ASYNC_ERROR_HANDLING`` 3, or 1 as torchrun sets it) torch's watchdog
    thread ends the process (SIGABRT) before Python sees an error, so dpkit says it here.

    dpkit does not set these variables: blocking wait (torch 2.13, ``ProcessGroupNCCL``)
    starts no watchdog and blocks the host thread in every synchronous collective until
    it completes. DeepSpeed's ZeRO reductions are synchronous collectives issued from
    backward hooks, so backward could no longer run ahead of communication; and a rank
    stuck in a CUDA synchronisation behind a hung collective (an ``.item()``, a memory
    probe) would then hang forever instead of being ended. Not measured: no GPU has run
    this. A user who prefers dpkit's line sets ``TORCH_NCCL_BLOCKING_WAIT=1``; any value
    the user set is read here, never replaced.
    """
    if backend != "nccl":
        return None
    if _torch_env_bool(env, ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT")):
        return None
    names = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")
    mode = _torch_env_int(env, names, default=3)
    within = f"a collective that does not complete within {collective_timeout_s:g} s"
    if mode == 0:
        return (
            f"backend nccl with TORCH_NCCL_ASYNC_ERROR_HANDLING=0: {within} "
            "(--collective-timeout) is only logged by torch's watchdog; a hung rank hangs the job"
        )
    if mode == 2:
        return (
            f"backend nccl with TORCH_NCCL_ASYNC_ERROR_HANDLING=2: {within} "
            "(--collective-timeout) makes torch's watchdog abort the communicators without "
            "ending the process (torch: later GPU work may run on incomplete data)"
        )
    return (
        f"backend nccl: {within} (--collective-timeout) ends every rank from torch's NCCL "
        f"watchdog (TORCH_NCCL_ASYNC_ERROR_HANDLING={mode}: 'Watchdog caught collective "
        "operation timeout', then SIGABRT), not with dpkit's one-line error; "
        "TORCH_NCCL_BLOCKING_WAIT=1 gives that line at the cost of blocking the host in "
        "every collective"
    )


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


def say_last(line: str) -> None:
    """Put the line that ends this rank where the user reads it last, once.

    Under torch elastic (``torchrun``, and ``accelerate launch`` on several processes or
    with DeepSpeed), the launcher answers a failed worker with its own traceback and a
    report whose "Root Cause" is read from the worker's error file (the path in
    ``TORCHELASTIC_ERROR_FILE``; torch.distributed.elastic.multiprocessing.errors), or
    says only "exitcode: 2 ... To enable traceback see ..." without one. Written there,
    the line is that root cause: the last thing on screen, and shown once (printed too,
    it would appear a second time, above the launcher's traceback). Elsewhere
    (``python``, ``deepspeed``, accelerate's one-process launcher) it goes to stderr.
    """
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
    if error_file:
        # The format torch's ProcessFailure reads: a plain message and its time (the
        # launcher names the earliest failure as the root cause).
        record = {"message": line, "timestamp": int(time.time())}
        try:
            Path(error_file).write_text(json.dumps(record))
            return
        except OSError:
            pass  # the launcher would show the exit code only: print it instead
    print(line, file=sys.stderr, flush=True)


def print_usage_error(err: UsageError) -> None:
    """Bad input as one line naming the program (:func:`say_last`): once for the job, by
    rank 0 (every rank meets the same input); another rank says it only if rank 0 did
    not (an input only that rank sees) after a grace period."""
    prog = Path(sys.argv[0]).name
    rank = os.environ.get("RANK", "0")
    if rank != "0":
        # Leaving first would let the launcher kill rank 0 before it could print.
        time.sleep(USAGE_ERROR_GRACE_S)
        say_last(f"{prog}: error: rank {rank}: {err}")
    else:
        say_last(f"{prog}: error: {err}")


@contextlib.contextmanager
def refuse_and_exit() -> Iterator[None]:
    """Bad input inside the block ends the program the way a command line does: one line
    (:func:`print_usage_error`) and ``SystemExit(2)``, with no traceback, so that a
    script of the user's own needs no :func:`run_and_exit` for its refusals."""
    try:
        yield
    except UsageError as err:
        print_usage_error(err)
        raise SystemExit(EXIT_USAGE) from None


def run_and_exit(main: Callable[[], None]) -> NoReturn:
    """A recipe's entry point: ``main()``, then :func:`exit_process`.

    Exit codes, each with one line on stderr naming the program: 0 when ``main``
    returns; 2 for bad input (:class:`~dpkit.errors.UsageError`, printed once for the
    job, by rank 0: every rank meets the same input); 3 for a non-finite loss or an fp16
    run stopped at its minimum loss scale (printed by rank 0); 1 for a collective that
    failed because another rank hung or died (printed by every rank that saw it); otherwise the code of the ``SystemExit``
    ``main`` raised (a stop request: 128 + the signal). Any other exception keeps its
    traceback.
    """
    prog = Path(sys.argv[0]).name
    rank = os.environ.get("RANK", "0")
    try:
        main()
    except SystemExit as exiting:
        if not isinstance(exiting.code, int):
            raise
        exit_process(exiting.code)
    except UsageError as err:
        print_usage_error(err)
        exit_process(EXIT_USAGE)
    except NonFiniteLossError as err:
        if rank == "0":
            say_last(f"{prog}: error: {err}")
        exit_process(EXIT_NON_FINITE)
    except RuntimeError as err:
        line = collective_failure(err)
        if line is None:
            raise
        # Printed, not the launcher's root cause: that is the rank that died or hung.
        print(f"{prog}: error: rank {rank}: {line}", file=sys.stderr, flush=True)
        exit_process(1)
    except Exception as err:  # a library's failure of the training itself (fp16's loss scale)
        line = training_failure(err)
        if line is None:
            raise
        if rank == "0":  # every rank fails at the same step (DeepSpeed agrees on overflow)
            say_last(f"{prog}: error: {line}")
        exit_process(EXIT_NON_FINITE)
    exit_process(0)
