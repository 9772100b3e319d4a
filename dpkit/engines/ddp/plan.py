"""DDP's bytes per rank, predicted: everything replicated, fp32 even in mixed precision.

Mixed precision under DDP is autocast: parameters, gradients and optimizer state stay
fp32 and there is no separate master copy (16 bytes/param for AdamW, the ZeRO paper's
2 + 2 + 12 in total). Pure arithmetic: no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from dpkit.core.units import OPTIMIZER_STATE_BYTES, ModelStateBytes
from dpkit.engines.ddp.settings import ddp_kwargs
from dpkit.engines.roles.planned import PlanArithmetic

if TYPE_CHECKING:
    from dpkit.core.spec import ModelSpec, PlanInputs
    from dpkit.core.step import PeakPoint, PeakView
    from dpkit.core.strategy import Strategy
    from dpkit.engines.roles.views import PlanRowView


def model_state_bytes(num_params: float, optimizer: str) -> ModelStateBytes:
    """fp32 parameters and gradients, the optimizer's state, all whole on every rank."""
    return ModelStateBytes(
        params=4 * num_params,
        grads=4 * num_params,
        optimizer=OPTIMIZER_STATE_BYTES[optimizer] * num_params,
        master=0.0,
    )


def paper_grad_bytes(num_params: float) -> float:
    """The paper's figure is DDP's own: every fp32 gradient on every rank."""
    return 4.0 * num_params


def buffer_bytes(settings: Mapping[str, Any], grads: float) -> dict[str, float]:
    """The reducer allocates flat buckets for every gradient up front (bucket_cap_mb only
    splits them); with ``gradient_as_bucket_view`` the gradients are views of those
    buckets and cost nothing more."""
    return {"ddp_gradient_buckets": 0.0 if settings["gradient_as_bucket_view"] else grads}


def autocast_weight_copies(num_params: float, precision: str) -> dict[str, float]:
    """DDP's mixed precision is autocast: it casts each weight to 16 bits once per forward
    and keeps the copy for backward (the matmul saves it): the memory report sees these
    among saved tensors. Norm weights and position embeddings are not cast, so this is
    an upper bound."""
    if precision == "fp32":
        return {}
    return {"autocast_weight_copies": 2.0 * num_params}


def peak_points(view: PeakView) -> list[PeakPoint]:
    """Where a DDP step may peak. The reducer allocates its buckets when the model is
    wrapped, so every gradient's bytes are held through the step (as the buckets' views
    with ``gradient_as_bucket_view``, else beside them). In backward each gradient is an
    operator's output until the reducer copies it into its bucket (the step's trace counts
    it until then). The update adds AdamW's moments (made inside the first one) and the
    optimizer's temporaries; the gradients stay until ``zero_grad``, after the update.

    With gradient accumulation the micro-batches before the last run under ``no_sync``: the
    reducer's hooks return early, so autograd stores each gradient in a ``.grad`` of its own,
    not a bucket view; the later micro-batches' forward and backward hold those beside the
    buckets, which the last backward fills (measured: 2 x 86.6 MiB of MiniLM's gradients in
    its second micro-batch's backward).

    Without ``gradient_as_bucket_view`` (the Trainer's DDP) the gradients are tensors of
    their own beside the buckets, and ``zero_grad`` (``set_to_none``, torch's default)
    frees them: a step's first forward holds none, and its backward holds each one from
    the moment autograd stores it (the trace's ``backward_kept_high``, not every gradient
    beside the backward's early high-water: measured, MiniLM under the Trainer peaks at
    2.8 MiB of stored gradients beside 183.2 MiB of activations). Under accumulation the
    later micro-batches add into the ``.grad`` the first one stored."""
    from dpkit.core.step import PeakPoint

    trace = view.trace
    buckets = {name: v for name, v in view.buffer_parts.items() if v}
    held = {"params": view.params, "grads": view.grads, **buckets, "batch": trace.batch}
    before = {"optimizer": view.optimizer_before_update} if view.optimizer_before_update else {}
    bucket_view = view.settings.get(
        "gradient_as_bucket_view", not view.buffer_parts.get("ddp_gradient_buckets")
    )
    if bucket_view or view.accumulation_steps > 1:
        if bucket_view and view.accumulation_steps > 1:
            before["grads_accumulated_outside_buckets"] = view.grads
        forward = {**held, **before, "activations": trace.forward_high}
        backward = {**held, **before, "activations": trace.backward_high}
    else:  # the gradients are made in this backward: each held from when it is stored
        without_grads = {k: v for k, v in held.items() if k != "grads"}
        forward = {**without_grads, **before, "activations": trace.forward_high}
        backward = {**without_grads, **before, "activations_and_grads": trace.backward_kept_high}
    return [
        PeakPoint(trace.forward_point, forward),
        PeakPoint("backward", backward),
        PeakPoint(
            "optimizer step",
            {**held, "optimizer": view.optimizer, **view.optimizer_temporaries},
            through=("after update",),
        ),
    ]


def why(strategy: Strategy, row: PlanRowView, inputs: PlanInputs) -> str:
    """Why DDP when it fits: nothing needs sharding."""
    from dpkit.core.units import format_gib

    return (
        f"{strategy.label} fits ({format_gib(row.total)} of {format_gib(inputs.usable)} "
        "usable): nothing needs sharding, and ZeRO would add a DeepSpeed engine and sharded "
        "checkpoints for memory that is not needed."
    )


class DDPPlan(PlanArithmetic):
    """DDP's plan arithmetic: every model state whole on every rank, fp32, and DDP's gradient buckets."""

    def model_state_bytes(
        self,
        strategy: Strategy,
        num_params: float,
        world_size: int,
        precision: str,
        optimizer: str,
        param_shapes: Sequence[Sequence[int]] | None,
    ) -> Any:
        return model_state_bytes(num_params, optimizer)

    def paper_grad_bytes(
        self, strategy: Strategy, num_params: float, world_size: int, precision: str
    ) -> float:
        return paper_grad_bytes(num_params)

    def plan_settings(self, spec: ModelSpec, world_size: int, on_cuda: bool) -> dict[str, Any]:
        return {"gradient_as_bucket_view": bool(ddp_kwargs().get("gradient_as_bucket_view", False))}

    def settings_from_run(self, recorded: Mapping[str, Any]) -> dict[str, Any]:
        key = "ddp.gradient_as_bucket_view"
        return {"gradient_as_bucket_view": recorded[key]} if key in recorded else {}

    def buffer_bytes(
        self,
        strategy: Strategy,
        spec: ModelSpec,
        world_size: int,
        precision: str,
        settings: Mapping[str, Any],
        grads: float,
    ) -> dict[str, float]:
        return buffer_bytes(settings, grads)

    def activation_extras(
        self, strategy: Strategy, num_params: float, precision: str
    ) -> dict[str, float]:
        return autocast_weight_copies(num_params, precision)

    def activations_under_autocast(self, strategy: Strategy, precision: str) -> bool:
        return precision != "fp32"  # accelerate's mixed precision under DDP is autocast

    def plan_settings_text(self, settings: Mapping[str, Any]) -> str:
        if settings["gradient_as_bucket_view"]:
            return "DDP gradients are views of its buckets"
        return "DDP's buckets copy every gradient"

    def peak_points(self, strategy: Strategy, view: PeakView) -> list[PeakPoint]:
        return peak_points(view)

    def why(self, strategy: Strategy, row: PlanRowView, inputs: PlanInputs) -> str:
        return why(strategy, row, inputs)
