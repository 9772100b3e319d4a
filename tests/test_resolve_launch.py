"""What the launcher asked for, read from its environment as a plain dict: every launch form
dpkit runs, every one it refuses (the whole line, as the user sees it), in process.

The environments are what each launcher sets, written out (torchrun: WORLD_SIZE, RANK...;
``accelerate launch``: ACCELERATE_* and FSDP_*; the deepspeed launcher: LOCAL_SIZE).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from dpkit.errors import UsageError
from dpkit.train.config import StrategyConfig
from dpkit.train.launcher import (
    check_accelerate_settings,
    check_launcher,
    read_launch,
    read_precision,
)
from tests.harness import REPO

ZERO1 = str(REPO / "ds_configs" / "zero1.json")
ZERO2 = str(REPO / "ds_configs" / "zero2.json")
ACCELERATE_DDP = {"ACCELERATE_DYNAMO_BACKEND": "NO", "WORLD_SIZE": "2"}
ACCELERATE_DS = {**ACCELERATE_DDP, "ACCELERATE_USE_DEEPSPEED": "true"}
ACCELERATE_FSDP2 = {
    **ACCELERATE_DDP,
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "FSDP_RESHARD_AFTER_FORWARD": "true",
}


def launch(flag, deepspeed, env):
    """What ``read_launch`` decides from the raw flags (as typed: StrategyConfig's own checks
    are test_config's) and the launcher's environment, on a CPU box."""
    args = SimpleNamespace(strategy=flag, deepspeed=deepspeed, mixed_precision=None)
    return read_launch(args, env, on_cuda=False)


def refusal(call, *args, **kwargs) -> str:
    """The one line a refused launch prints."""
    with pytest.raises(UsageError) as err:
        call(*args, **kwargs)
    message = str(err.value)
    assert "\n" not in message
    return message


def shipped(choice) -> tuple[str, ...]:
    """Where the chosen DeepSpeed JSON lives, relative to the package."""
    return Path(choice.config_path).parts[-3:]


# ---- which strategy, from where ------------------------------------------------------------


def test_no_launcher_no_flag_is_ddp_on_one_process():
    choice = launch("auto", None, {})
    assert (choice.strategy.name, choice.source) == ("ddp", "default (no DeepSpeed config)")
    assert choice.world_size == 1
    assert (choice.config_path, choice.config_template) == (None, None)


def test_ddp_by_the_flag_says_so():
    choice = launch("ddp", None, {"WORLD_SIZE": "3"})
    assert (choice.strategy.name, choice.source, choice.world_size) == (
        "ddp",
        "--strategy ddp",
        3,
    )


@pytest.mark.parametrize("stage", ["1", "2", "3"])
def test_accelerate_deepspeed_without_a_file_runs_dpkits_json_for_its_stage(stage):
    env = {
        **ACCELERATE_DS,
        "ACCELERATE_USE_DEEPSPEED": "TRUE",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": stage,
    }
    choice = launch("auto", None, env)
    assert choice.strategy.name == f"zero{stage}"
    assert choice.source == "accelerate launch (DeepSpeed)"
    assert shipped(choice) == ("configs", "deepspeed", f"zero{stage}.json")
    assert choice.config_template["zero_optimization"]["stage"] == int(stage)
    assert choice.world_size == 2


def test_accelerate_deepspeed_without_a_stage_is_zero2():
    """accelerate's own default stage is 2; an empty config-file entry means none."""
    env = {**ACCELERATE_DS, "ACCELERATE_DEEPSPEED_CONFIG_FILE": ""}
    choice = launch("auto", None, env)
    assert choice.strategy.name == "zero2"
    assert shipped(choice) == ("configs", "deepspeed", "zero2.json")


def test_accelerate_deepspeed_with_a_config_file_reads_it():
    env = {**ACCELERATE_DS, "ACCELERATE_DEEPSPEED_CONFIG_FILE": ZERO1}
    choice = launch("zero1", None, env)
    assert (choice.strategy.name, choice.config_path) == ("zero1", ZERO1)
    assert choice.source == "accelerate launch (DeepSpeed)"
    assert choice.config_template == json.loads(Path(ZERO1).read_text())


def test_the_same_json_from_the_flag_and_the_launcher_runs_the_flags():
    env = {**ACCELERATE_DS, "ACCELERATE_DEEPSPEED_CONFIG_FILE": ZERO2}
    choice = launch("auto", ZERO2, env)
    assert (choice.strategy.name, choice.config_path) == ("zero2", ZERO2)
    assert choice.source == f"--deepspeed {ZERO2}"


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3"])
def test_a_zero_flag_under_torchrun_runs_dpkits_json(name):
    choice = launch(name, None, {"WORLD_SIZE": "4"})
    assert (choice.strategy.name, choice.source) == (name, f"--strategy {name}")
    assert shipped(choice) == ("configs", "deepspeed", f"{name}.json")
    assert choice.config_template == json.loads(
        Path(REPO / "ds_configs" / f"{name}.json").read_text()
    )
    assert choice.world_size == 4


def test_an_fsdp2_flag_runs_under_torchrun():
    choice = launch("fsdp2_full_shard", None, {"WORLD_SIZE": "2"})
    assert (choice.strategy.name, choice.source) == (
        "fsdp2_full_shard",
        "--strategy fsdp2_full_shard",
    )
    assert (choice.config_path, choice.config_template) == (None, None)


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({}, "fsdp2_full_shard"),
        ({"FSDP_RESHARD_AFTER_FORWARD": "FULL_SHARD"}, "fsdp2_full_shard"),
        ({"FSDP_RESHARD_AFTER_FORWARD": "False"}, "fsdp2_shard_grad_op"),
        ({"FSDP_RESHARD_AFTER_FORWARD": "shard_grad_op"}, "fsdp2_shard_grad_op"),
        # accelerate writes these for a YAML that turns them off; dpkit needs them off.
        (
            {
                "ACCELERATE_USE_FSDP": "True",
                "FSDP_OFFLOAD_PARAMS": "False",
                "FSDP_ACTIVATION_CHECKPOINTING": "false",
                "FSDP_CPU_RAM_EFFICIENT_LOADING": "FALSE",
                "FSDP_AUTO_WRAP_POLICY": "transformer_based_wrap",
                "FSDP_IGNORED_MODULES": "",
            },
            "fsdp2_full_shard",
        ),
    ],
)
def test_an_accelerate_fsdp2_launch_picks_its_mode(settings, expected):
    env = {k: v for k, v in ACCELERATE_FSDP2.items() if k != "FSDP_RESHARD_AFTER_FORWARD"}
    choice = launch("auto", None, {**env, **settings})
    assert choice.strategy.name == expected
    assert choice.source == f"accelerate launch (FSDP2, {expected})"
    assert choice.world_size == 2 and choice.config_path is None
    assert launch(expected, None, {**env, **settings}).strategy.name == expected


def test_the_layer_classes_an_fsdp_launch_names():
    env = {**ACCELERATE_FSDP2, "FSDP_TRANSFORMER_CLS_TO_WRAP": " BertLayer, ,GPT2Block ,"}
    assert launch("auto", None, env).fsdp_layer_override == ("BertLayer", "GPT2Block")
    assert launch("auto", None, {**env, "ACCELERATE_USE_FSDP": "TRUE"}).fsdp_layer_override == (
        "BertLayer",
        "GPT2Block",
    )
    assert launch("auto", None, ACCELERATE_FSDP2).fsdp_layer_override == ()
    # Not an FSDP launch: whatever else the environment holds is not asked for.
    not_fsdp = {**env, "ACCELERATE_USE_FSDP": "false"}
    assert launch("auto", None, not_fsdp).fsdp_layer_override == ()


# ---- refused launch forms: the whole line -----------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "deepspeed", "env", "message"),
    [
        pytest.param(
            "auto", None, {**ACCELERATE_FSDP2, "FSDP_VERSION": "1"},
            "accelerate config fsdp_version=1: dpkit runs FSDP2; set fsdp_version: 2 "
            "(ds_configs/accelerate/fsdp2_full_shard.yaml)",
            id="fsdp1",
        ),
        pytest.param(
            "auto", None, {k: v for k, v in ACCELERATE_FSDP2.items() if k != "FSDP_VERSION"},
            "accelerate config fsdp_version=1: dpkit runs FSDP2; set fsdp_version: 2 "
            "(ds_configs/accelerate/fsdp2_full_shard.yaml)",
            id="fsdp-version-unset-is-1",
        ),
        pytest.param(
            "auto", None, {**ACCELERATE_FSDP2, "FSDP_CPU_RAM_EFFICIENT_LOADING": "true"},
            "accelerate config fsdp_cpu_ram_efficient_loading=true: dpkit's FSDP2 does not "
            "apply it",
            id="ram-efficient-loading",
        ),
        pytest.param(
            "auto", None, {**ACCELERATE_FSDP2, "FSDP_ACTIVATION_CHECKPOINTING": "true"},
            "accelerate config fsdp_activation_checkpointing=true: dpkit's FSDP2 does not "
            "apply it; use --gradient-checkpointing",
            id="activation-checkpointing",
        ),
        pytest.param(
            "auto", None, {**ACCELERATE_FSDP2, "FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP"},
            "accelerate config fsdp_auto_wrap_policy=SIZE_BASED_WRAP: dpkit wraps transformer "
            "layers (TRANSFORMER_BASED_WRAP; --fsdp-layer-classes names them)",
            id="size-wrap",
        ),
        pytest.param(
            "auto", None, {**ACCELERATE_FSDP2, "FSDP_IGNORED_MODULES": "head"},
            "accelerate config fsdp_ignored_modules=head: dpkit's FSDP2 shards every module",
            id="ignored-modules",
        ),
        pytest.param(
            "auto", None, {**ACCELERATE_FSDP2, "FSDP_RESHARD_AFTER_FORWARD": "HYBRID_SHARD"},
            "accelerate config fsdp_reshard_after_forward=hybrid_shard: one of true, false",
            id="hybrid",
        ),
        pytest.param(
            "ddp", None, ACCELERATE_FSDP2,
            "--strategy=ddp conflicts with accelerate launch (FSDP2, fsdp2_full_shard): drop one "
            "of them",
            id="ddp-flag-under-fsdp",
        ),
        pytest.param(
            "fsdp2_shard_grad_op", None, ACCELERATE_FSDP2,
            "--strategy=fsdp2_shard_grad_op conflicts with accelerate launch (FSDP2, "
            "fsdp2_full_shard): drop one of them",
            id="other-fsdp2-mode",
        ),
        pytest.param(
            "auto", ZERO2, ACCELERATE_FSDP2,
            f"--deepspeed={ZERO2!r} conflicts with accelerate launch (FSDP2, fsdp2_full_shard): "
            "drop one of them",
            id="json-under-fsdp",
        ),
        pytest.param(
            "auto", None, {**ACCELERATE_DS, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "4"},
            "accelerate launch --zero_stage 4: dpkit supports ZeRO stages 1, 2 and 3",
            id="stage4",
        ),
        pytest.param(
            "auto", None, {**ACCELERATE_DS, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "0"},
            "accelerate launch --zero_stage 0: dpkit supports ZeRO stages 1, 2 and 3",
            id="stage0",
        ),
        pytest.param(
            "zero2", None, {**ACCELERATE_DS, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"},
            "--strategy=zero2 conflicts with accelerate launch (DeepSpeed) (zero3): drop one of "
            "them",
            id="zero-flag-vs-accelerate-stage3",
        ),
        pytest.param(
            "auto", ZERO2, ACCELERATE_DDP,
            f"--deepspeed={ZERO2!r} conflicts with accelerate launch without DeepSpeed: use "
            "--config_file ds_configs/accelerate/zero2.yaml (or zero1.yaml), or the deepspeed "
            "launcher",
            id="json-under-accelerate-ddp",
        ),
        pytest.param(
            "auto", ZERO1, {**ACCELERATE_DS, "ACCELERATE_DEEPSPEED_CONFIG_FILE": ZERO2},
            f"--deepspeed={ZERO1!r} is ZeRO-1 but accelerate launch (DeepSpeed) is ZeRO-2: drop "
            "one of them",
            id="json-stage-vs-launcher-stage",
        ),
        pytest.param(
            "auto", ZERO2, {**ACCELERATE_DS, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "1"},
            f"--deepspeed={ZERO2!r} is ZeRO-2 but accelerate launch (DeepSpeed) is ZeRO-1: drop "
            "one of them",
            id="json-stage-vs-launcher-default-json",
        ),
        pytest.param(
            "zero1", None, {**ACCELERATE_DS, "ACCELERATE_DEEPSPEED_CONFIG_FILE": ZERO2},
            "--strategy=zero1 conflicts with accelerate launch (DeepSpeed) (zero2): drop one of "
            "them",
            id="zero-flag-vs-accelerate-json",
        ),
        pytest.param(
            "ddp", ZERO2, {"WORLD_SIZE": "2"},
            f"--strategy=ddp conflicts with --deepspeed={ZERO2!r}: torch DDP takes no DeepSpeed "
            "config; drop one of them",
            id="ddp-flag-vs-json",
        ),
        pytest.param(
            "fsdp2_full_shard", ZERO2, {"WORLD_SIZE": "2"},
            f"--strategy=fsdp2_full_shard conflicts with --deepspeed={ZERO2!r}: torch FSDP2 takes "
            "no DeepSpeed config; drop one of them",
            id="fsdp2-flag-vs-json",
        ),
        pytest.param(
            "fsdp2_full_shard", None, {**ACCELERATE_DS, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"},
            "--strategy=fsdp2_full_shard conflicts with accelerate launch (DeepSpeed) (zero2): "
            "drop one of them",
            id="fsdp2-flag-vs-accelerate-deepspeed",
        ),
        pytest.param(
            "zero1", None, ACCELERATE_DDP,
            "--strategy=zero1 conflicts with accelerate launch without DeepSpeed: use "
            "--config_file ds_configs/accelerate/zero1.yaml",
            id="zero-flag-under-accelerate-ddp",
        ),
    ],
)  # fmt: skip
def test_launches_that_would_run_something_else_are_refused(flag, deepspeed, env, message):
    assert refusal(launch, flag, deepspeed, env) == message


SIMPLE_LAUNCHER = (
    "accelerate launch --cpu --num_processes N starts a single process; use "
    "`accelerate launch --multi_gpu --num_processes N` (dpkit runs it on CPU with gloo) "
    "or --config_file ds_configs/accelerate/ddp.yaml"
)


def test_accelerates_simple_launcher_with_several_processes_is_refused():
    """``accelerate launch --cpu --num_processes 2`` sets MASTER_PORT but starts one process
    with neither RANK nor WORLD_SIZE (docs/stack-notes.md, "Launching on CPU")."""
    env = {"ACCELERATE_USE_CPU": "True", "MASTER_PORT": "29500"}
    assert refusal(check_launcher, env) == SIMPLE_LAUNCHER
    assert refusal(launch, "auto", None, env) == SIMPLE_LAUNCHER
    check_launcher({"ACCELERATE_USE_CPU": "True"})  # --num_processes 1: no port
    check_launcher({**env, "RANK": "0", "WORLD_SIZE": "2"})  # --multi_gpu: a real group
    check_launcher({**env, "RANK": "0"})
    check_launcher({**env, "WORLD_SIZE": "2"})
    check_launcher({"MASTER_PORT": "29500"})  # torchrun-like, not accelerate's CPU launcher


# ---- precision ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "launcher", "on_cuda", "expected"),
    [
        (None, None, False, "no"),
        (None, "BF16", False, "bf16"),
        ("bf16", None, False, "bf16"),
        ("bf16", "bf16", False, "bf16"),
        ("bf16", "no", False, "bf16"),
        ("fp16", None, True, "fp16"),
        (None, "fp16", True, "fp16"),
    ],
)
def test_precision_from_the_flag_or_the_launcher(flag, launcher, on_cuda, expected):
    env = {} if launcher is None else {"ACCELERATE_MIXED_PRECISION": launcher}
    assert read_precision(flag, env, on_cuda=on_cuda) == expected


def test_precision_refusals_name_where_the_value_came_from():
    assert refusal(read_precision, "fp16", {}, on_cuda=False) == (
        "--mixed-precision=fp16: needs a CUDA GPU; use bf16 on CPU"
    )
    fp16_launcher = {"ACCELERATE_MIXED_PRECISION": "fp16"}
    assert refusal(read_precision, None, fp16_launcher, on_cuda=False) == (
        "the launcher's mixed_precision=fp16: needs a CUDA GPU; use bf16 on CPU"
    )
    assert refusal(read_precision, "bf16", fp16_launcher, on_cuda=True) == (
        "--mixed-precision=bf16 conflicts with the launcher's mixed_precision=fp16"
    )
    assert refusal(read_precision, None, {"ACCELERATE_MIXED_PRECISION": "fp8"}, on_cuda=False) == (
        "mixed_precision='fp8': dpkit supports no, bf16 and fp16"
    )
    assert refusal(read_precision, "fp32", {}, on_cuda=False) == (
        "mixed_precision='fp32': dpkit supports no, bf16 and fp16"
    )


def test_precision_asks_torch_for_cuda_when_not_told():
    """The run's resolution asks torch whether it runs on CUDA (read_precision is told)."""
    import torch

    from dpkit.models import ModelSizes
    from dpkit.train.config import StrategyConfig
    from dpkit.train.resolution import resolve

    # The CPU suite hides the GPUs (tests/conftest.py): fp16 is refused as on a CPU box.
    assert not torch.cuda.is_available()
    sizes = ModelSizes(num_params=1000, largest_param_numel=500, hidden_size=16)
    flags = StrategyConfig(mixed_precision="fp16")
    assert refusal(resolve, flags, model=sizes, micro_batch_size=1, env={}) == (
        "--mixed-precision=fp16: needs a CUDA GPU; use bf16 on CPU"
    )


# ---- DeepSpeed settings an accelerate config gives --------------------------------------------


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "auto", "ACCELERATE_GRADIENT_CLIPPING": "auto"},
        {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "", "ACCELERATE_GRADIENT_CLIPPING": ""},
        {"ACCELERATE_GRADIENT_CLIPPING": "none"},
        {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4", "ACCELERATE_GRADIENT_CLIPPING": "0.5"},
        {
            "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "none",
            "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "",
        },
        {"ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "None"},
    ],
)
def test_accelerate_settings_that_agree_or_are_unset_pass(env):
    from dpkit.engines.deepspeed.engine import refuse_accelerate_offload

    check_accelerate_settings(env, gradient_accumulation_steps=4, max_grad_norm=0.5)
    refuse_accelerate_offload(env)  # the DeepSpeed engine's share of the same settings


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "2"},
            "accelerate config gradient_accumulation_steps=2 disagrees with the run's 4 "
            "(--gradient-accumulation-steps): make them equal",
        ),
        (
            {"ACCELERATE_GRADIENT_CLIPPING": "1.0"},
            "accelerate config gradient_clipping=1.0 disagrees with the run's 0.5 "
            "(--max-grad-norm): make them equal",
        ),
        (
            {"ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "CPU"},
            "accelerate config offload_optimizer_device=cpu: dpkit does not set up offload from "
            "accelerate's settings; put offload_optimizer in the DeepSpeed JSON",
        ),
        (
            {"ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "nvme"},
            "accelerate config offload_param_device=nvme: dpkit does not set up offload from "
            "accelerate's settings; put offload_optimizer in the DeepSpeed JSON",
        ),
    ],
)
def test_accelerate_settings_that_disagree_are_refused_in_full(env, message):
    from dpkit.engines.deepspeed.engine import refuse_accelerate_offload

    if "OFFLOAD" in next(iter(env)):  # offload is the DeepSpeed engine's to refuse
        assert refusal(refuse_accelerate_offload, env) == message
    else:
        call = check_accelerate_settings
        assert refusal(call, env, gradient_accumulation_steps=4, max_grad_norm=0.5) == message


# ---- NCCL: processes per visible GPU ------------------------------------------------------


def test_more_processes_than_several_gpus_is_refused_in_the_plural():
    from dpkit.train.launcher import check_ranks_per_gpu

    assert refusal(check_ranks_per_gpu, 4, 2, source="LOCAL_SIZE=4") == (
        "LOCAL_SIZE=4 processes on this node but 2 visible CUDA devices: NCCL refuses two ranks "
        "on one GPU; start one process per visible GPU (torchrun --nproc_per_node 2, deepspeed "
        "--num_gpus 2, accelerate launch --num_processes 2 per machine) or make more GPUs "
        "visible (CUDA_VISIBLE_DEVICES)"
    )


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, (1, "1")),  # python recipe.py: alone
        ({"LOCAL_RANK": "3"}, (4, "LOCAL_RANK=3, so at least 4")),
        # torchrun / accelerate: LOCAL_WORLD_SIZE; Open MPI names its own.
        ({"LOCAL_WORLD_SIZE": "8", "LOCAL_RANK": "0"}, (8, "LOCAL_WORLD_SIZE=8")),
        ({"OMPI_COMM_WORLD_LOCAL_SIZE": "2", "LOCAL_RANK": "1"}, (2, "OMPI_COMM_WORLD_LOCAL_SIZE=2")),
    ],
)  # fmt: skip
def test_the_local_process_count_says_where_it_was_read(env, expected):
    from dpkit.train.launcher import local_process_count

    assert local_process_count(env) == expected


def test_more_ranks_than_gpus_is_refused_on_cuda_only():
    from dpkit.train.launcher import check_ranks_per_gpu

    check_ranks_per_gpu(4, 0)  # a CPU run (gloo): any number of ranks
    check_ranks_per_gpu(2, 2)
    with pytest.raises(UsageError, match="LOCAL_WORLD_SIZE=3"):
        check_ranks_per_gpu(3, 2)


@pytest.mark.parametrize(
    ("flags", "plain"),
    [
        ({}, True),
        ({"ACCELERATE_USE_FSDP": "false", "ACCELERATE_USE_DEEPSPEED": "false"}, True),
        # accelerate writes "true"; a user's own environment may say "True".
        ({"ACCELERATE_USE_FSDP": "true"}, False),
        ({"ACCELERATE_USE_FSDP": "True"}, False),
        ({"ACCELERATE_USE_DEEPSPEED": "true"}, False),
        ({"ACCELERATE_USE_DEEPSPEED": "TRUE"}, False),
    ],
)
def test_accelerate_without_a_backend_is_told_by_its_use_flags(flags, plain):
    from dpkit.core.launch import uses_accelerate_without_backend

    assert uses_accelerate_without_backend({"ACCELERATE_DYNAMO_BACKEND": "NO", **flags}) is plain
    # Not accelerate at all (torchrun sets no ACCELERATE_DYNAMO_BACKEND).
    assert uses_accelerate_without_backend(flags) is False


# --- config paths from any directory (dpkit.config_files, through the DeepSpeed engine) ---

# What accelerate launch leaves in the environment for a DeepSpeed YAML (accelerate 1.15,
# utils/launch.py): the YAML's deepspeed_config_file as written.
ACCELERATE_DS_ENV = {"ACCELERATE_USE_DEEPSPEED": "true"}


def test_a_yaml_path_found_nowhere_names_the_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = {**ACCELERATE_DS_ENV, "ACCELERATE_DEEPSPEED_CONFIG_FILE": "conf/mine.json"}
    with pytest.raises(UsageError) as refused:
        read_launch(StrategyConfig(), env, on_cuda=False)
    # pytest's parent is no accelerate launch: the YAML is unknown, the variable is named.
    assert str(refused.value) == (
        "deepspeed_config_file (ACCELERATE_DEEPSPEED_CONFIG_FILE)='conf/mine.json': no such "
        "file in the current directory, and not one of dpkit's shipped configs "
        "(zero1.json, zero2.json, zero2_offload.json, zero3.json, zero3_offload.json)"
    )


def test_the_shipped_yaml_from_another_directory_runs_its_json(tmp_path, monkeypatch):
    """What accelerate hands a script launched with ds_configs/accelerate/zero1.yaml from
    outside the repository: the path as written, found as dpkit's copy, said once."""
    from dpkit.models import ModelSizes
    from dpkit.train.resolution import resolve

    monkeypatch.chdir(tmp_path)
    env = {**ACCELERATE_DS_ENV, "ACCELERATE_DEEPSPEED_CONFIG_FILE": "ds_configs/zero1.json"}
    launch = read_launch(StrategyConfig(), env, on_cuda=False)
    assert launch.strategy.name == "zero1"  # the stage written in ds_configs/zero1.json
    assert Path(launch.config_path).read_bytes() == (REPO / "ds_configs/zero1.json").read_bytes()
    sizes = ModelSizes(num_params=1000, hidden_size=8, largest_param_numel=64)
    resolution = resolve(model=sizes, micro_batch_size=2, env=env)
    said = [note for note in resolution.notes if "ds_configs/zero1.json" in note]
    assert len(said) == 1, resolution.notes


def test_offload_in_accelerates_settings_is_refused_when_the_run_resolves(tmp_path, monkeypatch):
    """The DeepSpeed engine refuses it while building its settings, before any group:
    accelerate would drop it beside the DeepSpeed JSON without a word."""
    from dpkit.models import ModelSizes
    from dpkit.train.resolution import resolve

    monkeypatch.chdir(tmp_path)
    env = {
        **ACCELERATE_DS_ENV,
        "ACCELERATE_DEEPSPEED_CONFIG_FILE": "ds_configs/zero2.json",
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu",
    }
    sizes = ModelSizes(num_params=1000, hidden_size=8, largest_param_numel=64)
    assert refusal(resolve, model=sizes, micro_batch_size=2, env=env) == (
        "accelerate config offload_optimizer_device=cpu: dpkit does not set up offload from "
        "accelerate's settings; put offload_optimizer in the DeepSpeed JSON"
    )


# ---- ZeRO-3 and accelerate's zero3_init_flag ----------------------------------------------------

_TINY = {"num_params": 1000, "hidden_size": 8, "largest_param_numel": 64}


def _resolve_zero3(tmp_path, monkeypatch, **settings):
    """A ZeRO-3 launch as accelerate leaves it (ds_configs/accelerate/zero3.yaml, plus
    ``settings``), resolved in process: the engine's configure step, no process group."""
    from dpkit.models import ModelSizes
    from dpkit.train.resolution import resolve

    monkeypatch.chdir(tmp_path)
    env = {**ACCELERATE_DS_ENV, "ACCELERATE_DEEPSPEED_CONFIG_FILE": "ds_configs/zero3.json"}
    return resolve(model=ModelSizes(**_TINY), micro_batch_size=2, env={**env, **settings})


@pytest.mark.parametrize("value", [None, "true", "True", "1", "yes"])
def test_zero3_with_zero_init_on_or_unset_resolves(value, tmp_path, monkeypatch):
    """accelerate writes ``str(flag).lower()``; unset, it turns zero.Init on for stage 3."""
    settings = {} if value is None else {"ACCELERATE_DEEPSPEED_ZERO3_INIT": value}
    resolution = _resolve_zero3(tmp_path, monkeypatch, **settings)
    assert resolution.strategy.name == "zero3"
    assert resolution.settings.ds_config["zero_optimization"]["stage"] == 3


@pytest.mark.parametrize(("value", "shown"), [("false", "false"), ("False", "false"), ("0", "0")])
def test_zero3_without_zero_init_is_refused_when_the_run_resolves(
    value, shown, tmp_path, monkeypatch
):
    """Refused while the DeepSpeed engine builds its settings, before any process group (it
    used to be refused only after the group had started, while the model was built)."""
    settings = {"ACCELERATE_DEEPSPEED_ZERO3_INIT": value}
    assert refusal(_resolve_zero3, tmp_path, monkeypatch, **settings) == (
        f"accelerate config zero3_init_flag={shown}: ZeRO-3 needs zero.Init (dpkit builds the "
        "model partitioned under it; without it every rank would load the whole model); set "
        "zero3_init_flag: true (--zero3_init_flag true) or leave it out"
    )
    garbled = {"ACCELERATE_DEEPSPEED_ZERO3_INIT": "maybe"}
    assert refusal(_resolve_zero3, tmp_path, monkeypatch, **garbled) == (
        "accelerate config zero3_init_flag='maybe' (ACCELERATE_DEEPSPEED_ZERO3_INIT): not true "
        "or false"
    )


def test_zero_init_off_below_stage_3_is_not_refused(tmp_path, monkeypatch):
    """zero.Init is ZeRO-3's (accelerate turns the flag off below stage 3 itself)."""
    from dpkit.models import ModelSizes
    from dpkit.train.resolution import resolve

    monkeypatch.chdir(tmp_path)
    env = {
        **ACCELERATE_DS_ENV,
        "ACCELERATE_DEEPSPEED_CONFIG_FILE": "ds_configs/zero2.json",
        "ACCELERATE_DEEPSPEED_ZERO3_INIT": "false",
    }
    resolution = resolve(model=ModelSizes(**_TINY), micro_batch_size=2, env=env)
    assert resolution.strategy.name == "zero2"
