"""Where an optimizer step's wall time goes on this rank: data, forward, backward, gradient sync, optimizer, the rest.

:class:`StepPhases` times the phases from hooks that cost a clock read each: a forward
pre-hook and hook on the prepared model (DDP's wrapper or DeepSpeed's engine), a hook on
the forward's loss (or first output) tensor that fires when the backward reaches it and
queues a callback for the backward's end, and a step pre-hook and post-hook on the
innermost ``torch.optim.Optimizer`` (under accelerate's and DeepSpeed's wrappers). Each
gap between two consecutive events goes to one phase, so the phases of a step add up to
its wall time:

* ``data_s``: from the previous step's end (or, under accumulation, the previous
  micro-batch's backward) to the forward: loading the batch, and whatever else ran
  between two steps (an evaluation, a checkpoint);
* ``forward_s``: inside the model's forward (training-mode forwards only);
* ``backward_s``: the autograd backward, from the forward's end to the end of the
  backward pass: gradient computation, with whatever reduction runs inside it
  (DeepSpeed's bucket reduces; DDP's allreduce overlaps it in the background);
* ``grad_sync_s``: from the end of the backward pass to the update: the wait for the
  gradient reduction still in flight (DDP's allreduce finishing; ZeRO's last buckets and
  its gradient norm), and clipping;
* ``optimizer_s``: the optimizer's own update;
* ``other_s``: from the update to the step's end: ``zero_grad``, the scheduler, the
  recipe's per-step work (loss all-reduce, log), and under ZeRO the all-gather of the
  updated parameter partitions that follows the update; a step whose update was
  skipped puts its post-backward time here too.

A forward whose output holds no tensor that requires grad (a loss computed outside the
model from no output of it) gets no backward events: its backward and gradient sync then
count as ``backward_s``.

DDP also times itself (its logger, sampled over its first 10 iterations and every
100th): :func:`ddp_timing` reads those averages, which split the backward into compute
and the allreduce time not hidden behind it.
"""

from __future__ import annotations

import time
from typing import Any

PHASES = ("data_s", "forward_s", "backward_s", "grad_sync_s", "optimizer_s", "other_s")

# (previous event, this event) -> the phase the gap between them belongs to; any other
# pair is other_s.
_GAP_PHASE = {
    ("step_end", "forward_start"): "data_s",
    ("backward_end", "forward_start"): "data_s",  # the next micro-batch, under accumulation
    ("forward_start", "forward_end"): "forward_s",
    ("forward_end", "backward_start"): "backward_s",
    ("backward_start", "backward_end"): "backward_s",
    ("backward_end", "update_start"): "grad_sync_s",
    ("update_start", "update_end"): "optimizer_s",
    # No backward events (no output tensor to hook): backward and sync as one.
    ("forward_end", "forward_start"): "backward_s",
    ("forward_end", "update_start"): "backward_s",
}


def backward_root(output: Any) -> Any:
    """The tensor of a forward's output the backward starts from or reaches first: the
    output itself, its ``loss`` (transformers' outputs), else its first tensor that
    requires grad; None if there is none."""
    import torch

    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return loss
    if isinstance(output, dict):  # transformers' ModelOutput is one
        values = list(output.values())
    elif isinstance(output, (list, tuple)):
        values = list(output)
    else:
        return None
    return next(
        (v for v in values if isinstance(v, torch.Tensor) and v.requires_grad),
        None,
    )


class StepPhases:
    """Per-step phase times of this rank (see the module docstring); :meth:`take` at the end of
    every optimizer step returns that step's and starts the next."""

    def __init__(self, model: Any, optimizer: Any) -> None:
        """
        Args:
            model: the prepared model (hooks go on the wrapper, so DDP's and the engine's
                own work in forward counts as forward).
            optimizer: the prepared optimizer; the hooks go on the ``torch.optim.Optimizer``
                inside it (:func:`dpkit.core.walk.inner_torch_optimizer`). None, or none
                inside: no ``optimizer_s`` (the time from the last forward on counts in ``other_s``).
        """
        self.model = model
        self._totals = dict.fromkeys(PHASES, 0.0)
        self._last_event = "step_end"
        self._last_time = time.perf_counter()
        self._handles = [
            model.register_forward_pre_hook(lambda module, args: self._event("forward_start")),
            model.register_forward_hook(self._forward_end),
        ]
        from dpkit.core.walk import inner_torch_optimizer

        inner = inner_torch_optimizer(optimizer)
        if inner is not None:
            self._handles += [
                inner.register_step_pre_hook(lambda *_: self._event("update_start")),
                inner.register_step_post_hook(lambda *_: self._event("update_end")),
            ]

    def _forward_end(self, module: Any, args: Any, output: Any) -> None:
        self._event("forward_end")
        if not self.model.training:
            return
        root = backward_root(output)
        if root is not None:
            root.register_hook(self._backward_started)

    def _backward_started(self, grad: Any) -> None:
        import torch

        self._event("backward_start")
        # Final callbacks run in order once the backward pass is done, this one first:
        # before DDP's (queued when its last bucket is ready), which waits for the
        # allreduce still in flight; that wait then falls in grad_sync_s.
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: self._event("backward_end")
        )

    def _event(self, event: str) -> None:
        if event.startswith("forward") and not self.model.training:
            return  # an evaluation's forwards are not the step's
        now = time.perf_counter()
        phase = _GAP_PHASE.get((self._last_event, event), "other_s")
        self._totals[phase] += now - self._last_time
        self._last_event, self._last_time = event, now

    def take(self) -> dict[str, float]:
        """This step's phase times in seconds (they add up to the wall time since the previous
        :meth:`take`, or since this clock was made); call at the end of every optimizer step."""
        self._event("step_end")
        taken, self._totals = self._totals, dict.fromkeys(PHASES, 0.0)
        return taken

    def remove(self) -> None:
        """Take the hooks off."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
