"""The activation side of a step's peak: the model's forward, loss and backward run on the
meta device, with every live tensor followed (:class:`~dpkit.core.step.StepTrace`).

:mod:`dpkit.plan.activations` counts what the forward saves for backward; the peak also
holds what lives between operators: the logits and the loss with cross-entropy's fp32
copies, attention's and the MLP's outputs before the next operator consumes them, and in
backward the gradients of every activation and of each weight until autograd stores it.
No formula is fitted here: the model's own code runs at full size on the meta device
(no memory, every shape) under a ``TorchDispatchMode`` that keeps, as
:class:`dpkit.memory.live.LiveTensors` does on a real run, the bytes of every storage an
operator's output brings until its last reference dies, and their high-water. The
kernels are those of the run's device (:func:`~dpkit.plan.activations._kernel_mode`).

What it leaves to the strategies (:mod:`dpkit.plan.peak`): parameters and module buffers
(made before the step), the gradients once stored (DDP's buckets, ZeRO's partitions and
FSDP2's shards hold them each their own way), the optimizer, and communication buffers.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any

from dpkit.core.spec import ModelSpec
from dpkit.core.step import StepTrace
from dpkit.models import quiet_transformers, repeated_blocks
from dpkit.plan.activations import (
    KERNEL_DEVICES,
    _checkpointed,
    _kernel_mode,
    _no_token_value_checks,
    _trace_labels,
    _trace_model,
    _TraceKey,
)


def _tensors(value: Any) -> list[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []


class _Follow:
    """Live bytes of the storages operators make, and which of them are stored gradients."""

    def __init__(self, known: set[int]) -> None:
        self.known = known  # storages made before the step: parameters, buffers, the batch
        self.live: dict[int, int] = {}
        self.refs: dict[int, Any] = {}
        self.stored: set[int] = set()
        self.total = 0
        self.grads = 0
        self.phase = "forward"
        self.depth = 0  # submodules running (the outermost module's own code at 0)
        self.returned = 0  # submodules that returned since the forward began
        self.forward_high = 0
        self.forward_point = "forward"
        self.backward_high = 0
        self.grads_at_backward_high = 0
        self.backward_kept_high = 0
        self.after_blocks = False  # the first repeated block's backward has ended
        self.grads_at_blocks_done = 0
        self.after_blocks_high: int | None = None
        self.stored_after_blocks = 0  # parameters whose gradient was stored after them

    def follow(self, tensor: Any) -> bool:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return False
        ident = id(storage)
        if ident in self.live or ident in self.known:
            return False
        self.live[ident] = int(storage.nbytes())
        self.refs[ident] = weakref.ref(storage, lambda _, ident=ident: self.freed(ident))
        self.total += self.live[ident]
        return True

    def freed(self, ident: int) -> None:
        nbytes = self.live.pop(ident, 0)
        self.refs.pop(ident, None)
        self.total -= nbytes
        if ident in self.stored:
            self.stored.discard(ident)
            self.grads -= nbytes

    def store(self, tensor: Any) -> None:
        """Autograd stored ``tensor`` as a parameter's ``.grad``: the strategy's from now."""
        ident = id(tensor.untyped_storage())
        self.stored_after_blocks += self.after_blocks
        if ident in self.live and ident not in self.stored:
            self.stored.add(ident)
            self.grads += self.live[ident]

    @property
    def held(self) -> int:
        """Bytes held besides the stored gradients."""
        return self.total - self.grads

    def grew(self) -> None:
        if self.phase == "forward":
            if self.held > self.forward_high:
                self.forward_high = self.held
                self.forward_point = "loss" if self.depth == 0 and self.returned else "forward"
        else:
            if self.held > self.backward_high:
                self.backward_high = self.held
                self.grads_at_backward_high = self.grads
            self.backward_kept_high = max(self.backward_kept_high, self.total)
            if self.after_blocks:  # the gradients stored from then on are kept in it
                tail = self.total - self.grads_at_blocks_done
                self.after_blocks_high = max(self.after_blocks_high or 0, tail)


def _mode(follow: _Follow) -> Any:
    from torch.utils._python_dispatch import TorchDispatchMode

    class LiveOnMeta(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if any([follow.follow(t) for t in _tensors(out)]):
                follow.grew()
            return out

    return LiveOnMeta()


def _batch(model: Any, micro_batch: int, seq_len: int) -> tuple[dict[str, Any], float]:
    """The forward's inputs as the recipes give them, and the batch's bytes: token ids,
    attention mask (token type ids where the model has them), labels. The mask is not fed
    to the meta forward (transformers reads its values); on the kernels traced it saves
    nothing (:func:`~dpkit.plan.activations._trace_once`)."""
    import torch

    ids = torch.zeros((micro_batch, seq_len), dtype=torch.long, device="meta")
    inputs: dict[str, Any] = {"input_ids": ids}
    labels = _trace_labels(model, micro_batch, seq_len)
    if labels is not None:
        inputs["labels"] = labels
    per_token = 2 + (1 if getattr(model.config, "type_vocab_size", 0) else 0)
    nbytes = 8.0 * micro_batch * seq_len * per_token
    if labels is not None:
        nbytes += float(labels.numel() * labels.element_size())
    return inputs, nbytes


def _run(model: Any, micro_batch: int, seq_len: int, device: str, autocast_dtype: Any) -> StepTrace:
    inputs, batch_bytes = _batch(model, micro_batch, seq_len)
    known = {id(t.untyped_storage()) for t in (*model.parameters(), *model.buffers())}
    known |= {id(t.untyped_storage()) for t in inputs.values()}
    follow = _Follow(known)
    blocks = repeated_blocks(model)
    block_forward = [0.0] * len(blocks)
    block_backward_start: list[float | None] = [None] * len(blocks)
    blocks_high: list[float] = []  # the forward's high-water when the last block returns
    grads_before_blocks: list[float] = []  # stored when the blocks' backward starts
    handles = []

    def enter(module: Any, args: Any) -> None:
        if follow.phase == "forward":
            follow.depth += 1

    def leave(module: Any, args: Any, output: Any) -> None:
        if follow.phase == "forward":
            follow.depth -= 1
            follow.returned += 1

    for module in model.modules():
        if module is not model:
            handles.append(module.register_forward_pre_hook(enter))
            handles.append(module.register_forward_hook(leave))

    def blocks_done(grad: Any) -> None:
        follow.after_blocks = True
        follow.grads_at_blocks_done = follow.grads

    def block_enter(index: int) -> Any:
        def hook(module: Any, args: Any) -> None:
            if follow.phase == "forward":
                block_forward[index] = float(follow.held)
                if index == 0:  # its input's gradient: the blocks' backward is over
                    inputs = [t for t in _tensors(args) if t.requires_grad]
                    if inputs:
                        inputs[0].register_hook(blocks_done)

        return hook

    def block_leave(index: int) -> Any:
        def started(grad: Any) -> None:
            block_backward_start[index] = float(follow.held)
            if index == len(blocks) - 1:
                grads_before_blocks.append(float(follow.grads))

        def hook(module: Any, args: Any, output: Any) -> None:
            if follow.phase != "forward":
                return  # a checkpointed block's recomputation
            if index == len(blocks) - 1:
                blocks_high.append(float(follow.forward_high))
            outs = [t for t in _tensors(output) if t.requires_grad]
            if outs:
                outs[0].register_hook(started)

        return hook

    for index, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(block_enter(index)))
        handles.append(block.register_forward_hook(block_leave(index)))
    for param in model.parameters():
        if param.requires_grad:
            handles.append(param.register_post_accumulate_grad_hook(lambda p: follow.store(p.grad)))
    try:
        with (
            quiet_transformers(),
            _no_token_value_checks(),
            _kernel_mode(device, autocast_dtype),
            _mode(follow),
        ):
            # As the recipes do (``loss = model(**batch).loss``): the output, and with it the
            # logits, is dropped before the backward; what autograd saved stays.
            loss = _loss(model(**inputs))
            follow.phase = "backward"
            loss.backward()
            del loss
            grads_stored = float(follow.grads)
            end = float(follow.held)
    finally:
        for handle in handles:
            handle.remove()
        for param in model.parameters():
            param.grad = None
    # Block i's backward ends where block i-1's starts; the first block's, with the backward.
    starts = [end if s is None else s for s in block_backward_start]
    backward_end = tuple(starts[i - 1] if i > 0 else end for i in range(len(starts)))
    return StepTrace(
        forward_high=float(follow.forward_high),
        forward_point=follow.forward_point,
        backward_high=float(follow.backward_high),
        grads_at_backward_high=float(follow.grads_at_backward_high),
        backward_kept_high=float(follow.backward_kept_high),
        grads_stored=grads_stored,
        block_forward=tuple(block_forward),
        block_backward_end=backward_end,
        forward_blocks_high=blocks_high[-1] if blocks_high else None,
        grads_before_blocks=grads_before_blocks[0] if grads_before_blocks else None,
        after_blocks_high=None
        if follow.after_blocks_high is None
        else float(follow.after_blocks_high),
        params_stored_after_blocks=follow.stored_after_blocks if blocks else None,
        batch=batch_bytes,
        micro_batch=micro_batch,
        seq_len=seq_len,
    )


def _loss(output: Any) -> Any:
    """What the backward starts from: the model's loss, or for a head dpkit labels no loss
    for, the sum of its first output that needs a gradient."""
    loss = getattr(output, "loss", None)
    if loss is not None:
        return loss
    first = next(t for t in _tensors(output) if t.requires_grad)
    return first.float().sum()


def step_trace(
    spec: ModelSpec,
    micro_batch: int,
    seq_len: int,
    precision: str,
    checkpointing: bool,
    attention: str = "sdpa",
    device: str = "cuda",
    autocast: bool = False,
) -> StepTrace | None:
    """One step's activation side at ``micro_batch`` x ``seq_len`` (None for a bare
    parameter count, which has no shapes). ``device``: whose kernels
    (:data:`~dpkit.plan.activations.KERNEL_DEVICES`); ``autocast``: the forward under torch
    autocast over fp32 weights (DDP's mixed precision), else with the module in the
    precision's dtype (DeepSpeed, FSDP2)."""
    if not spec.has_shapes:
        return None
    if device not in KERNEL_DEVICES:
        raise ValueError(f"device={device!r}: not one of {', '.join(KERNEL_DEVICES)}")
    key = _TraceKey.of(spec, seq_len, precision, checkpointing, attention, device)
    return _traced_step(key, micro_batch, autocast)


@functools.lru_cache(maxsize=32)
def _traced_step(key: _TraceKey, micro_batch: int, autocast: bool) -> StepTrace:
    import torch

    model = _trace_model(key.spec, key.attention)
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(key.precision)
    autocast_dtype = half if autocast else None
    if half is not None and not autocast:
        model = model.to(half)
    if key.checkpointing:
        # The recomputation in backward runs the same kernels as the forward.
        def contexts() -> tuple[Any, Any]:
            return contextlib.nullcontext(), _kernel_mode(key.device, autocast_dtype)

        with _checkpointed(model, contexts):
            return _run(model, micro_batch, key.seq_len, key.device, autocast_dtype)
    return _run(model, micro_batch, key.seq_len, key.device, autocast_dtype)
