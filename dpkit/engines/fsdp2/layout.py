"""Memory per rank as torch FSDP2 (``fully_shard``) holds it, from the parameters' shapes.

dpkit applies ``fully_shard`` to every transformer layer (the classes in the model's
``_no_split_modules``), then to the root model, on a 1-D mesh of N ranks. What torch
2.13 then holds (``torch/distributed/fsdp/_fully_shard/``):

1. **Sharded states, padded on dim 0.** Each parameter is cut on dim 0 with
   ``torch.chunk``'s rows, ceil(d0/N) per rank (the last ranks fewer, or none), and
   every rank's storage is padded to rank 0's chunk (``_fsdp_param.py``,
   ``_init_sharded_param``: ``padded_sharded_size = chunks[0].size()``). The
   reduce-scatter writes a rank's gradients into one flat output of those padded sizes,
   of which the fp32 ``param.grad`` are views (``_fsdp_collectives.py``,
   ``foreach_reduce``), and AdamW's state is ``zeros_like`` the rank's rows: rank 0 holds
   exactly :func:`shard_numel` elements of each, the worst rank. Parameters stay fp32
   (bf16 runs cast a copy for the compute); no master copy.
2. **Whole parameters.** A unit (a wrapped layer, or the root with what no layer holds)
   all-gathers its parameters into whole, padded tensors in the compute dtype
   (``MixedPrecisionPolicy.param_dtype``; fp32 without mixed precision) before its
   forward, beside the sharded ones. Without ``reshard_after_forward`` they stay until the
   unit's backward ends; with it they are freed after the forward and gathered again in
   backward, one unit ahead (``_fsdp_param_group.py``, ``_backward_prefetch``).
   The root is the exception: with ``reshard_after_forward`` left at ``None`` torch keeps
   its parameters whole after the forward (``_fsdp_state.py``, ``_lazy_init``: the root's
   groups get ``post_forward_mesh_info = None``); an explicit ``True`` reshards it and its
   pre-backward hook gathers it again as backward starts. Either way the root is whole
   through the backward: its post-backward runs in the final callback
   (``_root_post_backward_final_callback``), since its inputs (token ids) need no gradient.
3. **Whole gradients.** A unit's gradients come out of autograd whole in the compute
   dtype and are copied into a reduce-scatter input in the reduce dtype (fp32), padded,
   before they are freed (``foreach_reduce``); the previous unit's input is released
   first (``reduce_scatter_max_input_buffers`` is 1). The root's gradients (embeddings,
   head) appear as backward starts and are reduced only at its end.

:func:`transient_bytes` turns 2 and 3 into bytes per rank at the start of backward,
where activations peak; ``dpkit plan`` counts them as buffers. A 0-dimensional
parameter is counted as one row (``fully_shard`` itself refuses it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

REDUCE_BYTES = 4
"""Bytes per element of the reduce-scatter input: dpkit reduces in fp32."""


def _rows_and_rest(shape: Sequence[int]) -> tuple[int, int]:
    """Dim 0 and the elements of one row (a 0-dim parameter is one row of one)."""
    if not shape:
        return 1, 1
    return int(shape[0]), math.prod(int(d) for d in shape[1:])


def shard_numel(shapes: Iterable[Sequence[int]], world_size: int) -> int:
    """Elements of one rank's FSDP2 storage for parameters of ``shapes``: per parameter,
    ceil(d0/N) rows, what rank 0 holds and every rank's storage is padded to."""
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    total = 0
    for shape in shapes:
        rows, rest = _rows_and_rest(shape)
        total += -(-rows // world_size) * rest
    return total


def numel(shapes: Iterable[Sequence[int]]) -> int:
    """Elements of parameters of ``shapes``, unpadded."""
    return sum(math.prod(_rows_and_rest(shape)) for shape in shapes)


def units(
    shapes: Sequence[Sequence[int]], unit_of: Sequence[int]
) -> tuple[list[Sequence[int]], list[list[Sequence[int]]]]:
    """The root's shapes (``unit_of`` -1) and each wrapped layer's, in layer order."""
    if len(shapes) != len(unit_of):
        raise ValueError(f"{len(shapes)} shapes but {len(unit_of)} unit indices")
    root = [s for s, u in zip(shapes, unit_of, strict=True) if u < 0]
    layers: dict[int, list[Sequence[int]]] = {}
    for shape, unit in zip(shapes, unit_of, strict=True):
        if unit >= 0:
            layers.setdefault(unit, []).append(shape)
    return root, [layers[u] for u in sorted(layers)]


def transient_bytes(
    shapes: Sequence[Sequence[int]],
    unit_of: Sequence[int],
    world_size: int,
    compute_bytes: int,
    reshard_after_forward: bool,
    trainable: Sequence[bool] | None = None,
) -> dict[str, float]:
    """Bytes one rank holds at the start of backward besides its sharded states, by name.

    * ``whole_params``: without ``reshard_after_forward``, every unit's whole parameters
      (kept from its forward to its backward); with it, the root's and the two largest
      layers' (the one in backward and the one prefetched; in forward, the one running
      and the previous one's all-gather output, kept until the next copy-out).
    * ``root_whole_grads``: the root's whole gradients, in the compute dtype.
    * ``reduce_scatter``: the largest unit's whole gradients with its fp32 reduce-scatter
      input (the root's, at the end of backward, if it is the largest).

    The three do not all peak at one moment (the root's reduce-scatter comes last, when
    the layers' whole parameters are freed): their sum is an upper bound.

    Args:
        shapes: every parameter's shape (tied parameters once).
        unit_of: for each shape, the index of the wrapped layer holding it, -1 for the root.
        world_size: ranks N of the mesh.
        compute_bytes: bytes per element of the whole parameters and their gradients
            (2 under bf16/fp16 mixed precision, 4 in fp32).
        reshard_after_forward: the strategy's (FSDP2 full-shard: True).
        trainable: for each shape, whether it trains (None: all do). Frozen parameters
            (LoRA's) are gathered whole like the rest but get no gradient.
    """
    root, layers = units(shapes, unit_of)
    padded_whole = sorted((world_size * shard_numel(u, world_size) for u in layers), reverse=True)
    root_whole = world_size * shard_numel(root, world_size)
    gathered = padded_whole[:2] if reshard_after_forward else padded_whole
    if trainable is not None:
        kept = [i for i, trains in enumerate(trainable) if trains]
        root, layers = units([shapes[i] for i in kept], [unit_of[i] for i in kept])
    largest_reduce = max(
        compute_bytes * numel(unit) + REDUCE_BYTES * world_size * shard_numel(unit, world_size)
        for unit in [root, *layers]
    )
    return {
        "whole_params": float(compute_bytes * (root_whole + sum(gathered))),
        "root_whole_grads": float(compute_bytes * numel(root)),
        "reduce_scatter": float(largest_reduce),
    }
