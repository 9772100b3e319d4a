"""The checkpointed reference runs: uninterrupted 6-step runs that save at steps 3 and 6, shared by the modules that resume from them.

Every run: 6 optimizer steps over 128 examples (4 steps per epoch at global batch 32,
so a resume at step 3 lands mid-epoch and the run crosses an epoch boundary), a
checkpoint every 3 steps, launched with the strategy's shipped accelerate YAML (2
processes unless said). Each named reference is launched at most once per test session,
on first use, by the session fixture ``reference`` (tests/conftest.py):
tests/test_checkpoint.py resumes from them across strategies and world sizes,
tests/test_fsdp2.py compares FSDP2 with DDP on them.
"""

from __future__ import annotations

from pathlib import Path

from tests.harness import Launch, accelerate_cmd, max_rel_diff, python_cmd, run, saved_moments

CK_RUN = [
    "--max-steps", "6",
    "--max-train-samples", "128",
    "--max-eval-samples", "48",
    "--max-seq-length", "32",
    "--learning-rate", "1e-4",
    "--warmup-ratio", "0",
    "--logging-steps", "1",
    "--save-steps", "3",
    "--save-total-limit", "0",
]  # fmt: skip
# Resumed runs are compared by their logs; their own checkpoints and model are not needed.
LOGS_ONLY = ["--no-save-model", "--no-save-checkpoints"]
NO_DROPOUT = ["--dropout", "0"]  # runs on different world sizes draw different dropout masks
YAML_STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp2_shard_grad_op", "fsdp2_full_shard")
YAML = {s: ["--config_file", f"ds_configs/accelerate/{s}.yaml"] for s in YAML_STRATEGIES}


def launch_ck(strategy: str, nproc: int, out: Path, *args: str) -> Launch:
    """A checkpointed run of ``strategy`` on ``nproc`` processes (``python`` for one,
    else ``accelerate launch`` with the strategy's shipped YAML), checked to exit 0."""
    if nproc == 1:
        cmd = python_cmd(*CK_RUN, "--strategy", strategy, *args, "--output-dir", str(out))
    else:
        cmd = accelerate_cmd(
            [*YAML[strategy], "--num_processes", str(nproc)],
            *CK_RUN,
            *args,
            "--output-dir",
            str(out),
        )
    return run(cmd, out).check()


# name -> (strategy, processes, extra args). Only zero2's and fsdp2_shard_grad_op's final
# models are read (the export tests).
REFERENCES = {
    "ddp": ("ddp", 2, ["--micro-batch-size", "16", "--no-save-model"]),
    # The gathered layout (--checkpoint-format full), resumed by the same strategy.
    "zero1": (
        "zero1",
        2,
        ["--micro-batch-size", "16", "--no-save-model", "--checkpoint-format", "full"],
    ),
    # One ZeRO-2 run for every use: its model exported, its checkpoints truncated,
    # interrupted, consolidated, refused, resumed on 1 and 4 processes and by ZeRO-3,
    # and its losses compared with ZeRO-3's. Dropout off, since other world sizes and
    # ZeRO-3 draw other masks. (RNG streams restored under dropout: the ddp, zero1 and
    # ddp_accumulation runs' resumes check that, DeepSpeed's engine included: zero1.)
    "zero2": ("zero2", 2, ["--micro-batch-size", "16", *NO_DROPOUT]),
    # Accumulation, and rotation: a checkpoint every step, the last four kept, each
    # written in the background while the next step trains (--async-save).
    "ddp_accumulation": (
        "ddp",
        2,
        ["--micro-batch-size", "8", "--gradient-accumulation-steps", "2"]
        + ["--save-steps", "1", "--save-total-limit", "4", "--no-save-model", "--async-save"],
    ),
    # ZeRO-3 beside it (tests/test_zero3.py): the same run, the model loaded partitioned.
    "zero3_no_dropout": ("zero3", 2, ["--micro-batch-size", "16", *NO_DROPOUT]),
    "fsdp2_shard_grad_op": ("fsdp2_shard_grad_op", 2, ["--micro-batch-size", "16"]),
}


class ReferenceRuns:
    """``reference(name)``: the named run of :data:`REFERENCES`, launched on first use into
    ``root / ref-<name>``; the same :class:`~tests.harness.Launch` afterwards."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._done: dict[str, Launch] = {}

    def __call__(self, name: str) -> Launch:
        if name not in self._done:
            strategy, nproc, args = REFERENCES[name]
            self._done[name] = launch_ck(strategy, nproc, self.root / f"ref-{name}", *args)
        return self._done[name]


def step3(ref: Launch) -> Path:
    """The step-3 checkpoint of a reference run."""
    return ref.output_dir / "checkpoints" / "step-000003"


def moment_mismatches(got: dict, expected: dict) -> list[str]:
    """``name/moment`` of every Adam moment that is missing or not bit-identical."""
    import torch

    wrong = [name for name in expected if name not in got]
    for name, moments in expected.items():
        for key, value in moments.items():
            if name in got and not torch.equal(got[name].get(key, torch.empty(0)), value):
                wrong.append(f"{name}/{key}")
    return wrong


def assert_saved_again_unchanged(resumed: Launch, source: Path) -> None:
    """``resumed`` loaded ``source`` and saved it with no step trained (``--max-steps 3``):
    its step-3 save holds every Adam moment of ``source`` bit for bit."""
    assert "trained 0 steps in" in resumed.output
    expected = saved_moments(source)
    assert len(expected) > 100 and all(len(m) == 2 for m in expected.values())
    assert moment_mismatches(saved_moments(step3(resumed)), expected) == []


def assert_follows(resumed: Launch, uninterrupted: Launch, rtol: float) -> None:
    """``resumed`` (from step 3) trained steps 4-6 as ``uninterrupted`` did, within
    ``rtol``; the control: those steps move more than 10x the tolerance."""
    assert [r["step"] for r in resumed.train_log] == [4, 5, 6]
    after = uninterrupted.losses[3:]
    assert max_rel_diff(resumed.losses, after) <= rtol, (resumed.losses, after)
    assert max(after) - min(after) > 10 * rtol * max(after)
