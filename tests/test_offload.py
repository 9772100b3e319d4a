"""DeepSpeed ZeRO-2 with the optimizer offloaded (``zero2_offload``) through the
classification recipe: losses as ZeRO-2's, host and device memory planned = measured, a
sharded checkpoint resumed by ZeRO-2, and the optimizer trap it avoids.

One offload run (2 processes, ``torchrun --strategy zero2_offload``, the flags of
tests/checkpoint_runs.py's ``zero2``: 6 steps, 128 samples, sequence length 32,
micro-batch 16, dropout 0, checkpoints at 3 and 6) is checked many ways, beside that
ZeRO-2 reference run (shared with tests/test_zero3.py and tests/test_checkpoint.py). One
more launch resumes its step-3 checkpoint under ZeRO-2. The optimizer's negative control
and the plan's arithmetic run in-process.
"""

from __future__ import annotations

import json

import pytest

from dpkit.core.spec import PlanInputs
from tests.checkpoint_runs import CK_RUN, LOGS_ONLY, NO_DROPOUT, launch_ck, step3
from tests.harness import max_rel_diff, run, torchrun_cmd

# Offload against ZeRO-2, same flags, fp32, no dropout: measured within 1.9e-7 relative
# over these 6 steps (docs/offload.md), not to the bit: DeepSpeed's CPU Adam rounds its
# update otherwise than torch's fused AdamW (0.9% of one update, the negative control
# below). 1e-5 is the ZeRO-3 check's tolerance, 50x the measured difference.
RTOL = 1e-5
MIB = 2**20
PSI = 22_713_986  # MiniLM-L6 with the 2-label head: tests/test_zero3.py's count
WORD_EMBEDDING = 30_522 * 384  # MiniLM's largest parameter (vocabulary x hidden)


@pytest.fixture(scope="module")
def offload(module_tmp):
    out = module_tmp / "zero2_offload"
    cmd = torchrun_cmd(
        2, *CK_RUN, "--strategy", "zero2_offload", "--micro-batch-size", "16",
        *NO_DROPOUT, "--no-save-model", "--output-dir", str(out),
    )  # fmt: skip
    return run(cmd, out).check()


@pytest.mark.multiprocess
def test_offload_runs_as_offload_and_trains_as_zero2(reference, offload):
    info = offload.run_info
    assert (info["strategy"], info["zero_stage"], info["world_size"]) == ("zero2_offload", 2, 2)
    assert info["offload_optimizer"] == "cpu"
    assert "strategy=zero2_offload" in offload.output
    zero2 = reference("zero2")
    assert (zero2.run_info["strategy"], zero2.run_info["world_size"]) == ("zero2", 2)
    assert len(offload.losses) == len(zero2.losses) == 6
    assert max_rel_diff(offload.losses, zero2.losses) <= RTOL, (offload.losses, zero2.losses)
    assert max(zero2.losses) - min(zero2.losses) > 10 * RTOL * max(zero2.losses)
    # The config the run wrote says what DeepSpeed runs with: the client optimizer kept
    # (not swapped by accelerate), contiguous gradients on (DeepSpeed forces them).
    assert offload.ds_config["zero_force_ds_cpu_optimizer"] is False
    assert offload.ds_config["zero_optimization"]["contiguous_gradients"] is True
    assert offload.ds_config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


@pytest.mark.multiprocess
def test_what_the_plan_recommends_for_7b_on_one_gpu_is_what_this_launch_ran(offload):
    """dpkit plan for Llama-7B on one 80 GiB GPU (bf16, micro-batch 1 x 4096): nothing
    that keeps its state on the device fits (DDP needs 144.4 GiB, ZeRO-3 154.3 GiB; FSDP2
    130.2 GiB at one GPU); ZeRO-2 offload does (39.7 GiB). The name it recommends is the
    strategy this file's launch ran as, from --strategy given that name. The host: 256 GiB
    (a one-GPU server; the default is this machine's memory), within which ZeRO-2 offload's
    host states (fp32 moments and master, 12 bytes x 6.7B = 75.3 GiB, and its buffers) fit."""
    from dpkit.plan.inputs import load_model
    from dpkit.plan.recommend import make_plan

    inputs = PlanInputs(
        model=load_model("llama-7b"), gpus_per_node=1, gpu_memory=80 * 2**30,
        precision="bf16", micro_batch=1, seq_len=4096, host_memory=256 * 2**30,
    )  # fmt: skip
    recommended = make_plan(inputs).recommended
    assert recommended == offload.run_info["strategy"] == "zero2_offload"
    assert f"--strategy {recommended}" in " ".join(offload.cmd)


@pytest.mark.multiprocess
def test_offload_report_splits_host_and_device_as_planned(offload):
    """The report names the optimizer that ran and places each claim where DeepSpeed
    allocates it; ``dpkit plan --against`` the run: each model-state category within 2%,
    buffers within 10%, on the device and in host memory."""
    from dpkit.plan.check import check_run, format_check

    report = json.loads((offload.output_dir / "memory_report.json").read_text())
    assert (report["optimizer"], report["optimizer_class"]) == ("cpu_adam", "DeepSpeedCPUAdam")
    assert report["settings"]["zero.contiguous_gradients"] is True
    assert any("same RAM" in note for note in report["notes"]), report["notes"]
    fp32 = 4
    for rank in report["ranks"]:
        # On the device: the whole fp32 module (flat buffer), no optimizer, no master.
        assert rank["params"] / MIB == pytest.approx(fp32 * PSI / MIB, rel=0.01)
        assert rank["optimizer"] == rank["master"] == 0
        host = rank["host"]
        # In host memory: Adam's two fp32 moments and the fp32 master of half the model.
        assert host["optimizer"] / MIB == pytest.approx(2 * fp32 * PSI / 2 / MIB, rel=0.01)
        assert host["master"] / MIB == pytest.approx(fp32 * PSI / 2 / MIB, rel=0.01)
        assert "zero_fp32_partition" in rank["host_holders"]["master"]
    check = check_run(offload.output_dir)
    table = format_check(check)
    for key in ("params", "grads", "optimizer", "master", "total", "host grads",
                "host optimizer", "host master", "host total"):  # fmt: skip
        assert abs(check.error_pct[key] or 0.0) <= 2, (key, table)
    for key in ("buffers", "host buffers"):
        assert abs(check.error_pct[key]) <= 10, (key, table)
    # The device gradient is the word embedding's, whole (larger than the bucket), and
    # the host buffers stage it on the way in: not 0, not Psi/N.
    assert check.predicted["grads"] == fp32 * WORD_EMBEDDING
    assert check.predicted["host buffers"] == fp32 * PSI / 2 + fp32 * WORD_EMBEDDING
    assert "host rows" in table and "same RAM" in table


@pytest.mark.multiprocess
def test_offload_checkpoint_resumes_as_zero2(offload, tmp_path):
    """The offload run's step-3 sharded checkpoint resumed by ZeRO-2 (2 processes, the
    shipped YAML): steps 4-6 follow the uninterrupted offload run, which they would not
    with the Adam moments dropped (the first update from fresh moments is lr x sign(g))."""
    resumed = launch_ck(
        "zero2", 2, tmp_path, "--micro-batch-size", "16", *NO_DROPOUT, *LOGS_ONLY,
        "--resume", str(step3(offload)),
    )  # fmt: skip
    assert "optimizer moments and data position carried over" in resumed.output
    assert [r["step"] for r in resumed.train_log] == [4, 5, 6]
    after = offload.losses[3:]
    assert max_rel_diff(resumed.losses, after) <= RTOL, (resumed.losses, after)
    assert max(after) - min(after) > 10 * RTOL * max(after)


# --- the plan's arithmetic, in-process ------------------------------------------------------
#
# A toy layout, 2 ranks: group 0 holds parameters of 1000 and 10 elements, group 1 one of
# 300 (Psi = 1310), with a 500-element reduce bucket. Only the 1000-element parameter is
# larger than the bucket.


def _toy(precision: str, accumulation: int = 1):
    from dpkit.core.spec import ModelSpec, PlanInputs
    from dpkit.plan import estimate

    spec = ModelSpec(name="toy", source="count", num_params=1310, param_groups=((1000, 10), (300,)))
    inputs = PlanInputs(
        model=spec, gpus_per_node=2, precision=precision, seq_len=8,
        gradient_accumulation_steps=accumulation,
    )  # fmt: skip
    # contiguous_gradients written off: DeepSpeed runs offload with it on regardless.
    settings = {
        **estimate.buffer_settings(spec, 2),
        "reduce_bucket_size": 500, "contiguous_gradients": False, "overlap_comm": False,
    }  # fmt: skip
    return estimate.estimate(inputs, "zero2_offload", 1, None, settings)


@pytest.mark.parametrize(("precision", "module_bytes"), [("fp32", 4), ("bf16", 2)])
def test_offload_plan_puts_each_term_where_deepspeed_allocates_it(precision, module_bytes):
    row = _toy(precision)
    # Device: the module, the whole gradient of the parameter over the bucket waiting for
    # its copy, the bucket itself (contiguous gradients forced on) and the staging
    # buffer of the largest parameter; no optimizer state, no master.
    assert row.params == module_bytes * 1310
    assert row.grads == module_bytes * 1000
    assert (row.optimizer, row.master) == (0, 0)
    assert row.buffer_parts["reduce_bucket"] == module_bytes * 500
    assert row.buffer_parts["offload_device_staging"] == module_bytes * 1000
    # Host, per rank (Psi/N = 655): Adam's two fp32 moments, the fp32 master, the fp32
    # gradient partition; the partition's module-dtype copy and the largest parameter's
    # staging buffer.
    assert row.host == {
        "grads": 4 * 655,
        "optimizer": 8 * 655,
        "master": 4 * 655,
        "buffers": module_bytes * 655 + module_bytes * 1000,
    }
    assert row.host_offload == sum(row.host.values())


def test_offload_plan_accumulates_whole_gradients_in_host_memory():
    """Under accumulation each rank keeps the whole gradients of the parameters touching
    its partition in host memory between micro-batches. Group 0 (1010 elements, padded
    to 1012) splits at 506: rank 1 touches the 1000- and the 10-element parameters; group
    1 (300) splits at 150, both ranks touch it. Worst rank: 1000 + 10 + 300 elements."""
    once, twice = _toy("fp32"), _toy("fp32", accumulation=2)
    assert twice.host["grads"] - once.host["grads"] == 4 * (1000 + 10 + 300)
    assert twice.grads == once.grads  # the device's gradients do not accumulate


@pytest.mark.multiprocess  # not a launch: DeepSpeed's cpu_adam JIT build (3 min cold) is shared
def test_cpu_adam_in_l2_mode_is_not_adamw():
    """The optimizer trap: accelerate rebuilds any non-torch-AdamW optimizer under offload as
    ``DeepSpeedCPUAdam(adamw_mode=False)``, L2 decay. Against torch's AdamW (3 steps, lr
    5e-5, weight decay 0.01, gradients of 1e-3), CPU Adam in AdamW mode agrees within a
    few ulps of the update; in L2 mode it is off by more than the update itself."""
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(1000, 100, generator=generator)
    grads = [torch.randn(1000, 100, generator=generator) * 1e-3 for _ in range(3)]

    def stepped(make):
        param = torch.nn.Parameter(weights.clone())
        optimizer = make([param])
        for grad in grads:
            param.grad = grad.clone()
            optimizer.step()
        return param.detach()

    reference = stepped(lambda p: torch.optim.AdamW(p, lr=5e-5, weight_decay=0.01))
    update = (reference - weights).abs().max().item()
    assert update == pytest.approx(3 * 5e-5, rel=0.1)  # Adam's first steps: ~lr each
    adamw = stepped(lambda p: DeepSpeedCPUAdam(p, lr=5e-5, weight_decay=0.01, adamw_mode=True))
    l2 = stepped(lambda p: DeepSpeedCPUAdam(p, lr=5e-5, weight_decay=0.01, adamw_mode=False))
    assert (adamw - reference).abs().max().item() < 0.05 * update
    assert (l2 - reference).abs().max().item() > 0.5 * update
