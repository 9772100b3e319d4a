"""An engine's measured memory: where its backend keeps the training state, counted tensor by
tensor into a :class:`~dpkit.core.walk.Ledger`, and the points of a step it is probed at."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dpkit.core.strategy import Strategy

if TYPE_CHECKING:
    import torch

    from dpkit.core.walk import Ledger
    from dpkit.engines.roles.views import StepProbesView


class MeasuredMemory:
    """The measured-memory role (``engine.memory``); the defaults are those of a backend
    that keeps the torch optimizer's own state and holds nothing of its own."""

    def walk(self, ledger: Ledger, model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
        """Claim every tensor this rank holds for training into ``ledger``
        (:class:`dpkit.core.walk.Ledger`) by category and holder; returns what the walk
        found about the backend (its ``kind`` and settings)."""
        raise NotImplementedError

    def install_probes(
        self, probes: StepProbesView, model: torch.nn.Module, optimizer: Any
    ) -> None:
        """Hook :class:`dpkit.memory.probes.StepProbes` into the points of a step where
        this backend holds memory the optimizer's own step hooks do not see."""

    def steady_step(self, optimizer: Any) -> int:
        """The first optimizer step (of this process) whose memory is the run's own: the
        one the probes must reach and the live-bytes tracker watches. The first, for a
        backend whose first step holds what every later step holds."""
        return 1

    def precision_in_effect(self, optimizer: Any) -> str | None:
        """The precision the live objects keep the parameters in, where the backend casts
        them itself (DeepSpeed's 16-bit partitions); None: the run's own setting stands."""
        return None

    def optimizer_groups(self, optimizer: Any) -> list[list[Any]]:
        """The parameters of each optimizer group as the backend lays them out (the plan
        partitions the same groups): here the torch optimizer's own."""
        from dpkit.core.walk import inner_torch_optimizer

        torch_opt = inner_torch_optimizer(optimizer)
        return [list(g["params"]) for g in torch_opt.param_groups] if torch_opt is not None else []

    def settings_in_effect(self, model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
        """The memory-relevant settings as the live objects hold them (not as configured),
        keyed ``<backend>.<setting>``."""
        return {}

    def report_notes(self, strategy: Strategy, model: torch.nn.Module, optimizer: Any) -> list[str]:
        """What the memory report must say about these live objects (a backend asked
        for but not found, say)."""
        return []

    def offload_in_effect(self, optimizer: Any) -> str | None:
        """Where the live optimizer keeps its state off the device (``cpu``), or None."""
        return None

    def optimizer_in_effect(self, optimizer: Any) -> str | None:
        """The optimizer the live run steps with, as the plan names it
        (:data:`dpkit.core.units.OPTIMIZER_STATE_BYTES`), where the backend chose it (a
        CPU optimizer under offload); None: the one the caller built."""
        return None

    def report_param_shapes(self) -> bool:
        """Whether the memory report records every parameter's shape: the plan needs them
        where the backend pads per parameter (FSDP2)."""
        return False
