"""The real recipe under every documented launch form, 2 CPU processes, real MiniLM and data.

The launches are tests/recipe_runs.py's, shared with the modules that check them
otherwise (memory, two nodes). Each test reads from the run's own output
(run_info.json, written after ``accelerator.prepare`` from what torch/accelerate/
DeepSpeed report) that the intended strategy, world size and backend really ran.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.harness import SHORT_RUN, max_rel_diff, run, torchrun_cmd
from tests.recipe_runs import LAUNCHES

pytestmark = pytest.mark.multiprocess


@pytest.fixture
def launched(recipe_runs):
    """Each launch form of tests/recipe_runs.py, run at most once per session."""
    return recipe_runs


def test_deepspeed_launcher_run_leaves_no_shared_memory_behind(launched):
    """DeepSpeed's CPU backend writes 66 MB per rank to /dev/shm and never unlinks it;
    runs that leaked it filled a 24 GiB machine's RAM and hung later runs in their init."""
    result = launched("deepspeed_zero2")
    port = result.cmd[result.cmd.index("--master_port") + 1]
    leaked = sorted(p.name for p in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
    assert leaked == []


@pytest.mark.parametrize("name", list(LAUNCHES))
def test_launch_form_runs_what_it_says(launched, name):
    strategy, world_size, distributed_type, backend = LAUNCHES[name][1]
    result = launched(name)
    info = result.run_info
    assert info["strategy"] == strategy
    assert info["world_size"] == world_size
    assert info["distributed_type"] == distributed_type
    assert info["backend"] == backend
    assert info["global_batch_size"] == 16 * world_size
    # tests/recipe_runs.py: the DeepSpeed launcher's form also asks for checkpointing.
    assert info["gradient_checkpointing"] is (name == "deepspeed_zero2")
    assert ("| gradient checkpointing" in result.output) is (name == "deepspeed_zero2")
    if strategy == "ddp" and world_size > 1:
        assert info["wrapper"] == "DistributedDataParallel"
        assert info["ddp_forward_sync_buffers"] is False  # MiniLM's buffers are constants
    if strategy.startswith("zero"):
        assert info["zero_stage"] == int(strategy[-1])
        assert info["wrapper"] == "DeepSpeedEngine+DeepSpeedZeroOptimizer"
        ds = result.ds_config
        assert ds["zero_optimization"]["stage"] == int(strategy[-1])
        assert (
            ds["train_batch_size"]
            == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * world_size
        )
        assert "auto" not in str(ds)
        # Memory settings sized to the model (dpkit.engines.deepspeed.settings): MiniLM's hidden^2
        # (147,456) is under the floor of 2^21 elements.
        assert ds["zero_optimization"]["reduce_bucket_size"] == 2**21
        # MiniLM's word embedding (30,522 x 384 = 11.7M elements) is larger than the bucket
        # and than a quarter of any partition here: reduced alone after backward, it would
        # coexist with the pre-sized contiguous buffer, so dpkit turns that buffer off.
        # overlap_comm needs CUDA streams.
        assert ds["zero_optimization"]["contiguous_gradients"] is False
        assert ds["zero_optimization"]["overlap_comm"] is False
        # The memory report of the run, gathered from both ranks.
        report = json.loads((result.output_dir / "memory_report.json").read_text())
        assert report["world_size"] == world_size
    # The log says what runs, once, from the main process.
    assert result.output.count("dpkit: strategy=") == 1
    assert f"world_size={world_size}" in result.output
    # Run output: 6 steps logged, final evaluations, a loadable model folder.
    assert [r["step"] for r in result.train_log] == list(range(1, 7))
    # Every step timed and counted (dpkit.TrainingLog; what dpkit tune reads): 16 samples
    # per rank, at most 16 x 64 real tokens (padding is not counted).
    for record in result.train_log:
        assert record["step_time_s"] > 0 and record["step_cpu_s"] > 0, record
        assert record["samples_per_rank"] == 16 and 0 < record["tokens_per_rank"] <= 16 * 64
    assert result.final("validation")["samples"] == 101
    # The 6 steps end inside the first epoch: its end-of-epoch validation would be of the
    # final weights, which the final evaluation scores, once (validation, then test).
    assert [(m["split"], m["step"], m.get("final")) for m in result.metrics] == [
        ("validation", 6, True),
        ("test", 6, True),
    ]
    assert (result.output_dir / "model" / "model.safetensors").is_file()
    assert (result.output_dir / "model" / "tokenizer.json").is_file()
    assert not (result.output_dir / "checkpoints").exists()  # --no-save-checkpoints
    if name == "python":  # --report-to tensorboard, through accelerate's trackers
        assert list(result.output_dir.rglob("events.out.tfevents.*"))


def _warnings(output: str) -> list[str]:
    """The warnings in a launch's output, without their timestamps and progress-bar prefix."""
    found = []
    for line in output.splitlines():
        match = re.search(r"(\[WARNING\].*|\w*Warning: .*)", line)
        if match:
            found.append(re.sub(r"\[\d{4}-[^]]*\] ", "", match.group(1)))
    return found


@pytest.mark.parametrize("name", ["accelerate_ddp_yaml", "accelerate_zero2_yaml"])
def test_each_library_warning_appears_once_for_the_job(launched, name):
    """Not once per rank: the other ranks keep transformers', datasets', DeepSpeed's and
    Python's warnings to themselves (an error still reaches the terminal from any rank)."""
    warnings = _warnings(launched(name).output)
    repeated = {w: warnings.count(w) for w in warnings if warnings.count(w) > 1}
    assert repeated == {}, repeated
    assert not [w for w in warnings if "lr_scheduler.step()" in w]  # none the recipe causes


def test_run_config_records_the_launchers_environment_not_accelerates(launched):
    """accelerate sets ACCELERATE_USE_DEEPSPEED inside the process it runs DeepSpeed in;
    the deepspeed launcher set no ACCELERATE_* variable, and run_config.json says so."""
    config = json.loads((launched("deepspeed_zero2").output_dir / "run_config.json").read_text())
    assert not [k for k in config["launcher_env"] if k.startswith("ACCELERATE_")]
    assert config["launcher_env"]["WORLD_SIZE"] == "2"


# Tolerances, argued from measurements (docs/stack-notes.md, "What the bare stack does", and these runs):
# DeepSpeed stages 1 and 2 run the same fp32 reduction and the same optimizer on
# the same partitions, so they agree to float rounding (bare stack: ~1e-7
# relative). Torch DDP reduces gradients in other buckets and orders, so its
# rounding differs; Adam's normalisation amplifies that, and the bare stack drifted
# to ~3e-4 relative by step 6. We allow 2e-3 (about 6x) for DDP against ZeRO, far
# below the loss change these six steps make (checked too, so the comparison cannot
# pass on a flat trajectory).
ZERO_STAGES_RTOL = 1e-5
DDP_VS_ZERO_RTOL = 2e-3


def test_zero1_and_zero2_losses_agree(launched):
    zero1 = launched("accelerate_zero1_yaml").losses
    zero2 = launched("accelerate_zero2_yaml").losses
    assert max_rel_diff(zero1, zero2, length=6) < ZERO_STAGES_RTOL


def test_ddp_and_zero_losses_agree(launched):
    ddp = launched("accelerate_ddp_yaml").losses
    for name in ("accelerate_zero1_yaml", "deepspeed_zero2"):
        assert max_rel_diff(launched(name).losses, ddp, length=6) < DDP_VS_ZERO_RTOL, name
    # The trajectory moves (these steps span ~0.03 in loss): agreement is not an
    # artefact of a frozen model or of one repeated batch.
    assert max(ddp) - min(ddp) > 5 * DDP_VS_ZERO_RTOL * max(ddp)


# "2 processes = 1 process with accumulation" is checked without a MiniLM launch of its
# own (it cost ~60 CPU-seconds): tests/test_numerics.py holds every strategy, fp32 and
# bf16, at 2 ranks x accumulation 2 to one fp32 process accumulating the same global batch;
# tests/test_checkpoint.py's zero2-2to1 resumes this recipe as 1 process x accumulation 2
# and follows the 2-process run's losses and learning rates.


def test_one_and_two_processes_give_the_same_accuracy_on_the_same_weights(launched, tmp_path):
    """gather_for_metrics drops the padding duplicates of the uneven last batch. One process:
    the single-process run's own final evaluation; two: the weights it saved, evaluated
    under torchrun."""
    one = launched("python")
    args = [*SHORT_RUN, "--model", str(one.output_dir / "model"), "--eval-only"]
    two = run(
        torchrun_cmd(2, *args, "--output-dir", str(tmp_path / "two")), tmp_path / "two"
    ).check()
    assert two.run_info["world_size"] == 2
    for split in ("validation", "test"):
        assert one.final(split)["samples"] == two.final(split)["samples"] == 101
        assert one.final(split)["accuracy"] == two.final(split)["accuracy"]
        assert one.final(split)["f1_binary"] == two.final(split)["f1_binary"]
        # The mean loss over exactly the 101 examples (a duplicate would shift it).
        assert one.final(split)["loss"] == pytest.approx(two.final(split)["loss"], rel=1e-5)
