"""Checkpoints: exact resume, atomic saves, refusal of partial ones, export, and resume
across strategies and world sizes. Real recipe, real launchers, 2 CPU processes.

The uninterrupted runs are tests/checkpoint_runs.py's references (session fixture
``reference``). "Interrupted at step 3" is a run resumed from the step-3 checkpoint of
an uninterrupted run: that folder holds exactly what the interrupted run had written,
since nothing after step 3 touches it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dpkit.checkpoints import folder, resume
from dpkit.errors import UsageError
from dpkit.train.output import read_jsonl
from tests.checkpoint_runs import (
    CK_RUN,
    LOGS_ONLY,
    NO_DROPOUT,
    REFERENCES,
    YAML,
    launch_ck,
    moment_mismatches,
    step3,
)
from tests.harness import (
    BIN,
    REPO,
    accelerate_cmd,
    assert_refused,
    max_rel_diff,
    python_cmd,
    run,
    run_captured,
    saved_moments,
    score_model_folder,
)

pytestmark = pytest.mark.multiprocess

# Same strategy, same world size, RNG restored: the same arithmetic as the run that
# never stopped; only the order of float reductions could differ.
SAME_RUN_RTOL = 1e-6
# Across strategies and world sizes: the equivalence tolerance of tests/test_launchers.py.
CROSS_RTOL = 2e-3


def _check_continues(ref, resumed, rtol: float) -> None:
    """Steps 4-6 of the resumed run follow the uninterrupted trajectory."""
    assert [r["step"] for r in resumed.train_log] == [4, 5, 6]
    after = [r["loss"] for r in ref.train_log][3:]
    assert max_rel_diff(resumed.losses, after) < rtol
    lrs = [r["lr"] for r in ref.train_log][3:]
    assert [r["lr"] for r in resumed.train_log] == pytest.approx(lrs, rel=1e-12)
    # The trajectory moves: agreement is not an artefact of a frozen model.
    assert max(after) - min(after) > 10 * rtol * max(after)


# zero2 resumes the same way in test_interrupted_save_leaves_the_previous_checkpoint_in_use,
# which checks the same continuation on its one launch; plain DDP's resume is
# ddp_accumulation's with one micro-batch a step (the same DDP run, dropout and RNG
# streams restored, plus accumulation, rotation and background saves): one launch, not two.
@pytest.mark.parametrize("name", ["zero1", "ddp_accumulation"])
def test_resumed_run_equals_the_uninterrupted_one(reference, tmp_path, name):
    ref = reference(name)
    strategy, nproc, args = REFERENCES[name]
    resumed = launch_ck(strategy, nproc, tmp_path, *args, *LOGS_ONLY, "--resume", str(step3(ref)))
    assert "resuming from step 3 (epoch 0, 96 examples in)" in resumed.output
    assert "RNG streams not restored" not in resumed.output
    _check_continues(ref, resumed, SAME_RUN_RTOL)
    # The final evaluation sees the same weights.
    assert resumed.final("test")["accuracy"] == ref.final("test")["accuracy"]


# ZeRO-2 from 2 to 4 processes, and that checkpoint from 4 to DDP on 2, resume in
# test_resume_restores_the_saved_optimizer_state_exactly, whose check (every Adam moment
# bit for bit) is stronger than the loss trajectory's; one launch each, not two.
@pytest.mark.parametrize(
    "source, strategy, nproc, args",
    [
        ("zero2", "zero2", 1, ["--micro-batch-size", "16"] + ["--gradient-accumulation-steps", "2"]),
        ("ddp", "zero2", 2, ["--micro-batch-size", "16"]),
    ],
    ids=["zero2-2to1", "ddp-to-zero2"],
)  # fmt: skip
def test_resume_across_world_sizes_and_strategies(
    reference, tmp_path, source, strategy, nproc, args
):
    ref = reference(source)
    extra = NO_DROPOUT if "--dropout" in REFERENCES[source][2] else []  # as the source ran
    resumed = launch_ck(
        strategy, nproc, tmp_path, *args, *extra, *LOGS_ONLY, "--resume", str(step3(ref))
    )
    assert f"as {strategy} on {nproc} process(es)" in resumed.output
    changed_world = nproc != REFERENCES[source][1]
    assert ("RNG streams not restored (2 -> " in resumed.output) == changed_world
    _check_continues(ref, resumed, CROSS_RTOL)


def _moments(checkpoint_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    if (checkpoint_dir / "optimizer.pt").is_file():  # --checkpoint-format full
        saved = torch.load(checkpoint_dir / "optimizer.pt", map_location="cpu", weights_only=True)
        return {n: {k: v.flatten() for k, v in m.items()} for n, m in saved["moments"].items()}
    return saved_moments(checkpoint_dir)


@pytest.fixture(scope="module")
def zero2_resumed_on_4(reference, module_tmp):
    """The zero2 reference's step 3 resumed by ZeRO-2 on 4 processes with --max-steps 3
    (no step to train): its final save, written sharded by 4 ranks, is the state it
    loaded. Checked in the 2 -> 4 case below and read back on 2 in the 4 -> 2 case."""
    resumed = launch_ck(
        "zero2", 4, module_tmp / "zero2-on-4", "--micro-batch-size", "8", "--max-steps", "3",
        "--no-save-model", "--resume", str(step3(reference("zero2"))),
    )  # fmt: skip
    assert "trained 0 steps in" in resumed.output  # the save holds what was loaded
    return resumed


@pytest.mark.parametrize(
    "source, strategy, nproc, args",
    [
        ("zero2", "zero2", 4, None),
        # From the 4-process checkpoint above: ZeRO-2 on 4 -> DDP on 2.
        ("zero2", "ddp", 2, ["--micro-batch-size", "16"]),
        ("fsdp2_shard_grad_op", "zero2", 2, ["--micro-batch-size", "16"]),
        # Read from shards, written gathered (--checkpoint-format full): both layouts agree.
        ("ddp", "fsdp2_full_shard", 2, ["--micro-batch-size", "16", "--checkpoint-format", "full"]),
    ],
    ids=["zero2-2to4", "zero2-4to2-ddp", "fsdp2-to-zero2", "ddp-to-fsdp2-full"],
)
# FSDP2 <-> ZeRO/DDP continue from exactly the saved state here; that FSDP2 then trains
# exactly as DDP does is tests/test_fsdp2.py's (same flags, bit-for-bit losses).
def test_resume_restores_the_saved_optimizer_state_exactly(
    reference, zero2_resumed_on_4, tmp_path, source, strategy, nproc, args
):
    """Resume at step 3 with --max-steps 3 (no step to train), so the run's final save is
    the state it loaded: re-sharded for the new world size or strategy, then gathered
    back. Every Adam moment, by parameter name, is the source's bit for bit. (The loss
    comparison of the cross-resume runs cannot see a swap of two same-shaped parameters'
    moments: 3e-5 of loss deviation, under its 2e-3 tolerance.)"""
    ref = reference(source)
    if args is None:  # 2 -> 4: the module's run
        resumed = zero2_resumed_on_4
    else:
        # 4 -> 2 reads the 4-process checkpoint (the source's state, checked in 2 -> 4).
        start = step3(zero2_resumed_on_4 if strategy == "ddp" else ref)
        resumed = launch_ck(
            strategy, nproc, tmp_path, *args, "--max-steps", "3", "--no-save-model",
            "--resume", str(start),
        )  # fmt: skip
        assert "trained 0 steps in" in resumed.output
        if strategy == "ddp":
            assert "RNG streams not restored (4 -> 2" in resumed.output
    expected = _moments(step3(ref))
    assert len(expected) > 100 and all(len(m) == 2 for m in expected.values())
    assert moment_mismatches(_moments(step3(resumed)), expected) == []

    # Negative control: the comparison catches the breaks the loss comparison misses.
    query, key = (f"bert.encoder.layer.0.attention.self.{p}.weight" for p in ("query", "key"))
    swapped = {name: dict(m) for name, m in expected.items()}
    swapped[query], swapped[key] = swapped[key], swapped[query]
    assert moment_mismatches(swapped, expected) == [
        f"{query}/exp_avg", f"{query}/exp_avg_sq", f"{key}/exp_avg", f"{key}/exp_avg_sq",
    ]  # fmt: skip
    zeroed = {name: {k: torch.zeros_like(v) for k, v in m.items()} for name, m in expected.items()}
    assert len(moment_mismatches(zeroed, expected)) >= len(expected)


def test_each_rank_writes_its_own_shard_of_the_state(reference):
    """FSDP2 shard-grad-op on 2 processes (sharded, the default): one file per rank, each
    about half of MiniLM's fp32 weights and two Adam moments, listed in the manifest;
    nothing was gathered into one file. The zero1 reference wrote the gathered layout."""
    checkpoint = step3(reference("fsdp2_shard_grad_op"))
    files = sorted(p.name for p in (checkpoint / "shards").glob("*.distcp"))
    assert files == ["__0_0.distcp", "__1_0.distcp"]
    assert not (checkpoint / "optimizer.pt").exists()
    assert not (checkpoint / "model.safetensors").exists()
    # MiniLM + a 2-label head: 22,713,216 + 384 x 2 + 2 parameters (the model card's
    # 22.7M), each saved as fp32 weight, exp_avg and exp_avg_sq: 12 bytes.
    params = 22_713_216 + 384 * 2 + 2
    sizes = [(checkpoint / "shards" / f).stat().st_size for f in files]
    for size in sizes:
        assert size == pytest.approx(12 * params / 2, rel=0.02), sizes
    manifest = json.loads((checkpoint / "manifest.json").read_text())["files"]
    assert {f"shards/{f}" for f in files} <= set(manifest)
    index = json.loads((checkpoint / "tensors.json").read_text())
    assert index["step"] == 3
    # Every weight trains (BERT's buffers are not persistent): each has its moments.
    assert sorted(index["moments"]) == sorted(index["shapes"]) and len(index["shapes"]) == 105
    full = reference("zero1").output_dir / "checkpoints" / "step-000003"
    assert (full / "optimizer.pt").is_file() and not (full / "shards").exists()


def test_checkpoints_are_complete_and_rotated(reference):
    ref = reference("ddp_accumulation")
    kept = folder.list_checkpoints(ref.output_dir)
    assert [p.name for p in kept] == [f"step-00000{i}" for i in (3, 4, 5, 6)]
    assert not list((ref.output_dir / "checkpoints").glob(".tmp-*"))
    for path in kept:
        state = folder.verify_checkpoint(path)
        assert state.global_batch_size == 32
        assert (state.micro_batch_size, state.gradient_accumulation_steps) == (8, 2)
    # The last step of an epoch resumes at the start of the next one.
    epoch_end = folder.verify_checkpoint(kept[1])
    assert (epoch_end.step, epoch_end.epoch, epoch_end.samples_in_epoch) == (4, 1, 0)
    # Written in the background (--async-save), each completed before the next began; the
    # log says what each cost: bytes per rank (DDP's replicated state split evenly), the
    # seconds until complete, and training's stall, the copy to CPU memory, within them.
    records = read_jsonl(ref.output_dir / "checkpoint_log.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    params = 22_713_216 + 384 * 2 + 2  # MiniLM and a 2-label head
    for record in records:
        assert record["async"] is True and record["checkpoint_format"] == "sharded"
        assert 0 < record["stall_seconds"] <= record["seconds"]
        assert len(record["bytes_per_rank"]) == 2
        for written in record["bytes_per_rank"]:
            assert written == pytest.approx(12 * params / 2, rel=0.01)
    log_lines = [
        line for line in ref.output.splitlines() if "being written in the background" in line
    ]
    assert len(log_lines) == 6


def test_exported_model_loads_without_deepspeed_and_scores_the_same(reference):
    ref = reference("zero2")
    scored = score_model_folder(ref.output_dir / "model", samples=48, max_length=32)
    assert scored["deepspeed_imported"] is False
    assert scored["dtype"] == "torch.float32"
    # The run evaluated its live ZeRO engine; the folder is scored by plain transformers.
    final = ref.final("test")
    assert scored["accuracy"] == pytest.approx(final["accuracy"], abs=1e-6)
    assert scored["loss"] == pytest.approx(final["loss"], rel=1e-5)


def _copy_run(ref, dest: Path) -> Path:
    shutil.copytree(ref.output_dir, dest)
    return dest


def test_truncated_checkpoint_is_refused_before_anything_starts(reference, tmp_path):
    ref = reference("zero2")
    broken = shutil.copytree(step3(ref), tmp_path / "step-000003")
    shard = broken / "shards" / "__1_0.distcp"  # rank 1's part of the weights and moments
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(
        UsageError, match=rf"shards/__1_0.distcp is {size // 2} bytes, the manifest says {size}"
    ):
        folder.verify_checkpoint(broken)
    out = tmp_path / "run"
    result = run(
        python_cmd(*CK_RUN, "--micro-batch-size", "16", "--gradient-accumulation-steps", "2",
                   "--resume", str(broken), "--output-dir", str(out)),
    )  # fmt: skip
    assert result.returncode == 2, result.output[-3000:]
    errors = [line for line in result.output.splitlines() if "error:" in line]
    assert errors == [
        f"finetune.py: error: --resume={str(broken)!r}: shards/__1_0.distcp is {size // 2} bytes, "
        f"the manifest says {size} (truncated or partly written)"
    ]
    assert not out.exists()


def test_interrupted_save_leaves_the_previous_checkpoint_in_use(reference, tmp_path):
    """A save killed half-way leaves a .tmp-step-* folder; --resume latest skips it, and
    the ZeRO-2 run resumed from step 3 equals the uninterrupted one (as the other
    strategies do in test_resumed_run_equals_the_uninterrupted_one)."""
    ref = reference("zero2")
    run_dir = _copy_run(ref, tmp_path / "run")
    ckpts = run_dir / "checkpoints"
    partial = ckpts / ".tmp-step-000006"
    (ckpts / "step-000006").rename(partial)
    (partial / "manifest.json").unlink()  # the manifest is written last
    (partial / "shards" / "__1_0.distcp").unlink()  # rank 1 had not finished writing
    assert [p.name for p in folder.list_checkpoints(run_dir)] == ["step-000003"]
    ref_log = (run_dir / "train_log.jsonl").read_text().splitlines()
    resumed = run(
        accelerate_cmd(
            [*YAML["zero2"], "--num_processes", "2"],
            *CK_RUN,
            "--micro-batch-size",
            "16",
            *NO_DROPOUT,  # the reference's
            "--resume",
            "latest",
            "--output-dir",
            str(run_dir),
        ),  # fmt: skip
        run_dir,
    ).check()
    assert "resuming from step 3 (epoch 0, 96 examples in)" in resumed.output
    assert "RNG streams not restored" not in resumed.output
    # The log of the continued run: steps 1-3 kept, 4-6 written again, equal to before.
    log = [json.loads(x) for x in (run_dir / "train_log.jsonl").read_text().splitlines()]
    before = [json.loads(x) for x in ref_log]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]
    assert max_rel_diff([r["loss"] for r in log], [r["loss"] for r in before]) < SAME_RUN_RTOL
    assert [r["lr"] for r in log] == pytest.approx([r["lr"] for r in before], rel=1e-12)
    after = [r["loss"] for r in before][3:]  # the trajectory moves
    assert max(after) - min(after) > 10 * SAME_RUN_RTOL * max(after)
    # The final evaluation sees the same weights.
    assert resumed.final("test")["accuracy"] == ref.final("test")["accuracy"]
    # The new save replaced the partial folder.
    assert [p.name for p in folder.list_checkpoints(run_dir)] == ["step-000003", "step-000006"]
    assert not list(ckpts.glob(".tmp-*"))


def test_resume_refusals_name_the_problem(reference, tmp_path):
    empty = tmp_path / "fresh"
    with pytest.raises(UsageError, match=r"--resume=latest: no checkpoint under .*--resume auto"):
        resume.find_resume("latest", str(empty))
    assert resume.find_resume("auto", str(empty)) is None
    with pytest.raises(UsageError, match=r"no such checkpoint folder"):
        resume.find_resume(str(tmp_path / "nope"), str(empty))
    with pytest.raises(UsageError, match=r"not a complete dpkit checkpoint \(no manifest.json"):
        resume.find_resume(str(REPO / "ds_configs"), str(empty))
    path, state = resume.find_resume(str(step3(reference("zero2"))), str(empty))
    with pytest.raises(UsageError, match=r"written with global batch 32, this run's is 64"):
        resume.check_resumable(state, path, global_batch_size=64)


def test_a_resume_into_another_model_or_label_set_is_refused_before_anything_starts(
    reference, tmp_path
):
    """The checkpoint of MiniLM on Rotten Tomatoes (2 labels), resumed with --model naming
    another model (before: the checkpoint's MiniLM trained under the other name, exit 0)
    and with data of 3 labels (before: a 90-line traceback from from_pretrained). One
    line naming both sides, exit 2, nothing written, no process group."""
    import csv

    from tests import local_models

    ckpt = step3(reference("zero2"))
    assert json.loads((ckpt / "trainer_state.json").read_text())["model"] == (
        "sentence-transformers/all-MiniLM-L6-v2"  # the recipe's default --model, as named
    )
    other = local_models.build("roberta", tmp_path / "roberta")
    three = tmp_path / "three.csv"
    with open(three, "w", newline="") as f:
        rows = [("text", "label")] + [
            (f"review {i}", ("neg", "mid", "pos")[i % 3]) for i in range(90)
        ]
        csv.writer(f).writerows(rows)
    cases = [
        (
            ["--model", str(other)],
            "the checkpoint was trained from 'sentence-transformers/all-MiniLM-L6-v2', "
            f"this run names {str(other)!r}",
        ),
        (
            ["--dataset", str(three)],
            "the checkpoint classifies into 2 labels (rotten, fresh), this run's data into 3 "
            "(mid, neg, pos)",
        ),
    ]
    batch = ["--micro-batch-size", "16", "--gradient-accumulation-steps", "2"]  # global 32
    out = tmp_path / "run"
    for flags, message in cases:
        result = run(
            python_cmd(*CK_RUN, *batch, *flags, "--resume", str(ckpt), "--output-dir", str(out))
        )
        assert_refused(result, f"--resume={str(ckpt)!r}: {message}", out, exit_code=2)


def test_dpkit_checkpoint_consolidates_to_its_model_files(reference, tmp_path):
    """``dpkit consolidate`` of the ZeRO-2 run's last checkpoint (2 processes): a model
    folder that plain transformers scores as the run scored its live engine."""
    ref = reference("zero2")
    step6 = ref.output_dir / "checkpoints" / "step-000006"
    out = tmp_path / "model"
    done = run_captured([str(BIN / "dpkit"), "consolidate", str(step6), "--output-dir", str(out)])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dpkit checkpoint at step 6 (zero2, 2 processes)" in done.stdout
    assert not (out / "optimizer.pt").exists()
    # Independent of how the checkpoint was written: the consolidated folder, scored by
    # plain transformers, gives the test loss the run measured on its live ZeRO engine
    # after the same 6 steps (--max-eval-samples 48, --max-seq-length 32).
    scored = score_model_folder(out, samples=48, max_length=32)
    assert scored["deepspeed_imported"] is False
    final = ref.final("test")
    assert final["step"] == 6
    assert scored["loss"] == pytest.approx(final["loss"], rel=1e-5)
    assert scored["accuracy"] == pytest.approx(final["accuracy"], abs=1e-6)
    # A non-empty output folder is not overwritten by accident.
    again = run_captured([str(BIN / "dpkit"), "consolidate", str(step6), "--output-dir", str(out)])
    assert again.returncode == 2 and "not empty; pass --overwrite" in again.stderr
