"""The DDP engine: torch's DistributedDataParallel, as accelerate builds it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dpkit.core.launch import Launch
from dpkit.core.strategy import Strategy
from dpkit.engines import common
from dpkit.engines.base import Engine, EngineSettings, Prepared
from dpkit.engines.ddp import plan
from dpkit.engines.ddp.settings import buffers_need_forward_sync, ddp_kwargs
from dpkit.engines.roles.checkpoint_io import CheckpointIO
from dpkit.engines.roles.measured import MeasuredMemory
from dpkit.engines.roles.planned import PlanArithmetic

if TYPE_CHECKING:
    import torch

    from dpkit.engines.roles.views import FlagsView, RequestView, ResolutionView, RunView


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

    def from_flag(self, strategy: Strategy, args: FlagsView, env: Mapping[str, str]) -> Launch:
        named = args.strategy == strategy.name
        return Launch(
            strategy, f"--strategy {strategy.name}" if named else "default (no DeepSpeed config)"
        )

    def configure(self, strategy: Strategy, request: RequestView) -> DDPSettings:
        common.refuse_fsdp_layers(strategy, request)
        return DDPSettings(
            kwargs={
                **ddp_kwargs(),
                "find_unused_parameters": request.args.ddp_find_unused_parameters,
            },
            forward_sync_buffers=buffers_need_forward_sync(request.model),
        )

    def accelerator_options(self, strategy: Strategy, resolution: ResolutionView) -> dict[str, Any]:
        from accelerate.utils import DistributedDataParallelKwargs

        return {
            # Without CUDA, plain multi-process runs need cpu=True to form a gloo group
            # (otherwise each process trains alone as rank 0: docs/stack-notes.md).
            "cpu": not resolution.on_cuda,
            "kwargs_handlers": [DistributedDataParallelKwargs(**resolution.settings.kwargs)],
        }

    def after_prepare(self, run: RunView, model: torch.nn.Module, optimizer: Any) -> Prepared:
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

    def own_timing(self, model: torch.nn.Module) -> dict[str, Any]:
        from dpkit.engines.ddp.timing import ddp_timing

        return {"ddp_timing": ddp_timing(model)}

    def recognise(self, model: torch.nn.Module, optimizer: Any) -> Any:
        import torch.distributed as dist

        from dpkit.engines.ddp import memory

        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if memory.find_ddp(model) is not None or world == 1:
            return self.runnable(zero_stage=0)
        return None

    # bench
    def bare_baseline(self, strategy: Strategy) -> tuple[str, str, list[str]]:
        return "torchrun", "--nproc_per_node", ["--module", "dpkit.bench.bare_ddp"]

    @property
    def memory(self) -> MeasuredMemory:
        from dpkit.engines.ddp.memory import DDPMemory

        return DDPMemory()

    @property
    def plan(self) -> PlanArithmetic:
        return plan.DDPPlan()

    @property
    def checkpoints(self) -> CheckpointIO:
        from dpkit.engines.ddp.checkpoint import DDPCheckpoints

        return DDPCheckpoints()
