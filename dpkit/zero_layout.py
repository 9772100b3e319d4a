"""Gradient memory per rank as DeepSpeed ZeRO-1/2 really holds it, from the parameter layout.

The ZeRO paper counts a rank's gradients as Psi/N under stage 2 (:mod:`dpkit.analytic`).
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

ZeRO-1 keeps every full gradient until backward ends (``reduce_gradients``), then
reduces them in order (with ``contiguous_gradients``, into the same pre-sized partition
buffer), then steps as ZeRO-2 does. :func:`gradient_high_water` returns, per rank, the largest
of these moments: the figure the memory report measures as ``grads``
(``dpkit.memory_probes`` probes the same points), and the one ``dpkit plan`` predicts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

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


def partition_group(numels: Sequence[int], world_size: int, rank: int) -> GroupPartition:
    """Where one group's parameters (in group order) fall for ``rank`` of ``world_size``."""
    if world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of world size {world_size}")
    alignment = ALIGNMENT_FACTOR * world_size
    padded = int(math.ceil(sum(numels) / alignment)) * alignment
    size = padded // world_size
    start, end = rank * size, (rank + 1) * size
    touching, offset = [], 0
    for numel in numels:
        # DeepSpeed's test: the parameter starts inside the partition, or straddles its start.
        if start <= offset < end or offset < start < offset + numel:
            touching.append(numel)
        offset += numel
    return GroupPartition(size, tuple(touching), rank == world_size - 1)


@dataclass(frozen=True)
class GradientHighWater:
    """One rank's gradient bytes at the moments DeepSpeed holds the most."""

    rank: int
    backward: float
    """Largest holding during backward (activations are still alive then)."""
    step: float
    """Largest holding during the optimizer step (activations are freed)."""
    moment: str
    """Where the larger of the two happens."""
    partition_bytes: float
    """The paper's share: this rank's partitions in the module dtype."""

    @property
    def bytes(self) -> float:
        return max(self.backward, self.step)


def gradient_high_water(
    groups: Sequence[Sequence[int]],
    *,
    stage: int,
    world_size: int,
    module_bytes: int,
    reduce_bucket_size: int,
    contiguous_gradients: bool,
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
    """
    if stage not in (1, 2):
        raise ValueError(f"stage must be 1 or 2, got {stage}")
    total = sum(sum(g) for g in groups)
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
                # The partition buffer is allocated at the first reduction, while the
                # gradients not reduced yet are still whole: an upper bound (dpkit turns
                # contiguous_gradients off where a large parameter makes it costly).
                backward["reduction (partition buffer + gradients not reduced yet)"] = (
                    module_bytes * (sum(whole) + total)
                )
        else:
            held = sum(whole)
            if largest > reduce_bucket_size:
                # Counted already if it touches this rank's partition (then, without
                # contiguous buffers, it is not held twice).
                in_partition = any(largest in part.touching for part in parts)
                if contiguous_gradients or not in_partition:
                    held += largest
            backward["backward (partition + a parameter larger than the bucket)"] = (
                module_bytes * held
            )
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
