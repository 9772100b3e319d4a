"""DeepSpeed ZeRO's bytes per rank, predicted: the paper's sharding, with DeepSpeed's own copies.

Its ZeRO optimizer always keeps an fp32 master partition, even when the module itself
is fp32 (measured, docs/stack-notes.md); in bf16/fp16 the module's parameters and
gradients are 2 bytes, and its step casts the rank's 16-bit gradient partition to an
fp32 gradient for the master while the 16-bit gradients are still held
(``stage_1_and_2.py``, the step): gradients then peak at (2 + 4) x Psi/N, not the
paper's 2 x Psi/N. With the parameter layout known, the worst rank's gradients come from
DeepSpeed's own partitioning (:mod:`dpkit.engines.deepspeed.layout`). Pure arithmetic:
no torch.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from dpkit.core.units import OPTIMIZER_STATE_BYTES, GradientHighWater, ModelStateBytes, dtype_bytes
from dpkit.engines.deepspeed.layout import (
    gradient_high_water,
    group_order,
    largest_bucket_fill,
    largest_slice,
    partition_group,
    reduces_on_arrival,
    stage2_held_before,
)
from dpkit.engines.roles.planned import PlanArithmetic

if TYPE_CHECKING:
    import torch

    from dpkit.core.spec import ModelSpec, PlanInputs
    from dpkit.core.step import PeakPoint, PeakView
    from dpkit.core.strategy import Strategy
    from dpkit.engines.roles.views import PlanRowView


def buffer_settings(spec: ModelSpec, world_size: int, on_cuda: bool) -> dict[str, Any]:
    """The ZeRO settings a dpkit run uses (:mod:`dpkit.engines.deepspeed.settings`), over
    DeepSpeed's own defaults (``deepspeed/runtime/zero/config.py``); a bare ``--params``
    has no hidden size: DeepSpeed's defaults stand."""
    from dpkit.engines.deepspeed.settings import PERSISTENCE_THRESHOLD, zero_memory_settings

    settings: dict[str, Any] = {
        "reduce_bucket_size": 500_000_000,
        "contiguous_gradients": True,
        "overlap_comm": False,  # DeepSpeed turns it on for stage 3 only
        "stage3_prefetch_bucket_size": 50_000_000,
        "stage3_max_reuse_distance": 1_000_000_000,
        "stage3_param_persistence_threshold": PERSISTENCE_THRESHOLD,
    }
    if spec.hidden_size:
        largest = max((n for group in spec.param_groups for n in group), default=None)
        settings.update(
            zero_memory_settings(
                spec.num_params,
                spec.hidden_size,
                world_size=world_size,
                stage=2,
                largest_param_numel=largest,
                on_cuda=on_cuda,
            )
        )
    return settings


def model_state_bytes(
    stage: int, offload: bool, num_params: float, world_size: int, precision: str, optimizer: str
) -> ModelStateBytes:
    """ZeRO shards optimizer state and master weights from stage 1, gradients from stage 2,
    parameters from stage 3; below its stage a state is replicated."""
    psi, n = num_params, float(world_size)

    def per_rank(total_bytes: float, sharded_from_stage: int) -> float:
        return total_bytes / (n if stage >= sharded_from_stage else 1)

    # DeepSpeed casts the module to the 16-bit dtype.
    module_bytes = dtype_bytes(precision)
    params = per_rank(module_bytes * psi, 3)
    grads = per_rank(module_bytes * psi, 2)
    if stage in (1, 2) and module_bytes != 4 and not offload:
        # The step's fp32 copy of the 16-bit partition, beside it (offload builds it in
        # host memory). Under ZeRO-1 the full 16-bit gradients of backward may be larger.
        grads = max(grads, (module_bytes + 4) * psi / n)
    if stage == 3 and not offload:
        # ZeRO-3 keeps each parameter's reduced slice in one flat partition and, at the step,
        # a flattened fp32 copy of it as the masters' .grad (_prepare_fp32_grad_for_sub_group:
        # torch.cat, a copy even in fp32): measured 86.6 MiB for MiniLM at 2 ranks, fp32.
        grads = (module_bytes + 4) * psi / n
    optimizer_bytes = per_rank(OPTIMIZER_STATE_BYTES[optimizer] * psi, 1)
    master = per_rank(4 * psi, 1)
    if stage == 3 and offload:
        # ZeRO-3 offload (offload_param and offload_optimizer to the CPU): no model state
        # stays on the device between uses. Host: the 16-bit partitions, the flat
        # gradient partition (module dtype) with the masters' fp32 .grad beside it, Adam's
        # state and the fp32 masters (zero3_host_bytes).
        in_host = module_bytes * psi / n + (module_bytes + 4) * psi / n
        return ModelStateBytes(
            params=0.0,
            grads=0.0,
            optimizer=0.0,
            master=0.0,
            offloaded_to_cpu=in_host + optimizer_bytes + master,
        )
    if offload:
        return ModelStateBytes(
            params=params,
            grads=grads,
            optimizer=0.0,
            master=0.0,
            offloaded_to_cpu=optimizer_bytes + master,
        )
    return ModelStateBytes(params=params, grads=grads, optimizer=optimizer_bytes, master=master)


def paper_grad_bytes(stage: int, num_params: float, world_size: int, precision: str) -> float:
    """The module dtype's gradients, sharded from stage 2."""
    shards = world_size if stage >= 2 else 1
    return dtype_bytes(precision) * num_params / shards


def buffer_bytes(
    stage: int, spec: ModelSpec, precision: str, settings: Mapping[str, Any], offload: bool = False
) -> dict[str, float]:
    """ZeRO-1/2 (and offload): with ``contiguous_gradients`` the reduce bucket of
    ``reduce_bucket_size`` elements in the module dtype (two with ``overlap_comm``),
    and, either way, the transient flat copy of the fullest bucket DeepSpeed makes to
    reduce it (:func:`~dpkit.engines.deepspeed.layout.largest_bucket_fill`, from the
    model's parameter layout; a bare ``--params`` count has none, and its bucket is
    counted once instead). The post-step all-gather writes into the parameters in place
    (all_gather_into_tensor). ZeRO-3: the reduce bucket (only with
    ``contiguous_gradients``), the parameters gathered whole at the end of the forward
    and the small ones every rank keeps whole (``stage3_param_persistence_threshold``).

    ZeRO-3's gathered parameters, from its second step (the first records the module
    order and releases each module's parameters after use): at the end of the forward
    it keeps every parameter it will use again within ``stage3_max_reuse_distance``
    elements, plus what it prefetched (``stage3_prefetch_bucket_size``) and the module
    running; at DeepSpeed's defaults (1e9 and 5e7 elements) that is every parameter of a
    model under about a billion. Measured equal on MiniLM at 2 ranks (docs/zero3.md);
    for a larger model the sum is a bound (DeepSpeed's own estimator counts only the
    largest layer, which its defaults exceed).

    Offload (ZeRO-2) runs with ``contiguous_gradients`` whatever the settings say
    (DeepSpeed: ``contiguous_gradients or cpu_offload``) and keeps on the device a
    staging buffer of the largest parameter, in the module dtype, that each reduced
    gradient is copied into before it goes to host memory
    (``temp_grad_buffer_for_gpu_offload``, stage_1_and_2.py)."""
    module_bytes = dtype_bytes(precision)
    if offload and stage < 3:  # stage 3 takes contiguous_gradients as written (stage3.py)
        settings = {**settings, "contiguous_gradients": True}
    bucket = settings["reduce_bucket_size"]
    # Stages 1-2 double-buffer with overlap_comm; stage 3 keeps one flat bucket either way.
    shards_params = stage >= 3
    reduce_buckets = 2 if settings["overlap_comm"] and not shards_params else 1
    if shards_params:
        # ZeRO-3 allocates its ipg bucket only with contiguous_gradients (stage3.py).
        contiguous = settings["contiguous_gradients"]
        parts = {"reduce_bucket": (bucket * module_bytes) if contiguous else 0.0}
    elif not spec.param_groups:
        parts = {"reduce_bucket": reduce_buckets * bucket * module_bytes}
    else:
        groups = spec.param_groups
        # ZeRO-2 reduces as backward produces gradients (the model's order reversed);
        # ZeRO-1 after backward, in group order.
        in_groups = group_order(groups)
        order = (spec.param_order[::-1] or in_groups[::-1]) if stage == 2 else in_groups
        contiguous = settings["contiguous_gradients"]
        parts = {
            "reduce_bucket": (reduce_buckets * bucket * module_bytes) if contiguous else 0.0,
            "reduce_flat_copy": module_bytes * largest_bucket_fill(groups, bucket, order),
        }
    if shards_params:
        sharded = spec.num_params - spec.small_tensor_params
        window = (
            settings["stage3_max_reuse_distance"]
            + settings["stage3_prefetch_bucket_size"]
            + spec.largest_layer_params
        )
        parts["gathered_params"] = module_bytes * min(sharded, window)
        parts["persistent_small_tensors"] = module_bytes * spec.small_tensor_params
    largest = _largest_param(spec)
    if offload and largest and not shards_params:
        parts["offload_device_staging"] = float(module_bytes * largest)
    return parts


def _largest_param(spec: ModelSpec) -> int:
    """Elements of the model's largest parameter (0 for a bare ``--params`` count)."""
    return max((n for group in spec.param_groups for n in group), default=0)


def offload_device_grads(
    spec: ModelSpec, world_size: int, precision: str, settings: Mapping[str, Any]
) -> GradientHighWater | None:
    """ZeRO-2 offload's gradients on the device. Each gradient is reduced into the
    contiguous bucket and copied to host memory, so no gradient partition stays on the
    device; a parameter larger than ``reduce_bucket_size`` bypasses the bucket and keeps
    its whole gradient in ``param.grad`` until it is reduced and copied at the end of
    backward (``extra_large_param_to_reduce``, one slot per dtype, stage_1_and_2.py):
    the largest such parameter, in the module dtype. Every rank computes every
    gradient, so the figure is each rank's. None for a bare ``--params`` count."""
    if not spec.param_groups:
        return None
    module_bytes = dtype_bytes(precision)
    bucket = int(settings["reduce_bucket_size"])
    over_bucket = [n for group in spec.param_groups for n in group if n > bucket]
    waiting = float(module_bytes * max(over_bucket, default=0))
    moment = (
        "end of backward: the whole gradient of the largest parameter over the bucket, "
        "waiting for its copy to host memory"
        if over_bucket
        else "no parameter exceeds the bucket: gradients pass through it to host memory"
    )
    return GradientHighWater(
        rank=0,
        backward=waiting,
        step=0.0,
        moment=moment,
        partition_bytes=module_bytes * spec.num_params / world_size,
    )


def host_bytes(
    offload: bool, inputs: PlanInputs, optimizer: str, stage: int = 2
) -> dict[str, float]:
    """ZeRO-2 offload's host memory per rank, by category, where DeepSpeed allocates
    it (``self.device = 'cpu'`` under ``cpu_offload``, stage_1_and_2.py): the optimizer
    state and the fp32 master partition (Psi/N each: 8 and 4 bytes a parameter for
    Adam), the fp32 gradient partition the CPU step reads (4 Psi/N; under accumulation
    also ``accumulated_grads_in_cpu``, the whole gradients of the parameters touching
    the rank's partition in the module dtype, kept across micro-batches), and two
    buffers: the staging copy of one gradient on its way in
    (``temp_grad_buffer_for_cpu_offload``, the largest parameter in the module dtype)
    and the partition's 16-bit copy sent back to the device after the step
    (``param_buffer_of_bit16_for_cpu_offload_groups``, Psi/N in the module dtype).
    Nothing without offload. ZeRO-3 offload: :func:`zero3_host_bytes`."""
    if not offload:
        return {}
    if stage == 3:
        return zero3_host_bytes(inputs, optimizer)
    spec, n = inputs.model, float(inputs.world_size)
    psi = float(spec.num_params)
    module_bytes = dtype_bytes(inputs.precision)
    grads = 4.0 * psi / n
    if inputs.gradient_accumulation_steps > 1 and spec.param_groups:
        whole = max(
            sum(partition_group(g, inputs.world_size, rank).whole_numel for g in spec.param_groups)
            for rank in range(inputs.world_size)
        )
        grads += float(module_bytes * whole)
    buffers = module_bytes * psi / n + float(module_bytes * _largest_param(spec))
    return {
        "grads": grads,
        "optimizer": OPTIMIZER_STATE_BYTES[optimizer] * psi / n,
        "master": 4.0 * psi / n,
        "buffers": buffers,
    }


def zero3_host_bytes(inputs: PlanInputs, optimizer: str) -> dict[str, float]:
    """ZeRO-3 offload's host memory per rank, by category, where DeepSpeed 0.19 allocates
    it (stage3.py). With ``offload_param`` the rank's 16-bit partitions of the trainable
    parameters are narrows of one host buffer per parameter group
    (``param_groups_fp16_flat_cpu_memory``, Psi/N in the module dtype), and zero.Init
    builds a frozen parameter's partition on its ``remote_device`` (host) too. With
    ``offload_optimizer`` (``self.device = cpu``): the fp32 masters (4 Psi/N, a copy even
    in fp32: ``converted.clone()``), Adam's two moments (8 Psi/N), the flat gradient
    partition every reduced slice is copied into (``grad_partitions_flat_buffer``, the
    gradient accumulation dtype: the module's, as under ZeRO-3) and the masters' fp32
    ``.grad`` the CPU step reads, allocated once and kept (``initialize_optimizer_states``;
    without offload it is the step's transient copy). Nothing is staged in host memory
    beside them: the reduced slice is copied straight into the masters' ``.grad``
    (``_offload_grad_partition_at_boundary``)."""
    spec, n = inputs.model, float(inputs.world_size)
    psi = float(spec.num_params)
    module_bytes = dtype_bytes(inputs.precision)
    frozen = float(spec.frozen_params)
    return {
        "params": module_bytes * (psi + frozen) / n,
        "grads": (module_bytes + 4.0) * psi / n,
        "optimizer": OPTIMIZER_STATE_BYTES[optimizer] * psi / n,
        "master": 4.0 * psi / n,
        "buffers": 0.0,
    }


def gradient_layout(
    stage: int, offload: bool, inputs: PlanInputs, settings: Mapping[str, Any]
) -> GradientHighWater | None:
    """ZeRO-1/2's gradient holding on its worst rank, from the parameter layout; None
    where the paper's figure stands (offload keeps them off the GPU, ZeRO-3 is for
    reference, and a bare ``--params`` has no layout). Offload: the whole gradients
    waiting for their copy to host memory (:func:`offload_device_grads`)."""
    if offload and stage == 2:
        return offload_device_grads(inputs.model, inputs.world_size, inputs.precision, settings)
    if stage not in (1, 2) or offload or not inputs.model.param_groups:
        return None
    return _worst_rank_gradients(
        inputs.model.param_groups,
        stage,
        inputs.world_size,
        dtype_bytes(inputs.precision),
        settings["reduce_bucket_size"],
        settings["contiguous_gradients"],
        inputs.model.param_order[::-1] or None,
        inputs.gradient_accumulation_steps,
    )


@functools.lru_cache(maxsize=64)
def _worst_rank_gradients(
    groups: tuple[tuple[int, ...], ...],
    stage: int,
    world_size: int,
    module_bytes: int,
    reduce_bucket_size: int,
    contiguous_gradients: bool,
    arrival: tuple[tuple[int, int], ...] | None,
    accumulation_steps: int,
) -> GradientHighWater:
    # Cached: the micro-batch search asks for the same layout dozens of times.
    ranks = gradient_high_water(
        groups,
        stage=stage,
        world_size=world_size,
        module_bytes=module_bytes,
        reduce_bucket_size=reduce_bucket_size,
        contiguous_gradients=contiguous_gradients,
        arrival=arrival,
        accumulation_steps=accumulation_steps,
    )
    worst = max(ranks, key=lambda r: r.bytes)
    # The peak of each phase may sit on another rank than the overall high-water.
    return GradientHighWater(
        rank=worst.rank,
        backward=max(r.backward for r in ranks),
        step=max(r.step for r in ranks),
        moment=worst.moment,
        partition_bytes=worst.partition_bytes,
    )


def step_bytes(
    stage: int,
    offload: bool,
    num_params: float,
    world_size: int,
    precision: str,
    grads_laid_out: bool,
) -> dict[str, float]:
    """ZeRO-1/2 (not offloaded): the flat copy of this rank's gradient partition the step
    makes (in fp32 it becomes the master's gradient; in mixed precision it is cast to
    fp32, and that fp32 gradient is already among the model states). ZeRO-3: nothing
    more: the fp32 copy of its gradient partition the step makes is among its gradients
    (:func:`model_state_bytes`; DeepSpeed's estimator counts it as "4 bytes grads 32bit").
    Offload builds them in host memory. With the parameter layout known
    (``grads_laid_out``) they are part of the step's gradients instead
    (:mod:`dpkit.engines.deepspeed.layout`)."""
    if offload or grads_laid_out:
        return {}
    if stage in (1, 2):
        return {"flat_grad_partition": dtype_bytes(precision) * num_params / world_size}
    return {}


def peak_points(stage: int, view: PeakView) -> list[PeakPoint]:
    """Where a ZeRO-1/2 step may peak (``stage_1_and_2.py``). Through the step each rank
    holds the module's parameters and its fp32 master partition; in backward, with
    ``contiguous_gradients``, the reduce bucket. ZeRO-1 keeps the module's gradients whole
    as they arrive and reduces them after the backward; ZeRO-2 reduces a bucket at a time,
    so at the backward's high-water only the gradients that arrived before it, waiting for
    their bucket to fill, are held (at most a bucket of them). At the reduction the worst rank holds its gradient layout's backward high-water
    (:mod:`dpkit.engines.deepspeed.layout`) and the flat copy of the fullest bucket. The
    step flattens the rank's partition while the gradients it copies are alive (the
    layout's step figure), then the update holds the fp32 gradient partition for the
    master, AdamW's moments (made inside the first update) and the optimizer's
    temporaries. What the step holds before the update gets the moments only after the
    first step.

    With gradient accumulation a later micro-batch's forward and backward run beside the
    gradients accumulated so far: ZeRO-1's whole module gradients; ZeRO-2's, on the worst
    rank, the whole gradients of the parameters touching its partition (reason 4 of
    :mod:`dpkit.engines.deepspeed.layout`; with ``contiguous_gradients``, its partition
    buffer)."""
    from dpkit.core.step import PeakPoint

    trace = view.trace
    held = {
        "params": view.params,
        "master": view.master,
        "module_buffers": view.module_buffers,
        "batch": trace.batch,
    }
    before = {"optimizer": view.optimizer_before_update} if view.optimizer_before_update else {}
    # The layout's reduction and step figures hold the accumulated gradients already.
    accumulated = (
        {"grads_accumulated": _accumulated_gradients(stage, view)}
        if view.accumulation_steps > 1
        else {}
    )
    bucket = {"reduce_bucket": view.buffer_parts.get("reduce_bucket", 0.0)}
    first_micro_batch: list[PeakPoint] = []
    if stage == 1 and view.accumulation_steps > 1:
        # A later micro-batch's gradients are added into the whole ones autograd keeps
        # (each freed once added), not kept beside them: measured on train_lm's small
        # GPT-2 at 1 x 2, step 2: 357.4 MiB, where keeping them was predicted 429.8. The
        # first micro-batch keeps its gradients whole as they arrive, with nothing
        # accumulated yet.
        backward = {"activations": trace.backward_high}
        first_micro_batch.append(
            PeakPoint(
                "backward",
                {**held, **before, **bucket, "activations_and_grads": trace.backward_kept_high},
            )
        )
    elif stage == 1:
        backward = {"activations_and_grads": trace.backward_kept_high}
    else:
        # At the backward's high-water the gradients that arrived before it wait in their
        # bucket until it fills (at most one bucket of them).
        waiting = min(
            float(view.settings.get("reduce_bucket_size", 0)) * dtype_bytes(view.precision),
            trace.grads_at_backward_high,
        )
        backward = {"activations": trace.backward_high, "grads_in_bucket": waiting}
    grads_backward = view.grads if view.grads_backward is None else view.grads_backward
    embeddings: list[PeakPoint] = []
    before_embeddings = _stage2_before_embeddings(view) if stage == 2 else None
    if before_embeddings is not None and trace.after_blocks_high is not None:
        held_before_embeddings, reduced = before_embeddings
        # The embeddings' backward, after the blocks': what autograd holds there (a tied
        # embedding's two contributions and their sum) beside the gradients each rank
        # kept from the blocks' reductions (GPT-2 124M, fp32, 4 ranks, 2 x 128 tokens:
        # 1164.2 MiB measured on ranks 2 and 3, with 129.2 MiB of partition buffer and
        # 441.7 of tied-embedding gradients; without this point the plan said 1044.1).
        # Named as the memory report places it: after the reduction the first embedding
        # gradient's arrival starts, if it does (GPT-2 124M's position embedding, over
        # the bucket), else in the backward.
        embeddings.append(
            PeakPoint(
                "gradient reduction" if reduced else "backward",
                {
                    **held,
                    **before,
                    # A later micro-batch: beside those accumulated so far (the small
                    # LM of docs/peak.md at 1 x 2, step 2: 362.4 MiB measured, 334.2
                    # predicted at the reduction without this point).
                    **accumulated,
                    **bucket,
                    "grads": held_before_embeddings,
                    "activations_and_embedding_grads": trace.after_blocks_high,
                },
            )
        )
    if view.grads_step is None:  # no layout: the paper's gradients and the flat copy
        flatten = {"grads": view.grads, **view.step_parts}
    else:
        flatten = {"grads": view.grads_step}
    return [
        PeakPoint(
            trace.forward_point,
            {**held, **before, **accumulated, "activations": trace.forward_high},
        ),
        *first_micro_batch,
        PeakPoint("backward", {**held, **before, **accumulated, **bucket, **backward}),
        *embeddings,
        PeakPoint(
            "gradient reduction",
            {
                **held,
                **before,
                **bucket,
                "grads": grads_backward,
                "reduce_flat_copy": view.buffer_parts.get("reduce_flat_copy", 0.0),
            },
        ),
        PeakPoint("optimizer step", {**held, **before, **flatten}),
        PeakPoint(
            "optimizer step",
            {
                **held,
                "fp32_grad_partition": view.master,
                "optimizer": view.optimizer,
                **view.optimizer_temporaries,
            },
        ),
    ]


def zero3_peak_points(view: PeakView) -> list[PeakPoint]:
    """Where a ZeRO-3 step may peak (``stage3.py``, ``partitioned_param_coordinator.py``,
    ``partition_parameters.py``, DeepSpeed 0.19). All step each rank holds its parameter
    slices, its fp32 master partition, the flat gradient partition every reduced slice is
    copied into (``grad_partitions_flat_buffer``, the module dtype: DeepSpeed's gradient
    accumulation dtype by default) and the small parameters it keeps whole.

    From the second step (the first records the module order: see below) the forward's
    first fetch finds the trace complete and prefetches up to ``stage3_prefetch_bucket_size``
    elements in one coalesced all-gather: a flat buffer of every prefetched slice from every
    rank (``torch.empty(partition_sz * world_size)``). The first wait copies each parameter
    out of it whole (``torch.cat`` of its slices), so from then on the gathered parameters
    and the flat buffer are both alive; the buffer dies when the last parameter it holds is
    popped from the in-flight registry, that is when the last module owning one runs
    (inside the last repeated block, or just after it: a pooler). The parameters then stay
    gathered into the backward (``stage3_max_reuse_distance``, docs/zero3.md) and are
    released module by module as it ends. Without ``contiguous_gradients`` (dpkit's
    setting) each whole gradient autograd stores waits for its ``reduce_bucket_size``
    bucket; the bucket is reduce-scattered (``reduce_scatter_coalesced``: a flat,
    padded ``torch.cat`` of the bucket, on gloo a whole copy of it) and each slice copied
    into the flat partition. The step casts the flat partition to an fp32 copy for the
    masters' ``.grad`` (counted in ``view.grads``) beside AdamW's moments.

    The first step fetches each module's parameters when it runs and releases them after
    (no trace, no prefetch, no reuse): at most the largest layer gathered, with the flat
    buffer it was copied from. Not measured (``peak_live`` watches step 2)."""
    from dpkit.core.step import PeakPoint

    trace = view.trace
    module_bytes = dtype_bytes(view.precision)
    settings = view.settings
    parts = view.buffer_parts
    # view.grads is the flat partition plus its fp32 copy at the step (the master's size).
    grad_partition = max(view.grads - view.master, 0.0)
    held = {
        "params": view.params,
        "master": view.master,
        "grad_partition": grad_partition,
        "persistent_small_tensors": parts.get("persistent_small_tensors", 0.0),
        "batch": trace.batch,
        # Offload on a CPU (one RAM): the host's partitions, flat gradient buffer and the
        # masters' gradients are alive all step.
        **view.host_alive(optimizer=not view.first_step),
    }
    before = {"optimizer": view.optimizer_before_update} if view.optimizer_before_update else {}
    spec = view.spec
    sharded = float(spec.num_params - spec.small_tensor_params)
    if view.first_step:
        gathered = module_bytes * float(spec.largest_layer_params)
        flat_gather = gathered
    else:
        gathered = float(parts.get("gathered_params", 0.0))
        # One coalesced all-gather of up to the prefetch bucket alive at a time; each
        # slice's padding to a world-size multiple (< N elements) is left out. The module
        # being fetched is all-gathered apart from what is prefetched
        # (partitioned_param_coordinator.py: fetch_sub_module's __all_gather_params of
        # params_to_fetch, then of params_to_prefetch), so a model over the bucket holds
        # one bucket's buffer, not a bucket plus a layer (GPT-2 124M, a 38.6M-element
        # embedding first: 2112.2 MiB measured at the backward, 2112.2 predicted; a bucket
        # plus that layer put 2255.0 at the forward).
        prefetched = min(sharded, float(settings.get("stage3_prefetch_bucket_size", 50_000_000)))
        flat_gather = module_bytes * prefetched
    # The prefetched buffer is alive while the blocks run; the head's own code (an LM's
    # logits and loss) runs after it is freed.
    blocks_high = trace.forward_blocks_high
    in_blocks = trace.forward_high if blocks_high is None else blocks_high
    bucket_bytes = float(settings.get("reduce_bucket_size", 0)) * module_bytes
    if settings.get("contiguous_gradients", False):
        # Each gradient is copied into the ipg buffer as it arrives, and freed.
        waiting = {"reduce_bucket": float(parts.get("reduce_bucket", 0.0))}
    else:
        waiting = {"grads_in_bucket": min(bucket_bytes, trace.grads_at_backward_high)}
    bucket_grads = min(bucket_bytes, trace.grads_stored) if bucket_bytes else trace.grads_stored
    # The reduce-scatter's flat input, and gloo's whole copy of it (NCCL works in place).
    reduce_copies = 1 if view.on_gpu else 2
    points = [
        PeakPoint(
            "forward",
            {
                **held,
                **before,
                "gathered_params": gathered,
                "allgather_flat_buffer": flat_gather,
                "activations": in_blocks,
            },
        ),
        PeakPoint(
            trace.forward_point,
            {**held, **before, "gathered_params": gathered, "activations": trace.forward_high},
        ),
        PeakPoint(
            "backward",
            {
                **held,
                **before,
                "gathered_params": gathered,
                "activations": trace.backward_high,
                **waiting,
            },
        ),
        PeakPoint(
            "gradient reduction",
            {
                **held,
                **before,
                "grads_in_bucket": bucket_grads,
                "reduce_scatter_input": reduce_copies * bucket_grads,
            },
        ),
        PeakPoint(
            "optimizer step",
            {
                **{k: v for k, v in held.items() if k != "grad_partition"},
                "grads": view.grads,
                "optimizer": view.optimizer,
                **view.optimizer_temporaries,
                **view.host_alive(optimizer=True),
            },
        ),
    ]
    return points


def offload_peak_points(view: PeakView) -> list[PeakPoint]:
    """Where a ZeRO-2 offload step may peak (``stage_1_and_2.py`` under ``cpu_offload``,
    DeepSpeed 0.19). On the device, all step: the module's parameters and the staging
    buffer one gradient passes through on its way to host memory
    (``temp_grad_buffer_for_gpu_offload``), with ``contiguous_gradients`` forced on the
    reduce bucket. In backward the gradients that arrived wait in the bucket (at most one
    bucket of them); a parameter over the bucket keeps its whole gradient until the end
    of backward (the device grads). Reducing, each parameter's piece of the rank's
    partition has its norm taken in fp64 (``source.data.to(get_norm_dtype()).norm(2)``,
    ``copy_grads_in_partition``: a float64 copy of the piece, 8 bytes an element on any
    device with fp64) before it is copied to host memory; the bucket's reduction holds its
    flat copy. The step runs on the host (DeepSpeed's CPU Adam, in place); a lazy
    optimizer makes its moments in the first update. MiniLM fp32 on 2 CPU processes,
    step 1, rank 0: 445.3 MiB measured at the word embedding's norm (its 44.7 MiB whole
    gradient beside the 86.5 MiB float64 copy of its 11.3M elements in rank 0's
    partition).

    Host memory is in a CPU run's peak (one RAM: :meth:`PeakView.host_alive`), not in a
    GPU's."""
    from dpkit.core.step import PeakPoint

    trace = view.trace
    parts = view.buffer_parts
    held = {
        "params": view.params,
        "module_buffers": view.module_buffers,
        "offload_device_staging": parts.get("offload_device_staging", 0.0),
        "batch": trace.batch,
        **view.host_alive(optimizer=not view.first_step),
    }
    bucket = {"reduce_bucket": parts.get("reduce_bucket", 0.0)}
    waiting = min(
        float(view.settings.get("reduce_bucket_size", 0)) * dtype_bytes(view.precision),
        trace.grads_at_backward_high,
    )
    grads_whole = view.grads if view.grads_backward is None else view.grads_backward
    norm_copy = 8.0 * largest_slice(view.spec.param_groups, view.world_size)
    return [
        PeakPoint(trace.forward_point, {**held, "activations": trace.forward_high}),
        PeakPoint(
            "backward",
            {
                **held,
                **bucket,
                "activations": trace.backward_high,
                "grads_in_bucket": waiting,
            },
        ),
        PeakPoint(
            "gradient reduction",
            {
                **held,
                **bucket,
                "grads": grads_whole,
                "reduce_flat_copy": parts.get("reduce_flat_copy", 0.0),
            },
        ),
        PeakPoint(
            "gradient reduction",
            {**held, **bucket, "grads": grads_whole, "norm_fp64_copy": norm_copy},
        ),
        PeakPoint("optimizer step", {**held, **view.host_alive(optimizer=True)}),
    ]


def _stage2_before_embeddings(view: PeakView) -> tuple[float, bool] | None:
    """The worst rank's ZeRO-2 gradient bytes at the embeddings' backward
    (:func:`~dpkit.engines.deepspeed.layout.stage2_held_before`), and whether the first
    embedding gradient's arrival reduced a bucket; None where the layout is unknown."""
    spec = view.spec
    after = view.trace.params_stored_after_blocks
    if not after or not spec.param_order or "reduce_bucket_size" not in view.settings:
        return None
    # Backward stores the embeddings' gradients last: every other one arrived before.
    arrived = len(spec.param_order) - after
    groups = spec.param_groups
    arrival = tuple(spec.param_order[::-1])
    elements = max(
        _held_before(
            groups,
            view.world_size,
            rank,
            int(view.settings["reduce_bucket_size"]),
            arrival,
            arrived,
            bool(view.settings.get("contiguous_gradients", True)),
        )
        for rank in range(view.world_size)
    )
    bucket = int(view.settings["reduce_bucket_size"])
    reduced = reduces_on_arrival(groups, bucket, arrival, arrived)
    return float(dtype_bytes(view.precision) * elements), reduced


@functools.lru_cache(maxsize=256)
def _held_before(
    groups: tuple[tuple[int, ...], ...],
    world_size: int,
    rank: int,
    reduce_bucket_size: int,
    arrival: tuple[tuple[int, int], ...],
    arrived: int,
    contiguous: bool,
) -> int:
    # Cached: the micro-batch search asks for the same layout dozens of times.
    return stage2_held_before(
        groups, world_size, rank, reduce_bucket_size, arrival, arrived, contiguous
    )


def _accumulated_gradients(stage: int, view: PeakView) -> float:
    """Gradient bytes the worst rank keeps between micro-batches of one step."""
    module_bytes = dtype_bytes(view.precision)
    groups = view.spec.param_groups
    if stage == 1 or not groups:
        return view.trace.grads_stored if stage == 1 else view.grads
    n = view.world_size
    contiguous = bool(view.settings.get("contiguous_gradients", False))
    worst = 0
    for rank in range(n):
        parts = [partition_group(g, n, rank) for g in groups]
        held = (
            sum(p.partition_numel for p in parts)
            if contiguous
            else sum(p.whole_numel for p in parts)
        )
        worst = max(worst, held)
    return float(module_bytes * worst)


def optimizer_for_plan(offload: bool, optimizer: str) -> str | None:
    """The optimizer the analytic core should count, or None if it cannot run.

    ``cpu_adam`` needs its parameters in host memory, so DeepSpeed runs it only with
    optimizer offload. Under offload DeepSpeed swaps Adam/AdamW for its CPU Adam (same
    state size), and runs SGD on the CPU as a torch optimizer (which needs
    ``zero_force_ds_cpu_optimizer: false``).
    """
    if optimizer == "cpu_adam":
        return "cpu_adam" if offload else None
    if offload and optimizer in ("adamw", "adam"):
        return "cpu_adam"
    return optimizer


def why(strategy: Strategy, row: PlanRowView, inputs: PlanInputs) -> str:
    """What choosing a ZeRO strategy buys and costs."""
    from dpkit.core.units import format_gib

    n = inputs.world_size
    if strategy.offload and strategy.shards_parameters:
        return (
            "ZeRO-3 offload keeps only what a layer computes with on the GPU: parameter "
            "partitions, optimizer state, master weights and fp32 gradients live in host "
            f"memory ({format_gib(row.host_offload)} per GPU, "
            f"{format_gib(row.host_offload * inputs.gpus_per_node)} per node); parameters "
            "cross PCIe at every gather and the optimizer step runs on the CPU: the slowest "
            "row, for a model nothing else fits."
        )
    if strategy.offload:
        return (
            "Offload keeps ZeRO-2's sharding and moves optimizer state, master weights and fp32 "
            f"gradients to host memory ({format_gib(row.host_offload)} per GPU, "
            f"{format_gib(row.host_offload * inputs.gpus_per_node)} per node); the optimizer "
            "step runs on the CPU and gradients and weights cross PCIe every step, so steps "
            "slow down."
        )
    if strategy.zero_stage == 1:
        return (
            f"{strategy.label} shards optimizer state and master weights {n} ways at DDP's "
            "communication volume (ZeRO paper: 2x parameters per step): the least sharding "
            "that fits."
        )
    if strategy.zero_stage == 2:
        return (
            f"{strategy.label} also shards gradients {n} ways (reduce-scatter during backward, "
            "still DDP's volume): the least sharding that fits."
        )
    return (
        "Only ZeRO-3 fits: it shards the parameters too, all-gathering them in forward and "
        "backward (1.5x DDP's communication). dpkit runs DeepSpeed up to ZeRO-2, and FSDP2 "
        "full-shard does not fit; ZeRO-3 needs a DeepSpeed config of your own."
    )


class DeepSpeedPlan(PlanArithmetic):
    """DeepSpeed ZeRO's plan arithmetic: the ZeRO paper's per-stage sharding, the fp32 master partition, DeepSpeed's buckets and its step's flat copies."""

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
            strategy.zero_stage, strategy.offload, num_params, world_size, precision, optimizer
        )

    def paper_grad_bytes(
        self, strategy: Strategy, num_params: float, world_size: int, precision: str
    ) -> float:
        return paper_grad_bytes(strategy.zero_stage, num_params, world_size, precision)

    def plan_settings(self, spec: ModelSpec, world_size: int, on_cuda: bool) -> dict[str, Any]:
        return buffer_settings(spec, world_size, on_cuda)

    def buffer_bytes(
        self,
        strategy: Strategy,
        spec: ModelSpec,
        world_size: int,
        precision: str,
        settings: Mapping[str, Any],
        grads: float,
    ) -> dict[str, float]:
        return buffer_bytes(strategy.zero_stage, spec, precision, settings, strategy.offload)

    def gradient_layout(
        self, strategy: Strategy, inputs: PlanInputs, settings: Mapping[str, Any]
    ) -> Any:
        return gradient_layout(strategy.zero_stage, strategy.offload, inputs, settings)

    def step_bytes(
        self,
        strategy: Strategy,
        num_params: float,
        world_size: int,
        precision: str,
        grads_laid_out: bool,
    ) -> dict[str, float]:
        return step_bytes(
            strategy.zero_stage, strategy.offload, num_params, world_size, precision, grads_laid_out
        )

    def optimizer_for_plan(self, strategy: Strategy, optimizer: str) -> str | None:
        return optimizer_for_plan(strategy.offload, optimizer)

    def peak_points(self, strategy: Strategy, view: PeakView) -> list[PeakPoint]:
        if strategy.zero_stage in (1, 2) and not strategy.offload:
            return peak_points(strategy.zero_stage, view)
        if strategy.zero_stage == 3:
            return zero3_peak_points(view)
        return offload_peak_points(view)

    def host_bytes(
        self, strategy: Strategy, inputs: PlanInputs, optimizer: str
    ) -> dict[str, float]:
        return host_bytes(strategy.offload, inputs, optimizer, strategy.zero_stage)

    def settings_from_run(self, recorded: Mapping[str, Any]) -> dict[str, Any]:
        return {k.removeprefix("zero."): v for k, v in recorded.items() if k.startswith("zero.")}

    def plan_settings_text(self, settings: Mapping[str, Any]) -> str:
        return (
            f"ZeRO reduce bucket {settings['reduce_bucket_size']:,} elements, overlap_comm "
            f"{settings['overlap_comm']} (dpkit.engines.deepspeed.settings over DeepSpeed's "
            "defaults)"
        )

    def model_facts(
        self, model: torch.nn.Module, params: Sequence[torch.nn.Parameter]
    ) -> dict[str, Any]:
        from dpkit.engines.deepspeed.settings import PERSISTENCE_THRESHOLD

        # ZeRO-3 keeps tensors under its persistence threshold whole on every rank.
        small = sum(p.numel() for p in params if p.numel() < PERSISTENCE_THRESHOLD)
        return {"small_tensor_params": small}

    def why(self, strategy: Strategy, row: PlanRowView, inputs: PlanInputs) -> str:
        return why(strategy, row, inputs)
