"""``dpkit.resolve`` as a run calls it: the launcher's environment is a plain dict, so every
launch form is checked in process, without a process group.

Expected values are written out here (the global batch and its learning rate as arithmetic,
DeepSpeed's keys as literals), never taken from dpkit's own helpers.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import pytest

from dpkit.errors import UsageError
from dpkit.models import ModelSizes
from dpkit.train.config import StrategyConfig
from dpkit.train.resolution import resolve
from tests.harness import REPO

ZERO2 = str(REPO / "ds_configs" / "zero2.json")
# Sizes of a small model: resolution only needs them for ZeRO's buckets.
SIZES = ModelSizes(num_params=1000, largest_param_numel=500, hidden_size=16)


def torchrun_env(world_size: int) -> dict[str, str]:
    """What ``torchrun --nproc_per_node N`` sets for rank 0."""
    return {
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }


def deepspeed_json_with_optimizer(folder, **params) -> str:
    """ds_configs/zero2.json plus its own ``optimizer`` section (lr and decay "auto" unless
    given): DeepSpeed then builds the optimizer, and dpkit must write the run's lr into it."""
    config = json.loads(Path(ZERO2).read_text())
    config["optimizer"] = {
        "type": "AdamW",
        "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True, **params},
    }
    path = folder / "zero2_with_optimizer.json"
    path.write_text(json.dumps(config))
    return str(path)


# ---- learning-rate scaling: world size and accumulation both count ----------------------------

# 4 processes x accumulation 3: the global batch is 12 times one process's micro-batch.
LR_CASES = [
    pytest.param("none", 2e-5, id="none"),
    pytest.param("linear", 2e-5 * 4 * 3, id="linear"),
    pytest.param("sqrt", 2e-5 * math.sqrt(4 * 3), id="sqrt"),
]


@pytest.mark.parametrize(("rule", "expected"), LR_CASES)
def test_lr_scales_with_world_size_times_accumulation_under_torchrun(rule, expected):
    resolution = resolve(
        StrategyConfig(strategy="ddp"),
        model=SIZES,
        micro_batch_size=8,
        gradient_accumulation_steps=3,
        learning_rate=2e-5,
        scale_lr=rule,
        env=torchrun_env(4),
    )
    assert resolution.world_size == 4
    assert resolution.global_batch_size == 8 * 3 * 4
    assert resolution.learning_rate == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(("rule", "expected"), LR_CASES)
def test_the_scaled_lr_lands_in_a_deepspeed_jsons_optimizer(tmp_path, rule, expected):
    """The deepspeed launcher (``deepspeed --num_gpus 4 ... --deepspeed x.json``): the JSON's
    own optimizer section gets the scaled lr and the run's weight decay."""
    path = deepspeed_json_with_optimizer(tmp_path)
    resolution = resolve(
        StrategyConfig(deepspeed=path),
        model=SIZES,
        micro_batch_size=8,
        gradient_accumulation_steps=3,
        learning_rate=2e-5,
        scale_lr=rule,
        weight_decay=0.05,
        env=torchrun_env(4),
    )
    params = resolution.settings.config["optimizer"]["params"]
    assert params["lr"] == pytest.approx(expected, rel=1e-12)
    assert resolution.learning_rate == pytest.approx(expected, rel=1e-12)
    assert params["weight_decay"] == 0.05
    assert resolution.settings.config["train_batch_size"] == 8 * 3 * 4
    assert resolution.settings.config["gradient_accumulation_steps"] == 3


def test_the_lr_scales_under_accelerate_launch_with_deepspeed():
    """``accelerate launch --use_deepspeed --num_processes 2 --gradient_accumulation_steps 4``:
    the world size comes from the launcher, accumulation from the run (equal to accelerate's)."""
    env = {
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
        "ACCELERATE_DYNAMO_BACKEND": "NO",
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "RANK": "0",
        "LOCAL_RANK": "0",
    }
    resolution = resolve(
        model=SIZES,
        micro_batch_size=16,
        gradient_accumulation_steps=4,
        learning_rate=1e-4,
        scale_lr="linear",
        env=env,
    )
    assert resolution.strategy.name == "zero2"
    assert resolution.learning_rate == pytest.approx(1e-4 * 2 * 4, rel=1e-12)
    assert resolution.settings.config["train_batch_size"] == 16 * 4 * 2


def test_a_json_lr_that_is_not_the_scaled_one_is_refused(tmp_path):
    """A JSON that writes lr 2e-5 while the run scales it to 2e-5 x 12 must not train at
    either silently."""
    path = deepspeed_json_with_optimizer(tmp_path, lr=2e-5)
    with pytest.raises(UsageError) as err:
        resolve(
            StrategyConfig(deepspeed=path),
            model=SIZES,
            micro_batch_size=8,
            gradient_accumulation_steps=3,
            learning_rate=2e-5,
            scale_lr="linear",
            weight_decay=0.0,
            env=torchrun_env(4),
        )
    assert str(err.value) == (
        f"deepspeed config optimizer.params.lr=2e-05 disagrees with the recipe's {2e-5 * 12!r}: "
        'set it to "auto" or change the recipe flag'
    )


# ---- what a ZeRO run resolves to: every field, the DeepSpeed config sized by hand ------------

# 40M parameters, hidden 2048, a 6M-element largest parameter. Written out from the rules in
# dpkit/engines/deepspeed/settings.py's REASONS (not computed by it): the bucket is
# hidden^2 = 4,194,304 elements (over the 2^21 floor, under the 40M parameters; Psi / 100 =
# 400,000 would be the rule without a hidden size). At 2 ranks a partition is 20M elements:
# the 6M parameter is larger than the bucket and than a quarter of the partition (5M), so no
# contiguous gradients; at 1 rank (10M a quarter) it would have them.
BIG = ModelSizes(num_params=40_000_000, largest_param_numel=6_000_000, hidden_size=2048)


def deepspeed_launcher_env(world_size: int) -> dict[str, str]:
    """What ``deepspeed --num_gpus N`` sets for rank 0 (it passes --deepspeed to the script)."""
    return {**torchrun_env(world_size), "LOCAL_SIZE": str(world_size)}


def test_a_zero2_run_resolves_every_field(tmp_path):
    config = json.loads(Path(ZERO2).read_text())
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    path = tmp_path / "zero2_offload.json"
    path.write_text(json.dumps(config))
    resolution = resolve(
        StrategyConfig(deepspeed=str(path), mixed_precision="bf16", collective_timeout=123.0),
        model=BIG,
        micro_batch_size=8,
        gradient_accumulation_steps=3,
        max_grad_norm=0.5,
        env=deepspeed_launcher_env(2),
    )
    assert resolution.strategy.name == "zero2_offload"
    assert resolution.source == f"--deepspeed {path}"
    assert resolution.settings.config_path == str(path)
    assert resolution.precision == "bf16"
    assert (resolution.world_size, resolution.micro_batch_size) == (2, 8)
    assert resolution.gradient_accumulation_steps == 3
    assert resolution.global_batch_size == 8 * 3 * 2
    assert (resolution.on_cuda, resolution.backend) == (False, "gloo")
    assert resolution.collective_timeout_s == 123.0
    assert resolution.model_sizes == BIG
    assert resolution.learning_rate is None  # not given: nothing to scale or record
    assert resolution.settings.offload_optimizer == "cpu"
    assert resolution.notes == ()
    # ZeRO's settings, every one checked here: no DDP kwargs, no FSDP2 units.
    assert {f.name for f in dataclasses.fields(resolution.settings)} == {
        "notes",
        "ds_config",
        "ds_config_path",
        "offload_optimizer",
        "offload_param",
    }
    ds = resolution.settings.config
    assert ds["train_batch_size"] == 48 and ds["train_micro_batch_size_per_gpu"] == 8
    assert ds["gradient_accumulation_steps"] == 3 and ds["gradient_clipping"] == 0.5
    assert ds["bf16"] == {"enabled": True} and ds["fp16"] == {"enabled": False}
    assert ds["zero_optimization"] == {
        "stage": 2,
        "offload_optimizer": {"device": "cpu"},
        "reduce_bucket_size": 4_194_304,
        "allgather_bucket_size": 4_194_304,
        "overlap_comm": False,  # CPU: nothing to overlap
        # Written on: DeepSpeed forces it under offload (contiguous_gradients or cpu_offload).
        "contiguous_gradients": True,
        "round_robin_gradients": False,
        "reduce_scatter": True,
    }
    assert "optimizer" not in ds  # accelerate builds dpkit's AdamW


def test_zero1_from_the_flag_alone_takes_the_shipped_json():
    resolution = resolve(
        StrategyConfig(strategy="zero1"), model=BIG, micro_batch_size=4, env=torchrun_env(2)
    )
    assert resolution.strategy.name == "zero1"
    assert resolution.source == "--strategy zero1"
    # The wheel's copy of ds_configs/zero1.json.
    shipped = Path(resolution.settings.config_path)
    assert shipped.parts[-4:] == ("dpkit", "configs", "deepspeed", "zero1.json")
    assert shipped.read_text() == (REPO / "ds_configs" / "zero1.json").read_text()
    assert resolution.settings.config["zero_optimization"]["stage"] == 1
    assert resolution.settings.config["train_batch_size"] == 4 * 1 * 2
    assert resolution.settings.config["gradient_clipping"] == 0.0  # no clipping asked
    assert resolution.settings.offload_optimizer is None


def test_a_ddp_run_resolves_dpkits_ddp_settings():
    resolution = resolve(
        None, model=BIG, micro_batch_size=4, gradient_accumulation_steps=2, env=torchrun_env(4)
    )
    assert resolution.strategy.name == "ddp"
    assert resolution.source == "default (no DeepSpeed config)"
    assert resolution.settings.config is None and resolution.settings.config_path is None
    assert resolution.settings.run_info().get("offload_optimizer") is None
    # Bucket views (one gradient copy, not two) and torch's 25 MB cap, written out.
    assert resolution.settings.kwargs == {
        "gradient_as_bucket_view": True,
        "bucket_cap_mb": 25,
        "find_unused_parameters": False,
    }
    assert resolution.collective_timeout_s == 600.0  # dpkit's default, not torch's 30 min
    assert resolution.precision == "no"
    assert resolution.global_batch_size == 4 * 2 * 4


def test_precision_and_world_size_come_from_the_launcher():
    env = {
        **torchrun_env(3),
        "ACCELERATE_MIXED_PRECISION": "bf16",
        "ACCELERATE_DYNAMO_BACKEND": "NO",
    }
    resolution = resolve(None, model=BIG, micro_batch_size=2, env=env)
    assert (resolution.precision, resolution.world_size) == ("bf16", 3)


def test_with_no_env_given_resolve_reads_the_process_environment(monkeypatch):
    """``env`` defaults to ``os.environ`` (what a launched script has), and ``scale_lr``
    to ``none``: a learning rate is kept as given, whatever the world size."""
    for name in list(os.environ):
        if name.startswith(("ACCELERATE_", "FSDP_", "PET_", "DEEPSPEED_")):
            monkeypatch.delenv(name)
    for name, value in torchrun_env(3).items():
        monkeypatch.setenv(name, value)
    resolution = resolve(None, model=SIZES, micro_batch_size=2, learning_rate=3e-5)
    assert resolution.world_size == 3
    assert resolution.learning_rate == 3e-5


def test_accelerate_settings_equal_to_the_runs_are_accepted():
    env = {
        **torchrun_env(2),
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "1",
        "ACCELERATE_DYNAMO_BACKEND": "NO",
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "3",
        "ACCELERATE_GRADIENT_CLIPPING": "0.25",
    }
    resolution = resolve(
        None,
        model=BIG,
        micro_batch_size=2,
        gradient_accumulation_steps=3,
        max_grad_norm=0.25,
        env=env,
    )
    assert resolution.strategy.name == "zero1"
    assert resolution.source == "accelerate launch (DeepSpeed)"
    assert resolution.settings.config["gradient_clipping"] == 0.25
    with pytest.raises(UsageError) as err:
        resolve(None, model=BIG, micro_batch_size=2, gradient_accumulation_steps=2, env=env)
    assert str(err.value).startswith(
        "accelerate config gradient_accumulation_steps=3 disagrees with the run's 2"
    )
    with pytest.raises(UsageError) as err:
        resolve(None, model=BIG, micro_batch_size=2, gradient_accumulation_steps=3, env=env)
    assert str(err.value).startswith("accelerate config gradient_clipping=0.25 disagrees")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"micro_batch_size": 0}, "--micro-batch-size=0: must be > 0"),
        ({"micro_batch_size": -2}, "--micro-batch-size=-2: must be > 0"),
        ({"micro_batch_size": 2.0}, "--micro-batch-size=2.0: must be > 0"),
        (
            {"micro_batch_size": 2, "gradient_accumulation_steps": 0},
            "--gradient-accumulation-steps=0: must be > 0",
        ),
        (
            {"micro_batch_size": 2, "gradient_accumulation_steps": "4"},
            "--gradient-accumulation-steps='4': must be > 0",
        ),
    ],
)
def test_batch_settings_that_are_not_positive_integers_are_refused(kwargs, message):
    with pytest.raises(UsageError) as err:
        resolve(None, model=BIG, env={}, **kwargs)
    assert str(err.value) == message


def test_one_example_and_one_micro_batch_are_enough():
    resolution = resolve(None, model=BIG, micro_batch_size=1, gradient_accumulation_steps=1, env={})
    assert resolution.global_batch_size == 1 and resolution.world_size == 1


def test_find_unused_parameters_is_a_note_under_fsdp2():
    import torch

    class Stack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])

    asked = StrategyConfig(strategy="fsdp2_shard_grad_op", ddp_find_unused_parameters=True)
    resolution = resolve(asked, model=Stack(), micro_batch_size=2, env=torchrun_env(2))
    assert resolution.notes == (
        "--ddp-find-unused-parameters: DDP's; fsdp2_shard_grad_op needs none "
        "(parameters the loss does not use simply get no gradient)",
    )
    assert resolution.settings.layer_classes == ("Linear",)
    assert not hasattr(resolution.settings, "kwargs") and resolution.settings.config is None


def test_an_ignored_fsdp_state_dict_type_is_one_note():
    env = {
        **torchrun_env(2),
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": "2",
        "FSDP_RESHARD_AFTER_FORWARD": "false",
        "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
        "FSDP_TRANSFORMER_CLS_TO_WRAP": "Linear",
        "ACCELERATE_DYNAMO_BACKEND": "NO",
    }
    resolution = resolve(None, model=SIZES, micro_batch_size=2, env=env)
    assert resolution.strategy.name == "fsdp2_shard_grad_op"
    assert resolution.notes == (
        "accelerate config fsdp_state_dict_type=SHARDED_STATE_DICT: dpkit's checkpoints are "
        "its own portable layout (full fp32 weights and Adam moments) whatever the type",
    )
    # Given sizes only, the units are found once the model is sharded; the YAML's names kept.
    assert resolution.settings.layer_classes == ()
    assert resolution.settings.layer_override == ("Linear",)
    without = {k: v for k, v in env.items() if k != "FSDP_STATE_DICT_TYPE"}
    assert resolve(None, model=SIZES, micro_batch_size=2, env=without).notes == ()


def test_offload_deepspeed_would_not_run_as_written_is_refused_naming_the_file(tmp_path):
    config = json.loads(Path(ZERO2).read_text())
    config["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": "/tmp"}
    path = tmp_path / "nvme.json"
    path.write_text(json.dumps(config))
    with pytest.raises(UsageError) as err:
        resolve(StrategyConfig(deepspeed=str(path)), model=BIG, micro_batch_size=2, env={})
    assert str(err.value) == (
        f"deepspeed config {str(path)!r}: zero_optimization.offload_optimizer.device='nvme': "
        "DeepSpeed offloads to NVMe only under ZeRO-3; under ZeRO-2 it would run as CPU "
        "offload; use 'cpu'"
    )


# ---- on a CUDA machine (the probe answered yes; nothing starts) -------------------------------


@pytest.fixture
def cuda_machine(monkeypatch):
    """resolve() as on a machine with CUDA devices: only dpkit's probe is told so (the CPU
    suite hides the GPUs); resolution starts nothing on a device."""
    import dpkit.train.resolution as resolve_module

    monkeypatch.setattr(resolve_module, "_cuda_available", lambda: True)


def test_on_cuda_zero2_runs_nccl_and_overlaps_communication(cuda_machine):
    # 1M parameters, hidden 256, largest 300,000: the bucket is the 2^21 floor cut to the
    # 1M parameters; the largest parameter fits in it, so contiguous gradients stay on, and
    # ZeRO-2 on CUDA overlaps its reduction with the backward.
    sizes = ModelSizes(num_params=1_000_000, largest_param_numel=300_000, hidden_size=256)
    resolution = resolve(
        StrategyConfig(strategy="zero2", mixed_precision="fp16"),
        model=sizes,
        micro_batch_size=4,
        env=torchrun_env(2),
    )
    assert (resolution.on_cuda, resolution.backend, resolution.precision) == (
        True,
        "nccl",
        "fp16",
    )
    zero = resolution.settings.config["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["overlap_comm"]) == (1_000_000, True)
    assert zero["contiguous_gradients"] is True
    assert resolution.settings.config["fp16"]["enabled"] is True
    # ZeRO-1 reduces after the backward: no overlap even on CUDA.
    stage1 = resolve(StrategyConfig(strategy="zero1"), model=sizes, micro_batch_size=4, env={})
    assert stage1.settings.config["zero_optimization"]["overlap_comm"] is False


def test_on_cuda_fsdp2_refuses_fp16(cuda_machine):
    with pytest.raises(UsageError) as err:
        resolve(
            StrategyConfig(strategy="fsdp2_full_shard", mixed_precision="fp16"),
            model=SIZES,
            micro_batch_size=2,
            env=torchrun_env(2),
        )
    assert str(err.value) == (
        "mixed_precision=fp16 with --strategy=fsdp2_full_shard: dpkit's FSDP2 runs bf16 "
        "(fp16 would need a sharded gradient scaler); use bf16"
    )
    bf16 = StrategyConfig(strategy="fsdp2_full_shard", mixed_precision="bf16")
    assert resolve(bf16, model=SIZES, micro_batch_size=2, env={}).precision == "bf16"


@pytest.mark.parametrize("rule", ["Linear", "square-root", ""])
def test_an_unknown_lr_scaling_rule_is_refused_not_ignored(rule):
    with pytest.raises(UsageError, match=f"scale_lr={rule!r}: want 'none', 'linear' or 'sqrt'"):
        resolve(None, model=SIZES, micro_batch_size=2, learning_rate=1e-4, scale_lr=rule, env={})


def test_check_launch_reads_the_env_it_is_given_and_whether_cuda_is_there(monkeypatch):
    """parse_args' early check (before the model loads) is resolve's launch reading: the
    launcher's environment as given, and fp16 only where CUDA is."""
    from dpkit.train import resolution

    asked = StrategyConfig(mixed_precision="no")
    with pytest.raises(UsageError, match="conflicts with the launcher's mixed_precision=bf16"):
        resolution.check_launch(asked, {"ACCELERATE_MIXED_PRECISION": "bf16"})
    resolution.check_launch(asked, {})
    fp16 = StrategyConfig(mixed_precision="fp16")
    with pytest.raises(UsageError, match="fp16: needs a CUDA GPU"):
        resolution.check_launch(fp16, {})
    # Where torch sees a GPU (faked: this suite runs on CPU), fp16 passes the early check.
    monkeypatch.setattr(resolution, "_cuda_available", lambda: True)
    resolution.check_launch(fp16, {})


def test_checkpointing_and_lora_flags_reach_the_resolved_run():
    """What the run is told to build: --gradient-checkpointing and the LoRA flags as given
    (alpha, dropout, the target names split at commas and stripped), not dropped."""
    asked = StrategyConfig(
        strategy="ddp", gradient_checkpointing=True, lora_r=8, lora_alpha=16.0,
        lora_dropout=0.1, lora_target_modules="query, value",
    )  # fmt: skip
    resolution = resolve(asked, model=SIZES, micro_batch_size=2, env=torchrun_env(2))
    assert resolution.gradient_checkpointing is True
    lora = resolution.lora
    assert (lora.r, lora.alpha, lora.dropout, lora.target_modules) == (
        8,
        16.0,
        0.1,
        ("query", "value"),
    )
    plain = resolve(StrategyConfig(strategy="ddp"), model=SIZES, micro_batch_size=2, env={})
    assert plain.gradient_checkpointing is False and plain.lora is None
