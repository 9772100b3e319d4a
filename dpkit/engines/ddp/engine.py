"""The DDP engine: torch's DistributedDataParallel, as accelerate builds it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dpkit.core.launch import Launch
from dpkit.core.strategy import Strategy
from dpkit.engines import common
from dpkit.engines.base import Engine, EngineSettings, Prepared
from dpkit.engines.ddp import plan
from dpkit.engines.ddp.settings import buffers_need_forward_sync, ddp_kwargs


@dataclass(frozen=True)
class DDPSettings(EngineSettings):
    """What a DDP run hands accelerate, and what it sets on the wrapper once built."""

    kwargs: Mapping[str, Any] = field(default_factory=dict)
    """``DistributedDataParallelKwargs`` (:func:`~dpkit.engines.ddp.settings.ddp_kwargs`,
    and the run's ``find_unused_parameters``)."""
    forward_sync_buffers: bool = True
    """Re-broadcast rank 0's buffers before every forward (DDP's ``forward_sync_buffers``);
    off when every buffer is a constant (:func:`buffers_need_forward_sync`)."""


DDP = Strategy("ddp", "DDP", "ddp", 0, summary="a full replica per rank")


class DDPEngine(Engine):
    """A full replica per rank; gradients all-reduced in buckets during backward."""

    name = "ddp"
    label = "torch DDP"
    strategies = (DDP,)
    collectives = ("ddp_allreduce",)

    def from_flag(self, strategy: Strategy, args: Any, env: Mapping[str, str]) -> Launch:
        named = args.strategy == strategy.name
        return Launch(
            strategy, f"--strategy {strategy.name}" if named else "default (no DeepSpeed config)"
        )

    def configure(self, strategy: Any, request: Any) -> DDPSettings:
        common.refuse_fsdp_layers(strategy, request)
        return DDPSettings(
            kwargs={
                **ddp_kwargs(),
                "find_unused_parameters": request.args.ddp_find_unused_parameters,
            },
            forward_sync_buffers=buffers_need_forward_sync(request.model),
        )

    def accelerator_options(self, strategy: Any, resolution: Any) -> dict[str, Any]:
        from accelerate.utils import DistributedDataParallelKwargs

        return {
            # Without CUDA, plain multi-process runs need cpu=True to form a gloo group
            # (otherwise each process trains alone as rank 0: docs/stack-notes.md).
            "cpu": not resolution.on_cuda,
            "kwargs_handlers": [DistributedDataParallelKwargs(**resolution.settings.kwargs)],
        }

    def after_prepare(self, run: Any, model: Any, optimizer: Any) -> Prepared:
        wrapper = type(model).__name__
        world_size = run.accelerator.num_processes
        if world_size > 1 and wrapper != "DistributedDataParallel":
            raise RuntimeError(
                f"{world_size} processes but the model is not wrapped in DDP ({wrapper})"
            )
        if wrapper != "DistributedDataParallel":  # one process: nothing to synchronise
            return Prepared(wrapper, 0, {"ddp_forward_sync_buffers": None})
        # A DDP attribute, not a constructor argument: accelerate's
        # DistributedDataParallelKwargs only has the deprecated broadcast_buffers (a
        # FutureWarning on every rank, and it also skips the init-time sync).
        model.forward_sync_buffers = run.resolution.settings.forward_sync_buffers
        return Prepared(wrapper, 0, {"ddp_forward_sync_buffers": bool(model.forward_sync_buffers)})

    def own_timing(self, model: Any) -> dict[str, Any]:
        from dpkit.engines.ddp.timing import ddp_timing

        return {"ddp_timing": ddp_timing(model)}

    def recognise(self, model: Any, optimizer: Any) -> Any:
        import torch.distributed as dist

        from dpkit.engines.ddp import memory

        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if memory.find_ddp(model) is not None or world == 1:
            return self.runnable(zero_stage=0)
        return None

    # memory, measured
    def walk(self, ledger: Any, model: Any, optimizer: Any) -> dict[str, Any]:
        from dpkit.engines.ddp import memory

        return memory.walk(ledger, model, optimizer)

    def settings_in_effect(self, model: Any, optimizer: Any) -> dict[str, Any]:
        from dpkit.engines.ddp import memory

        return memory.settings_in_effect(model)

    # memory, planned
    def model_state_bytes(
        self,
        strategy: Any,
        num_params: float,
        world_size: int,
        precision: str,
        optimizer: str,
        param_shapes: Sequence[Sequence[int]] | None,
    ) -> Any:
        return plan.model_state_bytes(num_params, optimizer)

    def paper_grad_bytes(
        self, strategy: Any, num_params: float, world_size: int, precision: str
    ) -> float:
        return plan.paper_grad_bytes(num_params)

    def plan_settings(self, spec: Any, world_size: int, on_cuda: bool) -> dict[str, Any]:
        return {"gradient_as_bucket_view": bool(ddp_kwargs().get("gradient_as_bucket_view", False))}

    def buffer_bytes(
        self,
        strategy: Any,
        spec: Any,
        world_size: int,
        precision: str,
        settings: Mapping[str, Any],
        grads: float,
    ) -> dict[str, float]:
        return plan.buffer_bytes(settings, grads)

    def activation_extras(
        self, strategy: Any, num_params: float, precision: str
    ) -> dict[str, float]:
        return plan.autocast_weight_copies(num_params, precision)

    def activations_under_autocast(self, strategy: Any, precision: str) -> bool:
        return precision != "fp32"  # accelerate's mixed precision under DDP is autocast

    def plan_settings_text(self, settings: Mapping[str, Any]) -> str:
        if settings["gradient_as_bucket_view"]:
            return "DDP gradients are views of its buckets"
        return "DDP's buckets copy every gradient"

    def why(self, strategy: Any, row: Any, inputs: Any) -> str:
        return plan.why(strategy, row, inputs)

    # checkpoints
    def full_weights(self, accelerator: Any, module: Any) -> dict[str, Any]:
        from dpkit.engines.ddp import checkpoint

        return checkpoint.full_weights(accelerator, module)

    def full_moments(self, accelerator: Any, module: Any, optimizer: Any) -> dict | None:
        from dpkit.engines.ddp import checkpoint

        return checkpoint.full_moments(accelerator, module, optimizer)

    def load_moments(
        self, accelerator: Any, module: Any, optimizer: Any, moments: dict, step: Any
    ) -> None:
        from dpkit.engines.ddp import checkpoint

        checkpoint.load_moments(module, optimizer, moments, step)

    # bench
    def bare_baseline(self, strategy: Any) -> tuple[str, str, list[str]]:
        return "torchrun", "--nproc_per_node", ["--module", "dpkit.bench.bare_ddp"]
