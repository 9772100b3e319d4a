"""Gradient memory per rank as DeepSpeed ZeRO-1/2 really holds it, from the parameter layout.

The ZeRO paper counts a rank's gradients as Psi/N under stage 2 (:mod:`dpkit.memory.analytic`).
DeepSpeed (``stage_1_and_2.py``, 0.19) holds more, for three reasons that depend on
the sizes and order of the parameters, not only on their total:

1. **Whole parameters.** Each optimizer group is flattened (in group order, padded to
   a multiple of 2N elements) and cut into N equal partitions. A rank keeps the
   gradient of every parameter that *touches* its partition, whole
   (``params_in_partition``; ``grads_in_partition`` is sized by whole parameters).
   A word embedding straddling a boundary is held whole by each rank it touches.
2. **Parameters larger than the reduce bucket** are reduced alone, with their full
   gradient alive beside what the rank already holds; with ``contiguous_gradients``
   also beside their own slot in the pre-sized partition buffer.
3. **The step's flat copy.** At the step, per group, DeepSpeed flattens the rank's
   gradient partition into a new tensor (``flatten``; a view when the partition lies
   in one parameter) and casts it to fp32 for the master's ``.grad``, while the
   gradients it copies, and those of the groups not stepped yet, are still held.
4. **Accumulation (ZeRO-2).** Between the micro-batches of one step the epilogue of
   each backward keeps the gradients of every parameter touching the rank's partition,
   whole (``all_grad_tensors``), and adds the next backward's into them: the next
   backward runs beside them (measured on MiniLM, 2 ranks, fp32: the worst rank's
   gradients 129.9 MiB at one micro-batch a step, 173.2 MiB at two).

ZeRO-1 keeps every full gradient until backward ends (``reduce_gradients``), then
reduces them in order, then steps as ZeRO-2 does. With ``contiguous_gradients`` both
stages copy each gradient into a pre-allocated bucket (freeing its own storage) and
the first reduction that reaches the rank's partition allocates a buffer of its whole
parameters: :func:`stage1_contiguous_reduction` and :func:`stage2_contiguous_backward`
follow that bucket by bucket. :func:`gradient_high_water` returns, per rank, the largest
of these moments: the figure the memory report measures as ``grads``
(``dpkit.memory.probes`` probes the same points), and the one ``dpkit plan`` predicts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from dpkit.core.units import GradientHighWater

# DeepSpeed's nccl_start_alignment_factor: each flat group is padded to a multiple
# of this times N elements.
ALIGNMENT_FACTOR = 2


@dataclass(frozen=True)
class GroupPartition:
    """One optimizer group's flat layout on one rank."""

    partition_numel: int
    """Elements of each rank's partition (the padded group divided by N)."""
    touching: tuple[int, ...]
    """Elements of each parameter touching this rank's partition, whole."""
    last_rank: bool
    """The last rank flattens with padding: always a copy."""

    @property
    def whole_numel(self) -> int:
        return sum(self.touching)

    @property
    def tensors_in_partition(self) -> int:
        """How many parameters touch the partition (1: the flat copy is a view)."""
        return len(self.touching)


def _partition_size(numels: Sequence[int], world_size: int) -> int:
    alignment = ALIGNMENT_FACTOR * world_size
    return int(math.ceil(sum(numels) / alignment)) * alignment // world_size


def touches_partition(numels: Sequence[int], world_size: int, rank: int) -> list[bool]:
    """For each parameter of one group (in group order): does it touch ``rank``'s partition?"""
    if world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of world size {world_size}")
    size = _partition_size(numels, world_size)
    start, end = rank * size, (rank + 1) * size
    flags, offset = [], 0
    for numel in numels:
        # DeepSpeed's test: the parameter starts inside the partition, or straddles its start.
        flags.append(start <= offset < end or offset < start < offset + numel)
        offset += numel
    return flags


def partition_group(numels: Sequence[int], world_size: int, rank: int) -> GroupPartition:
    """Where one group's parameters (in group order) fall for ``rank`` of ``world_size``."""
    flags = touches_partition(numels, world_size, rank)
    touching = tuple(n for n, touches in zip(numels, flags, strict=True) if touches)
    return GroupPartition(_partition_size(numels, world_size), touching, rank == world_size - 1)


def stage1_contiguous_reduction(
    groups: Sequence[Sequence[int]], world_size: int, rank: int, reduce_bucket_size: int
) -> int:
    """Gradient elements ZeRO-1 with ``contiguous_gradients`` holds when it allocates
    the partition buffer, or 0 if no reduction reaches this rank's partition.

    After backward, DeepSpeed walks the parameters in group order into its
    pre-allocated bucket: each gradient is copied into the bucket and its own storage
    freed, except one larger than the bucket (reduced alone, kept whole; ZeRO-1 never
    frees those outside its partition). A full bucket is reduced before the next
    gradient goes in; the first reduction holding a parameter of this rank's partition
    allocates the buffer of whole touching parameters. Held then: the gradients not
    bucketed yet, the large ones so far, and that buffer.
    """
    order = []
    whole = 0
    for numels in groups:
        flags = touches_partition(numels, world_size, rank)
        order += list(zip(numels, flags, strict=True))
        whole += sum(n for n, touches in zip(numels, flags, strict=True) if touches)
    not_bucketed = sum(n for n, _ in order)
    large_held = 0
    bucket, bucket_touches = 0, False
    for numel, touches in order:
        if bucket + numel > reduce_bucket_size:
            # The full bucket is reduced before this gradient goes in.
            if bucket_touches:
                return not_bucketed + large_held + whole
            bucket, bucket_touches = 0, False
        not_bucketed -= numel
        if numel > reduce_bucket_size:
            large_held += numel
        bucket += numel
        bucket_touches = bucket_touches or touches
    # The last bucket is reduced after the loop (DeepSpeed's epilogue).
    return large_held + whole if bucket_touches else 0


def group_order(groups: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """(group, index) of every parameter in the optimizer's groups' order: ZeRO-1 reduces
    in it after backward; reversed, backward's order where the model's is unknown."""
    return [(g, i) for g, numels in enumerate(groups) for i in range(len(numels))]


def largest_bucket_fill(
    groups: Sequence[Sequence[int]],
    reduce_bucket_size: int,
    order: Sequence[tuple[int, int]],
) -> int:
    """Elements of the fullest ordinary reduce bucket: the transient flat copy DeepSpeed
    makes of a bucket to reduce it (``allreduce_bucket``'s ``flatten``; with
    ``contiguous_gradients`` of the bucket's slices, beside the bucket itself).

    Gradients go into the bucket in ``order`` (ZeRO-2: as backward produces them; ZeRO-1:
    group order, after backward); the bucket is reduced when the next one would overflow
    it. A parameter larger than the bucket is reduced alone: its copy is no ordinary
    bucket's (the memory report names it apart) and is left out here.
    """
    largest = bucket = 0
    for group, index in order:
        numel = groups[group][index]
        if bucket + numel > reduce_bucket_size:
            if bucket <= reduce_bucket_size:
                largest = max(largest, bucket)
            bucket = 0
        bucket += numel
    return max(largest, bucket) if bucket <= reduce_bucket_size else largest


def stage2_contiguous_backward(
    groups: Sequence[Sequence[int]],
    world_size: int,
    rank: int,
    reduce_bucket_size: int,
    arrival: Sequence[tuple[int, int]],
) -> int:
    """Largest gradient elements ZeRO-2 with ``contiguous_gradients`` holds in backward.

    Each gradient, as backward produces it (``arrival``: group, index), is copied into
    the pre-allocated bucket and its own storage freed, except one larger than the
    bucket (reduced alone, alive until the next reduction). The bucket is reduced when
    the next gradient would overflow it, while that gradient is alive; the first
    reduction holding a parameter of this rank's partition allocates the buffer of
    whole touching parameters (kept from then on).
    """
    flags = [touches_partition(numels, world_size, rank) for numels in groups]
    whole = sum(
        n for g, f in zip(groups, flags, strict=True) for n, t in zip(g, f, strict=True) if t
    )
    allocated = False
    bucket, bucket_touches, pending_large, peak = 0, False, 0, 0
    for group, index in arrival:
        numel, touches = groups[group][index], flags[group][index]
        if bucket + numel > reduce_bucket_size:
            allocated = allocated or bucket_touches
            peak = max(peak, (whole if allocated else 0) + pending_large + numel)
            bucket, bucket_touches, pending_large = 0, False, 0
        if numel > reduce_bucket_size:
            pending_large = numel
        bucket += numel
        bucket_touches = bucket_touches or touches
    # The last bucket is reduced after backward (DeepSpeed's epilogue).
    allocated = allocated or bucket_touches
    return max(peak, (whole if allocated else 0) + pending_large)


def stage2_held_before(
    groups: Sequence[Sequence[int]],
    world_size: int,
    rank: int,
    reduce_bucket_size: int,
    arrival: Sequence[tuple[int, int]],
    arrived: int,
    contiguous_gradients: bool,
) -> int:
    """Gradient elements ZeRO-2 holds on ``rank`` once the first ``arrived`` gradients of
    ``arrival`` went through its buckets and the next one arrived, that next one left
    out (it is an operator's output until autograd stores it).

    The moment this names: the embeddings' backward after the blocks' (``arrived``: the
    gradients of every parameter but the leading embeddings). A tied word embedding's
    two contributions and their sum are alive there (GPT-2 124M: three 147.2 MiB
    tensors), beside what each rank already holds: with ``contiguous_gradients``, its
    partition buffer once a reduction reached its partition (the later partitions are
    reduced first: GPT-2 124M at 4 ranks, 129.2 MiB on ranks 2 and 3); without, the
    whole gradients of the reduced parameters touching its partition and those waiting
    in the bucket. The next gradient's arrival first reduces the bucket when it would
    overflow it (always when the bucket holds a parameter larger than itself, so no such
    gradient is left waiting).
    """
    if not 0 <= arrived < len(arrival):
        raise ValueError(f"{arrived} gradients arrived of {len(arrival)}: the next one must exist")
    flags = [touches_partition(numels, world_size, rank) for numels in groups]
    whole = sum(
        n for g, f in zip(groups, flags, strict=True) for n, t in zip(g, f, strict=True) if t
    )
    allocated = False  # contiguous: the partition buffer exists
    kept = 0  # not contiguous: reduced gradients kept because they touch the partition
    bucket: list[tuple[int, bool]] = []
    for group, index in arrival[: arrived + 1]:
        numel = groups[group][index]
        if sum(n for n, _ in bucket) + numel > reduce_bucket_size:
            allocated = allocated or any(touches for _, touches in bucket)
            kept += sum(n for n, touches in bucket if touches)
            bucket = []
        bucket.append((numel, flags[group][index]))
    bucket.pop()  # the next one's own gradient: not stored yet
    if contiguous_gradients:  # the bucket's gradients were copied into the bucket
        return whole if allocated else 0
    return kept + sum(n for n, _ in bucket)


def reduces_on_arrival(
    groups: Sequence[Sequence[int]],
    reduce_bucket_size: int,
    arrival: Sequence[tuple[int, int]],
    position: int,
) -> bool:
    """Whether the gradient at ``arrival[position]`` finds the bucket too full for it, so
    that its arrival reduces the bucket (the same on every rank)."""
    bucket = 0
    for group, index in arrival[: position + 1]:
        numel = groups[group][index]
        full = bucket + numel > reduce_bucket_size
        bucket = numel if full else bucket + numel
    return full


def gradient_high_water(
    groups: Sequence[Sequence[int]],
    *,
    stage: int,
    world_size: int,
    module_bytes: int,
    reduce_bucket_size: int,
    contiguous_gradients: bool,
    arrival: Sequence[tuple[int, int]] | None = None,
    accumulation_steps: int = 1,
) -> list[GradientHighWater]:
    """Per rank, the largest gradient bytes DeepSpeed ZeRO ``stage`` (1 or 2) holds.

    Args:
        groups: numel of every trainable parameter, per optimizer group, in the
            order the optimizer holds them (DeepSpeed keeps that order unless
            ``round_robin_gradients``, which dpkit leaves off).
        stage: ZeRO stage, 1 or 2.
        world_size: data-parallel ranks N.
        module_bytes: bytes per element of the module's gradients (4 fp32, 2 bf16/fp16).
        reduce_bucket_size: DeepSpeed's ``reduce_bucket_size`` (elements).
        contiguous_gradients: DeepSpeed's ``contiguous_gradients``.
        arrival: (group, index) of every parameter in the order backward produces
            their gradients (ZeRO-2 with contiguous gradients reduces in that order);
            default: the groups' order reversed.
        accumulation_steps: micro-batches per optimizer step. Above 1, ZeRO-2 without
            contiguous gradients holds the accumulated whole gradients of its
            partition's parameters beside a backward (reason 4 above), in the module
            dtype (DeepSpeed's default ``grad_accum_dtype``); with contiguous gradients
            that path was not measured and is not modelled.
    """
    if stage not in (1, 2):
        raise ValueError(f"stage must be 1 or 2, got {stage}")
    total = sum(sum(g) for g in groups)
    if arrival is None:
        arrival = group_order(groups)[::-1]
    largest = max((n for g in groups for n in g), default=0)
    rows = []
    for rank in range(world_size):
        parts = [partition_group(g, world_size, rank) for g in groups]
        whole = [p.whole_numel for p in parts]
        backward: dict[str, float] = {}
        step: dict[str, float] = {}
        if stage == 1:
            backward["end of backward (every full gradient)"] = module_bytes * total
            if contiguous_gradients:
                backward["reduction (partition buffer + gradients not reduced yet)"] = (
                    module_bytes
                    * stage1_contiguous_reduction(groups, world_size, rank, reduce_bucket_size)
                )
        elif contiguous_gradients:
            backward["backward (partition buffer + gradients being reduced)"] = (
                module_bytes
                * stage2_contiguous_backward(groups, world_size, rank, reduce_bucket_size, arrival)
            )
        else:
            held = sum(whole)
            # A parameter larger than the bucket is held unreduced; counted already if it
            # touches this rank's partition (without contiguous buffers, not held twice).
            if largest > reduce_bucket_size and not any(largest in p.touching for p in parts):
                held += largest
            backward["backward (partition + a parameter larger than the bucket)"] = (
                module_bytes * held
            )
            if accumulation_steps > 1:
                backward[
                    "backward of a later micro-batch (accumulated whole gradients + its own)"
                ] = module_bytes * (sum(whole) + held)
        for i, part in enumerate(parts):
            still_held = module_bytes * sum(whole[i:])
            copies = part.last_rank or part.tensors_in_partition > 1
            flat = module_bytes * part.partition_numel if copies else 0.0
            # The fp32 cast is a second copy unless the gradients already are fp32.
            fp32 = 4.0 * part.partition_numel if module_bytes != 4 else 0.0
            step[f"step, group {i} (flat copy of the partition)"] = still_held + flat + fp32
        moments = {**backward, **step}
        moment = max(moments, key=moments.__getitem__)
        partition = module_bytes * sum(p.partition_numel for p in parts)
        rows.append(
            GradientHighWater(rank, max(backward.values()), max(step.values()), moment, partition)
        )
    return rows


def largest_slice(groups: Sequence[Sequence[int]], world_size: int) -> int:
    """Elements of the largest piece of one parameter inside one rank's partition, over
    every rank and group (ZeRO-2 offload takes each piece's norm in fp64 as it copies it
    to host memory)."""
    largest = 0
    for numels in groups:
        size = _partition_size(numels, world_size)
        offset = 0
        for numel in numels:
            for rank in range(world_size):
                start, end = rank * size, (rank + 1) * size
                largest = max(largest, min(end, offset + numel) - max(start, offset))
            offset += numel
    return largest
