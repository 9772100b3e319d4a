"""FSDP2's bytes per rank, predicted: every state sharded on dim 0, fp32 even in bf16.

Under torch ``fully_shard`` (both modes) parameters, gradients and optimizer state are
all sharded over N and stay fp32 in bf16 runs too (the 16-bit copy the compute uses is
transient: :mod:`dpkit.engines.fsdp2.layout`); no master copy. Per rank 4 + 4 + K bytes
per parameter, over N: ZeRO-3's sharding even in shard-grad-op mode, which differs only
in how long parameters stay whole. With the parameters' shapes known the figure is exact
for the worst rank (each parameter's dim 0 padded to a multiple of N); from a bare count
it is Psi/N. Pure arithmetic: no torch.

Full-shard offload (torch's ``CPUOffloadPolicy``) moves those shards, parameters,
gradients and the optimizer state built over them, to host memory: the device holds none
of them between steps, only what the compute needs whole (the same buffers as
full-shard's), and the host holds the 4 + 4 + K bytes per parameter over N
(:func:`host_bytes`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from dpkit.core.strategy import Strategy
from dpkit.core.units import OPTIMIZER_STATE_BYTES, ModelStateBytes, dtype_bytes
from dpkit.engines.fsdp2 import layout
from dpkit.engines.roles.planned import PlanArithmetic

if TYPE_CHECKING:
    import torch

    from dpkit.core.spec import ModelSpec, PlanInputs
    from dpkit.core.step import PeakPoint, PeakView
    from dpkit.engines.roles.views import PlanRowView


def shard_numel(
    num_params: float, world_size: int, shapes: Sequence[Sequence[int]] | None
) -> float:
    """Elements of the worst rank's shards: each parameter's ceil(d0/N) rows on rank 0
    (:mod:`dpkit.engines.fsdp2.layout`), or Psi/N from a count."""
    if not shapes:
        return num_params / world_size
    if layout.numel(shapes) != num_params:
        raise ValueError(
            f"param_shapes hold {layout.numel(shapes)} elements, num_params is {num_params:.0f}"
        )
    return float(layout.shard_numel(shapes, world_size))


def model_state_bytes(
    num_params: float,
    world_size: int,
    optimizer: str,
    shapes: Sequence[Sequence[int]] | None,
    offload: bool = False,
) -> ModelStateBytes:
    """fp32 parameters, gradients and optimizer state, sharded (:func:`shard_numel`); on
    the device, or all in host memory under ``offload`` (``offloaded_to_cpu``)."""
    per_rank = shard_numel(num_params, world_size, shapes)
    states = ModelStateBytes(
        params=4 * per_rank,
        grads=4 * per_rank,
        optimizer=OPTIMIZER_STATE_BYTES[optimizer] * per_rank,
        master=0.0,
    )
    if offload:
        return ModelStateBytes(0.0, 0.0, 0.0, 0.0, offloaded_to_cpu=states.total)
    return states


def host_bytes(offload: bool, inputs: PlanInputs, optimizer: str) -> dict[str, float]:
    """Full-shard offload's host memory per rank, by category: every parameter's shard in
    fp32, frozen ones too (``_fsdp_param.py``, ``_init_sharded_param``: the padded shard is
    moved ``.cpu()``), the trainable ones' gradient shards in fp32 (the reduce-scatter
    output copied ``.to("cpu")``, ``_fsdp_collectives.py``; fp32 under bf16 too, the
    reduce dtype being fp32), and the optimizer state built over the shards on the host
    (K bytes per element, no master copy). Nothing without offload."""
    if not offload:
        return {}
    spec, n = inputs.model, inputs.world_size
    trained = shard_numel(spec.num_params, n, spec.shapes_where(trains=True) or None)
    frozen = 0.0
    if spec.frozen_params:
        frozen = shard_numel(spec.frozen_params, n, spec.shapes_where(trains=False) or None)
    return {
        "params": 4.0 * (trained + frozen),
        "grads": 4.0 * trained,
        "optimizer": OPTIMIZER_STATE_BYTES[optimizer] * trained,
    }


def paper_grad_bytes(num_params: float, world_size: int) -> float:
    """fp32 gradients sharded N ways in either mode (padding aside)."""
    return 4.0 * num_params / world_size


def buffer_bytes(
    reshard_after_forward: bool,
    spec: ModelSpec,
    world_size: int,
    precision: str,
    offload: bool = False,
) -> dict[str, float]:
    """FSDP2's whole parameters and gradients per GPU at the start of backward, by name
    (:func:`dpkit.engines.fsdp2.layout.transient_bytes`), in the compute dtype (bf16/fp16
    under mixed precision: ``MixedPrecisionPolicy.param_dtype``).

    Shard-grad-op keeps every layer's parameters whole from its forward to its backward:
    about the whole model again, in the compute dtype. Full-shard keeps the root's and
    about two layers'. Both hold the root's whole gradients through backward and one
    unit's whole gradients with its fp32 reduce-scatter input. A bare ``--params`` has no
    layout: shard-grad-op's whole parameters are then Psi in the compute dtype, and
    nothing else is counted. Offload holds no model state on the device, so a bare count
    would plan it at nothing: it counts the whole model gathered (shard-grad-op's bound)
    rather than recommend it on a floor of zero.
    """
    compute_bytes = dtype_bytes(precision)
    if not spec.param_shapes:
        if reshard_after_forward and not offload:
            return {}
        return {"fsdp2_whole_params": float(compute_bytes * (spec.num_params + spec.frozen_params))}
    parts = layout.transient_bytes(
        spec.param_shapes,
        spec.param_units,
        world_size,
        compute_bytes,
        reshard_after_forward,
        trainable=spec.trainable or None,
    )
    return {f"fsdp2_{name}": value for name, value in parts.items()}


def peak_points(
    reshard_after_forward: bool, view: PeakView, offload: bool = False
) -> list[PeakPoint]:
    """Where an FSDP2 step may peak, unit by unit (:mod:`dpkit.engines.fsdp2.layout` for
    the mechanism). Forward, unit i: its whole parameters and the flat all-gather output
    they were copied out of (kept until the next all-gather), the root's whole parameters,
    and, without ``reshard_after_forward``, every earlier unit's. Backward, unit i's
    reduce-scatter: the sharded gradients of the units done, the root's whole parameters
    and gradients, the unit's whole gradients in the compute dtype with the fp32
    reduce-scatter input they are copied into (on gloo, the input and the whole copy gloo
    reduces), the next unit back gathered (prefetched), and the activations of the units
    before it. With gradient accumulation every micro-batch reduce-scatters (dpkit does not
    skip FSDP2's gradient sync): a later micro-batch runs beside the sharded gradients
    accumulated so far, and each unit's reduce-scatter output is added into them. A bare
    ``--params`` has no units: the default points. Under ``offload`` the sharded
    gradients go to host memory after each reduce-scatter and the optimizer steps there:
    no gradient shard is counted on the device."""
    from dpkit.core.step import PeakPoint
    from dpkit.core.units import dtype_bytes

    spec, trace, n = view.spec, view.trace, view.world_size
    if not spec.param_shapes or not spec.param_units:
        return []
    compute = dtype_bytes(view.precision)
    trainable = spec.trainable or (True,) * len(spec.param_shapes)
    root, layers = layout.units(spec.param_shapes, spec.param_units)
    kept_shapes = [s for s, t in zip(spec.param_shapes, trainable, strict=True) if t]
    kept_units = [u for u, t in zip(spec.param_units, trainable, strict=True) if t]
    root_trained, layers_trained = layout.units(kept_shapes, kept_units)
    if len(layers_trained) != len(layers):  # a unit with no trainable parameter (LoRA)
        indexed = dict(zip(sorted(set(kept_units) - {-1}), layers_trained, strict=True))
        layers_trained = [indexed.get(i, []) for i in sorted(set(spec.param_units) - {-1})]

    def whole(shapes: list) -> float:
        return float(compute * n * layout.shard_numel(shapes, n))

    def reduce_scatter(shapes: list) -> float:
        padded = float(layout.REDUCE_BYTES * n * layout.shard_numel(shapes, n))
        copy_in = compute * layout.numel(shapes) + padded
        return max(copy_in, 2 * padded) if not view.on_gpu else copy_in

    def grad_shard(shapes: list) -> float:
        if offload and view.on_gpu:  # copied to host memory once reduced
            return 0.0
        return float(layout.REDUCE_BYTES * layout.shard_numel(shapes, n))

    count = len(layers)
    forward_at = list(trace.block_forward[1:]) + [trace.forward_high]
    if len(trace.block_forward) != count:  # blocks not the units: the forward's high-water
        forward_at = [trace.forward_high] * count
    backward_end = list(trace.block_backward_end)
    if len(backward_end) != count:
        backward_end = [trace.backward_high] * count
    held = {
        "params": view.params,
        "module_buffers": view.module_buffers,
        "batch": trace.batch,
        "root_whole_params": whole(root),
    }
    if view.optimizer_before_update:
        held["optimizer"] = view.optimizer_before_update
    # Offload on a CPU (one RAM): the host's shards are in the peak; the gradient shards
    # arrive one unit's reduce-scatter at a time (``grad_shard``), as without offload.
    held.update(view.host_alive(optimizer=not view.first_step, grads=False))
    accumulating = view.accumulation_steps > 1
    if accumulating:
        held["accumulated_grad_shards"] = view.grads
    points = []
    for i, unit in enumerate(layers):
        earlier = 0.0 if reshard_after_forward else sum(whole(u) for u in layers[:i])
        points.append(
            PeakPoint(
                "forward",
                {
                    **held,
                    "earlier_units_whole": earlier,
                    "unit_whole_params": whole(unit),
                    "all_gather_output": whole(unit),
                    "activations": forward_at[i],
                },
            )
        )
    last = layers[-1] if layers else []
    kept_whole = 0.0 if reshard_after_forward else sum(whole(u) for u in layers)
    points.append(
        PeakPoint(
            trace.forward_point,
            {
                **held,
                "units_whole": kept_whole,
                "all_gather_output": whole(last),
                "activations": trace.forward_high,
            },
        )
    )
    root_grads = float(compute * layout.numel(root_trained))
    # Inside the blocks' backward only the root's parameters used after the blocks have a
    # stored gradient (a tied embedding's head contribution waits in autograd, in the
    # trace's activations, until the embedding's backward at the end).
    root_grads_in_blocks = root_grads
    if trace.grads_before_blocks is not None and trace.grads_stored:
        trainable_numel = layout.numel(root_trained) + sum(layout.numel(u) for u in layers_trained)
        stored = compute * trainable_numel * trace.grads_before_blocks / trace.grads_stored
        root_grads_in_blocks = min(root_grads, float(stored))
    regathered = 2 * whole(last) if reshard_after_forward else kept_whole
    points.append(
        PeakPoint(
            "backward",
            {
                **held,
                "units_whole": regathered,
                "root_whole_grads": root_grads_in_blocks,
                "activations": trace.backward_high,
            },
        )
    )
    for i in range(count - 1, -1, -1):
        if reshard_after_forward:
            gathered = 2 * whole(layers[i - 1]) if i > 0 else 0.0
        else:
            gathered = sum(whole(u) for u in layers[:i])
        points.append(
            PeakPoint(
                "backward",
                {
                    **held,
                    "grads": grad_shard(layers_trained[i])
                    if accumulating
                    else sum(grad_shard(u) for u in layers_trained[i:]),
                    "units_whole": gathered,
                    "root_whole_grads": root_grads_in_blocks,
                    "reduce_scatter": reduce_scatter(layers_trained[i]),
                    "activations": backward_end[i],
                },
            )
        )
    if trace.after_blocks_high is not None:  # the embeddings' backward, after the blocks'
        points.append(
            PeakPoint(
                "backward",
                {
                    **held,
                    "grads": 0.0 if accumulating else sum(grad_shard(u) for u in layers_trained),
                    "root_whole_grads": root_grads_in_blocks,
                    # the first unit's reduce-scatter input, kept until the root's
                    # (FSDPParamGroup.post_backward: reduce_scatter_states, 1 buffer)
                    "reduce_scatter_input_kept": float(
                        layout.REDUCE_BYTES * n * layout.shard_numel(layers_trained[0], n)
                    )
                    if layers_trained
                    else 0.0,
                    "activations_and_root_grads": trace.after_blocks_high,
                },
            )
        )
    points.append(
        PeakPoint(
            "gradient reduction",
            {
                **held,
                "grads": grad_shard(root_trained)
                if accumulating
                else sum(grad_shard(u) for u in layers_trained),
                "reduce_scatter": reduce_scatter(root_trained),
            },
        )
    )
    points.append(
        PeakPoint(
            "optimizer step",
            {
                **{
                    k: v
                    for k, v in held.items()
                    if k not in ("root_whole_params", "accumulated_grad_shards")
                },
                "grads": view.grads,
                "optimizer": view.optimizer,
                **view.optimizer_temporaries,
                **view.host_alive(optimizer=True),
            },
        )
    )
    return points


def why(strategy: Strategy, row: PlanRowView, inputs: PlanInputs) -> str:
    """What choosing an FSDP2 mode buys and costs."""
    n = inputs.world_size
    if strategy.offload:
        return (
            f"{strategy.label} keeps the parameters, gradients and optimizer state, sharded "
            f"over {n} rank(s), in host memory (torch CPUOffloadPolicy): the device holds only the "
            "layers being computed, at the cost of copying every shard to the device and "
            "every gradient back each step and of an optimizer step on the CPU."
        )
    if not strategy.reshard_after_forward:
        return (
            f"{strategy.label} shards parameters, gradients and optimizer state {n} ways between "
            "steps and keeps each layer's parameters whole from its forward to its backward "
            "(torch fully_shard: an all-gather and a reduce-scatter per step, DDP's volume; no "
            "DeepSpeed engine): the least sharding dpkit runs that fits."
        )
    return (
        f"{strategy.label} also frees each layer's whole parameters after its forward and "
        "all-gathers them again in backward (1.5x DDP's communication), holding about two "
        "layers whole at a time: the least sharding dpkit runs that fits."
    )


def row_note(strategy: Strategy, row: PlanRowView) -> str:
    """What an FSDP2 row's buffers hold whole, for the notes under the plan's table."""
    from dpkit.core.units import format_gib

    parts = row.buffer_parts
    if "fsdp2_reduce_scatter" not in parts:
        if strategy.offload:
            return (
                f"  {row.label}: a bare --params has no layout: the whole model counted as "
                "gathered at once (an upper bound), whole gradients not counted"
            )
        return f"  {row.label}: a bare --params has no layout: " + (
            "whole gradients not counted"
            if "fsdp2_whole_params" in parts
            else "whole parameters and gradients not counted"
        )
    held = (
        "the root's and two layers'"
        if strategy.reshard_after_forward
        else "every layer's and the root's, each from its forward to its backward"
    )
    grads = parts["fsdp2_root_whole_grads"] + parts["fsdp2_reduce_scatter"]
    return (
        f"  {row.label}: whole parameters {format_gib(parts['fsdp2_whole_params'])} ({held}, "
        f"in the compute dtype), whole gradients and reduce-scatter input {format_gib(grads)} "
        "(dpkit.engines.fsdp2.layout)"
    )


class FSDP2Plan(PlanArithmetic):
    """FSDP2's plan arithmetic: every state sharded on dim 0 (padded per parameter), units all-gathered whole for their compute."""

    def model_state_bytes(
        self,
        strategy: Strategy,
        num_params: float,
        world_size: int,
        precision: str,
        optimizer: str,
        param_shapes: Sequence[Sequence[int]] | None,
    ) -> Any:
        return model_state_bytes(
            num_params, world_size, optimizer, param_shapes, offload=strategy.offload
        )

    def paper_grad_bytes(
        self, strategy: Strategy, num_params: float, world_size: int, precision: str
    ) -> float:
        return paper_grad_bytes(num_params, world_size)

    def buffer_bytes(
        self,
        strategy: Strategy,
        spec: ModelSpec,
        world_size: int,
        precision: str,
        settings: Mapping[str, Any],
        grads: float,
    ) -> dict[str, float]:
        return buffer_bytes(
            strategy.reshard_after_forward, spec, world_size, precision, strategy.offload
        )

    def host_bytes(
        self, strategy: Strategy, inputs: PlanInputs, optimizer: str
    ) -> dict[str, float]:
        return host_bytes(strategy.offload, inputs, optimizer)

    def plan_row_note(self, strategy: Strategy, row: PlanRowView) -> str:
        return row_note(strategy, row)

    def unprobed_buffer_parts(self, strategy: Strategy) -> tuple[str, ...]:
        # A unit's whole gradients and its reduce-scatter input exist inside its backward
        # only (docs/limits.md); shard-grad-op's whole parameters are seen at the end of
        # forward, full-shard's are gathered again inside backward.
        backward = ("fsdp2_root_whole_grads", "fsdp2_reduce_scatter")
        return (*backward, "fsdp2_whole_params") if strategy.reshard_after_forward else backward

    def model_facts(
        self, model: torch.nn.Module, params: Sequence[torch.nn.Parameter]
    ) -> dict[str, Any]:
        from dpkit.engines.fsdp2.shard import units_of

        unit_of = units_of(model)
        return {"param_units": tuple(unit_of.get(id(p), -1) for p in params)}

    def peak_points(self, strategy: Strategy, view: PeakView) -> list[PeakPoint]:
        return peak_points(
            strategy.reshard_after_forward, view, strategy.offload
        ) or super().peak_points(strategy, view)

    def why(self, strategy: Strategy, row: PlanRowView, inputs: PlanInputs) -> str:
        return why(strategy, row, inputs)
