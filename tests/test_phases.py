"""dpkit.StepPhases: where a step's time goes, from hooks on the prepared model and optimizer.

In-process and single-process (the phases of real 2-process DDP, ZeRO and Trainer runs
are checked on the classification bench's launches, tests/test_bench_trainer.py)."""

from __future__ import annotations

import time

import pytest
import torch

from dpkit.memory.walk import inner_torch_optimizer
from dpkit.train.phases import PHASES, StepPhases, ddp_timing

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
