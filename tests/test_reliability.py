"""Failure behaviour under real launchers: a rank killed or hung, a NaN loss, SIGTERM.

Each test starts a real 2-process run, waits until it has trained a few steps
(reading its train_log.jsonl), then does to it what a cluster does: kill -9 one
rank, SIGSTOP one rank, send SIGTERM to the job. No fault is simulated inside
dpkit; the NaN comes from a learning rate of 1e30.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from dpkit.checkpoints import folder
from tests.harness import REPO, accelerate_cmd, launch_env, run

pytestmark = pytest.mark.multiprocess

LONG_RUN = [
    "--max-train-samples", "512",
    "--micro-batch-size", "8",
    "--max-seq-length", "32",
    "--max-eval-samples", "16",
    "--logging-steps", "1",
    "--no-save-model",
]  # fmt: skip
DDP = ["--config_file", "ds_configs/accelerate/ddp.yaml", "--num_processes", "2"]
ZERO2 = ["--config_file", "ds_configs/accelerate/zero2.yaml", "--num_processes", "2"]


class Job:
    """A launch running in the background, in its own session."""

    def __init__(self, cmd: list[str], output_dir: Path):
        self.output_dir = output_dir
        self.log_path = output_dir.with_name(output_dir.name + ".log")
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in wait)
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=launch_env(),
        )

    def steps_logged(self) -> int:
        path = self.output_dir / "train_log.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def wait_for_step(self, step: int, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while self.steps_logged() < step:
            assert self.proc.poll() is None, f"exited early:\n{self.output()[-3000:]}"
            assert time.monotonic() < deadline, f"no step {step}:\n{self.output()[-3000:]}"
            time.sleep(0.05)

    def ranks(self) -> dict[int, psutil.Process]:
        """The recipe processes under the launcher, by their RANK."""
        found = {}
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if any(a.endswith("finetune.py") for a in child.cmdline()):
                    found[int(child.environ()["RANK"])] = child
            except (psutil.NoSuchProcess, KeyError):
                continue
        return found

    def wait(self, timeout: float) -> tuple[int, float]:
        """Exit code and seconds until the launcher exited; kills everything on timeout."""
        start = time.monotonic()
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(
                f"still running after {timeout} s:\n{self.output()[-3000:]}"
            ) from None
        finally:
            self._log.close()
        return code, time.monotonic() - start

    def output(self) -> str:
        return self.log_path.read_text()


def _gone(procs: list[psutil.Process], timeout: float = 15) -> bool:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return not alive


def test_a_killed_rank_ends_the_whole_job_and_keeps_the_last_checkpoint(tmp_path):
    out = tmp_path / "run"
    job = Job(
        accelerate_cmd(DDP, *LONG_RUN, "--max-steps", "500", "--save-steps", "2", "--output-dir", str(out)),
        out,
    )  # fmt: skip
    job.wait_for_step(3)
    ranks = job.ranks()
    assert sorted(ranks) == [0, 1]
    ranks[1].kill()  # SIGKILL, mid-step
    code, seconds = job.wait(timeout=120)
    assert code != 0
    assert seconds < 60, f"the job took {seconds:.0f} s to end after rank 1 died"
    assert _gone(list(ranks.values())), "orphan rank processes"
    output = job.output()
    # torchrun's report names the dead rank and the signal; rank 0 says what it saw.
    assert "rank      : 1" in output and "exitcode  : -9" in output, output[-3000:]
    # Rank 0's own line, not only the launcher's: one line for what it saw.
    lost = [line for line in output.splitlines() if "lost the connection to another rank" in line]
    assert lost == [
        "finetune.py: error: rank 0: lost the connection to another rank: it died "
        "(see the launcher's report above)"
    ], output[-3000:]
    latest = folder.list_checkpoints(out)[-1]
    assert folder.verify_checkpoint(latest).step >= 2


def test_a_hung_rank_fails_the_job_within_the_collective_timeout(tmp_path):
    out = tmp_path / "run"
    job = Job(
        accelerate_cmd(
            DDP, *LONG_RUN, "--max-steps", "500", "--save-steps", "0",
            "--collective-timeout", "10", "--output-dir", str(out),
        ),
        out,
    )  # fmt: skip
    job.wait_for_step(2)
    ranks = job.ranks()
    ranks[1].suspend()  # SIGSTOP: alive, but it takes part in no collective
    stopped = time.monotonic()
    try:
        # dpkit's part: rank 0 gives up after the 10 s timeout and exits with one line.
        gone, _ = psutil.wait_procs([ranks[0]], timeout=60)
        rank0_seconds = time.monotonic() - stopped
        # The launcher's part: it ends the job. A stopped process does not act on the
        # SIGTERM it is sent until continued (torchrun would SIGKILL it after a 30 s
        # grace); continued, it ends as a rank blocked in a collective does.
        ranks[1].resume()
        code, _ = job.wait(timeout=120)
    finally:
        for proc in ranks.values():
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
    assert gone, "rank 0 still running 60 s after its peer stopped"
    # 10 s of timeout, plus the step in flight and the exit (measured: about 12 s).
    assert 10 <= rank0_seconds < 10 + 20, f"rank 0 took {rank0_seconds:.0f} s to give up"
    assert code != 0
    output = job.output()
    assert (
        "finetune.py: error: rank 0: a collective did not complete within 10 s "
        "(--collective-timeout): another rank is hung or stopped" in output
    ), output[-3000:]
    assert _gone(list(ranks.values()))


def test_a_nan_loss_stops_every_rank_and_saves_nothing(tmp_path):
    out = tmp_path / "run"
    result = run(
        accelerate_cmd(
            ZERO2, *LONG_RUN, "--max-steps", "8", "--learning-rate", "1e30",
            "--warmup-ratio", "0", "--save-steps", "1", "--output-dir", str(out),
        ),
        out,
    )  # fmt: skip
    assert result.returncode != 0
    errors = [line for line in result.output.splitlines() if "finetune.py: error:" in line]
    assert len(errors) == 1, result.output[-3000:]
    assert (
        "the loss is nan (averaged over ranks); stopped on every rank without saving" in errors[0]
    )
    # Both ranks stopped by themselves, with dpkit's exit code for a non-finite loss.
    assert result.output.count("exitcode  : 3") == 2, result.output[-3000:]
    log = result.train_log
    assert log[-1]["loss"] == "nan"
    nan_step = log[-1]["step"]
    # Checkpoints of the finite steps before it exist; none at or after the NaN step.
    steps = [folder.verify_checkpoint(p).step for p in folder.list_checkpoints(out)]
    assert steps and max(steps) < nan_step


def test_sigterm_saves_at_the_next_step_and_resume_is_exact(tmp_path):
    args = [*LONG_RUN, "--max-steps", "16", "--save-steps", "100"]
    reference = run(
        accelerate_cmd(DDP, *args, "--output-dir", str(tmp_path / "ref")), tmp_path / "ref"
    )
    reference.check()
    out = tmp_path / "run"
    job = Job(accelerate_cmd(DDP, *args, "--output-dir", str(out)), out)
    job.wait_for_step(2)
    os.killpg(job.proc.pid, signal.SIGTERM)  # what Slurm does on preemption: the whole job
    code, seconds = job.wait(timeout=120)
    assert code != 0  # the launcher reports that it was signalled
    output = job.output()
    saved = folder.list_checkpoints(out)
    assert len(saved) == 1, output[-3000:]
    stopped_at = folder.verify_checkpoint(saved[0]).step
    assert 2 <= stopped_at < 16
    assert (
        f"dpkit: stopped by SIGTERM after step {stopped_at}/16; resume with --resume latest"
        in output
    )
    assert job.steps_logged() == stopped_at

    resumed = run(accelerate_cmd(DDP, *args, "--resume", "latest", "--output-dir", str(out)), out)
    resumed.check()
    assert f"resuming from step {stopped_at}" in resumed.output
    assert [r["step"] for r in resumed.train_log] == list(range(1, 17))
    # Same strategy, world size and RNG streams: the same losses as the run that never stopped.
    for got, want in zip(resumed.train_log, reference.train_log, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6), got["step"]


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_for_resume(tmp_path):
    out = tmp_path / "run"
    args = [*LONG_RUN, "--max-steps", "500", "--save-steps", "3", "--save-total-limit", "0"]
    job = Job(accelerate_cmd(DDP, *args, "--output-dir", str(out)), out)
    ckpts = out / "checkpoints"
    partial = ckpts / ".tmp-step-000006"
    deadline = time.monotonic() + 300
    while not partial.exists():  # the save of step 6 has begun (step 3's is complete)
        assert job.proc.poll() is None and time.monotonic() < deadline, job.output()[-3000:]
        time.sleep(0.005)
    job.ranks()[0].kill()  # the rank that writes, in the middle of writing
    code, _ = job.wait(timeout=120)
    assert code != 0
    assert not (ckpts / "step-000006").exists(), "the save finished before the kill"
    assert [p.name for p in folder.list_checkpoints(out)] == ["step-000003"]
    assert folder.verify_checkpoint(ckpts / "step-000003").step == 3

    resumed = run(
        accelerate_cmd(DDP, *LONG_RUN, "--max-steps", "8", "--save-steps", "0",
                       "--resume", "latest", "--output-dir", str(out)),
        out,
    ).check()  # fmt: skip
    assert "resuming from step 3" in resumed.output
    assert [r["step"] for r in resumed.train_log] == list(range(1, 9))
    # The interrupted save's leftovers are gone with the next save of that name or
    # stay hidden: only complete checkpoints are listed.
    assert [p.name for p in folder.list_checkpoints(out)] == ["step-000003", "step-000008"]
