"""ZeRO settings that keep the model-state savings from being eaten by DeepSpeed's buffers.

Every choice below was measured with :mod:`dpkit.memory` on all-MiniLM-L6-v2
(22.7M parameters, fp32, torch AdamW, 2 and 4 CPU ranks, gloo; deepspeed 0.19.8,
torch 2.13). The figures quoted are per rank. :func:`zero_memory_settings` returns a
plain dict that the engine merges into the resolved ``zero_optimization`` section, so
that each value is visible in the saved config; :data:`REASONS` says why, for writing
beside it. (DDP's: :mod:`dpkit.engines.ddp.settings`.)
"""

from __future__ import annotations

from typing import Any

# DeepSpeed's default ``stage3_param_persistence_threshold``
# (deepspeed/runtime/zero/config.py): ZeRO-3 keeps tensors smaller than this
# whole on every rank (:attr:`dpkit.core.spec.ModelSpec.small_tensor_params`).
PERSISTENCE_THRESHOLD = 100_000

# DeepSpeed's own default for both bucket sizes (elements).
DEEPSPEED_DEFAULT_BUCKET = 500_000_000
# The smallest ZeRO bucket (elements; 8 MiB in fp32, 4 MiB in 16-bit). Every reduce
# call pays a fixed cost before it moves a byte (~1.3 ms on gloo between 2 CPU ranks):
# allreducing 23.2M fp32 elements took 168 ms in 262,144-element calls, 76 ms in
# 1,048,576, 64 ms in 2,500,000 and 56 ms in one call (torchrun, 2 ranks, median of 5).
# hidden^2 alone gives small models tiny buckets (262,144 at hidden 512).
MIN_BUCKET_ELEMENTS = 2**21
# The smallest reduce bucket dpkit tune tries (elements): below, buckets only add per-call
# costs (MIN_BUCKET_ELEMENTS above).
TUNE_MIN_BUCKET = 2**18
# DeepSpeed's nccl_start_alignment_factor (stage_1_and_2.py): bucket sizes must be multiples.
ZERO_BUCKET_ALIGNMENT = 2

# The zero_optimization keys zero_memory_settings() sizes; DeepSpeed's attribute of the
# same name holds the value a live ZeRO optimizer runs with.
ZERO_MEMORY_KEYS = (
    "reduce_bucket_size",
    "allgather_bucket_size",
    "contiguous_gradients",
    "overlap_comm",
    "round_robin_gradients",
    "reduce_scatter",
)

REASONS: dict[str, str] = {
    "reduce_bucket_size": (
        "DeepSpeed allocates this many elements for its ipg bucket up front (and copies a "
        "bucket flat to reduce it): its 5e8 default is 1,907 MiB in fp32 (measured), more "
        "than all of a 22.7M model's states. hidden^2, but at least 2^21 elements (8 MiB in "
        "fp32) and never more than the parameter count: each reduce call has a fixed cost, "
        "and at hidden^2 = 262,144 a 23.2M-param ZeRO-2 step on 2 CPU ranks took 1.20 s "
        "(dpkit/bare 1.06x) against 1.09 s (1.00x) at 2.5M elements, for +8 MiB of buffers"
    ),
    "allgather_bucket_size": (
        "unused for memory on torch >= 2 (the all-gather writes into the flat parameter "
        "buffer); set like reduce_bucket_size so the legacy chunked path stays small"
    ),
    "overlap_comm": (
        "a second ipg bucket (measured 0.56 -> 1.1 MiB at a 147,456-element bucket); on CPU "
        "it overlaps nothing (no streams), and in ZeRO-1 it moves reduction into backward "
        "where rank 1's gradient high-water rose 86.6 -> 131.4 MiB; on for ZeRO-2 on CUDA "
        "only, where it buys overlap, and only with contiguous_gradients: without them "
        "DeepSpeed keeps other partitions' reduced gradients alive until the next bucket "
        "(previous_reduced_grads, stage_1_and_2.py), a bucket of gradients the memory "
        "model does not count; the speed this gives up is unmeasured (no GPU yet)"
    ),
    "contiguous_gradients": (
        "ZeRO-1 and -2 pre-size grads_in_partition for every parameter touching the "
        "partition, and a parameter larger than the bucket is reduced with its own full "
        "gradient (ZeRO-1: with every gradient not reduced yet) still alive: both coexist. Off "
        "when the largest parameter exceeds the bucket and a quarter of the partition "
        "(MiniLM's word embedding at 4 ranks, measured worst-rank gradient high-water: ZeRO-2 "
        "110.5 -> 87.4 MiB, ZeRO-1 152.4 -> 87.4 MiB); otherwise on, against allocator "
        "fragmentation on CUDA; always on under optimizer offload, where DeepSpeed forces it "
        "(stage_1_and_2.py: contiguous_gradients or cpu_offload)"
    ),
    "round_robin_gradients": (
        "memory-neutral (measured identical breakdowns); it reorders reduction for CPU offload"
    ),
    "reduce_scatter": (
        "each rank receives only its partition's reduced gradients instead of all of them"
    ),
}


def bucket_elements(hidden_size: int | None, num_params: int | None = None) -> int:
    """``reduce_bucket_size`` (and ``allgather_bucket_size``) in elements.

    hidden^2 (accelerate's and the HF Trainer's rule), at least
    :data:`MIN_BUCKET_ELEMENTS`, never above the model itself (a bucket larger than
    every gradient is allocated and never filled) nor DeepSpeed's default. Without a
    hidden size: Psi / 100, or DeepSpeed's default when Psi is unknown too.
    """
    if hidden_size:
        per_layer = max(hidden_size * hidden_size, MIN_BUCKET_ELEMENTS)
    elif num_params:
        per_layer = max(num_params // 100, MIN_BUCKET_ELEMENTS)
    else:
        per_layer = DEEPSPEED_DEFAULT_BUCKET
    ceiling = min(num_params, DEEPSPEED_DEFAULT_BUCKET) if num_params else DEEPSPEED_DEFAULT_BUCKET
    elements = int(max(1, min(per_layer, ceiling)))
    # DeepSpeed asserts allgather_bucket_size % 2 == 0 (4-byte alignment of 16-bit
    # buffers, on CPU too): a model with an odd parameter count would stop at prepare.
    return -(-elements // ZERO_BUCKET_ALIGNMENT) * ZERO_BUCKET_ALIGNMENT


def fill_zero_settings(zero: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """Put ``settings`` (:func:`zero_memory_settings`) into a ``zero_optimization`` section
    wherever it leaves a key of :data:`ZERO_MEMORY_KEYS` out or ``"auto"``; a written value
    is kept. Returns ``zero``, changed in place."""
    for key in ZERO_MEMORY_KEYS:
        if zero.get(key, "auto") == "auto" and key in settings:
            zero[key] = settings[key]
    return zero


def zero_memory_settings(
    num_params: int,
    hidden_size: int | None,
    *,
    world_size: int,
    stage: int,
    largest_param_numel: int | None = None,
    on_cuda: bool = False,
    offload: bool = False,
) -> dict[str, Any]:
    """``zero_optimization`` keys for ZeRO stage 1/2 that keep its buffers small.

    Args:
        num_params: trainable parameters (Psi).
        hidden_size: the model's hidden size (sets the bucket, :func:`bucket_elements`);
            None falls back to Psi / 100.
        world_size: data-parallel ranks N.
        stage: 1 or 2.
        largest_param_numel: elements of the largest parameter (decides
            contiguous_gradients); None keeps DeepSpeed's default (on).
        on_cuda: whether ranks run on CUDA devices (decides overlap_comm).
        offload: the optimizer is offloaded: DeepSpeed then runs with contiguous_gradients
            whatever the config says (``contiguous_gradients or cpu_offload``), so it is
            written on.
    """
    if num_params <= 0 or world_size <= 0:
        raise ValueError(
            f"num_params and world_size must be positive, got {num_params}, {world_size}"
        )
    if stage not in (1, 2, 3):
        raise ValueError(f"stage must be 1, 2 or 3, got {stage}")
    bucket = bucket_elements(hidden_size, num_params)
    partition = num_params / world_size
    # A parameter bigger than the bucket is reduced alone after backward, while its slot
    # in the pre-sized contiguous partition buffer already exists: the two coexist.
    large_late_param = (
        largest_param_numel is not None
        and largest_param_numel > bucket
        and largest_param_numel > partition / 4
    )
    return {
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
        # ZeRO-1 reduces after backward; overlapping moves it into backward (more memory).
        # Without contiguous gradients it keeps reduced gradients a bucket longer.
        "overlap_comm": bool(on_cuda and stage == 2 and not large_late_param),
        "contiguous_gradients": offload or not large_late_param,
        "round_robin_gradients": False,
        "reduce_scatter": True,
    }
