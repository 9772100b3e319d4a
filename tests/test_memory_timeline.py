"""The memory timeline in one process: the points of a step, their bytes, the chart, ``dpkit report``.

A small model of three repeated blocks, one rank, a plain torch optimizer (walked as
DDP's engine walks it). Every expected figure is counted here from the model's own
tensors or written out as arithmetic, never read from dpkit. The 2-process checks of
real DDP, ZeRO-2 and FSDP2 runs are in tests/test_memory_timeline_multiprocess.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dpkit import cli
from dpkit.memory.tracker import MemoryTracker

CPU = SimpleNamespace(process_index=0, device=torch.device("cpu"), log=lambda *a, **k: None)
DIM, BLOCKS, VOCAB, BATCH, SEQ = 32, 3, 50, 4, 8
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(DIM, DIM)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + torch.tanh(self.linear(hidden))


class Stack(torch.nn.Module):
    """An embedding, three blocks in a ModuleList (the layer list), a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = torch.nn.Linear(DIM, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.head(hidden).float().pow(2).mean()


# Parameters, counted by hand: embedding 50 x 32, three Linear(32, 32) with bias, a
# Linear(32, 2) with bias.
PARAMS = VOCAB * DIM + BLOCKS * (DIM * DIM + DIM) + (DIM * 2 + 2)
PARAM_BYTES = 4 * PARAMS  # fp32


def _tracked(steps: int = 1, probe_steps: int = 1) -> tuple[MemoryTracker, Stack]:
    torch.manual_seed(0)
    model = Stack()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tracker = MemoryTracker(
        CPU, model, optimizer, strategy="ddp", precision="fp32", probe_steps=probe_steps
    )
    for step in range(1, steps + 1):
        model(torch.randint(0, VOCAB, (BATCH, SEQ))).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tracker.step_done(step)
    return tracker, model


def _points(row: dict) -> dict[str, dict]:
    return {p["point"]: p for p in row["timeline"]["points"]}


def test_a_step_is_recorded_point_by_point_in_order_with_its_phases():
    tracker, _ = _tracked()
    row = tracker.measure()
    timeline = row["timeline"]
    assert timeline["step"] == 1 and timeline["complete"] is True
    assert timeline["memory_figure"] == "rss"
    names = [p["point"] for p in timeline["points"]]
    # Forward into each block, backward out of each block (block 0's input is the
    # embedding's output, which carries a gradient), then the optimizer's step.
    assert names == [
        "forward_begin",
        "forward block 0", "forward block 1", "forward block 2",
        "forward_end",
        "backward block 2", "backward block 1", "backward block 0",
        "backward_end",
        "optimizer_step_begin", "optimizer_step_end",
    ]  # fmt: skip
    phases = [p["phase"] for p in timeline["points"]]
    assert phases == ["forward"] * 5 + ["backward"] * 4 + ["optimizer"] * 2
    times = [p["t"] for p in timeline["points"]]
    assert times[0] == 0.0 and times == sorted(times)
    assert all(p["memory"] > 0 for p in timeline["points"])  # the RSS, in bytes


def test_the_bytes_at_each_point_are_what_the_step_holds_there():
    tracker, model = _tracked()
    points = _points(tracker.measure())
    # No gradient exists before the backward; after it, every parameter has one (fp32).
    assert points["forward_end"]["grads"] == 0.0
    assert points["backward_end"]["grads"] == PARAM_BYTES
    assert points["optimizer_step_begin"]["grads"] == PARAM_BYTES
    # AdamW creates its state in the first step: two fp32 moments per parameter and a
    # 4-byte step counter per tensor (1 + 3 x 2 + 2 = 9 tensors).
    assert points["optimizer_step_begin"]["optimizer"] == 0.0
    assert points["optimizer_step_end"]["optimizer"] == 2 * PARAM_BYTES + 4 * 9
    assert {p["params"] for p in points.values()} == {PARAM_BYTES}


def test_activations_rise_through_the_forward_and_drain_through_the_backward():
    tracker, _ = _tracked()
    points = _points(tracker.measure())
    held = [points[f"forward block {i}"]["activations"] for i in range(BLOCKS)]
    held.append(points["forward_end"]["activations"])
    assert held == sorted(held) and held[0] < held[-1]
    draining = [points[f"backward block {i}"]["activations"] for i in (2, 1, 0)]
    assert draining == sorted(draining, reverse=True)
    # Each block saves at least its input (4 x 8 x 32 fp32 = 4 KiB) and tanh's output.
    per_block = BATCH * SEQ * DIM * 4
    assert points["forward block 2"]["activations"] - points["forward block 1"]["activations"] >= (
        2 * per_block
    )
    assert points["backward_end"]["activations"] == 0.0
    assert points["optimizer_step_end"]["activations"] == 0.0


def test_the_timeline_peak_is_the_reports_worst_moment():
    tracker, _ = _tracked()
    row = tracker.measure()
    categories = ("params", "grads", "optimizer", "master", "buffers")
    totals = [sum(p[c] for c in categories) for p in row["timeline"]["points"]]
    assert max(totals) == row["largest_moment"]["total"]
    # By hand: parameters, gradients and AdamW's two moments and nine step counters.
    assert max(totals) == 4 * PARAM_BYTES + 4 * 9


def test_the_last_probed_step_is_kept_and_later_steps_add_nothing():
    tracker, _ = _tracked(steps=3, probe_steps=2)
    row = tracker.measure()
    assert row["timeline"]["step"] == 2
    # Its times start again from its own first point.
    assert row["timeline"]["points"][0]["t"] == 0.0
    points = _points(row)
    # Step 2 starts with AdamW's state in place (created in step 1).
    assert points["forward_begin"]["optimizer"] == 2 * PARAM_BYTES + 4 * 9
    seconds = row["probe_seconds"]
    assert tracker.measure()["probe_seconds"] == seconds  # nothing walks after step 2


def test_evaluation_forwards_are_not_part_of_the_step():
    tracker, model = _tracked()
    before = tracker.measure()["timeline"]
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (BATCH, SEQ)))
    assert tracker.measure()["timeline"] == before


def test_without_a_timeline_the_report_has_none():
    torch.manual_seed(0)
    model = Stack()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tracker = MemoryTracker(CPU, model, optimizer, strategy="ddp", precision="fp32", probe_steps=0)
    model(torch.randint(0, VOCAB, (BATCH, SEQ))).backward()
    optimizer.step()
    assert "timeline" not in tracker.measure()


# ---- the chart and dpkit report -------------------------------------------------------------


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A finished run's folder: the tracker's own report and chart."""
    out = tmp_path_factory.mktemp("timeline-run")
    tracker, _ = _tracked()
    tracker.write_report(out / "memory_report.json", step=1)
    return out


def _is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 10_000


def test_the_report_is_written_with_its_chart_beside_it(run_dir):
    report = json.loads((run_dir / "memory_report.json").read_text())
    assert report["schema"] == 2
    assert report["ranks"][0]["timeline"]["points"]
    assert _is_png(run_dir / "memory_timeline.png")


def test_dpkit_report_draws_the_chart_from_the_report_alone(run_dir, tmp_path, capsys):
    only = tmp_path / "copied"
    only.mkdir()
    (only / "memory_report.json").write_bytes((run_dir / "memory_report.json").read_bytes())
    assert cli.main(["report", str(only)]) == 0
    assert _is_png(only / "memory_timeline.png")
    out, err = capsys.readouterr()
    assert f"wrote {only / 'memory_timeline.png'}" in out
    assert "rank 0: 11 points" in out
    # No run_config.json here: drawn without dpkit plan's line, and said so.
    assert "drawn without dpkit plan's line" in err
    elsewhere = tmp_path / "elsewhere.png"
    assert cli.main(["report", str(only), "--output", str(elsewhere), "--no-plan"]) == 0
    assert _is_png(elsewhere)


def _refused(capsys, argv: list[str], message: str) -> None:
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dpkit report: error: "), err
    assert message in lines[0], lines[0]
    assert "Traceback" not in out + err


def test_dpkit_report_refuses_bad_input_in_one_line(run_dir, tmp_path, capsys):
    _refused(capsys, ["report", str(tmp_path / "nowhere")], "no such folder")
    _refused(capsys, ["report", str(tmp_path)], "no memory_report.json")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "memory_report.json").write_text("{not json")
    _refused(capsys, ["report", str(broken)], "not valid JSON")
    # A report of the version before the timeline (schema 1: rows without one).
    old = tmp_path / "old"
    old.mkdir()
    report = json.loads((run_dir / "memory_report.json").read_text())
    report["schema"] = 1
    for row in report["ranks"]:
        del row["timeline"]
    (old / "memory_report.json").write_text(json.dumps(report))
    _refused(capsys, ["report", str(old)], "no memory timeline (report schema 1")
    assert not (old / "memory_timeline.png").exists()
    _refused(
        capsys,
        ["report", str(run_dir), "--output", str(tmp_path / "no" / "such" / "t.png")],
        "--output=",
    )


def test_dpkit_report_without_run_dir_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["report"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "RUN_DIR" in err[0]


# ---- the bench's side-by-side chart ----------------------------------------------------------


def _two_rank_report(run_dir: Path, larger_rank: int) -> dict:
    """The tracker's one-rank report made two ranks, ``larger_rank`` holding 1 MiB more
    gradients at every point (so its worst moment is the larger)."""
    report = json.loads((run_dir / "memory_report.json").read_text())
    (row,) = report["ranks"]
    rows = []
    for rank in (0, 1):
        copy = json.loads(json.dumps(row))
        copy["rank"] = rank
        extra = 2.0**20 if rank == larger_rank else 0.0
        for point in copy["timeline"]["points"]:
            point["grads"] += extra
        copy["largest_moment"]["total"] += extra
        rows.append(copy)
    report["ranks"] = rows
    report["world_size"] = 2
    return report


@pytest.mark.parametrize("larger_rank", [0, 1])
def test_the_bench_takes_the_timeline_of_the_rank_that_peaks_highest(run_dir, larger_rank):
    from dpkit.bench.results import summarize_memory

    report = _two_rank_report(run_dir, larger_rank)
    for row in report["ranks"]:  # the runtime's own bytes at the peak, told apart per rank
        row["peak"] = {**(row.get("peak") or {}), "rss_runtime_at_track": 1000.0 + row["rank"]}
    memory = summarize_memory(report)
    assert memory["timeline_rank"] == larger_rank
    assert memory["runtime_bytes"] == 1000.0 + larger_rank
    points = memory["timeline"]["points"]
    first = json.loads((run_dir / "memory_report.json").read_text())["ranks"][0]["timeline"]
    assert points[0]["grads"] == first["points"][0]["grads"] + 2.0**20


def test_a_bench_report_without_timelines_summarises_without_one(run_dir):
    from dpkit.bench.chart import has_timelines
    from dpkit.bench.results import summarize_memory

    report = _two_rank_report(run_dir, 1)
    for row in report["ranks"]:
        del row["timeline"]
    memory = summarize_memory(report)
    assert memory["timeline"] is None and memory["timeline_rank"] is None
    assert memory["runtime_bytes"] is None
    results = {"strategies": ["ddp"], "runs": {"ddp": {"memory": memory}}}
    assert not has_timelines(results)


def test_the_bench_draws_every_strategys_timeline_side_by_side(run_dir, tmp_path):
    from dpkit.bench.chart import has_timelines, write_timelines_chart
    from dpkit.bench.results import summarize_memory

    memory = summarize_memory(_two_rank_report(run_dir, 1))
    names = ["ddp", "zero2", "fsdp2_full_shard"]
    results = {
        "strategies": names,
        "runs": {name: {"memory": memory} for name in names},
        "comparison": {
            name: {"predicted_model_states": 4 * PARAM_BYTES, "plan_model_states": 4 * PARAM_BYTES}
            for name in names
        },
        "settings": {"nproc": 2},
        "num_params": PARAMS,
        "precision": "fp32",
    }
    assert has_timelines(results)
    path = tmp_path / "timelines.png"
    write_timelines_chart(results, path)
    assert _is_png(path)
