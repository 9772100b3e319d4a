"""Where a ZeRO-1/2 rank's memory lives, and the points of a step where it is probed.

DeepSpeed keeps its training state inside its ZeRO optimizer, not in ``param.grad``:
the fp32 master partition, the flat 16-bit buffer the module's parameters are views
of, the reduced gradient partition, the reduction buckets. :func:`walk` counts them
from the ZeRO optimizer's own attributes (deepspeed 0.15-0.19; read with ``getattr``
defaults so that a renamed attribute costs a category, not a crash), and
:class:`ZeroProbes` walks at the moments DeepSpeed holds gradients that no optimizer
hook sees (before its reduction, per bucket, at the step's flat copies).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from dpkit.core.categories import PARTITION_SHARE
from dpkit.core.walk import (
    Ledger,
    claim_module_buffers,
    claim_optimizer_state,
    storage_key,
    tensors_in,
    unwrap_module,
    unwrap_optimizer,
)
from dpkit.engines.deepspeed.settings import ZERO_MEMORY_KEYS
from dpkit.engines.roles.measured import MeasuredMemory

if TYPE_CHECKING:
    from dpkit.core.strategy import Strategy
    from dpkit.core.walk import Ledger
    from dpkit.engines.roles.views import StepProbesView

# Attributes of DeepSpeed's ZeRO stage 1/2 optimizer (deepspeed 0.15-0.19).
_ZERO_MARKERS = ("single_partition_of_fp32_groups", "bit16_groups_flat")

# DeepSpeed ZeRO methods probed at their start: (method, probe point, the lowest ZeRO stage
# whose gradient high-water needs it). Written against deepspeed 0.15-0.19; a version
# without one of them gets a report with the gradient figure marked unmeasured.
ZERO_PROBE_POINTS = (
    # ZeRO-1: every full gradient is alive here, before the reduction.
    ("reduce_gradients", "zero_reduce_gradients_begin", 1),
    # Every bucket reduction, while the gradient that filled the bucket is alive.
    ("reduce_ipg_grads", "zero_reduce_bucket", 2),
    ("independent_gradient_partition_epilogue", "zero_backward_epilogue_begin", 2),
)


def zero_tensors_in(value: Any) -> Iterable[torch.Tensor]:
    """Tensors in a (possibly nested) container, or in a DeepSpeed grad-buffer group
    (``GradPartitionBufferGroup``: one flat fp32 partition that its grad views share)."""
    if value is not None and isinstance(getattr(value, "flat_partition", None), torch.Tensor):
        yield value.flat_partition
    elif isinstance(value, dict):
        for item in value.values():
            yield from zero_tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from zero_tensors_in(item)
    else:
        yield from tensors_in(value)


def is_zero_optimizer(obj: Any) -> bool:
    """Whether ``obj`` is DeepSpeed's ZeRO stage 1/2 optimizer (by its attributes)."""
    return all(hasattr(obj, name) for name in _ZERO_MARKERS)


def zero_optimizer(optimizer: Any) -> Any | None:
    """DeepSpeed's ZeRO optimizer behind accelerate's wrapper, or None."""
    owner = unwrap_optimizer(optimizer)
    return owner if is_zero_optimizer(owner) else None


def stage3_optimizer(optimizer: Any) -> Any | None:
    """DeepSpeed's ZeRO-3 optimizer behind accelerate's wrapper (the parameters themselves
    partitioned: ``fp32_partitioned_groups_flat``), or None."""
    owner = unwrap_optimizer(optimizer)
    return owner if hasattr(owner, "fp32_partitioned_groups_flat") else None


def _walk_stage3(ledger: Ledger, zero: Any, module: torch.nn.Module) -> dict[str, Any]:
    """ZeRO-3's memory: each parameter's slice (views into the 16-bit flat partitions), the
    small parameters it keeps whole (``ds_persist``), the ones gathered whole right now,
    the fp32 master partitions and their optimizer state, the flat gradient partition and
    the reduction buckets.

    Under offload each claim is placed where DeepSpeed allocates it (on a CPU run every
    tensor says ``cpu``, so the placement comes from the optimizer's flags): with
    ``offload_param`` the 16-bit partitions are narrows of ``param_groups_fp16_flat_cpu_memory``
    (``_create_fp16_partitions_with_defragmentation``) and zero.Init put the frozen ones
    on its ``remote_device``; with ``offload_optimizer`` the fp32 masters, their Adam
    state, their persistent ``.grad`` and the flat gradient partition are built on
    ``self.device = cpu`` (stage3.py). What is gathered whole for compute, the persistent
    small parameters and the reduce bucket stay on the device."""
    params_at = "host" if getattr(zero, "offload_param", False) else "device"
    states_at = "host" if getattr(zero, "offload_optimizer", False) else "device"
    # 1. The parameters: this rank's slices, then whatever is whole right now (persistent
    # ones always, the others between their gather and their release).
    ledger.claim_all(
        (f for f in zero.fp16_partitioned_groups_flat if f is not None),
        "params",
        "zero3_param_partition",
        params_at,
    )
    # A frozen parameter (LoRA's base weights) is partitioned too, outside the optimizer's
    # flat groups: its own slice (a trainable one's is a view into the flat above).
    ledger.claim_all(
        (p.ds_tensor for p in module.parameters() if getattr(p, "ds_tensor", None) is not None),
        "params",
        "zero3_param_partition (frozen)",
        params_at,
    )
    persistent, gathered = [], []
    for param in module.parameters():
        if getattr(param, "ds_numel", 0) and param.data.numel():
            (persistent if getattr(param, "ds_persist", False) else gathered).append(param.data)
    # Whole copies beside the rank's own slice (which the partitions above hold): the
    # small parameters every rank keeps whole, and the others between their gather and
    # their release (ZeRO-3's working set). The plan counts both as buffers.
    ledger.claim_all(persistent, "buffers", "zero3_persistent_params (whole on every rank)")
    ledger.claim_all(gathered, "buffers", "zero3_gathered_params (whole until released)")
    ledger.claim_all(module.parameters(), "params", "module parameters outside ZeRO-3")
    # 2. The fp32 masters and the inner optimizer's state on them.
    ledger.claim_all(zero.fp32_partitioned_groups_flat, "master", "zero3_fp32_partition", states_at)
    claim_optimizer_state(ledger, getattr(zero, "optimizer", None), states_at)
    # 3. Gradients: the flat partition every parameter's reduced slice lives in, and the
    # masters' .grad during the step.
    ledger.claim_all(
        zero_tensors_in(getattr(zero, "grad_partitions_flat_buffer", None)),
        "grads",
        "zero3_grad_partition",
        states_at,
    )
    # Under offload_optimizer the masters' .grad is allocated once and kept
    # (initialize_optimizer_states); without, it is the step's flat fp32 copy.
    for flat in zero.fp32_partitioned_groups_flat:
        if isinstance(flat.grad, torch.Tensor):
            ledger.claim(flat.grad, "grads", "zero3_fp32_partition.grad", states_at)
    ledger.claim_all(
        zero_tensors_in(getattr(zero, "averaged_gradients", None)),
        "grads",
        "averaged_gradients",
        states_at,
    )
    for param in module.parameters():
        if isinstance(param.grad, torch.Tensor):
            ledger.claim(param.grad, "grads", "param.grad (before its reduction)")
    # 4. Reduction buckets (one flat buffer each, or none without contiguous_gradients).
    for bucket in getattr(zero, "ipg_buckets", {}).values():
        ledger.claim_all(
            zero_tensors_in(getattr(bucket, "buffer", None)), "buffers", "zero_ipg_bucket"
        )
    claim_module_buffers(ledger, module)
    return {"kind": "zero", "stage": 3}


def _gathered_param_keys(module: torch.nn.Module) -> set[tuple[str, int, int]]:
    """Storages of ``module``'s own parameters now (gathered whole while it computes)."""
    return {k for p in module.parameters(recurse=False) if (k := storage_key(p)) is not None}


def _skip_gathered_params(activations: Any, module: torch.nn.Module) -> None:
    """A pre-hook on every module with parameters, registered after DeepSpeed's own (so it
    runs once they are gathered), tells the activation count which storages are them:
    measured, MiniLM's gathered matrices otherwise counted 41 MiB of "activations" at 2 ranks."""
    activations.param_storages = _gathered_param_keys
    for sub in module.modules():
        if sub is not module and next(sub.parameters(recurse=False), None) is not None:
            activations.add_handle(sub.register_forward_pre_hook(activations.note_params))


def _partition_bounds(zero: Any, group: int) -> tuple[torch.Tensor, int, int] | None:
    """The flat buffer of ``group`` and this rank's partition of it, as [start, end) elements."""
    import torch.distributed as dist

    try:
        flat = zero.bit16_groups_flat[group]
        process_group = zero.real_dp_process_group[group]
        rank = dist.get_rank(group=process_group) if dist.is_initialized() else 0
        partition = zero.parallel_partitioned_bit16_groups[group][rank]
    except (AttributeError, IndexError, TypeError, RuntimeError):
        return None
    start = (partition.data_ptr() - flat.data_ptr()) // flat.element_size()
    return flat, start, start + partition.numel()


def straddle_extras(zero: Any, module: torch.nn.Module) -> dict[int, tuple[str, int]]:
    """Per parameter cut by this rank's partition boundary: its name and elements outside.

    DeepSpeed keeps the *whole* gradient of every parameter that touches the rank's
    partition (``grads_in_partition`` is sized by whole parameters), so a parameter
    cut by a boundary is held in full by each rank it touches: with one large
    parameter (a word embedding) this can double a rank's gradient memory.
    Parameters are views into the flat buffer, so their offsets (alignment padding
    included) come from their addresses. Keyed by ``id(param)``.
    """
    names = {id(p): n for n, p in module.named_parameters()}
    extras: dict[int, tuple[str, int]] = {}
    for i, params in enumerate(getattr(zero, "params_in_partition", [])):
        bounds = _partition_bounds(zero, i)
        if bounds is None:
            continue
        flat, start, end = bounds
        for index, param in enumerate(params):
            offset = (param.data_ptr() - flat.data_ptr()) // flat.element_size()
            inside = max(0, min(end, offset + param.numel()) - max(start, offset))
            if inside < param.numel():
                name = names.get(id(param), f"group {i} param {index}")
                extras[id(param)] = (name, param.numel() - inside)
    return extras


def straddling_params(zero: Any, module: torch.nn.Module) -> tuple[int, list[str]]:
    """Total elements held beyond the partition by whole-gradient copies, and the params."""
    extras = straddle_extras(zero, module)
    return sum(e for _, e in extras.values()), [n for n, _ in extras.values()]


def _claim_partition_grads(
    ledger: Ledger,
    tensors: Iterable[Any],
    label: str,
    params: Iterable[torch.nn.Parameter],
    extras: dict[int, tuple[str, int]],
) -> None:
    """Claim gradients of the rank's partition, naming the part that lies outside it."""
    scratch = f"{label}\0"
    tensors = list(tensors)
    ledger.claim_all(tensors, "grads", scratch)
    held = ledger.holders["grads"].pop(scratch, 0.0)
    if not held:
        return
    element_size = next((t.element_size() for t in tensors if isinstance(t, torch.Tensor)), 4)
    cut = [extras[id(p)] for p in params if id(p) in extras]
    outside = min(held, float(element_size * sum(e for _, e in cut)))
    grads = ledger.holders["grads"]
    share = f"{label} {PARTITION_SHARE}"
    grads[share] = grads.get(share, 0.0) + held - outside
    if outside:
        name = f"{label} (whole gradients of boundary-straddling params: {', '.join(n for n, _ in cut)})"
        grads[name] = grads.get(name, 0.0) + outside


class ZeroProbes:
    """The points of a ZeRO step where DeepSpeed holds gradients the optimizer's own
    hooks do not see, probed through a :class:`~dpkit.memory.probes.StepProbes`.

    The start of ``reduce_gradients`` (ZeRO-1: every full gradient, before reduction),
    of each bucket's reduction and of the backward epilogue (ZeRO-2: the partition and
    the ipg bucket), of the ZeRO ``step``, and the two copies ZeRO makes with
    ``flatten``: the flat gradient partition built at the step (while the gradients it
    copies are still held) and the flat copy of a reduction larger than the bucket (a
    parameter bigger than ``reduce_bucket_size``). Flat copies of ordinary buckets are
    only sized, not walked, to keep the probes cheap. ZeRO steps its parameter groups
    one at a time (flatten, inner step, per group): with several groups, those points
    are named per group.
    """

    def __init__(self, probes: StepProbesView, zero: Any) -> None:
        self.probes = probes
        self.zero = zero
        self.in_step = False
        self.groups = len(getattr(zero, "bit16_groups", []))
        self.group = 0
        probes.point_name = self.per_group
        probes.inner_step_done.append(self._inner_step_done)
        self._install()

    def per_group(self, point: str) -> str:
        return f"{point} (group {self.group})" if self.groups > 1 else point

    def _inner_step_done(self) -> None:
        if self.in_step:
            self.group += 1  # the next flatten / inner step belongs to the next group

    def _install(self) -> None:
        probes, zero = self.probes, self.zero
        stage = 2 if getattr(zero, "partition_gradients", False) else 1
        for method, point, needed_at_stage in ZERO_PROBE_POINTS:
            original = getattr(zero, method, None)
            if original is not None:
                probes.replace(zero, method, self._probed(point, original))
            elif stage >= needed_at_stage:
                probes.missing.append(f"{type(zero).__name__}.{method}")

        original_copy = getattr(zero, "copy_grads_in_partition", None)
        if original_copy is not None:
            probes.replace(zero, "copy_grads_in_partition", self._probed_first_copy(original_copy))
        elif getattr(zero, "contiguous_gradients", False):
            probes.missing.append(f"{type(zero).__name__}.copy_grads_in_partition")

        original_step = zero.step

        def step(*args: Any, **kwargs: Any) -> Any:
            probes.probe("zero_step_begin")
            self.in_step = True
            self.group = 0
            try:
                return original_step(*args, **kwargs)
            finally:
                self.in_step = False

        probes.replace(zero, "step", step)
        original_flatten = getattr(zero, "flatten", None)
        if original_flatten is None:
            probes.missing.append(f"{type(zero).__name__}.flatten")
            return
        element_size = torch.tensor([], dtype=getattr(zero, "dtype", torch.float32)).element_size()
        bucket_bytes = float(getattr(zero, "reduce_bucket_size", 0)) * element_size

        def flatten(tensors: Any) -> torch.Tensor:
            flat = original_flatten(tensors)
            nbytes = float(flat.numel() * flat.element_size())
            if self.in_step:
                holder = "flat gradient partition (copy made by the ZeRO step)"
                point = self.per_group("zero_step_flatten_grads")
                probes.probe(point, extra=[(flat, "grads", holder)])
                self._probe_cast(flat, holder)
            elif nbytes > bucket_bytes:
                holder = "zero_reduce_flat_copy (parameter larger than the bucket)"
                probes.probe("zero_reduce_flatten_oversized", extra=[(flat, "buffers", holder)])
            else:
                name = "zero_reduce_flat_copy (largest bucket copy, transient)"
                probes.sized_buffers[name] = max(probes.sized_buffers.get(name, 0.0), nbytes)
            return flat

        probes.replace(zero, "flatten", flatten)

    def _probe_cast(self, flat: torch.Tensor, flat_holder: str) -> None:
        """Probe the moment the ZeRO step casts the flat gradient partition to fp32.

        In bf16/fp16 the step runs ``flat.to(fp32)`` (``stage_1_and_2.py``) while the
        16-bit gradients it copied and the flat copy itself are alive: the gradient
        high-water of a mixed-precision step, three copies at once. The cast is caught
        by shadowing ``to`` on this one tensor; the shadow holds the tensor weakly, so
        DeepSpeed's ``del`` still frees it when it means to.
        """
        flat_ref = weakref.ref(flat)
        point = self.per_group("zero_step_cast_grads_fp32")
        probes = self.probes

        def to(*args: Any, **kwargs: Any) -> torch.Tensor:
            source = flat_ref()
            if source is None:  # unreachable while DeepSpeed calls it on the tensor
                raise RuntimeError("dpkit probe: the flat gradient partition is gone")
            cast = torch.Tensor.to(source, *args, **kwargs)
            if cast is not source:  # fp32 gradients: no copy, nothing new to see
                holder = "fp32 gradient partition (cast for the master's step)"
                probes.probe(point, extra=[(source, "grads", flat_holder), (cast, "grads", holder)])
            return cast

        flat.to = to  # type: ignore[method-assign]

    def _probed_first_copy(self, original: Any) -> Any:
        """With ``contiguous_gradients``, the first copy into the partition buffer
        allocates it (whole parameters) while the gradients not reduced yet are alive:
        ZeRO-1's reduction high-water. Probed after that copy, with the copied gradient
        (alive until the copy ends) counted too."""
        zero, probes = self.zero, self.probes

        def copy_grads_in_partition(param: Any, *args: Any, **kwargs: Any) -> Any:
            first = getattr(zero, "grads_in_partition", False) is None
            # detach(): DeepSpeed swaps param.grad.data; this keeps the copied storage.
            grad = param.grad.detach() if first and param.grad is not None else None
            result = original(param, *args, **kwargs)
            if first and getattr(zero, "grads_in_partition", None) is not None:
                holder = "param.grad (being copied into the partition buffer)"
                extra = [(grad, "grads", holder)] if grad is not None else []
                probes.probe("zero_partition_buffer_allocated", extra=extra)
            return result

        return copy_grads_in_partition

    def _probed(self, point: str, original: Any) -> Any:
        probes = self.probes

        def probed(*args: Any, **kwargs: Any) -> Any:
            probes.probe(point)
            return original(*args, **kwargs)

        return probed


class DeepSpeedMemory(MeasuredMemory):
    """DeepSpeed ZeRO's measured memory: its 16-bit and fp32 partitions, flat buffers and buckets, read from the ZeRO optimizer, and the points of its step it is probed at."""

    def walk(self, ledger: Ledger, model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
        """DeepSpeed ZeRO stage 1/2: the partitions and buffers inside ``DeepSpeedZeroOptimizer``
        (a model that DeepSpeed does not drive, under a ZeRO strategy, walks as plain torch)."""
        stage3 = stage3_optimizer(optimizer)
        if stage3 is not None:
            return _walk_stage3(ledger, stage3, unwrap_module(model))
        zero = zero_optimizer(optimizer)
        if zero is None:
            zero = zero_optimizer(getattr(model, "optimizer", None))
        if zero is None:
            from dpkit.engines.ddp.memory import DDPMemory

            return DDPMemory().walk(ledger, model, optimizer)
        module = unwrap_module(model)
        fp32_partitions = list(getattr(zero, "single_partition_of_fp32_groups", []))
        # Under optimizer offload DeepSpeed builds the master partition, its gradient, the
        # optimizer state and its staging buffers on `zero.device` ('cpu':
        # stage_1_and_2.py, `self.device = 'cpu' if self.cpu_offload`): host memory. On
        # a CPU run every tensor says `cpu`, so the placement is read from this flag.
        host = "host" if getattr(zero, "cpu_offload", False) else "device"
        # 1. The fp32 master partition the inner optimizer updates (Psi/N per rank).
        ledger.claim_all(fp32_partitions, "master", "zero_fp32_partition", host)
        # 2. The flat buffer the module's parameters are views of (all Psi, padded).
        ledger.claim_all(getattr(zero, "bit16_groups_flat", []), "params", "zero_flat_params")
        ledger.claim_all(module.parameters(), "params", "module parameters outside ZeRO groups")
        # 3. Optimizer state on the fp32 partition (beside it, in host memory under offload).
        claim_optimizer_state(ledger, getattr(zero, "optimizer", None), host)
        # 4. Gradients ZeRO keeps on purpose: the reduced partition (during backward, in
        # grads_in_partition / averaged_gradients; during the step, as the master's .grad).
        for partition in fp32_partitions:
            grad = partition.grad
            if isinstance(grad, torch.Tensor):
                # Flattening a single gradient returns a view, not a copy: a partition that lies
                # inside one parameter keeps that parameter's whole gradient alive through the step.
                whole = grad.untyped_storage().nbytes() > grad.numel() * grad.element_size()
                suffix = " (a view: keeps a whole parameter's gradient alive)" if whole else ""
                ledger.claim(grad, "grads", "zero_fp32_partition.grad" + suffix, host)
        extras = straddle_extras(zero, module)
        groups = list(getattr(zero, "params_in_partition", []))
        in_partition = {id(p) for params in groups for p in params}
        # grads_in_partition (contiguous_gradients) holds all groups' partition parameters,
        # whole; it is dropped at the end of backward, and averaged_gradients (its views, or
        # without contiguous_gradients views of the parameters' own gradients) keeps it alive
        # until the step.
        all_partition_params = [p for params in groups for p in params]
        partition_buffer = getattr(zero, "grads_in_partition", None)
        _claim_partition_grads(
            ledger, [partition_buffer], "grads_in_partition", all_partition_params, extras
        )
        averaged = getattr(zero, "averaged_gradients", None) or {}
        # With contiguous_gradients every group's averaged_gradients are views into the one
        # buffer of all groups: claiming any of them claims the whole buffer, so the part
        # outside the partition is named from every group's cut parameters.
        shared_buffer = bool(getattr(zero, "contiguous_gradients", False))
        for group, value in averaged.items() if isinstance(averaged, dict) else []:
            params = (
                all_partition_params
                if shared_buffer
                else (groups[group] if group < len(groups) else [])
            )
            _claim_partition_grads(
                ledger, zero_tensors_in(value), "averaged_gradients", params, extras
            )
        ledger.claim_all(
            zero_tensors_in(getattr(zero, "all_grad_tensors", None)), "grads", "all_grad_tensors"
        )
        # 5. Reduction buckets: the contiguous ipg buffer(s), one per comm dtype (two with overlap_comm).
        for bucket in getattr(zero, "ipg_buckets", {}).values():
            ledger.claim_all(getattr(bucket, "buffer", []), "buffers", "zero_ipg_bucket")
        # 6. What param.grad still points at. A view into a larger storage not claimed above
        # is a stale view into an ipg buffer that DeepSpeed already dropped: the view keeps
        # the whole bucket alive until the step frees the .grad fields. A gradient with a
        # storage of its own is either a reduced one of this rank's partition (ZeRO-2
        # without contiguous_gradients keeps them so) or one not reduced yet: all of them in
        # ZeRO-1 before its post-backward reduction, in ZeRO-2 those waiting in a bucket or
        # larger than reduce_bucket_size (reduced alone, after backward).
        param_ids = getattr(zero, "param_id", {})
        reduced_flags = getattr(zero, "params_already_reduced", [])
        unreduced: list[tuple[str, torch.Tensor]] = []
        for name, param in module.named_parameters():
            for grad in (param.grad, getattr(param, "grad_accum", None)):
                if not isinstance(grad, torch.Tensor) or ledger.owner(grad) is not None:
                    continue
                if grad.untyped_storage().nbytes() > grad.numel() * grad.element_size():
                    ledger.claim(
                        grad, "buffers", "zero_ipg_bucket (kept alive by param.grad views)"
                    )
                    continue
                index = param_ids.get(id(param))
                reduced = index is not None and index < len(reduced_flags) and reduced_flags[index]
                if reduced and id(param) in in_partition:
                    _claim_partition_grads(ledger, [grad], "param.grad", [param], extras)
                else:
                    unreduced.append((name, grad))
        if unreduced:
            names = [n for n, _ in unreduced]
            listed = ", ".join(names) if len(names) <= 3 else f"{len(names)} params"
            ledger.claim_all(
                (g for _, g in unreduced), "grads", f"param.grad (unreduced: {listed})"
            )
        # 7. Offload staging buffers and other per-optimizer scratch space, where DeepSpeed
        # allocates them (stage_1_and_2.py): the gradient copied to the host (largest
        # parameter) and the bit16 copy of the partition sent back (Psi/N) on `zero.device`,
        # the gradient staged on the device before that copy (largest parameter) on the
        # accelerator. Under accumulation the whole gradients of the rank's partition
        # parameters accumulate between micro-batches on `zero.device`: gradients.
        for name, category, placement in (
            ("temp_grad_buffer_for_cpu_offload", "buffers", host),
            ("temp_grad_buffer_for_gpu_offload", "buffers", "device"),
            ("param_buffer_of_bit16_for_cpu_offload_groups", "buffers", host),
            ("_muon_allgather_buffers", "buffers", "device"),
            ("accumulated_grads_in_cpu", "grads", host),
        ):
            ledger.claim_all(
                zero_tensors_in(getattr(zero, name, None)),
                category,
                f"zero_{name.strip('_')}",
                placement,
            )
        claim_module_buffers(ledger, module)
        return {"kind": "zero", "stage": 2 if getattr(zero, "partition_gradients", False) else 1}

    def install_probes(
        self, probes: StepProbesView, model: torch.nn.Module, optimizer: Any
    ) -> None:
        """:class:`ZeroProbes` on the run's ZeRO optimizer (none without one); under ZeRO-3
        the activation count skips the parameters each module holds gathered while it
        computes (what autograd saves of them is parameter memory, not activations)."""
        zero = zero_optimizer(optimizer)
        if zero is not None:
            ZeroProbes(probes, zero)
        if stage3_optimizer(optimizer) is not None:
            # The end of a training forward: from the steady step on, ZeRO-3 keeps there
            # every parameter it will use again within stage3_max_reuse_distance elements
            # (and those it prefetched) gathered whole for the backward.
            probes.add_remover(
                unwrap_module(model)
                .register_forward_hook(
                    lambda module, args, output: (
                        probes.probe("zero3_forward_end") if module.training else None
                    )
                )
                .remove
            )
            if probes.activations is not None:
                _skip_gathered_params(probes.activations, unwrap_module(model))

    def steady_step(self, optimizer: Any) -> int:
        """ZeRO-3 records the order its modules run in during step 1, releasing each
        module's parameters after use; from step 2 it prefetches and keeps parameters it
        will reuse (measured: a 0.9M-parameter GPT-2 at DeepSpeed's defaults holds every
        parameter gathered at the end of the forward of step 2, none in step 1)."""
        return 2 if stage3_optimizer(optimizer) is not None else 1

    def precision_in_effect(self, optimizer: Any) -> str | None:
        import torch

        stage3 = stage3_optimizer(optimizer)
        zero = zero_optimizer(optimizer)
        if zero is None and stage3 is None:
            return None
        flats = (
            stage3.fp16_partitioned_groups_flat if stage3 is not None else zero.bit16_groups_flat
        )
        dtype = flats[0].dtype
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "no")

    def optimizer_groups(self, optimizer: Any) -> list[list[Any]]:
        stage3 = stage3_optimizer(optimizer)
        if stage3 is not None:
            return [list(group) for group in stage3.fp16_groups]
        zero = zero_optimizer(optimizer)
        if zero is None:
            return super().optimizer_groups(optimizer)
        return [list(group) for group in getattr(zero, "bit16_groups", [])]

    def settings_in_effect(self, model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
        """The ZeRO optimizer's memory settings as it runs with them."""
        if stage3_optimizer(optimizer) is not None:
            # ZeRO-3's are read from the DeepSpeed engine (accelerate's prepared model).
            ds_engine = getattr(model, "zero_max_reuse_distance", None) and model
            if ds_engine is None:
                return {}
            return {
                "zero.reduce_bucket_size": ds_engine.zero_reduce_bucket_size(),
                "zero.contiguous_gradients": ds_engine.zero_contiguous_gradients(),
                "zero.overlap_comm": ds_engine.zero_overlap_comm(),
                "zero.stage3_prefetch_bucket_size": ds_engine.zero_prefetch_bucket_size(),
                "zero.stage3_max_reuse_distance": ds_engine.zero_max_reuse_distance(),
                "zero.stage3_param_persistence_threshold": (
                    ds_engine.zero_param_persistence_threshold()
                ),
            }
        zero = zero_optimizer(optimizer)
        if zero is None:
            return {}
        names = (*ZERO_MEMORY_KEYS, "partition_gradients", "cpu_offload")
        return {f"zero.{n}": getattr(zero, n) for n in names if hasattr(zero, n)}

    def report_notes(self, strategy: Strategy, model: torch.nn.Module, optimizer: Any) -> list[str]:
        if zero_optimizer(optimizer) is not None or stage3_optimizer(optimizer) is not None:
            return []
        return [f"strategy {strategy.name!r} but no ZeRO optimizer found: measured as plain torch"]

    def offload_in_effect(self, optimizer: Any) -> str | None:
        stage3 = stage3_optimizer(optimizer)
        if stage3 is not None:  # ZeRO-3: offload_optimizer, a bool (stage3.py)
            return "cpu" if getattr(stage3, "offload_optimizer", False) else None
        zero = zero_optimizer(optimizer)
        return "cpu" if getattr(zero, "cpu_offload", False) else None

    def optimizer_in_effect(self, optimizer: Any) -> str | None:
        """``cpu_adam`` when the ZeRO optimizer steps with DeepSpeed's CPU Adam (offload)."""
        owner = stage3_optimizer(optimizer) or zero_optimizer(optimizer)
        inner = getattr(owner, "optimizer", None)
        return "cpu_adam" if type(inner).__name__ == "DeepSpeedCPUAdam" else None
