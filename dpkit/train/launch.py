"""What the launcher asked for: the strategy and precision, from the flags and the launcher's environment.

Pure functions of their arguments (the environment is one of them), called before
any process group exists, so every conflict is a one-line
:class:`~dpkit.errors.UsageError`. What they work around (measured, see
``../shared/STACK-NOTES.md``):

* ``accelerate launch --cpu --num_processes N`` starts one process: refused with
  the launch form to use instead.
* ``accelerate launch --use_fsdp`` (``fsdp_version: 2``) is FSDP2, which dpkit applies
  itself (accelerate's own path runs unconnected copies on CPU); FSDP1 and the FSDP
  settings dpkit does not apply (offload, activation checkpointing, a size-based
  wrap policy, ignored modules) are refused.
* A strategy flag that contradicts the launcher (``--strategy ddp`` under a ZeRO
  config, ``--strategy zero1`` with ``--deepspeed zero2.json``, a ZeRO flag or a
  ``--deepspeed`` file under an accelerate config without DeepSpeed) is refused rather
  than one of them winning.
* DeepSpeed settings an accelerate YAML gives (accumulation, clipping, offload):
  honoured where they agree with the run, refused where they do not (accelerate
  would otherwise drop them without a word beside a DeepSpeed config file).
* More NCCL processes on a node than visible GPUs: accelerate gives each process
  ``cuda:(LOCAL_RANK % device_count)``, so two ranks share a GPU, which NCCL refuses
  once the group is up; refused before it (:func:`check_ranks_per_gpu`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dpkit import resources
from dpkit.errors import UsageError
from dpkit.strategy import DDP, Strategy, deepspeed_strategy, fsdp2_strategy, get_strategy
from dpkit.train.deepspeed_config import read_ds_config, zero_stage_of

PRECISIONS = ("no", "bf16", "fp16")
# Where launchers say how many processes they started on this node: torchrun and
# accelerate launch, the deepspeed launcher, Open MPI's mpirun.
LOCAL_PROCESS_COUNT_VARIABLES = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")
# DeepSpeed settings an accelerate YAML or flag can give (the launcher passes them as
# environment variables), which dpkit takes from the run's own flags instead.
_OFFLOAD_SETTINGS = {
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "offload_optimizer_device",
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "offload_param_device",
}


@dataclass(frozen=True)
class StrategyChoice:
    """What will run, decided from the recipe flags and the launcher's environment."""

    strategy: Strategy
    """The strategy."""
    source: str
    """Where the choice came from, for the log (a flag, a launcher, a config file)."""
    ds_config_path: str | None
    """The DeepSpeed JSON the config was read from (ZeRO only)."""
    ds_template: dict | None
    """That JSON as read, ``"auto"`` values still in it (ZeRO only)."""
    expected_world_size: int
    """Processes the launcher started (``WORLD_SIZE``), checked once the group is up."""


# FSDP settings of an accelerate YAML that dpkit does not apply, with the value that
# means "off"; anything else is refused rather than dropped.
_FSDP_SETTINGS_OFF = {
    "FSDP_OFFLOAD_PARAMS": ("fsdp_offload_params", "false"),
    "FSDP_ACTIVATION_CHECKPOINTING": ("fsdp_activation_checkpointing", "false"),
    "FSDP_CPU_RAM_EFFICIENT_LOADING": ("fsdp_cpu_ram_efficient_loading", "false"),
}


def _fsdp_launch(env: Mapping[str, str]) -> Strategy | None:
    """The FSDP2 strategy an accelerate FSDP launch asks for (None: not one)."""
    if env.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return None
    version = env.get("FSDP_VERSION", "1")
    if version != "2":
        raise UsageError(
            f"accelerate config fsdp_version={version}: dpkit runs FSDP2; set fsdp_version: 2 "
            "(ds_configs/accelerate/fsdp2_full_shard.yaml)"
        )
    for variable, (name, off) in _FSDP_SETTINGS_OFF.items():
        value = env.get(variable, off).lower()
        if value != off:
            raise UsageError(f"accelerate config {name}={value}: dpkit's FSDP2 does not apply it")
    policy = env.get("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP")
    if policy.upper() != "TRANSFORMER_BASED_WRAP":
        raise UsageError(
            f"accelerate config fsdp_auto_wrap_policy={policy}: dpkit wraps transformer "
            "layers (TRANSFORMER_BASED_WRAP; --fsdp-layer-classes names them)"
        )
    if env.get("FSDP_IGNORED_MODULES"):
        raise UsageError(
            f"accelerate config fsdp_ignored_modules={env['FSDP_IGNORED_MODULES']}: "
            "dpkit's FSDP2 shards every module"
        )
    reshard = env.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower()
    by_value = {"true": True, "full_shard": True, "false": False, "shard_grad_op": False}
    if reshard not in by_value:
        raise UsageError(
            f"accelerate config fsdp_reshard_after_forward={reshard}: one of true, false"
        )
    return fsdp2_strategy(by_value[reshard])


def fsdp_layer_classes_from_launcher(env: Mapping[str, str]) -> tuple[str, ...]:
    """``fsdp_transformer_layer_cls_to_wrap`` of an accelerate FSDP launch (comma-separated)."""
    if env.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return ()
    value = env.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "")
    return tuple(name.strip() for name in value.split(",") if name.strip())


def check_launcher(env: Mapping[str, str]) -> None:
    """Refuse launch forms that would silently run something else than asked."""
    _fsdp_launch(env)
    # accelerate's simple launcher sets MASTER_PORT when more than one process was
    # asked for, but starts only one and sets no RANK.
    simple_launcher = "ACCELERATE_USE_CPU" in env and "RANK" not in env
    if simple_launcher and "MASTER_PORT" in env and "WORLD_SIZE" not in env:
        raise UsageError(
            "accelerate launch --cpu --num_processes N starts a single process; use "
            "`accelerate launch --multi_gpu --num_processes N` (dpkit runs it on CPU with gloo) "
            "or --config_file ds_configs/accelerate/ddp.yaml"
        )


def resolve_strategy(
    strategy_flag: str, deepspeed_flag: str | None, env: Mapping[str, str]
) -> StrategyChoice:
    """Decide the strategy from ``--strategy``, ``--deepspeed`` and the launcher.

    The launcher's choice (an accelerate DeepSpeed config, or ``--deepspeed`` given to
    the recipe by the deepspeed launcher) and ``--strategy`` must agree; ``--strategy
    auto`` follows the launcher and falls back to DDP.
    """
    check_launcher(env)
    world_size = int(env.get("WORLD_SIZE", "1"))
    fsdp_launched = _fsdp_launch(env)
    if fsdp_launched is not None:
        source = f"accelerate launch (FSDP2, {fsdp_launched.name})"
        if deepspeed_flag is not None:
            raise UsageError(
                f"--deepspeed={deepspeed_flag!r} conflicts with {source}: drop one of them"
            )
        if strategy_flag not in ("auto", fsdp_launched.name):
            raise UsageError(
                f"--strategy={strategy_flag} conflicts with {source}: drop one of them"
            )
        return StrategyChoice(fsdp_launched, source, None, None, world_size)

    launcher_path: str | None = None
    launcher_source = ""
    if env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        launcher_path = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or None
        launcher_source = "accelerate launch (DeepSpeed)"
        if launcher_path is None:
            stage = int(env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))
            if stage not in (1, 2):
                raise UsageError(
                    f"accelerate launch --zero_stage {stage}: dpkit supports ZeRO stages 1 and 2"
                )
            launcher_path = str(resources.deepspeed_config(deepspeed_strategy(stage).name))
    accelerate_without_ds = "ACCELERATE_DYNAMO_BACKEND" in env and not launcher_source

    if deepspeed_flag is not None:
        if accelerate_without_ds:
            raise UsageError(
                f"--deepspeed={deepspeed_flag!r} conflicts with accelerate launch without "
                "DeepSpeed: use --config_file ds_configs/accelerate/zero2.yaml (or zero1.yaml), "
                "or the deepspeed launcher"
            )
        if launcher_path is not None:
            flag_stage = zero_stage_of(read_ds_config(deepspeed_flag), deepspeed_flag)
            launcher_stage = zero_stage_of(read_ds_config(launcher_path), launcher_path)
            if flag_stage != launcher_stage:
                raise UsageError(
                    f"--deepspeed={deepspeed_flag!r} is ZeRO-{flag_stage} but {launcher_source} "
                    f"is ZeRO-{launcher_stage}: drop one of them"
                )
        launcher_path, launcher_source = deepspeed_flag, f"--deepspeed {deepspeed_flag}"

    if launcher_path is not None:
        template = read_ds_config(launcher_path)
        launched = deepspeed_strategy(zero_stage_of(template, launcher_path))
        if strategy_flag not in ("auto", launched.name):
            if get_strategy(strategy_flag).uses_fsdp2 and deepspeed_flag is not None:
                raise UsageError(
                    f"--strategy={strategy_flag} conflicts with --deepspeed={deepspeed_flag!r}: "
                    "FSDP2 takes no DeepSpeed config; drop one of them"
                )
            raise UsageError(
                f"--strategy={strategy_flag} conflicts with {launcher_source} "
                f"({launched.name}): drop one of them"
            )
        return StrategyChoice(launched, launcher_source, launcher_path, template, world_size)

    if strategy_flag in ("auto", DDP.name):
        source = "--strategy ddp" if strategy_flag == DDP.name else "default (no DeepSpeed config)"
        return StrategyChoice(DDP, source, None, None, world_size)

    strategy = get_strategy(strategy_flag)
    if strategy.uses_fsdp2:
        # dpkit applies fully_shard itself: every launcher that starts N plain processes
        # (torchrun, accelerate launch without DeepSpeed, deepspeed) runs it.
        return StrategyChoice(strategy, f"--strategy {strategy.name}", None, None, world_size)
    if accelerate_without_ds:
        raise UsageError(
            f"--strategy={strategy_flag} conflicts with accelerate launch without DeepSpeed: "
            f"use --config_file ds_configs/accelerate/{strategy_flag}.yaml"
        )
    path = str(resources.deepspeed_config(strategy.name))
    return StrategyChoice(
        strategy, f"--strategy {strategy.name}", path, read_ds_config(path), world_size
    )


def resolve_precision(
    flag: str | None, env: Mapping[str, str], *, on_cuda: bool | None = None
) -> str:
    """The flag wins over the launcher's default ``no``; two explicit, different values conflict.

    ``on_cuda``: whether the run has CUDA devices (fp16 needs them); None asks torch.
    """
    if on_cuda is None:
        import torch

        on_cuda = torch.cuda.is_available()
    launcher = env.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if flag is not None and launcher not in ("no", flag):
        raise UsageError(
            f"--mixed-precision={flag} conflicts with the launcher's mixed_precision={launcher}"
        )
    precision = flag or launcher
    if precision not in PRECISIONS:
        raise UsageError(f"mixed_precision={precision!r}: dpkit supports no, bf16 and fp16")
    if precision == "fp16" and not on_cuda:
        source = "--mixed-precision" if flag else "the launcher's mixed_precision"
        raise UsageError(f"{source}=fp16: needs a CUDA GPU; use bf16 on CPU")
    return precision


def check_accelerate_settings(
    env: Mapping[str, str], *, gradient_accumulation_steps: int, max_grad_norm: float
) -> None:
    """DeepSpeed settings from an accelerate config must agree with the run's own flags."""
    given = env.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
    if given not in (None, "", "auto") and int(given) != gradient_accumulation_steps:
        raise UsageError(
            f"accelerate config gradient_accumulation_steps={given} disagrees with the run's "
            f"{gradient_accumulation_steps} (--gradient-accumulation-steps): make them equal"
        )
    given = env.get("ACCELERATE_GRADIENT_CLIPPING")
    if given not in (None, "", "auto", "none") and float(given) != float(max_grad_norm):
        raise UsageError(
            f"accelerate config gradient_clipping={given} disagrees with the run's "
            f"{max_grad_norm:g} (--max-grad-norm): make them equal"
        )
    for variable, name in _OFFLOAD_SETTINGS.items():
        device = env.get(variable, "none").lower()
        if device not in ("", "none"):
            raise UsageError(
                f"accelerate config {name}={device}: dpkit does not set up offload from "
                "accelerate's settings; put offload_optimizer in the DeepSpeed JSON"
            )


def local_process_count(env: Mapping[str, str]) -> tuple[int, str]:
    """How many processes the launcher started on this node, and where that was read
    (``LOCAL_WORLD_SIZE=8``), for the error line.

    Without a count, ``LOCAL_RANK`` gives a lower bound (this rank and those below it);
    without either, this process is alone (``python recipe.py``).
    """
    for name in LOCAL_PROCESS_COUNT_VARIABLES:
        value = env.get(name, "")
        if value:
            return int(value), f"{name}={value}"
    local_rank = env.get("LOCAL_RANK", "")
    if local_rank:
        count = int(local_rank) + 1
        return count, f"LOCAL_RANK={local_rank}, so at least {count}"
    return 1, "1"


def check_ranks_per_gpu(
    local_processes: int, visible_cuda_devices: int, *, source: str | None = None
) -> None:
    """Refuse a NCCL launch that would put two ranks of one communicator on one GPU.

    accelerate maps each process to ``cuda:(LOCAL_RANK % device_count)``, so with more
    processes on a node than visible devices two ranks share one; NCCL refuses that
    (``../shared/STACK-NOTES.md``), but only once the process group is up, in an error
    that names neither the launch flag nor the count. Call before the group starts.

    Args:
        local_processes: processes the launcher started on this node
            (:func:`local_process_count`).
        visible_cuda_devices: ``torch.cuda.device_count()``, which honours
            ``CUDA_VISIBLE_DEVICES``; 0 means a CPU run (gloo), which this does not concern.
        source: how the launcher gave ``local_processes``, for the message (default
            ``LOCAL_WORLD_SIZE=<local_processes>``).
    """
    if visible_cuda_devices <= 0 or local_processes <= visible_cuda_devices:
        return
    source = source or f"LOCAL_WORLD_SIZE={local_processes}"
    devices = "device" if visible_cuda_devices == 1 else "devices"
    n = visible_cuda_devices
    raise UsageError(
        f"{source} processes on this node but {n} visible CUDA {devices}: NCCL refuses two "
        f"ranks on one GPU; start one process per visible GPU (torchrun --nproc_per_node {n}, "
        f"deepspeed --num_gpus {n}, accelerate launch --num_processes {n} per machine) "
        "or make more GPUs visible (CUDA_VISIBLE_DEVICES)"
    )
