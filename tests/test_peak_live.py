"""The live-tensor high-water of a measured step (dpkit.memory.live), checked three ways.

(a) Against torch's own ``MemTracker`` (torch.distributed._tools.mem_tracker), active on
the same step: both follow every storage an operator makes, from the model's parameters,
buffers and optimizer state on; their high-waters agree within 2%.
(b) A model whose forward (or loss) makes a temporary of a size worked out here: the
high-water is that temporary plus what is alive beside it, counted by hand from the
operators the forward runs, and the point of the step is named.
(c) Real 2-process launches: every rank's ``peak_live`` in memory_report.json, its
categories adding up to it and no smaller than what the probes' walks saw together.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from dpkit.memory.tracker import MemoryTracker
from tests.harness import run, torchrun_cmd

CPU = SimpleNamespace(process_index=0, device=torch.device("cpu"))
FP32 = 4  # bytes per element


def _measured_step(model, optimizer, make_batch, loss_of) -> dict:
    """One training step under dpkit's tracker (created just before it, as Run.prepare
    does): its peak_live figures."""
    tracker = MemoryTracker(CPU, model, optimizer, strategy="ddp", precision="fp32")
    try:
        loss = loss_of(model, make_batch())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tracker.step_done(1)
        return tracker.measure()["peak_live"]
    finally:
        tracker.stop()


def test_the_high_water_is_torchs_memtracker_on_the_same_step():
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import AutoModelForSequenceClassification

    from dpkit.models import local_model_path

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(
        local_model_path("minilm"), num_labels=2
    )
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def make_batch():
        ids = torch.randint(0, 1000, (4, 48))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "labels": torch.tensor([0, 1, 0, 1])}  # fmt: skip

    def loss_of(m, batch):
        return m(**batch).loss

    # A first step makes Adam's moments: the measured step then holds what every later
    # step holds, and MemTracker counts them from the start (track_external).
    loss_of(model, make_batch()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    theirs = MemTracker()
    theirs.track_external(model, optimizer)
    with theirs:  # outside ours: both see every operator of the step
        ours = _measured_step(model, optimizer, make_batch, loss_of)
    their_peak = theirs.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    print(f"dpkit {ours['bytes']:.0f} B, MemTracker {their_peak} B at {ours['point']}")
    assert abs(ours["bytes"] - their_peak) <= 0.02 * their_peak
    assert sum(ours["by_category"].values()) == ours["bytes"]
    params = sum(p.numel() * FP32 for p in model.parameters())
    assert ours["by_category"]["params"] == params
    assert ours["by_category"]["optimizer"] >= 2 * params  # both moments, all step long


def test_fsdp2s_regathered_parameters_are_followed_as_memtracker_follows_them(one_rank_group):
    """FSDP2 frees and refills each unit's whole parameters with ``UntypedStorage.resize_``
    (no operator) and runs its ops on DTensors: a one-rank mesh in this process."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[
            torch.nn.Sequential(
                torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128)
            )
            for _ in range(3)
        ]
    )
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        model(torch.randn(16, 128)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    theirs = MemTracker()
    theirs.track_external(model, optimizer)
    with theirs:
        tracker = MemoryTracker(
            CPU, model, optimizer, strategy="fsdp2_full_shard", precision="fp32"
        )
        try:
            step()
            tracker.step_done(1)
            ours = tracker.measure()["peak_live"]
        finally:
            tracker.stop()
    their_peak = theirs.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert abs(ours["bytes"] - their_peak) <= 0.02 * their_peak
    assert sum(ours["by_category"].values()) == ours["bytes"]


B, D = 8, 64  # batch, width of the one Linear (no bias)
K_BIG, K_SMALL = 2**22, 2**20  # elements of the deliberate temporary


class _Scratch(torch.nn.Module):
    """Adds the sum of a fresh buffer of ``k`` ones: a temporary of 4k bytes."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        scratch = torch.ones(self.k)
        return h + scratch.sum()


class _InForward(torch.nn.Module):
    def __init__(self, k: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(D, D, bias=False)
        self.scratch = _Scratch(k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scratch(self.lin(x)).pow(2).mean()


class _InLoss(torch.nn.Module):
    """The temporary made by the loss, in the outermost forward after its last submodule."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(D, D, bias=False)
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        scratch = torch.ones(self.k)
        return h.pow(2).mean() + scratch.sum()


def _peak_of(model_class, k: int) -> dict:
    torch.manual_seed(0)
    model = model_class(k)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return _measured_step(model, optimizer, lambda: torch.randn(B, D), lambda m, x: m(x))


@pytest.mark.parametrize("model_class", [_InForward, _InLoss])
def test_a_deliberate_temporary_is_the_high_water_where_it_is_made(model_class):
    weight, x, h = D * D * FP32, B * D * FP32, B * D * FP32
    big = _peak_of(model_class, K_BIG)
    small = _peak_of(model_class, K_SMALL)
    # The high-water moves by exactly the difference in the temporary.
    assert big["bytes"] - small["bytes"] == (K_BIG - K_SMALL) * FP32
    if model_class is _InForward:
        # At the add in _Scratch: the weight, the batch x (saved by the matmul), h = lin(x),
        # the ones, their sum (one float) and the add's output h + sum.
        expected = weight + x + h + K_BIG * FP32 + FP32 + B * D * FP32
        assert (big["point"], big["module"]) == ("forward", "scratch")
        assert big["op"].startswith("aten.add")
        saved = x
    else:
        # At the mean: the weight, x, h (saved by pow), the ones, h**2 and its mean; the
        # ones' sum comes after h**2 is freed.
        expected = weight + x + h + K_BIG * FP32 + B * D * FP32 + FP32
        assert big["point"] == "loss"
        assert big["op"].startswith("aten.mean")
        saved = x + h
    assert big["bytes"] == expected
    split = big["by_category"]
    assert split["params"] == weight
    assert split["activations"] == saved
    assert split["temporary"] == expected - weight - saved
    assert split["grads"] == split["optimizer"] == 0  # step 1: neither exists yet then
    assert big["at_step_start"] == weight + x


def test_frees_are_followed_so_a_loop_of_temporaries_is_one_at_a_time():
    """Ten temporaries of 4k bytes made one after another: the high-water holds one."""

    class Loop(torch.nn.Module):
        def __init__(self, k: int) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(D, D, bias=False)
            self.k = k

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            total = self.lin(x).sum()
            for _ in range(10):
                total = total + torch.ones(self.k).sum()
            return total

    peak = _peak_of(Loop, K_BIG)
    assert K_BIG * FP32 < peak["bytes"] < 2 * K_BIG * FP32


# MiniLM, 2 optimizer steps of 4 x 32 tokens per rank, nothing saved.
TINY_RUN = [
    "--max-steps", "2", "--micro-batch-size", "4", "--max-seq-length", "32",
    "--max-train-samples", "16", "--max-eval-samples", "8", "--eval-steps", "0",
    "--no-save-model", "--no-save-checkpoints",
]  # fmt: skip


@pytest.mark.multiprocess
def test_bytes_no_walk_reaches_count_from_the_start_and_once_when_they_show_up():
    """DDP's reducer allocates its buckets when the model is wrapped and no walk can reach
    them before the first backward (.grad is still None): they are held from the step's
    start, and their storage shows up only as the out= argument of the reducer's first
    write. Counted once: from the start, not again at that write."""
    from dpkit.core.walk import Unreached
    from dpkit.memory.live import LiveTensors

    bucket = torch.zeros(1000)  # 4,000 bytes made before the step, unknown to the tracker
    gradient = torch.ones(1000)
    other, ones = torch.zeros(10), torch.ones(10)  # made before the step too
    live = LiveTensors(torch.device("cpu"))
    live.hold_unreached(Unreached("grads", 1000 * FP32))
    with live:
        assert live.total == 4000
        torch.mul(gradient, 0.5, out=bucket)  # the first write: no new bytes
        assert live.total == 4000
        doubled = bucket * 2  # a new 4,000-byte tensor
        assert live.total == 8000 and live.peak == 8000
        # A second pre-existing storage written in place, once the pool is spent, is new
        # to the count (the tracker could not know it was there).
        torch.mul(ones, 2.0, out=other)
        assert live.total == 8000 + 10 * FP32
        del doubled
    split = live.breakdown()
    assert split["grads"] == 4000, split  # the bucket, by the pool's category
    assert live.peak == 8040


def test_unreached_bytes_their_holder_lets_go_leave_the_count():
    """DDP rebuilds its buckets in the second step's forward: the old ones, counted by size
    from the step's start, are freed by C++ code the tracker does not see; the holder's
    word (``still_held``) takes them out, and the new buckets count as they are made."""
    from dpkit.core.walk import Unreached
    from dpkit.memory.live import LiveTensors

    rebuilt = []
    live = LiveTensors(torch.device("cpu"))
    live.hold_unreached(Unreached("grads", 4000.0, still_held=lambda: not rebuilt))
    with live:
        live.drop_released()
        assert live.total == 4000  # still held
        rebuilt.append(True)
        live.drop_released()
        new_bucket = torch.zeros(1000)  # the rebuilt bucket, made in the window
        assert live.total == 4000, "the old buckets counted beside the new ones"
        del new_bucket
    assert live.peak == 4000


def test_a_two_process_run_reports_each_ranks_live_high_water(tmp_path):
    out = tmp_path / "run"
    launch = run(torchrun_cmd(2, *TINY_RUN, "--output-dir", str(out)), out)
    launch.check()
    report = json.loads((out / "memory_report.json").read_text())
    assert [row["rank"] for row in report["ranks"]] == [0, 1]
    for row in report["ranks"]:
        peak = row["peak_live"]
        assert peak["step"] == 1
        assert peak["point"] in (
            "forward", "loss", "backward", "gradient reduction", "optimizer step", "after update"
        )  # fmt: skip
        assert sum(peak["by_category"].values()) == peak["bytes"]
        # The parameters are alive all step; every counted tensor at the probes' worst
        # point was alive at one moment, which the high-water cannot be below.
        assert peak["by_category"]["params"] == row["params"]
        assert peak["bytes"] >= row["largest_moment"]["total"]
        assert peak["at_step_start"] >= row["params"]
    assert "peak live tensors" in launch.output


def test_the_measured_batch_is_the_token_ids_shape():
    """``peak_live["batch"]``: the first 2-D integer input of the forward (the token ids),
    which ``dpkit plan --against`` predicts the peak for; none for other inputs."""
    from dpkit.memory.live import _batch_shape

    ids = torch.zeros((4, 24), dtype=torch.long)
    assert _batch_shape([torch.ones(3), ids, torch.zeros((2, 2), dtype=torch.long)]) == {
        "micro_batch": 4,
        "seq_len": 24,
    }
    assert _batch_shape([torch.ones((4, 24))]) is None
