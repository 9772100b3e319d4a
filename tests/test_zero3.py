"""DeepSpeed ZeRO-3 through the classification recipe: the model loaded partitioned, losses as
ZeRO-2's, memory planned = measured, checkpoints to and from other strategies, export.

One ZeRO-3 run (tests/checkpoint_runs.py's ``zero3_no_dropout``: 2 processes, accelerate
launch with the shipped ds_configs/accelerate/zero3.yaml, 6 steps, checkpoints at 3 and
6, the final model saved) is checked many ways, beside the ZeRO-2 run of the same flags
that tests/test_checkpoint.py also resumes from. Two more launches resume across
strategies: ZeRO-2 -> ZeRO-3 (every Adam moment re-saved bit for bit) and ZeRO-3 -> DDP
on one process.
"""

from __future__ import annotations

import json

import pytest

from tests.checkpoint_runs import (
    LOGS_ONLY,
    NO_DROPOUT,
    assert_follows,
    assert_saved_again_unchanged,
    launch_ck,
    step3,
)
from tests.harness import BIN, max_rel_diff, run_captured, score_model_folder

pytestmark = pytest.mark.multiprocess

# ZeRO-3 against ZeRO-2, same flags, fp32, no dropout: the same arithmetic but for the
# order of fp32 reductions (measured against DDP on 4 steps: equal to the last bit at
# steps 1-2, 4.2e-7 relative by step 4). 1e-5 leaves 20x; a gradient off by a constant
# factor, or one rank's weights not the other's, moves the loss by 1e-3 or more.
RTOL = 1e-5
# Across world sizes the reduction order changes too: the tolerance of tests/test_checkpoint.py.
CROSS_RTOL = 2e-3


@pytest.fixture(scope="module")
def zero3(reference):
    return reference("zero3_no_dropout")


def test_zero3_runs_as_zero3_and_trains_as_zero2(reference, zero3):
    info = json.loads((zero3.output_dir / "run_info.json").read_text())
    assert (info["strategy"], info["zero_stage"], info["world_size"]) == ("zero3", 3, 2)
    assert info["wrapper"] == "DeepSpeedEngine+DeepSpeedZeroOptimizer_Stage3"
    # The whole model is counted, not ZeRO-3's empty placeholders: MiniLM's 22,713,986
    # parameters with the 2-label head (docs/memory.md's figure for the same model).
    assert info["num_params"] == 22_713_986
    zero2 = reference("zero2")
    zero2_info = json.loads((zero2.output_dir / "run_info.json").read_text())
    assert (zero2_info["strategy"], zero2_info["world_size"]) == ("zero2", 2)  # both 2-process
    assert len(zero3.losses) == len(zero2.losses) == 6
    assert max_rel_diff(zero3.losses, zero2.losses) <= RTOL, (zero3.losses, zero2.losses)
    assert max(zero2.losses) - min(zero2.losses) > 10 * RTOL * max(zero2.losses)
    assert zero3.final("test")["accuracy"] == zero2.final("test")["accuracy"]


def test_zero3_memory_is_planned_as_measured(zero3):
    """``dpkit plan --against`` the run: every model-state category within 2%, buffers
    (the parameters ZeRO-3 keeps gathered at the end of the forward) within 10%."""
    from dpkit.plan.check import check_run

    report = json.loads((zero3.output_dir / "memory_report.json").read_text())
    rank = report["ranks"][0]
    # Per rank, fp32, 2 ranks: half of MiniLM's parameters (4 bytes x 22.7M / 2 = 43.3
    # MiB) as this rank's slice; at DeepSpeed's defaults (reuse distance 1e9 elements)
    # the whole model is gathered at the end of the forward from step 2: 86.6 MiB more.
    mib = 2**20
    assert rank["params"] / mib == pytest.approx(4 * 22_713_986 / 2 / mib, rel=0.01)
    gathered = rank["buffers"]["zero3_gathered_params (whole until released)"]
    assert gathered / mib == pytest.approx(4 * 22_713_986 / mib, rel=0.01)
    # The live-bytes high-water is taken at ZeRO-3's steady step, not its trace step.
    assert rank["peak_live"]["step"] == 2
    check = check_run(zero3.output_dir)
    for category in ("params", "grads", "optimizer", "master", "total"):
        assert abs(check.error_pct[category]) <= 2, (category, check.error_pct)
    assert abs(check.error_pct["buffers"]) <= 10, check.error_pct


def test_zero3_timeline_shows_the_gather_and_each_blocks_release(zero3):
    """The timeline of ZeRO-3's watched step (step 2) shows DeepSpeed's gather and release
    per block, in the gathered parameters (buffers). MiniLM's parameters over ZeRO-3's
    persistence threshold (1e5 elements; the rest stay whole on every rank): the word
    embedding 30,522 x 384, the position embedding 512 x 384, six layers of
    4 x 384 x 384 + 2 x 384 x 1,536 = 1,769,472 weights each, the pooler 384 x 384:
    22,681,344 elements, under the 5e7-element prefetch bucket, so the whole of them
    arrives in one all-gather before the first layer; the backward releases one
    layer's weights at the end of each layer's backward."""
    report = json.loads((zero3.output_dir / "memory_report.json").read_text())
    timeline = report["ranks"][0]["timeline"]
    assert timeline["step"] == 2 and timeline["complete"]
    points = timeline["points"]
    layer = 4 * (4 * 384 * 384 + 2 * 384 * 1536)  # fp32 bytes
    gathered = 4 * (30_522 * 384 + 512 * 384 + 6 * layer // 4 + 384 * 384)
    assert gathered == 4 * 22_681_344
    forward = [p["buffers"] for p in points if p["point"].startswith("forward block")]
    rises = [b - a for a, b in zip(forward, forward[1:], strict=False) if b != a]
    assert rises == [gathered], forward  # one gather, nothing released inside the forward
    backward = [p["buffers"] for p in points if p["point"].startswith("backward block")]
    drops = [a - b for a, b in zip(backward, backward[1:], strict=False)]
    assert len(drops) >= 4 and all(d == layer for d in drops), drops


def test_zero3_saved_model_and_consolidated_checkpoint_score_as_the_run(zero3, tmp_path):
    """The final model (gathered from the partitions) and ``dpkit consolidate`` of the
    step-6 sharded checkpoint, each scored by plain transformers, give the test loss the
    run measured on its live ZeRO-3 engine."""
    final = zero3.final("test")
    assert final["step"] == 6
    step6 = zero3.output_dir / "checkpoints" / "step-000006"
    out = tmp_path / "model"
    done = run_captured([str(BIN / "dpkit"), "consolidate", str(step6), "--output-dir", str(out)])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dpkit checkpoint at step 6 (zero3, 2 processes)" in done.stdout
    for folder in (zero3.output_dir / "model", out):
        scored = score_model_folder(folder, samples=48, max_length=32)
        assert scored["deepspeed_imported"] is False
        assert scored["loss"] == pytest.approx(final["loss"], rel=1e-5), folder
        assert scored["accuracy"] == pytest.approx(final["accuracy"], abs=1e-6), folder


def test_zero2_state_resumed_and_saved_by_zero3_is_the_same_state(reference, tmp_path):
    """ZeRO-2's step-3 checkpoint resumed under ZeRO-3 with --max-steps 3 (no step to
    train): the final save, written from ZeRO-3's partitions, holds every Adam moment of
    the source bit for bit (a load or a save that put any slice in the wrong place fails;
    tests/test_checkpoint.py shows the comparison catches a swap and zeroes)."""
    source = step3(reference("zero2"))
    resumed = launch_ck(
        "zero3", 2, tmp_path, "--micro-batch-size", "16", *NO_DROPOUT, "--max-steps", "3",
        "--no-save-model", "--resume", str(source),
    )  # fmt: skip
    assert_saved_again_unchanged(resumed, source)


def test_zero3_checkpoint_resumes_as_ddp_on_one_process(zero3, tmp_path):
    """ZeRO-3's step 3, resumed by plain DDP on one process with accumulation 2 (the same
    global batch): steps 4-6 follow the uninterrupted ZeRO-3 run."""
    resumed = launch_ck(
        "ddp", 1, tmp_path, "--micro-batch-size", "16", "--gradient-accumulation-steps", "2",
        *NO_DROPOUT, *LOGS_ONLY, "--resume", str(step3(zero3)),
    )  # fmt: skip
    assert "as ddp on 1 process(es)" in resumed.output
    assert_follows(resumed, zero3, CROSS_RTOL)
