"""Running the real recipe under the real launchers, for the multi-process tests.

Every launch: its own session (so a timeout kills the whole process tree), a
free rendezvous port, a hard timeout, and any non-zero return code, negative
ones (killed by a signal) included, counted as failure by the caller.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from dpkit.train.run_output import read_jsonl

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
RECIPE = "recipes/finetune.py"
LAUNCH_TIMEOUT_S = int(os.environ.get("DPKIT_TEST_LAUNCH_TIMEOUT", "600"))

# A short fine-tune of the real MiniLM on the real data: 6 optimizer steps,
# dropout off so that runs at different world sizes see identical computations.
SHORT_RUN = [
    "--max-steps", "6",
    "--max-train-samples", "512",
    "--max-eval-samples", "101",  # odd on purpose: the last eval batch is uneven
    "--micro-batch-size", "16",
    "--max-seq-length", "64",
    "--learning-rate", "1e-4",
    "--warmup-ratio", "0",
    "--dropout", "0",
    "--logging-steps", "1",
    "--no-save-checkpoints",
    "--overwrite-output-dir",
]  # fmt: skip


def assert_refused(
    result: Launch, message: str, output_dir: Path | None, exit_code: int | None = None
) -> None:
    """Bad input: non-zero exit (``exit_code`` when given), exactly one error line holding
    ``message``, no traceback from dpkit's code, no process group, nothing written
    (``output_dir`` not created; ``None`` when it existed before and the caller checks it)."""
    assert result.returncode != 0, result.output[-3000:]
    if exit_code is not None:
        assert result.returncode == exit_code, result.output[-3000:]
    errors = [line for line in result.output.splitlines() if "finetune.py: error:" in line]
    assert len(errors) == 1, result.output[-3000:]  # one line for the job, not one per rank
    assert message in errors[0], errors[0]
    # No traceback from dpkit's code (a launcher may still print its own when a child exits non-zero).
    frames = [line for line in result.output.splitlines() if '.py", line' in line]
    assert not [f for f in frames if "/dpkit/" in f or "/recipes/" in f], result.output[-3000:]
    # DeepSpeed logs this when it starts a process group; dpkit logs its strategy line after prepare.
    assert "Initializing TorchBackend" not in result.output, result.output[-3000:]
    assert "dpkit: strategy=" not in result.output, result.output[-3000:]
    if output_dir is not None:
        assert not output_dir.exists(), "nothing may be written for a refused run"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Launch:
    cmd: list[str]
    returncode: int
    output: str
    output_dir: Path | None

    def _json(self, name: str) -> dict:
        return json.loads((self.output_dir / name).read_text())

    def _jsonl(self, name: str) -> list[dict]:
        return read_jsonl(self.output_dir / name)

    @property
    def run_info(self) -> dict:
        return self._json("run_info.json")

    @property
    def ds_config(self) -> dict:
        return self._json("ds_config.json")

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self._jsonl("train_log.jsonl")]

    @property
    def train_log(self) -> list[dict]:
        return self._jsonl("train_log.jsonl")

    @property
    def metrics(self) -> list[dict]:
        return self._jsonl("metrics.jsonl")

    def final(self, split: str) -> dict:
        return [m for m in self.metrics if m.get("final") and m["split"] == split][-1]

    def check(self) -> Launch:
        assert self.returncode == 0, (
            f"exit code {self.returncode} from {' '.join(self.cmd)}\n{self.output[-6000:]}"
        )
        return self


def launch_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    # No Hub here: fail fast instead of retrying the network.
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    for key in [k for k in env if k.startswith("ACCELERATE_")] + [
        "RANK",
        "WORLD_SIZE",
        "MASTER_PORT",
    ]:
        env.pop(key, None)
    env.update(extra)
    return env


def run(
    cmd: list[str], output_dir: Path | None = None, timeout: int = LAUNCH_TIMEOUT_S, **env
) -> Launch:
    """Run ``cmd`` from the repo root; on timeout kill its whole process group and fail."""
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=launch_env(**env),
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(
            f"timed out after {timeout} s: {' '.join(cmd)}\n{output[-4000:]}"
        ) from None
    return Launch(cmd, proc.returncode, output, output_dir)


def python_cmd(*args: str) -> list[str]:
    return [sys.executable, RECIPE, *args]


def accelerate_cmd(launch_args: list[str], *args: str) -> list[str]:
    return [
        str(BIN / "accelerate"), "launch", "--main_process_port", str(free_port()),
        *launch_args, RECIPE, *args,
    ]  # fmt: skip


def deepspeed_cmd(nproc: int, *args: str) -> list[str]:
    return [
        str(BIN / "deepspeed"),
        "--num_gpus",
        str(nproc),
        "--master_port",
        str(free_port()),
        RECIPE,
        *args,
    ]


def torchrun_cmd(nproc: int, *args: str) -> list[str]:
    return [
        str(BIN / "torchrun"),
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(free_port()),
        RECIPE,
        *args,
    ]


def run_nodes(
    cmds: list[list[str]], output_dir: Path | None = None, timeout: int = LAUNCH_TIMEOUT_S, **env
) -> list[Launch]:
    """Run one launcher per "node" (``cmds[i]`` is node i's command) side by side from the
    repo root, each in its own session, and wait for all of them.

    When one node exits non-zero, the others are killed at once (process group and all):
    a node whose peer is gone waits in its rendezvous or its next collective until the
    process-group timeout. On ``timeout`` every node is killed and the call fails.
    Returns one :class:`Launch` per node, in order; a killed node has a negative code.
    """
    procs: list[subprocess.Popen] = []

    def kill_all() -> None:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):  # the whole group has exited
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in procs:
            proc.wait()

    timed_out = False
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile(mode="w+")) for _ in cmds]
        stack.callback(kill_all)  # also when the wait below is interrupted
        for cmd, log in zip(cmds, logs, strict=True):
            procs.append(
                subprocess.Popen(
                    cmd,
                    cwd=REPO,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                    env=launch_env(**env),
                )
            )
        deadline = time.monotonic() + timeout
        while True:
            codes = [proc.poll() for proc in procs]  # every node polled, each time
            if None not in codes or any(code not in (None, 0) for code in codes):
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.5)
        kill_all()  # the nodes still running after a failure, and any stray children
        texts = []
        for log in logs:
            log.seek(0)
            texts.append(log.read())
    if timed_out:
        shown = "\n".join(
            f"--- node {i}: {' '.join(cmd)}\n{text[-3000:]}"
            for i, (cmd, text) in enumerate(zip(cmds, texts, strict=True))
        )
        raise AssertionError(f"timed out after {timeout} s\n{shown}")
    return [
        Launch(cmd, proc.returncode, text, output_dir)
        for cmd, proc, text in zip(cmds, procs, texts, strict=True)
    ]


def run_captured(cmd: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    """A short single-process command from the repo root, stdout and stderr kept apart."""
    return subprocess.run(
        cmd, cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=timeout
    )
