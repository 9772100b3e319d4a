"""An engine's plan arithmetic: the bytes its backend holds per rank, predicted, in plain
numbers (no torch: ``dpkit plan`` runs without it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from dpkit.core.strategy import Strategy

if TYPE_CHECKING:
    import torch

    from dpkit.core.spec import ModelSpec, PlanInputs
    from dpkit.core.step import PeakPoint, PeakView
    from dpkit.core.units import GradientHighWater, ModelStateBytes
    from dpkit.engines.roles.views import PlanRowView


class PlanArithmetic:
    """The plan role (``engine.plan``); the defaults are those of a backend with no
    buffers, step temporaries or host memory of its own."""

    def model_facts(
        self, model: torch.nn.Module, params: Sequence[torch.nn.Parameter]
    ) -> dict[str, Any]:
        """Fields of :class:`~dpkit.core.spec.ModelSpec` that this backend's plan reads of
        ``model``'s parameters (``params``, each once) besides their sizes: ZeRO-3's
        persistent small tensors, FSDP2's units. The only method here that sees a module."""
        return {}

    def model_state_bytes(
        self,
        strategy: Strategy,
        num_params: float,
        world_size: int,
        precision: str,
        optimizer: str,
        param_shapes: Sequence[Sequence[int]] | None,
    ) -> ModelStateBytes:
        """Per-rank parameters, gradients, optimizer state and master weights."""
        raise NotImplementedError

    def paper_grad_bytes(
        self, strategy: Strategy, num_params: float, world_size: int, precision: str
    ) -> float:
        """The ZeRO paper's per-rank gradient figure for this strategy."""
        raise NotImplementedError

    def plan_settings(self, spec: ModelSpec, world_size: int, on_cuda: bool) -> dict[str, Any]:
        """The buffer settings a dpkit run of this backend uses, as ``dpkit plan`` assumes
        them (keys of the backend's own; :func:`dpkit.plan.estimate.buffer_settings`)."""
        return {}

    def buffer_bytes(
        self,
        strategy: Strategy,
        spec: ModelSpec,
        world_size: int,
        precision: str,
        settings: Mapping[str, Any],
        grads: float,
    ) -> dict[str, float]:
        """Per-GPU communication buffers held through forward and backward, by name."""
        return {}

    def gradient_layout(
        self, strategy: Strategy, inputs: PlanInputs, settings: Mapping[str, Any]
    ) -> GradientHighWater | None:
        """The worst rank's gradient holding from the parameter layout, where the backend
        lays gradients out otherwise than the paper counts them; None elsewhere."""
        return None

    def step_bytes(
        self,
        strategy: Strategy,
        num_params: float,
        world_size: int,
        precision: str,
        grads_laid_out: bool,
    ) -> dict[str, float]:
        """Per-GPU temporaries of the optimizer step, by name."""
        return {}

    def activation_extras(
        self, strategy: Strategy, num_params: float, precision: str
    ) -> dict[str, float]:
        """What the backend adds to the bytes saved for backward (autocast's weight copies)."""
        return {}

    def activations_under_autocast(self, strategy: Strategy, precision: str) -> bool:
        """Whether the forward runs under torch autocast over fp32 weights (the plan then
        uses the trace made under autocast, which holds the weight copies
        :meth:`activation_extras` would add); False where the backend casts the weights
        themselves to 16 bits."""
        return False

    def host_bytes(
        self, strategy: Strategy, inputs: PlanInputs, optimizer: str
    ) -> dict[str, float]:
        """Host bytes per GPU under offload, by category (``grads``, ``optimizer``,
        ``master``, ``buffers``); empty where the backend keeps everything on the device.
        ``optimizer``: the one the plan counts (:meth:`optimizer_for_plan`)."""
        return {}

    def optimizer_for_plan(self, strategy: Strategy, optimizer: str) -> str | None:
        """The optimizer whose state the plan counts under ``strategy``, or None where it
        cannot run there."""
        return None if optimizer == "cpu_adam" else optimizer

    def settings_from_run(self, recorded: Mapping[str, Any]) -> dict[str, Any]:
        """The buffer settings (keys of :meth:`plan_settings`) a run really used, from what
        its memory report recorded (:meth:`MeasuredMemory.settings_in_effect`'s keys)."""
        return {}

    def plan_settings_text(self, settings: Mapping[str, Any]) -> str:
        """The plan's note on this backend's buffer settings ("" for none)."""
        return ""

    def plan_row_note(self, strategy: Strategy, row: PlanRowView) -> str:
        """A note under the plan's table on what one row of this backend holds ("" for none)."""
        return ""

    def unprobed_buffer_parts(self, strategy: Strategy) -> tuple[str, ...]:
        """The plan's buffer parts (:meth:`buffer_bytes`) of ``strategy`` that live only
        between the memory report's probe points, so that a run's counted tensors never
        include them (a GPU's allocator peak does)."""
        return ()

    def peak_points(self, strategy: Strategy, view: PeakView) -> list[PeakPoint]:
        """The points of one step where this backend's live bytes may peak, each with what
        is alive there (:mod:`dpkit.plan.peak` takes the largest). The default: states
        as the plan counts them, its buffers held through the forward and the backward
        (ZeRO-3's gathered parameters and buckets), gradients stored as they arrive."""
        from dpkit.core.step import PeakPoint

        trace = view.trace
        held = {
            "params": view.params,
            "master": view.master,
            "batch": trace.batch,
        }
        buffers = {name: v for name, v in view.buffer_parts.items() if v}
        return [
            PeakPoint(
                trace.forward_point,
                {
                    **held,
                    **buffers,
                    "optimizer": view.optimizer_before_update,
                    "activations": trace.forward_high,
                },
            ),
            PeakPoint(
                "backward",
                {
                    **held,
                    **buffers,
                    "optimizer": view.optimizer_before_update,
                    "activations_and_grads": trace.backward_kept_high,
                },
            ),
            PeakPoint(
                "optimizer step",
                {
                    **held,
                    "module_buffers": view.module_buffers,
                    "grads": view.grads,
                    "optimizer": view.optimizer,
                    **view.optimizer_temporaries,
                },
            ),
        ]

    def why(self, strategy: Strategy, row: PlanRowView, inputs: PlanInputs) -> str:
        """What choosing ``strategy`` buys and costs, for the plan's recommendation."""
        raise NotImplementedError
