"""The run directory: resolved configuration, per-step and per-evaluation JSON lines.

Layout of ``<output_dir>``::

    run_config.json     every recipe argument and the launcher's environment
    run_info.json       what really ran (strategy, world size, backend, batch, precision)
                        and what the script adds (recipes/finetune.py: ``schedule``, and
                        ``labels``, the label each class id stands for, ``{"0": "neg",
                        "1": "pos"}``, as the saved model's config.json ``id2label``)
    ds_config.json      the resolved DeepSpeed config (ZeRO runs)
    train_log.jsonl     one line per optimizer step: loss (mean over ranks), lr, grad norm;
                        ``skipped: true`` on a step whose update was skipped for a
                        gradient overflow, and in fp16 runs ``loss_scale`` (the one the
                        step ran at) and ``skipped_steps`` (so far) on every line
    train_summary.json  at the end of training: the last step, how many steps were
                        skipped (they count toward the steps), the final loss scale
    metrics.jsonl       one line per evaluation
    memory_report.json  the per-rank memory report, with each rank's timeline of one step
    memory_timeline.png that timeline as a chart (``dpkit report RUN_DIR`` draws it again)
    model/              the final model (save_pretrained, safetensors, fp32) and tokenizer
    checkpoints/        the full training state every --save-steps (see dpkit.checkpoints)

Only the main process writes; every method is a no-op elsewhere.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

# Files a previous run left that would mix with this run's lines.
_RUN_FILES = (
    "run_config.json",
    "run_info.json",
    "ds_config.json",
    "train_log.jsonl",
    "checkpoint_log.jsonl",
    "train_summary.json",
    "metrics.jsonl",
    "memory_report.json",
    "memory_timeline.png",
)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if hasattr(value, "item"):
        return value.item()
    return value


class RunOutput:
    """The run directory: every method writes from the main process only (a no-op elsewhere)."""

    def __init__(self, output_dir: str, is_main_process: bool):
        self.path = Path(output_dir)
        self.is_main = is_main_process

    def start(self, run_config: dict, resume_step: int | None = None) -> None:
        """Create the directory and write the config.

        A fresh run clears a previous run's logs and checkpoints (only reached with
        --overwrite-output-dir, checked at argument parsing). A resumed run keeps its
        logs up to ``resume_step`` and drops what the interrupted run logged after it.
        """
        if not self.is_main:
            return
        self.path.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            for name in _RUN_FILES:
                (self.path / name).unlink(missing_ok=True)
            shutil.rmtree(self.path / "checkpoints", ignore_errors=True)
        else:
            # The interrupted run's summary, if it got that far, counts steps this run redoes.
            (self.path / "train_summary.json").unlink(missing_ok=True)
            for name in ("train_log.jsonl", "metrics.jsonl", "checkpoint_log.jsonl"):
                path = self.path / name
                if path.exists():
                    kept = [r for r in read_jsonl(path) if r.get("step", 0) <= resume_step]
                    tmp = path.with_name(f".{name}.tmp")
                    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
                    os.replace(tmp, path)
        self.write_json("run_config.json", run_config)

    def write_json(self, name: str, payload: dict) -> None:
        if not self.is_main:
            return
        tmp = self.path / f".{name}.tmp"
        tmp.write_text(json.dumps(payload, indent=2, default=_jsonable) + "\n")
        os.replace(tmp, self.path / name)

    def append_jsonl(self, name: str, record: dict) -> None:
        if not self.is_main:
            return
        clean = {k: _jsonable(v) for k, v in record.items()}
        with open(self.path / name, "a") as f:
            f.write(json.dumps(clean) + "\n")

    @property
    def model_dir(self) -> Path:
        return self.path / "model"


# What only a run that got as far as training leaves behind. A folder holding just
# run_config.json is a start that failed before training (a bad tokenizer, a dead
# rank at start-up): retrying into it needs no --overwrite-output-dir.
_RUN_PRODUCTS = ("run_info.json", "train_log.jsonl", "metrics.jsonl", "memory_report.json")
_RUN_FOLDERS = ("model", "checkpoints")


def holds_run(output_dir: str | Path) -> bool:
    """Whether ``output_dir`` holds the products of a run that started training."""
    out = Path(output_dir)
    return any((out / name).is_file() for name in _RUN_PRODUCTS) or any(
        (out / name).is_dir() for name in _RUN_FOLDERS
    )


def check_output_dir(output_dir: str, *, overwrite: bool, resumes_own_run: bool = False) -> None:
    """Refuse (one line) an ``--output-dir`` that is a file, that cannot be created, or that
    holds another run unless ``--overwrite-output-dir`` or the run resumes its own
    checkpoints there. Nothing is left behind by the check."""
    from dpkit.errors import UsageError

    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--output-dir={output_dir!r}: exists and is not a directory")
    if not out.exists():
        problem = _why_not_creatable(out)
        if problem:
            raise UsageError(f"--output-dir={output_dir!r}: cannot be created ({problem})")
    elif not os.access(out, os.W_OK | os.X_OK):
        raise UsageError(f"--output-dir={output_dir!r}: not writable")
    if holds_run(out) and not overwrite and not resumes_own_run:
        raise UsageError(
            f"--output-dir={output_dir!r}: holds another run; pass --overwrite-output-dir "
            "or choose a new directory"
        )


def _why_not_creatable(path: Path) -> str | None:
    """Make a folder of this process's own where the first missing one would go, then
    remove it: the only sure test (a read-only mount or /proc refuses even root, whom
    os.access lets through). Not ``path`` itself: every rank probes at once, and a rank
    that sees another's probe of ``path`` come and go between its own checks refuses the
    run ("exists and is not a directory" or "not writable": the likely cause of one rank
    of four exiting 2 at start in CI, its line lost from the log's tail)."""
    probe = path.absolute()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is not a directory"
    try:
        made = tempfile.mkdtemp(prefix=".dpkit-probe-", dir=probe)
    except OSError as err:
        return f"{probe}: {err.strerror or type(err).__name__}"
    with contextlib.suppress(OSError):
        os.rmdir(made)
    return None


def read_json(path: str | Path) -> dict:
    """A JSON file a run wrote (run_info.json, memory_report.json, ds_config.json...)."""
    return json.loads(Path(path).read_text())


def read_jsonl(path: str | Path) -> list[dict]:
    """The records of a JSON-lines file (for tests and the bench)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
