"""Running the real recipe under the real launchers, for the multi-process tests.

Every launch: its own session (so a timeout kills the whole process tree), a
free rendezvous port, a hard timeout, and any non-zero return code, negative
ones (killed by a signal) included, counted as failure by the caller.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from dpkit.run_output import read_jsonl

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
    "--overwrite-output-dir",
]  # fmt: skip


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
