"""Probes that run the memory walk inside a training step, and count activations.

A report taken after training cannot see gradients: DeepSpeed frees them in its
step and ``zero_grad`` releases DDP's. These probes run :func:`walk` at the
points where each strategy holds them and keep the high-water of each category.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from dpkit.memory.walk import (
    CATEGORIES,
    fsdp2_params,
    inner_torch_optimizer,
    is_zero_optimizer,
    storage_key,
    unwrap_optimizer,
    walk,
)

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


def _rss_now() -> float | None:
    try:
        import psutil
    except ImportError:
        return None
    return float(psutil.Process().memory_info().rss)


def _whole_param_keys(unit: torch.nn.Module) -> set[tuple[str, int, int]]:
    """Storages of the whole parameters an FSDP2 unit holds now (its all-gather output)."""
    return {
        key
        for record in fsdp2_params(unit, recurse=False)
        for tensor in getattr(record, "all_gather_outputs", None) or []
        if (key := storage_key(tensor)) is not None
    }


class _SavedActivations:
    """Bytes saved for backward during one forward: the activation memory autograd keeps.

    A forward pre-hook enters ``saved_tensors_hooks`` and the forward hook leaves it;
    the pack hook returns the tensor unchanged and only counts its storage once,
    skipping parameter storages (model states, already counted) and, under FSDP2, the
    whole parameters each unit all-gathers for its compute (communication buffers to
    the walk), noted as each unit starts its forward.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.high_water = 0.0
        self.last = 0.0
        self._seen: set[tuple[str, int, int]] = set()
        self._param_keys: set[tuple[str, int, int]] = set()
        self._bytes = 0.0
        self._context: contextlib.AbstractContextManager | None = None
        self._handles = [
            model.register_forward_pre_hook(self._begin),
            model.register_forward_hook(self._end, always_call=True),
        ]
        # Registered after FSDP2's own pre-forward hooks, so they run after the all-gather.
        for module in model.modules():
            if module is not model and fsdp2_params(module, recurse=False):
                self._handles.append(module.register_forward_pre_hook(self._note_whole_params))

    def _note_whole_params(self, module: torch.nn.Module, args: Any) -> None:
        if self._context is not None:
            self._param_keys |= _whole_param_keys(module)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = storage_key(tensor)
        if key is not None and key not in self._seen and key not in self._param_keys:
            self._seen.add(key)
            self._bytes += float(tensor.untyped_storage().nbytes())
        return tensor

    @staticmethod
    def _unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def _begin(self, module: torch.nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled() or self._context is not None:
            return  # evaluation saves nothing for backward; nested calls count once
        self._param_keys = {k for p in module.parameters() if (k := storage_key(p)) is not None}
        self._param_keys |= _whole_param_keys(module)
        self._seen.clear()
        self._bytes = 0.0
        self._context = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._context.__enter__()

    def _end(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._context is None:
            return
        self._context.__exit__(None, None, None)
        self._context = None
        self.last = self._bytes
        self.high_water = max(self.high_water, self._bytes)
        self._seen.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class StepProbes:
    """Walks the rank's tensors at the points of a step where each strategy holds its gradients.

    Points: the torch optimizer's step (pre and post hooks; DDP's gradients and the
    optimizer state are all alive there), and under DeepSpeed the start of
    ``reduce_gradients`` (ZeRO-1: every full gradient, before reduction), of the
    backward epilogue (ZeRO-2: the partition and the ipg bucket), of the ZeRO
    ``step``, and the two copies ZeRO makes with ``flatten``: the flat gradient
    partition built at the step (while the gradients it copies are still held) and
    the flat copy of a reduction larger than the bucket (a parameter bigger than
    ``reduce_bucket_size``). Flat copies of ordinary buckets are only sized, not
    walked, to keep the probes cheap.

    Per category the high-water is kept with the point it came from; per point the
    last breakdown is kept in ``phases``; ``largest_moment`` is the point where all
    counted tensors together were largest.
    """

    def __init__(self, model: torch.nn.Module, optimizer: Any, count_activations: bool = True):
        self.model = model
        self.optimizer = optimizer
        self.high_water: dict[str, dict[str, Any]] = {}
        self.phases: dict[str, dict[str, float]] = {}
        self.largest_moment: dict[str, Any] = {}
        # Largest flat copy of an ordinary reduction bucket (sized, not walked).
        self.bucket_flat_copy_bytes = 0.0
        self.probe_seconds = 0.0
        # ZeRO methods these probes rely on that this DeepSpeed lacks (another version):
        # gradients held only there are not seen, and the report says so.
        self.missing: list[str] = []
        self._removers: list[Any] = []
        self._in_zero_step = False
        # ZeRO steps its parameter groups one at a time (flatten, inner step, per group):
        # with several groups, those points are named per group.
        self._zero_groups = 0
        self._group = 0
        self.activations = _SavedActivations(model) if count_activations else None
        # What the process holds besides counted tensors, measured once (after prepare,
        # before the first step): the interpreter, the libraries, the data. It is the
        # part of a CPU peak that no parallelism strategy can shrink.
        snap = walk(model, optimizer)
        self.baseline = {
            "rss": _rss_now(),
            "counted_tensors": sum(snap[c] for c in CATEGORIES),
        }
        torch_opt = inner_torch_optimizer(optimizer)
        if torch_opt is not None:
            pre = torch_opt.register_step_pre_hook(
                lambda *_: self.probe(self._per_group("optimizer_step_begin"))
            )
            post = torch_opt.register_step_post_hook(self._after_inner_step)
            self._removers += [pre.remove, post.remove]
        zero = unwrap_optimizer(optimizer)
        if is_zero_optimizer(zero):
            self._probe_zero(zero)
        if fsdp2_params(model):
            # FSDP2 shard-grad-op holds every unit's whole parameters from the end of the
            # forward until each unit's backward: the largest moment of its buffers.
            handle = model.register_forward_hook(self._after_forward)
            self._removers.append(handle.remove)

    def _after_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():  # a training forward; evaluation keeps nothing
            self.probe("forward_end")

    def _per_group(self, point: str) -> str:
        return f"{point} (group {self._group})" if self._zero_groups > 1 else point

    def _after_inner_step(self, *_: Any) -> None:
        self.probe(self._per_group("optimizer_step_end"))
        if self._in_zero_step:
            self._group += 1  # the next flatten / inner step belongs to the next group

    def _probe_zero(self, zero: Any) -> None:
        self._zero_groups = len(getattr(zero, "bit16_groups", []))
        stage = 2 if getattr(zero, "partition_gradients", False) else 1
        for method, point, needed_at_stage in ZERO_PROBE_POINTS:
            original = getattr(zero, method, None)
            if original is not None:
                self._replace(zero, method, self._probed(point, original))
            elif stage >= needed_at_stage:
                self.missing.append(f"{type(zero).__name__}.{method}")

        original_copy = getattr(zero, "copy_grads_in_partition", None)
        if original_copy is not None:
            self._replace(
                zero, "copy_grads_in_partition", self._probed_first_copy(zero, original_copy)
            )
        elif getattr(zero, "contiguous_gradients", False):
            self.missing.append(f"{type(zero).__name__}.copy_grads_in_partition")

        original_step = zero.step

        def step(*args: Any, **kwargs: Any) -> Any:
            self.probe("zero_step_begin")
            self._in_zero_step = True
            self._group = 0
            try:
                return original_step(*args, **kwargs)
            finally:
                self._in_zero_step = False

        self._replace(zero, "step", step)
        original_flatten = getattr(zero, "flatten", None)
        if original_flatten is None:
            self.missing.append(f"{type(zero).__name__}.flatten")
            return
        element_size = torch.tensor([], dtype=getattr(zero, "dtype", torch.float32)).element_size()
        bucket_bytes = float(getattr(zero, "reduce_bucket_size", 0)) * element_size

        def flatten(tensors: Any) -> torch.Tensor:
            flat = original_flatten(tensors)
            nbytes = float(flat.numel() * flat.element_size())
            if self._in_zero_step:
                holder = "flat gradient partition (copy made by the ZeRO step)"
                point = self._per_group("zero_step_flatten_grads")
                self.probe(point, extra=[(flat, "grads", holder)])
                self._probe_cast(flat, holder)
            elif nbytes > bucket_bytes:
                holder = "zero_reduce_flat_copy (parameter larger than the bucket)"
                self.probe("zero_reduce_flatten_oversized", extra=[(flat, "buffers", holder)])
            else:
                self.bucket_flat_copy_bytes = max(self.bucket_flat_copy_bytes, nbytes)
            return flat

        self._replace(zero, "flatten", flatten)

    def _probe_cast(self, flat: torch.Tensor, flat_holder: str) -> None:
        """Probe the moment the ZeRO step casts the flat gradient partition to fp32.

        In bf16/fp16 the step runs ``flat.to(fp32)`` (``stage_1_and_2.py``) while the
        16-bit gradients it copied and the flat copy itself are alive: the gradient
        high-water of a mixed-precision step, three copies at once. The cast is caught
        by shadowing ``to`` on this one tensor; the shadow holds the tensor weakly, so
        DeepSpeed's ``del`` still frees it when it means to.
        """
        flat_ref = weakref.ref(flat)
        point = self._per_group("zero_step_cast_grads_fp32")

        def to(*args: Any, **kwargs: Any) -> torch.Tensor:
            source = flat_ref()
            if source is None:  # unreachable while DeepSpeed calls it on the tensor
                raise RuntimeError("dpkit probe: the flat gradient partition is gone")
            cast = torch.Tensor.to(source, *args, **kwargs)
            if cast is not source:  # fp32 gradients: no copy, nothing new to see
                holder = "fp32 gradient partition (cast for the master's step)"
                self.probe(point, extra=[(source, "grads", flat_holder), (cast, "grads", holder)])
            return cast

        flat.to = to  # type: ignore[method-assign]

    def _probed_first_copy(self, zero: Any, original: Any) -> Any:
        """With ``contiguous_gradients``, the first copy into the partition buffer
        allocates it (whole parameters) while the gradients not reduced yet are alive:
        ZeRO-1's reduction high-water. Probed after that copy, with the copied gradient
        (alive until the copy ends) counted too."""

        def copy_grads_in_partition(param: Any, *args: Any, **kwargs: Any) -> Any:
            first = getattr(zero, "grads_in_partition", False) is None
            # detach(): DeepSpeed swaps param.grad.data; this keeps the copied storage.
            grad = param.grad.detach() if first and param.grad is not None else None
            result = original(param, *args, **kwargs)
            if first and getattr(zero, "grads_in_partition", None) is not None:
                holder = "param.grad (being copied into the partition buffer)"
                extra = [(grad, "grads", holder)] if grad is not None else []
                self.probe("zero_partition_buffer_allocated", extra=extra)
            return result

        return copy_grads_in_partition

    def _probed(self, point: str, original: Any) -> Any:
        def probed(*args: Any, **kwargs: Any) -> Any:
            self.probe(point)
            return original(*args, **kwargs)

        return probed

    def _replace(self, obj: Any, name: str, replacement: Any) -> None:
        # An instance attribute shadows a class method (removing it restores the method);
        # an attribute that was already the instance's own (ZeRO's `flatten`) is put back.
        own = name in vars(obj)
        previous = vars(obj).get(name)
        setattr(obj, name, replacement)
        self._removers.append(
            (lambda: setattr(obj, name, previous)) if own else (lambda: delattr(obj, name))
        )

    def probe(self, point: str, extra: Iterable[tuple[torch.Tensor, str, str]] = ()) -> None:
        started = time.perf_counter()
        snap = walk(self.model, self.optimizer, extra)
        self.phases[point] = {**{c: snap[c] for c in CATEGORIES}, "holders": snap["holders"]}
        for category in CATEGORIES:
            best = self.high_water.get(category)
            if best is None or snap[category] > best["bytes"]:
                self.high_water[category] = {
                    "bytes": snap[category],
                    "point": point,
                    "holders": dict(snap["holders"].get(category, {})),
                }
        total = sum(snap[c] for c in CATEGORIES)
        if total > self.largest_moment.get("total", -1.0):
            self.largest_moment = {"point": point, "total": total, **self.phases[point]}
        self.probe_seconds += time.perf_counter() - started

    def reset(self) -> None:
        self.high_water.clear()
        self.phases.clear()
        self.largest_moment = {}
        self.bucket_flat_copy_bytes = 0.0
        if self.activations is not None:
            self.activations.high_water = 0.0

    @property
    def installed(self) -> bool:
        """Whether the probes are still in place (each step pays for their walks)."""
        return bool(self._removers)

    def remove(self, keep_activations: bool = False) -> None:
        """Take the walks out of the step (and the activation count, unless kept)."""
        for remover in reversed(self._removers):
            remover()
        self._removers.clear()
        if self.activations is not None and not keep_activations:
            self.activations.remove()
