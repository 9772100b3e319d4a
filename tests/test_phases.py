"""dpkit.StepPhases: where a step's time goes, from hooks on the prepared model and optimizer.

In-process: one process, and a real one-rank gloo DDP whose forward, backward and
allreduce take known times (the phases of real 2-process DDP, ZeRO and Trainer runs are
checked on the classification bench's launches, tests/test_bench_trainer.py)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from dpkit.core.walk import inner_torch_optimizer
from dpkit.engines.ddp.timing import ddp_timing
from dpkit.train.phases import PHASES, StepPhases

# Sleeps, in seconds, one per phase, all different; SLACK bounds what else a phase may
# hold (real work of a tiny model, a busy machine's scheduling delay) and is below the
# smallest sleep, so that a sleep counted in the wrong phase fails.
DATA, FORWARD, SYNC, AFTER = 0.15, 0.2, 0.25, 0.3
SLACK = 0.12


class _Slow(torch.nn.Module):
    """A linear layer whose forward takes at least ``delay`` seconds."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.delay = delay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay)
        return self.linear(x)


def _step(model, optimizer, data_delay=0.0, sync_delay=0.0, after_delay=0.0, micro_batches=1):
    for _ in range(micro_batches):
        time.sleep(data_delay)
        model(torch.ones(2, 4)).sum().backward()
    time.sleep(sync_delay)  # after the backward pass, before the update: as clipping would
    optimizer.step()
    optimizer.zero_grad()
    time.sleep(after_delay)


def test_each_gap_goes_to_its_phase_and_the_phases_add_up_to_the_step():
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = _Slow(0.0)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    assert inner_torch_optimizer(optimizer) is optimizer.optimizer  # under accelerate's wrapper
    _step(model, optimizer)  # AdamW's first step makes its state: not part of the test
    model.delay = FORWARD
    phases = StepPhases(model, optimizer)
    started = time.perf_counter()
    _step(model, optimizer, data_delay=DATA, sync_delay=SYNC, after_delay=AFTER)
    # An evaluation's forward between two steps is not the step's forward.
    model.eval()
    with torch.no_grad():
        model(torch.ones(2, 4))
    model.train()
    taken = phases.take()
    wall = time.perf_counter() - started
    assert set(taken) == set(PHASES)
    assert sum(taken.values()) == pytest.approx(wall, abs=2e-3)
    # Each sleep lands in its phase; real work (a 4 x 1 layer) is far below SLACK, so a
    # gap misattributed would be off by a whole sleep.
    assert DATA <= taken["data_s"] < DATA + SLACK
    assert FORWARD <= taken["forward_s"] < FORWARD + SLACK
    assert 0 < taken["backward_s"] < SLACK
    assert SYNC <= taken["grad_sync_s"] < SYNC + SLACK
    assert 0 < taken["optimizer_s"] < SLACK
    # after the update: the sleep and the evaluation's forward.
    assert AFTER + FORWARD <= taken["other_s"] < AFTER + FORWARD + SLACK
    # Under accumulation the next micro-batch's loading is data, not backward; each step
    # starts from zero.
    _step(model, optimizer, data_delay=DATA, micro_batches=2)
    taken = phases.take()
    assert 2 * DATA <= taken["data_s"] < 2 * DATA + SLACK
    assert 2 * FORWARD <= taken["forward_s"] < 2 * FORWARD + SLACK
    assert taken["backward_s"] < SLACK
    phases.remove()
    _step(model, optimizer)
    assert phases.take()["forward_s"] == 0.0  # no hooks left
    assert ddp_timing(model) is None  # one process: no DDP wrapper


def test_a_forward_without_an_output_to_hook_counts_backward_and_sync_together():
    """A model whose output holds no tensor requiring grad (the loss computed from a side
    channel): no backward events, so the time from the forward to the update is backward."""

    class SideChannel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> dict:
            self.loss = self.linear(x).sum()
            return {"n": x.shape[0]}

    model = SideChannel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert inner_torch_optimizer(object()) is None
    phases = StepPhases(model, optimizer)
    model(torch.ones(2, 4))
    model.loss.backward()
    time.sleep(SYNC)
    optimizer.step()
    taken = phases.take()
    assert taken["grad_sync_s"] == 0.0
    assert SYNC <= taken["backward_s"] < SYNC + SLACK
    assert taken["optimizer_s"] > 0


# --- DDP's own timing, on a real DDP of one rank -----------------------------------------

# The DDP step below: its forward sleeps FORWARD, its backward BACKWARD (between the
# gradients of its two layers), and every bucket's allreduce completes COMM after DDP
# launches it. All three differ from each other and from 1 s, so a figure read in the
# wrong unit (ms or us taken as ns: 1e3 or 1e6 too large), from the wrong key, or with
# the overlap added instead of taken off, lands outside its window.
BACKWARD, COMM = 0.35, 0.45


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward takes at least BACKWARD seconds: backward compute DDP
    times between the second layer's gradients and the first's."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(BACKWARD)
        return grad


class _TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(4, 4)
        self.second = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(FORWARD)
        return self.second(_SlowBackward.apply(self.first(x)))


def _allreduce_after_comm(state, bucket):
    """DDP's communication hook: a world of one has nothing to add, so the bucket is its
    own result, delivered COMM seconds after DDP hands it over (an allreduce in flight
    for COMM, as a slow network's would be)."""
    done = torch.futures.Future()
    threading.Timer(COMM, done.set_result, args=(bucket.buffer(),)).start()
    return done


def test_ddp_timing_is_in_seconds_of_the_step_it_timed(one_rank_group):
    """``ddp_timing`` against the known sleeps and the test's own clock.

    DDP's logger records an iteration's figures (nanoseconds) when the next forward
    starts, for its first 10 iterations and every 100th after, and reports their running
    averages. Three steps here: the first two are recorded. The first iteration reduces
    every gradient in one bucket, once the backward is done; from the second DDP has
    rebuilt its buckets to the gradients' order (bucket_cap_mb below one parameter: one
    bucket each), so the second layer's allreduce starts before the BACKWARD sleep. Per
    iteration, allreduce from its first start to its last end: COMM, then BACKWARD + COMM
    (averaged: COMM + BACKWARD / 2); exposed (not overlapped with backward compute): COMM
    both times.
    """
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(_TwoLayers(), bucket_cap_mb=1e-5)
    model.register_comm_hook(None, _allreduce_after_comm)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    phases = StepPhases(model, optimizer)
    walls = []
    for step in range(3):
        started = time.perf_counter()
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        walls.append(time.perf_counter() - started)
        taken = phases.take()
        if step == 0:  # recorded when the next forward starts: nothing yet
            assert ddp_timing(model) is None
        # dpkit's own clock on the same step: DDP's wait for the allreduce in flight is
        # grad_sync, after the backward (its callback runs before DDP's, which waits).
        # The last bucket's allreduce starts a little before the backward's end (measured
        # 0.446 s of grad_sync once): its window is COMM +- SLACK.
        assert FORWARD <= taken["forward_s"] < FORWARD + SLACK, (step, taken)
        assert BACKWARD <= taken["backward_s"] < BACKWARD + SLACK, (step, taken)
        assert abs(taken["grad_sync_s"] - COMM) < SLACK, (step, taken)
    timing = ddp_timing(model)
    assert set(timing) == {
        "forward_compute_s",
        "backward_compute_s",
        "backward_comm_s",
        "backward_comm_exposed_s",
    }
    # Measured (2 CPUs, loaded): 0.201-0.210, 0.352-0.358, 0.627-0.634, 0.450-0.456 s.
    assert FORWARD <= timing["forward_compute_s"] < FORWARD + SLACK, timing
    assert BACKWARD <= timing["backward_compute_s"] < BACKWARD + SLACK, timing
    both = COMM + BACKWARD / 2
    assert both <= timing["backward_comm_s"] < both + SLACK, timing
    # The overlap added instead of taken off would read COMM + BACKWARD: beyond SLACK.
    assert abs(timing["backward_comm_exposed_s"] - COMM) < SLACK, timing
    # The scale against the test's own clock: each recorded step's wall time holds its
    # forward, its backward compute and the exposed allreduce, one after the other, so
    # their averages fit in the two recorded steps' mean wall time.
    in_step = (
        timing["forward_compute_s"]
        + timing["backward_compute_s"]
        + timing["backward_comm_exposed_s"]
    )
    assert in_step <= (walls[0] + walls[1]) / 2, (timing, walls)
    # DDP's figures are integer nanoseconds (torch's c10d logger): the conversion exact.
    raw = model._get_ddp_logging_data()
    assert timing["forward_compute_s"] == raw["avg_forward_compute_time"] / 1e9
    assert timing["backward_compute_s"] == raw["avg_backward_compute_time"] / 1e9
    assert timing["backward_comm_s"] == raw["avg_backward_comm_time"] / 1e9
    overlap = raw["avg_backward_compute_comm_overlap_time"] / 1e9
    assert timing["backward_comm_exposed_s"] == timing["backward_comm_s"] - overlap
    phases.remove()


# --- what the backward starts from ---------------------------------------------------------


class _Outputs(torch.nn.Module):
    """A linear layer whose forward returns its output in one of the shapes models use."""

    def __init__(self, shape: str) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.shape = shape

    def forward(self, x: torch.Tensor):
        out = self.linear(x).sum()
        frozen = torch.zeros(1)  # holds no grad: never what the backward starts from
        if self.shape == "tensor":
            return out
        if self.shape == "tuple":
            return (frozen, out)
        if self.shape == "list":
            return [frozen, out]
        if self.shape == "dict":
            return {"frozen": frozen, "logits": out}
        if self.shape == "attribute":  # neither a tensor nor a container: its .loss
            from types import SimpleNamespace

            return SimpleNamespace(logits=frozen, loss=out)
        from transformers.modeling_outputs import SequenceClassifierOutput

        return SequenceClassifierOutput(loss=out, logits=frozen)  # "loss": a ModelOutput


def _loss_of(output) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (list, tuple)):
        return output[1]
    if not isinstance(output, dict):
        return output.loss
    return output["loss"] if "loss" in output else output["logits"]


@pytest.mark.parametrize("shape", ["tensor", "tuple", "list", "dict", "attribute", "model_output"])
def test_the_backward_is_found_from_every_output_shape(shape):
    """The backward's end is found from the output's tensor that needs grad, in any of
    the shapes a model returns: the gap after it, before the update, is grad_sync."""
    model = _Outputs(shape)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    phases = StepPhases(model, optimizer)
    _loss_of(model(torch.ones(2, 4))).backward()
    time.sleep(SYNC)
    optimizer.step()
    taken = phases.take()
    assert SYNC <= taken["grad_sync_s"] < SYNC + SLACK, taken
    assert taken["backward_s"] < SLACK, taken
    # A training-mode forward under no_grad (a probe, a metric) has nothing to hook.
    with torch.no_grad():
        model(torch.ones(2, 4))
    phases.remove()
    phases.remove()  # twice: nothing left to take off


def test_a_loss_computed_after_the_forward_is_backward():
    """The loss computed outside the model, between its forward and the backward call,
    counts as backward (from the forward's end to the backward pass's end)."""
    model = _Outputs("tensor")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    phases = StepPhases(model, optimizer)
    out = model(torch.ones(2, 4))
    time.sleep(SYNC)  # a slow loss function
    out.backward()
    optimizer.step()
    taken = phases.take()
    assert SYNC <= taken["backward_s"] < SYNC + SLACK, taken
    assert taken["grad_sync_s"] < SLACK and taken["other_s"] < SLACK, taken
    phases.remove()


def test_without_an_output_to_hook_accumulated_micro_batches_count_as_backward():
    """No tensor needing grad in the output: no backward events, so the time from one
    micro-batch's forward to the next one's is backward (its backward and the next
    batch's loading together), and from the last forward to the update too."""

    class Counts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> int:
            self.loss = self.linear(x).sum()
            return x.shape[0]

    model = Counts()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    phases = StepPhases(model, optimizer)
    time.sleep(DATA)
    for _ in range(2):
        model(torch.ones(2, 4))
        model.loss.backward()
        time.sleep(SYNC)
    optimizer.step()
    time.sleep(AFTER)
    taken = phases.take()
    assert DATA <= taken["data_s"] < DATA + SLACK, taken
    assert 2 * SYNC <= taken["backward_s"] < 2 * SYNC + SLACK, taken
    assert taken["grad_sync_s"] == 0.0
    assert AFTER <= taken["other_s"] < AFTER + SLACK, taken


def test_a_step_without_an_optimizer_to_hook_counts_the_rest_as_other():
    """``optimizer=None`` (or nothing inside): no update events; after the backward's
    end the step is other_s."""
    model = _Outputs("tensor")
    phases = StepPhases(model, None)
    model(torch.ones(2, 4)).backward()
    time.sleep(AFTER)
    taken = phases.take()
    assert taken["optimizer_s"] == 0.0 and taken["grad_sync_s"] == 0.0
    assert AFTER <= taken["other_s"] < AFTER + SLACK, taken
