"""The memory timeline of real 2-process runs, against facts known without dpkit.

The runs are the session's shared launches, never launched again here: the recipe under
DDP (``accelerate launch --multi_gpu``) and ZeRO-2 (``deepspeed``) from
tests/recipe_runs.py, FSDP2 shard-grad-op from tests/checkpoint_runs.py. All fine-tune
MiniLM (``sentence-transformers/all-MiniLM-L6-v2`` with a 2-class head) in fp32 with
AdamW on 2 CPU processes; the memory probes (and so the timeline) run in step 1.

MiniLM with its classification head has 22,713,986 trainable parameters: the
embeddings 30,522 x 384 (words) + 512 x 384 (positions) + 2 x 384 (token types) +
2 x 384 (LayerNorm); six layers of 4 x (384 x 384 + 384) (query, key, value, attention
output) + 2 x 384 (LayerNorm) + 384 x 1,536 + 1,536 + 1,536 x 384 + 384 (feed-forward)
+ 2 x 384 (LayerNorm); the pooler 384 x 384 + 384; the classifier 384 x 2 + 2.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.multiprocess

WORDS, POSITIONS, HIDDEN, FFN, LAYERS = 30_522, 512, 384, 1_536, 6
PER_LAYER = (
    4 * (HIDDEN * HIDDEN + HIDDEN) + 2 * HIDDEN + 2 * HIDDEN * FFN + FFN + HIDDEN + 2 * HIDDEN
)
PSI = (
    (WORDS + POSITIONS + 2) * HIDDEN
    + 2 * HIDDEN
    + LAYERS * PER_LAYER
    + HIDDEN * HIDDEN
    + HIDDEN
    + HIDDEN * 2
    + 2
)
WORLD = 2
CATEGORIES = ("params", "grads", "optimizer", "master", "buffers")


def _report(launch) -> dict:
    return json.loads((launch.output_dir / "memory_report.json").read_text())


def _runs(recipe_runs, reference) -> dict[str, dict]:
    return {
        "ddp": _report(recipe_runs("accelerate_multi_gpu")),
        "zero2": _report(recipe_runs("deepspeed_zero2")),
        "fsdp2": _report(reference("fsdp2_shard_grad_op")),
    }


@pytest.fixture(scope="module")
def reports(recipe_runs, reference) -> dict[str, dict]:
    return _runs(recipe_runs, reference)


def _points(row: dict) -> list[dict]:
    return row["timeline"]["points"]


def _first(row: dict, prefix: str) -> dict:
    return next(p for p in _points(row) if p["point"].startswith(prefix))


def test_the_parameter_count_by_hand_is_the_reports():
    assert PSI == 22_713_986


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "fsdp2"])
def test_every_rank_records_the_first_step_through_all_its_phases(reports, strategy):
    report = reports[strategy]
    assert report["schema"] == 2 and len(report["ranks"]) == WORLD
    for row in report["ranks"]:
        timeline = row["timeline"]
        assert timeline["step"] == 1 and timeline["complete"], timeline
        assert timeline["memory_figure"] == "rss"
        names = [p["point"] for p in _points(row)]
        assert names[0] == "forward_begin" and "forward_end" in names
        # MiniLM's six layers (and its embeddings, a block of their own where the model
        # lists them as one), each entered in forward and left in backward.
        assert sum(n.startswith("forward block") for n in names) >= LAYERS
        assert sum(n.startswith("backward block") for n in names) >= LAYERS
        phases = [p["phase"] for p in _points(row)]
        assert {"forward", "backward", "optimizer"} <= set(phases)
        assert phases.index("backward") > max(i for i, p in enumerate(phases) if p == "forward"), (
            "every forward point comes before the first backward point"
        )
        assert phases[-1] == "optimizer"
        times = [p["t"] for p in _points(row)]
        assert times[0] == 0.0 and times == sorted(times)


def test_ddp_holds_the_full_gradients_at_the_optimizer_step(reports):
    for row in reports["ddp"]["ranks"]:
        # 4 bytes (fp32) x every parameter, on every rank: DDP replicates the gradients.
        assert _first(row, "optimizer_step_begin")["grads"] == 4 * PSI


def test_zero2_worst_rank_holds_its_partition_after_reduction(reports):
    rows = reports["zero2"]["ranks"]
    worst = max(rows, key=lambda r: r["model_state_total"])
    # At the inner optimizer's step the reduction is over: the rank holds its fp32
    # gradient partition, 4 bytes x Psi / N, up to DeepSpeed's layout: each group's
    # partition is padded to an alignment of a few elements, and a LayerNorm bias cut by
    # the partition boundary is held whole (384 x 4 = 1,536 bytes). 0.01% of 45 MB is
    # 4.5 KB: room for both, and far below one layer's gradients (7 MB).
    after_reduction = _first(worst, "optimizer_step_begin")["grads"]
    assert after_reduction == pytest.approx(4 * PSI / WORLD, rel=1e-4)
    # Just before, at the step's flat copy, the worst rank held three partitions' worth:
    # its partition share (4 Psi / 2), the flat copy the step makes of it while it is
    # alive (4 Psi / 2 again), and the word embedding's gradient beyond its partition.
    # The word embedding (30,522 x 384 = 11,720,448 elements) is larger than a partition
    # (Psi / 2 = 11,356,993), so at N=2 it crosses the boundary and the rank it ends in
    # holds it whole: about another Psi / 2 outside its own share (all but the part
    # inside, which depends on the groups' order). Measured 2.997 partitions; 1% apart.
    flat_copy = _first(worst, "zero_step_flatten_grads")["grads"]
    assert flat_copy == pytest.approx(3 * 4 * PSI / WORLD, rel=0.01)


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "fsdp2"])
def test_activations_return_to_about_zero_after_backward(reports, strategy):
    checkpointed = reports[strategy]["gradient_checkpointing"]
    # The ZeRO-2 run is the DeepSpeed launcher's form, which checkpoints (tests/recipe_runs.py).
    assert checkpointed is (strategy == "zero2")
    for row in reports[strategy]["ranks"]:
        points = _points(row)
        at_forward_end = _first(row, "forward_end")["activations"]
        # 16 sequences x 32 or 64 tokens x 384 x 4 bytes = 0.75-1.5 MiB per saved hidden
        # state, and each of six layers saves several: tens of MiB at the end of forward;
        # checkpointed, each layer keeps its input only: 6 x 0.75-1.5 MiB and the
        # embeddings' few (measured 10.6 MiB).
        assert at_forward_end > (4 if checkpointed else 20) * 2**20
        last_backward = max(i for i, p in enumerate(points) if p["phase"] == "backward")
        for point in points[last_backward:]:
            # About 0: every saved storage unpacked by the backward; 1% would leave room
            # for one tensor saved by a node the backward never runs.
            assert point["activations"] <= 0.01 * at_forward_end, point


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "fsdp2"])
def test_the_timeline_peak_is_the_reports_worst_moment(reports, strategy):
    for row in reports[strategy]["ranks"]:
        totals = [sum(p[c] for c in CATEGORIES) for p in _points(row)]
        assert max(totals) == row["largest_moment"]["total"], row["rank"]
        assert _points(row)[totals.index(max(totals))]["point"] == row["largest_moment"]["point"]


def test_fsdp2_holds_whole_parameters_only_inside_forward_and_backward(reports):
    for row in reports["fsdp2"]["ranks"]:
        points = _points(row)
        # Its own shard of the parameters all step: 4 bytes x Psi / 2, each dim 0 padded
        # to a multiple of 2 (MiniLM's dims are all even: no padding).
        assert {p["params"] for p in points} == {4 * PSI / WORLD}
        # A unit's whole parameters (a MiniLM layer: PER_LAYER x 4 bytes = 7.1 MB) are
        # buffers inside the step and gone once the optimizer steps.
        inside = max(p["buffers"] for p in points if p["phase"] in ("forward", "backward"))
        assert inside >= 4 * PER_LAYER
        assert _first(row, "optimizer_step_end")["buffers"] < 2**20


def test_the_chart_is_written_beside_every_report(recipe_runs, reference):
    for launch in (
        recipe_runs("accelerate_multi_gpu"),
        recipe_runs("deepspeed_zero2"),
        reference("fsdp2_shard_grad_op"),
    ):
        chart = launch.output_dir / "memory_timeline.png"
        assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and chart.stat().st_size > 20_000
