"""The test harness itself: a launch that outlives its timeout ends, workers included."""

from __future__ import annotations

import re
import sys
import time

import psutil
import pytest

from tests.harness import run

# A launcher whose worker runs in a session of its own (as torch elastic starts them) and
# holds the output pipe: both sleep well past the timeout.
LAUNCHER = """
import subprocess, sys, time
worker = subprocess.Popen(
    [sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True
)
print("worker", worker.pid, flush=True)
time.sleep(120)
"""


def test_a_timed_out_launch_ends_with_its_workers():
    started = time.monotonic()
    with pytest.raises(AssertionError, match="timed out after 3 s") as failed:
        run([sys.executable, "-c", LAUNCHER], timeout=3)
    # Before: the killed launcher's worker kept the pipe open and run() never returned.
    assert time.monotonic() - started < 60
    worker_pid = int(re.search(r"^worker (\d+)$", str(failed.value), re.MULTILINE).group(1))
    try:
        worker = psutil.Process(worker_pid)
    except psutil.NoSuchProcess:
        return  # killed and reaped
    # SIGKILL is delivered asynchronously: on a loaded machine the worker can still be
    # running for a moment after run() returns (seen under pytest -n 2). Its sleep lasts
    # 120 s, so gone (or a zombie awaiting its reaper) within 10 s is the kill's doing.
    _, alive = psutil.wait_procs([worker], timeout=10)
    assert not alive or worker.status() == psutil.STATUS_ZOMBIE
