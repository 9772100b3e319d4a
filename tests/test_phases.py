"""dpkit.StepPhases: where a step's time goes, from hooks on the prepared model and optimizer.

In-process and single-process (the phases of real 2-process DDP, ZeRO and Trainer runs
are checked on the classification bench's launches, tests/test_bench_trainer.py)."""

from __future__ import annotations

import time

import pytest
import torch

from dpkit.train.phases import PHASES, StepPhases, ddp_timing, torch_optimizer


class _Slow(torch.nn.Module):
    """A linear layer whose forward takes at least ``delay`` seconds."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.delay = delay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay)
        return self.linear(x)


def _step(model, optimizer, data_delay=0.0, update_delay=0.0, after_delay=0.0):
    time.sleep(data_delay)
    model(torch.ones(2, 4)).sum().backward()
    time.sleep(update_delay)  # counts as backward: after the forward, before the update
    optimizer.step()
    optimizer.zero_grad()
    time.sleep(after_delay)


def test_each_gap_goes_to_its_phase_and_the_phases_add_up_to_the_step():
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = _Slow(0.05)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    assert torch_optimizer(optimizer) is optimizer.optimizer  # under accelerate's wrapper
    phases = StepPhases(model, optimizer)
    started = time.perf_counter()
    _step(model, optimizer, data_delay=0.03, update_delay=0.04, after_delay=0.02)
    # An evaluation's forward between two steps is not the step's forward.
    model.eval()
    with torch.no_grad():
        model(torch.ones(2, 4))
    model.train()
    taken = phases.take()
    wall = time.perf_counter() - started
    assert set(taken) == set(PHASES)
    assert sum(taken.values()) == pytest.approx(wall, abs=2e-3)
    assert taken["data_s"] == pytest.approx(0.03, abs=0.02)
    assert taken["forward_s"] == pytest.approx(0.05, abs=0.02)
    assert taken["backward_s"] == pytest.approx(0.04, abs=0.02)
    assert 0 < taken["optimizer_s"] < 0.02
    # after the update: the sleep and the evaluation's forward (0.05 s).
    assert taken["other_s"] == pytest.approx(0.07, abs=0.03)
    # The next step starts from zero.
    _step(model, optimizer)
    assert phases.take()["forward_s"] == pytest.approx(0.05, abs=0.02)
    phases.remove()
    _step(model, optimizer, data_delay=0.01)
    assert phases.take()["forward_s"] == 0.0  # no hooks left
    assert ddp_timing(model) is None  # one process: no DDP wrapper


def test_without_a_torch_optimizer_the_time_after_the_forward_is_other():
    model = _Slow(0.0)
    assert torch_optimizer(object()) is None
    phases = StepPhases(model, None)
    model(torch.ones(2, 4)).sum().backward()
    time.sleep(0.02)
    taken = phases.take()
    assert taken["optimizer_s"] == 0.0 and taken["backward_s"] == 0.0
    assert taken["other_s"] >= 0.02
