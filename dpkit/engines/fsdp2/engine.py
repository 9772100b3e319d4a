"""The FSDP2 engine: torch's ``fully_shard`` on each layer, then the root, applied by dpkit.

accelerate enters its own FSDP2 path only for accelerator devices: on a CPU-only
machine an FSDP YAML runs unconnected single-process copies, and ``cpu=True`` wraps the
model in DDP (docs/stack-notes.md). dpkit therefore shards the model itself
(:meth:`FSDP2Engine.before_optimizer`), on CPU (gloo) and GPU (nccl) alike, and
accelerate prepares the sharded model without a wrapper.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dpkit.core.launch import Launch
from dpkit.core.strategy import Strategy
from dpkit.engines import common
from dpkit.engines.base import Engine, EngineSettings, Prepared
from dpkit.engines.fsdp2 import plan
from dpkit.engines.roles.checkpoint_io import CheckpointIO
from dpkit.engines.roles.measured import MeasuredMemory
from dpkit.engines.roles.planned import PlanArithmetic
from dpkit.errors import UsageError

if TYPE_CHECKING:
    import torch

    from dpkit.engines.roles.views import FlagsView, RequestView, ResolutionView, RunView


@dataclass(frozen=True)
class FSDP2Settings(EngineSettings):
    """Which modules ``fully_shard`` makes units."""

    layer_classes: tuple[str, ...] = ()
    """The class names made sharding units before the root (empty when only the model's
    config was given: found when the model is sharded)."""
    layer_override: tuple[str, ...] = ()
    """The classes the user named (``--fsdp-layer-classes`` or the accelerate YAML's
    ``fsdp_transformer_layer_cls_to_wrap``)."""
    asked_by: str = ""
    """What asked for FSDP2, for messages (the flag as typed, or the launcher)."""
    offload: bool = False
    """torch's ``CPUOffloadPolicy`` on every unit (``fsdp2_full_shard_offload``)."""

    def run_info(self) -> dict[str, Any]:
        # The optimizer steps where its shards live: in host memory under offload.
        return {"offload_optimizer": "cpu" if self.offload else None}


def _asked_by(source: str) -> str:
    """How a message names what asked for FSDP2: the flag as typed, or the launcher."""
    if source.startswith("--strategy "):
        return "--strategy=" + source.removeprefix("--strategy ")
    return source


# FSDP settings of an accelerate YAML that dpkit does not apply, with the value that
# means "off" and what to use instead; anything else is refused rather than dropped.
_FSDP_SETTINGS_OFF = {
    "FSDP_ACTIVATION_CHECKPOINTING": (
        "fsdp_activation_checkpointing", "false", "; use --gradient-checkpointing"
    ),
    "FSDP_CPU_RAM_EFFICIENT_LOADING": ("fsdp_cpu_ram_efficient_loading", "false", ""),
}  # fmt: skip


def _fsdp_launch(env: Mapping[str, str]) -> tuple[bool, bool] | None:
    """``reshard_after_forward`` and ``fsdp_offload_params`` of an accelerate FSDP launch
    (None: not one); the FSDP settings dpkit does not apply (activation checkpointing, a
    size-based wrap policy, ignored modules) and FSDP1 are refused."""
    if env.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return None
    version = env.get("FSDP_VERSION", "1")
    if version != "2":
        raise UsageError(
            f"accelerate config fsdp_version={version}: dpkit runs FSDP2; set fsdp_version: 2 "
            "(ds_configs/accelerate/fsdp2_full_shard.yaml)"
        )
    for variable, (name, off, hint) in _FSDP_SETTINGS_OFF.items():
        value = env.get(variable, off).lower()
        if value != off:
            raise UsageError(
                f"accelerate config {name}={value}: dpkit's FSDP2 does not apply it{hint}"
            )
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
    # accelerate writes the YAML's fsdp_offload_params as "true"/"false" (utils/launch.py).
    offload = env.get("FSDP_OFFLOAD_PARAMS", "false").lower()
    if offload not in ("true", "false"):
        raise UsageError(f"accelerate config fsdp_offload_params={offload}: one of true, false")
    if offload == "true" and not by_value[reshard]:
        raise UsageError(
            "accelerate config fsdp_offload_params=true with fsdp_reshard_after_forward="
            f"{reshard}: dpkit offloads under full-shard only; set fsdp_reshard_after_forward: "
            "true (ds_configs/accelerate/fsdp2_full_shard_offload.yaml)"
        )
    return by_value[reshard], offload == "true"


FSDP2_SHARD_GRAD_OP = Strategy(
    "fsdp2_shard_grad_op",
    "FSDP2 shard-grad-op",
    "fsdp2",
    2,
    summary="torch FSDP2: gradients and optimizer state sharded, parameters whole in the step",
)
FSDP2_FULL_SHARD = Strategy(
    "fsdp2_full_shard",
    "FSDP2 full-shard",
    "fsdp2",
    3,
    reshard_after_forward=True,
    summary="torch FSDP2: parameters, gradients and optimizer state sharded",
)
FSDP2_FULL_SHARD_OFFLOAD = Strategy(
    "fsdp2_full_shard_offload",
    "FSDP2 full-shard offload",
    "fsdp2",
    3,
    offload=True,
    reshard_after_forward=True,
    memory_fallback=True,
    summary="FSDP2 full-shard with sharded parameters, gradients and optimizer state in host "
    "memory (torch CPUOffloadPolicy); the optimizer steps on the CPU",
)


class FSDP2Engine(Engine):
    """Parameters, gradients and optimizer state sharded on dim 0; layers all-gathered for
    their compute (kept whole until the backward in shard-grad-op mode)."""

    name = "fsdp2"
    label = "torch FSDP2"
    strategies = (FSDP2_SHARD_GRAD_OP, FSDP2_FULL_SHARD, FSDP2_FULL_SHARD_OFFLOAD)
    needs_process_group = True

    def launched(self, args: FlagsView, env: Mapping[str, str]) -> Launch | None:
        """An accelerate FSDP launch (``fsdp_version: 2``): its mode, and the layer classes
        its YAML names. dpkit applies ``fully_shard`` itself (accelerate's own path runs
        unconnected copies on CPU)."""
        launch = _fsdp_launch(env)
        if launch is None:
            return None
        reshard, offload = launch
        strategy = next(
            s
            for s in self.strategies
            if (s.reshard_after_forward, s.offload) == (reshard, offload) and s.runnable
        )
        source = f"accelerate launch (FSDP2, {strategy.name})"
        if args.deepspeed is not None:
            raise UsageError(
                f"--deepspeed={args.deepspeed!r} conflicts with {source}: drop one of them"
            )
        if args.strategy not in ("auto", strategy.name):
            raise UsageError(
                f"--strategy={args.strategy} conflicts with {source}: drop one of them"
            )
        value = env.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "")
        layers = tuple(name.strip() for name in value.split(",") if name.strip())
        return Launch(strategy, source, fsdp_layer_override=layers)

    def configure(self, strategy: Strategy, request: RequestView) -> FSDP2Settings:
        if request.precision == "fp16":
            raise UsageError(
                f"mixed_precision=fp16 with --strategy={strategy.name}: dpkit's FSDP2 runs bf16 "
                "(fp16 would need a sharded gradient scaler); use bf16"
            )
        asked_by = _asked_by(request.source)
        layers: tuple[str, ...] = ()
        if common.is_module(request.model):
            from dpkit.engines.fsdp2.shard import layer_classes

            layers = layer_classes(request.model, request.fsdp_layer_override, asked_by=asked_by)
        notes = list(common.note_find_unused(strategy, request))
        state_dict_type = request.env.get("FSDP_STATE_DICT_TYPE")
        if state_dict_type:
            notes.append(
                f"accelerate config fsdp_state_dict_type={state_dict_type}: dpkit's checkpoints "
                "are its own portable layout (full fp32 weights and Adam moments) whatever the type"
            )
        return FSDP2Settings(
            notes=tuple(notes),
            layer_classes=layers,
            layer_override=request.fsdp_layer_override,
            asked_by=asked_by,
            offload=strategy.offload,
        )

    def accelerator_options(self, strategy: Strategy, resolution: ResolutionView) -> dict[str, Any]:
        # The strategy was read from an FSDP launch, if any; accelerate would otherwise take
        # its own FSDP path on GPUs (and dpkit's sharded model would be sharded twice).
        os.environ.pop("ACCELERATE_USE_FSDP", None)
        return {"cpu": not resolution.on_cuda}

    def prepare(self, run: RunView, objects: Sequence[Any]) -> tuple[Any, ...]:
        """Shard the model, switch an optimizer built over its whole parameters onto the
        shards (by parameter name: it must not have stepped), then prepare everything."""
        import torch

        objects = list(objects)
        index = next((i for i, o in enumerate(objects) if common.is_module(o)), None)
        if index is None:
            return super().prepare(run, objects)
        model = objects[index]
        optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
        if any(opt.state for opt in optimizers):
            raise UsageError(
                "run.prepare: the optimizer has already stepped; FSDP2 shards the parameters "
                "it updates, so build it (or prepare) before training"
            )
        name_of = {id(p): name for name, p in model.named_parameters()}
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                if any(id(p) not in name_of for p in group["params"]):
                    raise UsageError(
                        "run.prepare: the optimizer holds a parameter that is not the model's; "
                        "FSDP2 can only shard the model's own"
                    )
        sharded = self.before_optimizer(run, model)
        shard_of = dict(sharded.named_parameters())
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["params"] = [shard_of[name_of[id(p)]] for p in group["params"]]
        objects[index] = sharded
        return super().prepare(run, objects)

    def before_optimizer(self, run: RunView, model: torch.nn.Module) -> Any:
        """Shard ``model`` (each layer a unit, then the root) and hand it to accelerate,
        which then prepares it without a wrapper. The optimizer must be built after:
        FSDP2 replaces the parameters by their shards."""
        from dpkit.engines.fsdp2.shard import layer_classes, shard_model

        settings = run.resolution.settings
        classes = settings.layer_classes or layer_classes(
            model, settings.layer_override, asked_by=settings.asked_by
        )
        model = shard_model(
            model,
            layer_class_names=classes,
            reshard_after_forward=run.resolution.strategy.reshard_after_forward,
            offload=settings.offload,
            precision=run.resolution.precision,
            device_type=run.accelerator.device.type,
        )
        # evaluation_mode: accelerate applies what it applies to every model (autocast
        # under mixed precision) and no DDP wrapper; the later prepare() passes it through.
        return run.accelerator.prepare_model(model, evaluation_mode=True)

    def after_prepare(self, run: RunView, model: torch.nn.Module, optimizer: Any) -> Prepared:
        """The model must be sharded, and the optimizer must hold the shards (built after
        :meth:`before_optimizer`)."""
        from torch.distributed.fsdp import FSDPModule

        from dpkit.core.walk import inner_torch_optimizer
        from dpkit.engines.fsdp2.shard import is_sharded, unit_count

        if not isinstance(model, FSDPModule):
            raise RuntimeError(
                f"FSDP2 was asked for but the model is not sharded ({type(model).__name__}): "
                "pass the model to run.prepare"
            )
        torch_opt = inner_torch_optimizer(optimizer)
        params = [p for group in torch_opt.param_groups for p in group["params"]]
        if not all(is_sharded(p) for p in params):
            raise RuntimeError(
                "the optimizer holds the model's unsharded parameters: build it after "
                "the model is sharded (run.prepare does both in order)"
            )
        wrapper = f"FSDP2 fully_shard ({unit_count(model)} units)+{type(torch_opt).__name__}"
        return Prepared(wrapper, run.resolution.strategy.zero_stage)

    def after_evaluation(self, model: torch.nn.Module) -> None:
        from dpkit.engines.fsdp2.shard import reshard

        reshard(model)  # shard-grad-op keeps whole parameters after a forward

    # bench

    def bare_baseline(self, strategy: Strategy) -> tuple[str, str, list[str]]:
        reshard = str(strategy.reshard_after_forward).lower()
        module = ["--module", "dpkit.bench.bare_fsdp2", "--reshard-after-forward", reshard]
        if strategy.offload:
            module += ["--offload", "true"]
        return "torchrun", "--nproc_per_node", module

    @property
    def memory(self) -> MeasuredMemory:
        from dpkit.engines.fsdp2.memory import FSDP2Memory

        return FSDP2Memory()

    @property
    def plan(self) -> PlanArithmetic:
        return plan.FSDP2Plan()

    @property
    def checkpoints(self) -> CheckpointIO:
        from dpkit.engines.fsdp2.checkpoint import FSDP2Checkpoints

        return FSDP2Checkpoints()
