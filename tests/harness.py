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

from dpkit.train.output import read_jsonl

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


# torch elastic (torchrun; accelerate launch on several processes) shows a worker's
# error file in its report as "  traceback : <message>" (torch 2.13,
# torch/distributed/elastic/multiprocessing/errors/__init__.py, _FAILURE_FORMAT_TEMPLATE).
ELASTIC_TRACEBACK = "  traceback : "


def error_lines(output: str, prog: str) -> list[str]:
    """The ``PROG: error:`` lines of a job's output as the program wrote them: printed on
    stderr, or shown by torch elastic's report from the worker's error file (with the
    report's ``  traceback : `` in front, removed here)."""
    return [
        line.removeprefix(ELASTIC_TRACEBACK)
        for line in output.splitlines()
        if f"{prog}: error:" in line
    ]


def assert_refused(
    result: Launch,
    message: str,
    output_dir: Path | None,
    exit_code: int | None = None,
    prog: str = "finetune.py",
) -> None:
    """Bad input: non-zero exit (``exit_code`` when given), exactly one error line holding
    ``message``, no traceback from dpkit's code, no process group, nothing written
    (``output_dir`` not created; ``None`` when it existed before and the caller checks it)."""
    assert result.returncode != 0, result.output[-3000:]
    if exit_code is not None:
        assert result.returncode == exit_code, result.output[-3000:]
    errors = error_lines(result.output, prog)
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


# FSDP2 against DDP, same flags: measured, both modes' losses equal DDP's bit for bit on 2
# CPU processes (6 classification steps, 3 LM steps; gloo sums a reduce-scatter in the
# order of an allreduce) and within 1e-7 at 4. Another backend may order the sum
# differently: fp32 rounding, about 1e-7 relative per step; 1e-5 leaves that margin and
# still catches a gradient averaged wrongly or left unsynchronised (1e-3 at step 2).
FSDP2_RTOL = 1e-5


def max_rel_diff(values: list[float], reference: list[float], length: int | None = None) -> float:
    """The largest |value - reference| / |reference| over paired series (losses, say) of
    equal, non-zero length (``length`` when given)."""
    assert len(values) == len(reference) > 0, (len(values), len(reference))
    if length is not None:
        assert len(values) == length, (len(values), length)
    return max(abs(a - b) / abs(b) for a, b in zip(values, reference, strict=True))


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
        # The processes' one-line errors first: a long traceback can push them out of the tail.
        errors = [line for line in self.output.splitlines() if ": error: " in line]
        assert self.returncode == 0, (
            f"exit code {self.returncode} from {' '.join(self.cmd)}\n"
            + "".join(f"{line}\n" for line in errors[:10])
            + self.output[-6000:]
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
        kill_tree(proc.pid)
        output, _ = proc.communicate()
        raise AssertionError(
            f"timed out after {timeout} s: {' '.join(cmd)}\n{output[-4000:]}"
        ) from None
    return Launch(cmd, proc.returncode, output, output_dir)


def kill_tree(pid: int) -> None:
    """SIGKILL a launcher and every process under it.

    Its process group is not enough: torch elastic starts each worker in a session of
    its own, so a worker outlives the killed launcher, keeps the output pipe open and
    ``communicate()`` waits on it for ever (seen in CI: two ranks blocked on a stale
    DeepSpeed JIT lock, the test hung past its timeout). The descendants are listed
    before anything is killed: once the launcher is gone they are init's children.
    """
    import psutil

    try:
        descendants = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for child in descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()


def python_cmd(*args: str, recipe: str = RECIPE) -> list[str]:
    return [sys.executable, recipe, *args]


def accelerate_cmd(launch_args: list[str], *args: str, recipe: str = RECIPE) -> list[str]:
    return [
        str(BIN / "accelerate"), "launch", "--main_process_port", str(free_port()),
        *launch_args, recipe, *args,
    ]  # fmt: skip


def deepspeed_cmd(nproc: int, *args: str, recipe: str = RECIPE) -> list[str]:
    launcher = [
        str(BIN / "deepspeed"), "--num_gpus", str(nproc), "--master_port", str(free_port()),
    ]  # fmt: skip
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "" and Path("/dev/nvidiactl").exists():
        # A GPU machine running the CPU suite (tests/conftest.py hid the GPUs): the
        # launcher sets CUDA_VISIBLE_DEVICES=0..N-1 for its workers whatever accelerator
        # it picked, so the worker command hides them again (and reads LOCAL_RANK).
        worker = ["env", "CUDA_VISIBLE_DEVICES=", sys.executable, "-u"]
        return [*launcher, "--no_local_rank", "--no_python", *worker, recipe, *args]
    return [*launcher, recipe, *args]


def torchrun_cmd(nproc: int, *args: str, recipe: str = RECIPE) -> list[str]:
    return [
        str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", str(free_port()),
        recipe, *args,
    ]  # fmt: skip


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


# Scores a saved model folder on the recipe's test split in a fresh process that imports
# neither dpkit's training code nor DeepSpeed: plain transformers, padding to the longest
# example (the recipe pads to a multiple of 8; masked positions do not change the logits).
_SCORE_SCRIPT = """
import json, sys, torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from dpkit.data.classification import load_classification_splits
model_dir, samples, max_length = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
tokenizer = AutoTokenizer.from_pretrained(model_dir)
splits, _ = load_classification_splits("rotten-tomatoes-snippets", text_column="text",
    label_column="label", validation_fraction=0.1, test_fraction=0.1, split_seed=42)
test = splits["test"].select(range(samples))
batch = tokenizer(list(test["text"]), truncation=True, max_length=max_length, padding=True,
                  return_tensors="pt")
labels = torch.tensor(list(test["label"]))
with torch.no_grad():
    logits = model(**batch).logits
print(json.dumps({
    "accuracy": (logits.argmax(-1) == labels).float().mean().item(),
    "loss": torch.nn.functional.cross_entropy(logits, labels).item(),
    "dtype": str(next(model.parameters()).dtype),
    "deepspeed_imported": "deepspeed" in sys.modules,
}))
"""


def score_model_folder(model_dir: Path, samples: int, max_length: int) -> dict:
    """Accuracy and mean cross-entropy of a saved classifier on the first ``samples``
    test examples, computed without dpkit's training code or DeepSpeed."""
    done = run_captured(
        [sys.executable, "-c", _SCORE_SCRIPT, str(model_dir), str(samples), str(max_length)]
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- single-process recipe runs that stop in pre-flight, from a warm process ----------------

# Imports what the recipe imports (about 6 s on 2 cores), once; then, per request, forks a
# child that runs the recipe as __main__ with the request's argv, output to a file, and
# reports the child's exit status. The child is an ordinary process running the whole
# recipe from its first line; only the imports it would repeat are shared. The server
# itself runs no torch operation, so no thread pool exists for fork to break.
_WARM_SERVER = """
import json, os, runpy, sys, traceback
import datasets, torch, transformers, accelerate, deepspeed  # noqa: F401
import dpkit, dpkit.train.resolution  # noqa: F401
print("@warm-recipe " + json.dumps({"ready": os.getpid()}), flush=True)
for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            out = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, 1)
            os.dup2(out, 2)
            os.chdir(request["cwd"])
            sys.argv = list(request["argv"])
            sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
            try:
                runpy.run_path(sys.argv[0], run_name="__main__")
                code = 0
            except SystemExit as exiting:
                if exiting.code is None or isinstance(exiting.code, int):
                    code = exiting.code or 0
                else:
                    print(exiting.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    print("@warm-recipe " + json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)
"""


class WarmRecipe:
    """Runs ``python recipes/finetune.py ARGS`` for runs that end before training (bad
    input), each in its own forked process, without paying the imports every time."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.count = 0
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WARM_SERVER],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env=launch_env(),
        )
        self._reply(timeout=300)

    def _reply(self, timeout: float) -> dict:
        """The server's next answer; libraries may print to its stdout at import."""
        import selectors

        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            while True:
                if not selector.select(max(deadline - time.monotonic(), 0)):
                    self.close()
                    raise AssertionError(f"the warm recipe process gave no answer in {timeout} s")
                line = self.proc.stdout.readline()
                if not line:
                    raise AssertionError(f"the warm recipe process exited ({self.proc.wait()})")
                if line.startswith("@warm-recipe "):
                    return json.loads(line.removeprefix("@warm-recipe "))

    def run(self, *args: str, output_dir: Path | None = None, timeout: int = 300) -> Launch:
        """Like ``run(python_cmd(*args), output_dir)``."""
        self.count += 1
        log = self.log_dir / f"run-{self.count}.log"
        argv = [RECIPE, *args]
        request = {"argv": argv, "cwd": str(REPO), "log": str(log)}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        returncode = self._reply(timeout)["returncode"]
        return Launch([sys.executable, *argv], returncode, log.read_text(), output_dir)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


from dpkit.plan.check import PlanCheck, check_run, format_check  # noqa: E402

MODEL_STATE_CATEGORIES = ("params", "grads", "optimizer", "master")


def assert_plan_matches_report(run_dir: Path, category_pct: float, total_pct: float) -> PlanCheck:
    """``dpkit plan --against run_dir`` against the run's own ``memory_report.json``, read
    here: per category (params, grads, optimizer, master) the plan's figure against the
    largest rank's, a category measured as 0 predicted as 0 and any other within
    ``category_pct`` percent; and the model-state total (the plan's categories added up)
    against the largest rank's sum of its four categories, within ``total_pct`` percent.
    The tolerances are the caller's, argued from its measurement. Returns the check."""
    check = check_run(run_dir)
    table = format_check(check)
    ranks = json.loads((Path(run_dir) / "memory_report.json").read_text())["ranks"]
    predicted = {c: check.predicted[c] for c in MODEL_STATE_CATEGORIES}
    for category in MODEL_STATE_CATEGORIES:
        measured = max(float(r[category]) for r in ranks)
        if measured == 0:
            assert predicted[category] == 0, f"{category}: measured 0\n{table}"
        else:
            error = abs(predicted[category] - measured) / measured
            assert error <= category_pct / 100, f"{category}: {100 * error:.2f}%\n{table}"
    measured_total = max(sum(float(r[c]) for c in MODEL_STATE_CATEGORIES) for r in ranks)
    predicted_total = sum(predicted.values())
    assert check.predicted["total"] == predicted_total, table
    error = abs(predicted_total - measured_total) / measured_total
    assert error <= total_pct / 100, f"total: {100 * error:.2f}%\n{table}"
    return check


def saved_tensors(checkpoint: Path) -> dict:
    """Every tensor of a sharded dpkit checkpoint by its key (``model/<name>``,
    ``optim/<name>/<moment>``, flattened to 1-D), read by torch's own converter of a
    Distributed Checkpoint folder (``dcp_to_torch_save``), not by dpkit."""
    import warnings

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_to_torch_save(str(checkpoint / "shards"), f"{tmp}/state.pt")
        return torch.load(f"{tmp}/state.pt", weights_only=True)


def saved_moments(checkpoint: Path) -> dict[str, dict]:
    """name -> {moment: flat fp32 tensor} of a sharded checkpoint (:func:`saved_tensors`)."""
    moments: dict[str, dict] = {}
    for key, value in saved_tensors(checkpoint).items():
        if key.startswith("optim/"):
            name, moment = key.removeprefix("optim/").rsplit("/", 1)
            moments.setdefault(name, {})[moment] = value
    return moments
