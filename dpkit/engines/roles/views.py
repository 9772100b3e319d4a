"""What an engine reads of the objects that the layers above it own, as Protocols.

The engines sit below the subsystems that call them (the run, its resolution, the memory
probes, the plan's rows), so they never import those classes: each role's methods are
typed by the few attributes they read, and any object that has them serves (the run's
dataclasses, a test's stand-in). The dependency points one way, as in Lightning Fabric,
whose strategies see the accelerator and precision through their own interfaces.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from dpkit.core.strategy import Strategy

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

    from dpkit.models import ModelSizes


class FlagsView(Protocol):
    """The strategy flags of a run (:class:`dpkit.train.config.StrategyConfig`)."""

    strategy: str
    deepspeed: str | None
    ddp_find_unused_parameters: bool


class RequestView(Protocol):
    """What a run asks of a backend before any process group
    (:class:`dpkit.train.resolution.Request`)."""

    source: str
    args: FlagsView
    env: Mapping[str, str]
    precision: str
    on_cuda: bool
    world_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    max_grad_norm: float
    learning_rate: float | None
    weight_decay: float | None
    model: Any
    model_sizes: ModelSizes
    ds_config_path: str | None
    ds_template: Mapping[str, Any] | None
    fsdp_layer_override: tuple[str, ...]


class ResolutionView(Protocol):
    """A run resolved once (:class:`dpkit.train.resolution.Resolution`)."""

    strategy: Strategy
    precision: str
    on_cuda: bool
    settings: Any


class RunView(Protocol):
    """A run being prepared (:class:`dpkit.train.run.Run`)."""

    @property
    def accelerator(self) -> Accelerator: ...

    resolution: ResolutionView


class StepProbesView(Protocol):
    """The memory probes of one step (:class:`dpkit.memory.probes.StepProbes`), into which a
    backend hooks the points where it holds memory."""

    activations: Any
    missing: list[str]
    sized_buffers: dict[str, float]
    point_name: Callable[..., str]
    inner_step_done: list[Callable[[], None]]

    def probe(self, point: str, extra: Iterable[tuple[torch.Tensor, str, str]] = ()) -> None: ...

    def replace(self, obj: Any, name: str, replacement: Any) -> None: ...

    def add_remover(self, remover: Callable[[], Any]) -> None: ...


class PlanRowView(Protocol):
    """One strategy's row of a plan (:class:`dpkit.plan.estimate.StrategyEstimate`)."""

    label: str
    total: float
    host_offload: float
    buffer_parts: Mapping[str, float]
