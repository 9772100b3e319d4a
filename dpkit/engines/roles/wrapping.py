"""An engine's wrapping: what it does to the model and optimizer around ``accelerator.prepare``,
and the check that the live objects are what was asked for."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dpkit.core.strategy import Strategy

if TYPE_CHECKING:
    import torch

    from dpkit.engines.roles.views import RunView


@dataclass(frozen=True)
class Prepared:
    """What runs, read back from the live objects after ``accelerator.prepare``."""

    wrapper: str
    """How the model and optimizer are wrapped (``DistributedDataParallel``,
    ``DeepSpeedEngine+DeepSpeedZeroOptimizer``, ``FSDP2 fully_shard (7 units)+AdamW``)."""
    zero_stage: int
    """What is sharded, in ZeRO's terms, as the live objects say."""
    run_info: dict[str, Any] = field(default_factory=dict)
    """Engine fields for ``run_info.json`` known only once prepared."""


class Wrapping:
    """The wrapping role (every engine is one)."""

    def prepare(self, run: RunView, objects: Sequence[Any]) -> tuple[Any, ...]:
        """``objects`` (the model, its optimizer, loaders, a scheduler) wrapped for this
        backend: ``accelerator.prepare``, which builds DDP or DeepSpeed's engine."""
        prepared = run.accelerator.prepare(*objects)
        return prepared if isinstance(prepared, tuple) else (prepared,)

    @contextlib.contextmanager
    def building_model(self, run: RunView) -> Iterator[None]:
        """The context a model is built or loaded in (ZeRO-3: under ``zero.Init``, which
        needs the process group); nothing for a backend that wraps a whole model."""
        yield

    def before_optimizer(self, run: RunView, model: torch.nn.Module) -> Any:
        """The model as the optimizer must see it (FSDP2 replaces parameters by shards);
        ``model`` itself where the backend wraps it in ``accelerator.prepare``."""
        return model

    def after_prepare(self, run: RunView, model: torch.nn.Module, optimizer: Any) -> Prepared:
        """Check that the prepared objects are what was asked for (a mismatch is a
        ``RuntimeError``, not a warning), apply what the backend takes only once built,
        and describe it."""
        raise NotImplementedError

    def after_evaluation(self, model: torch.nn.Module) -> None:
        """Give back what a forward without a backward left held (FSDP2 shard-grad-op's
        whole parameters)."""

    def own_timing(self, model: torch.nn.Module) -> dict[str, Any]:
        """The backend's own timing of a step, for ``train_summary.json`` (DDP's
        ``ddp_timing``: None under a backend that times nothing)."""
        return {"ddp_timing": None}

    def recognise(self, model: torch.nn.Module, optimizer: Any) -> Strategy | None:
        """The strategy these live objects run under this backend, or None if they are
        not this backend's (the Trainer integration reads a run it did not set up)."""
        return None
