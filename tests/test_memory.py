"""Unit tests for dpkit.memory: the tensor walk, the probes, the report math, the settings.

All in one process except the DeepSpeed/DDP checks, which need a process group and
run in a subprocess (world size 1) so that pytest's own process stays clean.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dpkit import memory
from dpkit.core.walk import Ledger, walk
from dpkit.engines import engine_of
from dpkit.engines.ddp import settings as ddp_settings
from dpkit.engines.deepspeed import settings as memory_settings
from dpkit.engines.deepspeed.memory import straddling_params
from dpkit.memory.report import MemoryReport, error_pct
from dpkit.memory.tracker import MemoryTracker, count_params

REPO = Path(__file__).resolve().parents[1]
CPU = SimpleNamespace(process_index=0, device=torch.device("cpu"))
# A plain module and a torch optimizer are walked by the engine that runs them (DDP's).
TORCH = engine_of("ddp")


def _nbytes(params) -> float:
    return float(sum(p.numel() * p.element_size() for p in params))


class TiedModel(torch.nn.Module):
    """An embedding whose weight is also the output projection's (as in GPT-2)."""

    def __init__(self, vocab: int = 50, dim: int = 16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.hidden = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("positions", torch.arange(8))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(self.embed(ids))))


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, zero_grad: bool) -> None:
    ids = torch.randint(0, 50, (4, 8))
    loss = model(ids).float().pow(2).mean()
    loss.backward()
    opt.step()
    if zero_grad:
        opt.zero_grad(set_to_none=True)


def test_ledger_counts_a_shared_storage_once_by_its_size():
    base = torch.zeros(100)
    ledger = Ledger()
    assert ledger.claim(base[:10], "params", "a")
    assert not ledger.claim(base[50:], "grads", "b"), "a view of a counted storage is not new"
    assert ledger.owner(base) == "params"
    snap = ledger.snapshot()
    assert snap["params"] == 400.0 and snap["grads"] == 0.0


def test_tied_weights_counted_once_in_params_and_count_params():
    model = TiedModel()
    unique = {id(p): p for p in model.parameters()}.values()
    snap = walk(TORCH, model, None)
    assert snap["params"] == _nbytes(unique)
    assert count_params(model) == sum(p.numel() for p in unique)
    assert snap["holders"]["buffers"]["module_buffers"] == 8 * 8  # int64 positions


def test_plain_module_with_adamw_after_a_step():
    model = TiedModel()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train_step(model, opt, zero_grad=False)
    snap = walk(TORCH, model, opt)
    param_bytes = _nbytes(model.parameters())
    assert snap["params"] == param_bytes
    assert snap["grads"] == param_bytes
    assert snap["master"] == 0.0
    holders = snap["holders"]["optimizer"]
    assert holders["exp_avg"] == holders["exp_avg_sq"] == param_bytes
    # AdamW's `step` is one scalar tensor per parameter: counted, and tiny.
    assert holders["step"] <= 8 * len(list(model.parameters()))


def test_dpkits_adamw_is_the_fused_kernel_with_the_loops_results_and_states():
    from dpkit.models import adamw, adamw_param_groups

    def trained(fused_kernel: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16))
        groups = adamw_param_groups(model, 0.01)
        opt = adamw(groups, 1e-2, 0.01) if fused_kernel else torch.optim.AdamW(groups, lr=1e-2)
        for _ in range(3):
            model(torch.ones(4, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    (fused_model, fused_opt), (loop_model, loop_opt) = trained(True), trained(False)
    assert fused_opt.defaults["fused"] is True and not loop_opt.defaults["fused"]
    # The same update rounded in another order: measured at most 3e-7 apart after 3 steps
    # at lr 1e-2 (weights of order 0.1-1); a wrong lr or weight decay moves them by 1e-3.
    for a, b in zip(fused_model.parameters(), loop_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert fused_opt.state_dict()["state"].keys() == loop_opt.state_dict()["state"].keys()
    # Parameters the kernel does not take: torch's default AdamW, not a failure at step 1.
    complex_param = torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    assert not adamw([complex_param], 1e-3, 0.0).defaults["fused"]


def test_without_probes_released_gradients_are_not_seen_and_the_report_says_so():
    model = TiedModel()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train_step(model, opt, zero_grad=True)
    tracker = MemoryTracker(CPU, model, opt, strategy="ddp", precision="fp32", probe_steps=0)
    report = tracker.report()
    assert report.ranks[0]["grads"] == 0.0
    assert report.ranks[0]["measured_at"] == "now (no probes)"
    assert any("no step probes" in note for note in report.notes)


def test_probes_keep_the_gradient_high_water_and_count_activations():
    model = TiedModel()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tracker = MemoryTracker(CPU, model, opt, strategy="ddp", precision="fp32")
    probes = tracker.probes
    try:
        _train_step(model, opt, zero_grad=True)
        row = tracker.measure()
        param_bytes = _nbytes(model.parameters())
        assert row["grads"] == param_bytes
        assert row["high_water_points"]["grads"] == "optimizer_step_begin"
        # AdamW: two moments per parameter and a 4-byte step per tensor.
        assert row["optimizer"] == 2 * param_bytes + 4 * len(list(model.parameters()))
        assert row["model_state_total"] == sum(row[c] for c in memory.MODEL_STATES)
        assert set(row["phases"]) == {"optimizer_step_begin", "optimizer_step_end"}
        assert row["activations"] > 0
        before = probes.activations.high_water
        with torch.no_grad():
            model(torch.randint(0, 50, (64, 8)))  # saves nothing for backward
        assert probes.activations.high_water == before
    finally:
        tracker.stop()
    # Stopping removes every hook: the optimizer steps without them.
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


def test_peak_is_a_named_process_figure_on_cpu_never_a_silent_zero():
    import psutil

    memory.reset_peak(CPU.device)
    before = psutil.Process().memory_info().rss
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, written, so resident
    during = psutil.Process().memory_info().rss
    del block
    peak = memory.peak_figures(torch.device("cpu"))
    assert peak["headline"] == "rss_high_water"
    assert peak["rss_high_water_source"]
    # The high-water saw the block while it lived (psutil's reading then), and keeps it
    # after the block went back to the system. The kernel's counters are batched per
    # thread, so the high-water may trail psutil's reading by a few hundred KiB.
    assert during - before >= 60 * 2**20
    assert peak["rss_high_water"] >= during - 2**20
    assert peak["rss_high_water"] - peak["rss_current"] >= 60 * 2**20
    assert "max_allocated" not in peak, "no CUDA figure on a CPU device"


def _row(rank: int, **bytes_by_category: float) -> dict:
    row = {"rank": rank, "buffers": {}, "buffers_total": 0.0, "holders": {}, "activations": None}
    row.update({c: 0.0 for c in memory.MODEL_STATES})
    row.update(bytes_by_category)
    row["model_state_total"] = sum(row[c] for c in memory.MODEL_STATES)
    row["peak"] = {"headline": "rss_high_water", "rss_high_water": 3e9}
    return row


def _zero2_report(extra_grad: float = 0.0) -> MemoryReport:
    psi, n = 1_000_000, 2
    rows = [
        _row(r, params=4 * psi, grads=4 * psi / n, optimizer=8 * psi / n, master=4 * psi / n)
        for r in range(n)
    ]
    rows[1]["grads"] += extra_grad
    rows[1]["model_state_total"] += extra_grad
    rows[1]["holders"] = {
        "grads": {"grads_in_partition (partition share)": 2e6, "param.grad": extra_grad}
    }
    rows[1]["buffers"] = {"zero_ipg_bucket": 589_824.0}
    rows[1]["buffers_total"] = 589_824.0
    return MemoryReport(
        strategy="zero2", precision="fp32", world_size=n, num_params=psi, ranks=rows
    )


def test_report_math_matches_the_analytic_core():
    report = _zero2_report()
    data = report.to_dict()
    psi = 1_000_000
    # By hand (ZeRO paper, fp32 AdamW, N=2): ZeRO-2 shards gradients, moments and master.
    assert data["predicted"] == {
        "params": 4 * psi, "grads": 4 * psi / 2, "optimizer": 8 * psi / 2,
        "master": 4 * psi / 2, "offloaded_to_cpu": 0, "total": 12 * psi,
    }  # fmt: skip
    assert data["full_replication"] == {
        "params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi, "master": 0,
        "offloaded_to_cpu": 0, "total": 16 * psi,
    }  # fmt: skip
    full = 16 * psi
    measured = data["measured"]["model_state_total"]
    assert measured == 4 * psi + 2 * psi + 4 * psi + 2 * psi
    assert data["savings"]["measured"]["saved_bytes"] == full - measured
    assert data["savings"]["measured"]["ratio"] == pytest.approx(measured / full)
    assert data["savings"]["predicted"]["ratio"] == pytest.approx(0.75)
    with_buffers = data["savings"]["measured_with_buffers"]
    assert with_buffers["saved_bytes"] == full - measured - 589_824.0
    assert all(abs(e) < 1e-9 for e in data["error_pct"].values())
    assert [r["category"] for r in data["residuals"]] == ["buffers"]


def test_a_category_above_prediction_is_named_with_its_holders():
    report = _zero2_report(extra_grad=1e6)
    grads = [r for r in report.residuals() if r["category"] == "grads"]
    assert len(grads) == 1
    assert grads[0]["rank"] == 1
    assert grads[0]["excess_bytes"] == 1e6
    assert list(grads[0]["held_by"]) == ["grads_in_partition (partition share)", "param.grad"]
    assert report.error_pct()["grads"] == pytest.approx(error_pct(2e6, 3e6))
    assert "above prediction: grads" in report.format_table()


def test_a_gpu_peak_is_split_on_the_device_not_against_host_rss():
    """On CUDA the counted tensors are device bytes: the breakdown is of max_allocated,
    never host RSS minus device bytes."""
    from dpkit.memory.tracker import peak_breakdown

    baseline = {"rss": 2.0e9, "counted_tensors": 0.5e9}
    gpu_peak = {"headline": "max_allocated", "max_allocated": 3.0e9, "rss_high_water": 2.5e9}
    assert peak_breakdown(gpu_peak, baseline, 1.0e9) == {"allocated_rest_at_peak": 2.0e9}
    cpu_peak = {"headline": "rss_high_water", "rss_high_water": 2.5e9}
    assert peak_breakdown(cpu_peak, baseline, 1.0e9) == {
        "rss_runtime_at_track": 1.5e9,
        "rss_rest_at_peak": 0.0,
    }
    report = _zero2_report()
    for row in report.ranks:
        row["peak"] = {**gpu_peak, **peak_breakdown(gpu_peak, baseline, 1.0e9)}
        row["largest_moment"] = {"total": 1.0e9}
    lines = [line for line in report.format_table().splitlines() if "= counted" in line]
    assert lines[0] == (
        "rank 0 max allocated 2,861.0 MiB = counted tensors at worst moment 953.7 + rest "
        "1,907.3 (activations, workspace)"
    )
    assert "rss" not in report.format_table().split("saved vs full replication")[1]


def test_a_mixed_precision_zero_report_names_the_papers_gradient_figure():
    psi, n = 1_000_000, 2
    rows = [_row(r, params=2 * psi, grads=6 * psi / n) for r in range(n)]
    report = MemoryReport(
        strategy="zero2", precision="bf16", world_size=n, num_params=psi, ranks=rows
    )
    assert report.predicted.grads == 6 * psi / n
    assert report.to_dict()["predicted_grads_paper"] == 2 * psi / n
    assert report.error_pct()["grads"] == pytest.approx(0.0)
    assert (
        "predicted grads 2.9 MiB = the 16-bit gradients plus the fp32 partition DeepSpeed's "
        "step casts from them for the master weights; the ZeRO paper counts 1.0 MiB"
    ) in report.format_table()
    fp32 = _zero2_report()
    assert "the ZeRO paper counts" not in fp32.format_table()


def test_error_pct_definition():
    assert error_pct(110.0, 100.0) == pytest.approx(10.0)
    assert error_pct(0.0, 0.0) == 0.0
    assert error_pct(5.0, 0.0) is None


def test_tracker_scalars_and_json_round_trip(tmp_path):
    report = _zero2_report(extra_grad=1e6)
    scalars = report.tracker_scalars()
    assert scalars and all(k.startswith("memory/") for k in scalars)
    assert all(isinstance(v, float) and math.isfinite(v) for v in scalars.values())
    for key in ("memory/model_state_mib", "memory/saved_ratio_measured", "memory/error_pct/grads"):
        assert key in scalars
    path = tmp_path / "run" / "memory_report.json"
    report.save(path)
    data = json.loads(path.read_text())
    assert MemoryReport.load(path).to_dict() == data == report.to_dict()


def test_straddling_parameters_are_found_from_the_partition_layout():
    # Rank 0 of 2 over a flat buffer [big(70) | pad(2) | small(28)]: partition [0, 50)
    # holds 50 elements of `big`, whose whole gradient DeepSpeed copies (20 more).
    flat = torch.zeros(100)
    module = torch.nn.Module()
    module.big = torch.nn.Parameter(flat[:70])
    module.small = torch.nn.Parameter(flat[72:])
    zero = SimpleNamespace(
        bit16_groups_flat=[flat],
        parallel_partitioned_bit16_groups=[[flat[:50], flat[50:]]],
        real_dp_process_group=[None],
        params_in_partition=[[module.big]],
    )
    assert straddling_params(zero, module) == (20, ["big"])
    # Rank 1 would hold [50, 100): 20 of `big` (50 more copied) and all of `small`.
    zero.parallel_partitioned_bit16_groups = [[flat[50:], flat[:50]]]
    zero.params_in_partition = [[module.big, module.small]]
    assert straddling_params(zero, module) == (50, ["big"])


# Single-process DDP and DeepSpeed: a process group of one, in a subprocess.
_WORLD_OF_ONE = textwrap.dedent(
    """
    import json, os, sys, torch
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs
    from dpkit.memory import MemoryTracker

    strategy, bucket_view, missing = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
    if missing:  # what a DeepSpeed without this method looks like to the probes
        from dpkit.engines.deepspeed import memory as zero_memory
        zero_memory.ZERO_PROBE_POINTS = (*zero_memory.ZERO_PROBE_POINTS, (missing, "renamed", 1))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    handlers = [InitProcessGroupKwargs(backend="gloo")]
    plugin = None
    if strategy == "ddp":
        handlers.append(DistributedDataParallelKwargs(gradient_as_bucket_view=bucket_view))
    else:
        # As every dpkit run does (dpkit.engines.deepspeed.config): the CPU shared-memory
        # all-reduce op is never used in training, and building it costs ~40 s.
        from dpkit.engines.deepspeed.config import skip_deepspeed_cpu_shm_op
        skip_deepspeed_cpu_shm_op()
        plugin = DeepSpeedPlugin(hf_ds_config={
            "train_micro_batch_size_per_gpu": 4, "train_batch_size": 4,
            "gradient_accumulation_steps": 1, "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": int(strategy[-1]), "reduce_bucket_size": 4096},
        })
    acc = Accelerator(cpu=plugin is None, kwargs_handlers=handlers, deepspeed_plugin=plugin)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    tracker = MemoryTracker(acc, model, opt, strategy=strategy, precision="fp32")
    for _ in range(2):
        loss = model(torch.randn(4, 64, device=acc.device)).pow(2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    report = tracker.report()
    print("REPORT" + json.dumps(report.to_dict()))
    """
)


def _world_of_one(
    tmp_path: Path, strategy: str, bucket_view: bool = True, missing_method: str = ""
) -> dict:
    script = tmp_path / "world_of_one.py"
    script.write_text(_WORLD_OF_ONE)
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    proc = subprocess.run(
        [sys.executable, str(script), strategy, "1" if bucket_view else "0", missing_method],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("REPORT"))
    return {**json.loads(line[len("REPORT") :]), "stderr": proc.stderr}


PARAM_BYTES = 4.0 * (64 * 256 + 256 + 256 * 4 + 4)


@pytest.mark.subprocess_only
@pytest.mark.parametrize("bucket_view", [True, False])
def test_ddp_world_of_one_buckets_are_the_grads_only_with_bucket_view(tmp_path, bucket_view):
    data = _world_of_one(tmp_path, "ddp", bucket_view)
    row = data["ranks"][0]
    assert row["params"] == row["grads"] == PARAM_BYTES
    assert row["settings"]["ddp.gradient_as_bucket_view"] is bucket_view
    buckets = row["buffers"].get("ddp_buckets", 0.0)
    # Without bucket views the reducer keeps a second full-size copy of the gradients.
    assert buckets == (0.0 if bucket_view else PARAM_BYTES)
    assert abs(data["error_pct"]["total"]) < 0.1


@pytest.mark.subprocess_only
@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_deepspeed_world_of_one_finds_zero_partitions(tmp_path, strategy):
    data = _world_of_one(tmp_path, strategy)
    row = data["ranks"][0]
    # One rank: the partition is the whole model (plus alignment padding).
    assert row["master"] == pytest.approx(PARAM_BYTES, rel=1e-3)
    assert row["optimizer"] == pytest.approx(2 * PARAM_BYTES, rel=1e-3)
    assert row["params"] == pytest.approx(PARAM_BYTES, rel=1e-3)
    # The gradient high-water is the ZeRO step's flat copy next to the gradients it copies
    # (ZeRO-1 holds as much once before: its partition buffer beside every full gradient).
    assert row["grads"] == pytest.approx(2 * PARAM_BYTES, rel=1e-3)
    flatten = row["phases"]["zero_step_flatten_grads"]
    assert flatten["grads"] == pytest.approx(2 * PARAM_BYTES, rel=1e-3)
    assert "flat gradient partition (copy made by the ZeRO step)" in flatten["holders"]["grads"]
    # What the inner optimizer steps on is one partition's gradient.
    assert row["phases"]["optimizer_step_begin"]["grads"] == pytest.approx(PARAM_BYTES, rel=1e-3)
    assert "zero_fp32_partition" in row["holders"]["master"]
    assert "zero_flat_params" in row["holders"]["params"]
    assert row["buffers"]["zero_ipg_bucket"] == 4096 * 4
    assert row["settings"]["zero.reduce_bucket_size"] == 4096
    for category in ("params", "optimizer", "master"):
        assert abs(data["error_pct"][category]) < 0.1


@pytest.mark.subprocess_only
def test_a_deepspeed_without_a_probed_method_marks_gradients_unmeasured(tmp_path):
    """The probes patch DeepSpeed internals by name; under a DeepSpeed that lacks one (another
    version), the run says so in one line and the report marks gradients unmeasured instead
    of reporting a gradient figure that missed a high-water."""
    data = _world_of_one(tmp_path, "zero2", missing_method="reduce_grads_of_another_version")
    assert data["grads_measured"] is False
    assert data["error_pct"]["grads"] is None and data["error_pct"]["total"] is None
    assert "grads" not in [r["category"] for r in data["residuals"]]
    notes = [n for n in data["notes"] if "reduce_grads_of_another_version" in n]
    assert len(notes) == 1 and "unmeasured" in notes[0]
    warnings = [x for x in data["stderr"].splitlines() if "reduce_grads_of_another_version" in x]
    assert len(warnings) == 1 and "unmeasured" in warnings[0]
    table = MemoryReport.from_dict(data).format_table()
    assert "unmeasured" in table.splitlines()[2]  # rank 0's grads cell
    # Everything else is measured as usual.
    assert data["ranks"][0]["master"] == pytest.approx(PARAM_BYTES, rel=1e-3)


def test_current_summary_names_the_process_figure_on_cpu():
    text = memory.current_summary(CPU.device)
    assert "rss high-water" in text and "GiB" in text


def test_ddp_kwargs_share_gradients_with_the_buckets():
    kwargs = ddp_settings.ddp_kwargs()
    assert kwargs["gradient_as_bucket_view"] is True
    # The keys are DistributedDataParallelKwargs fields.
    from accelerate.utils import DistributedDataParallelKwargs

    DistributedDataParallelKwargs(**kwargs)


MINILM = {"num_params": 22_713_986, "hidden_size": 384, "largest_param_numel": 30522 * 384}


def test_zero_settings_size_the_bucket_to_the_model_not_deepspeeds_default():
    # hidden^2 = 147,456 is below the floor: 2^21 elements, so a step makes few calls.
    settings = memory_settings.zero_memory_settings(**MINILM, world_size=2, stage=2)
    assert settings["reduce_bucket_size"] == memory_settings.MIN_BUCKET_ELEMENTS == 2**21
    assert settings["allgather_bucket_size"] == 2**21
    # Above the floor, hidden^2 (Llama-7B's hidden size).
    llama = memory_settings.zero_memory_settings(6_738_415_616, 4096, world_size=8, stage=2)
    assert llama["reduce_bucket_size"] == 4096 * 4096
    # A model smaller than the floor never gets a bucket larger than itself.
    tiny = memory_settings.zero_memory_settings(1000, 384, world_size=2, stage=2)
    assert tiny["reduce_bucket_size"] == 1000
    # DeepSpeed asserts even bucket sizes: an odd model rounds up.
    odd = memory_settings.zero_memory_settings(1001, 384, world_size=2, stage=2)
    assert odd["reduce_bucket_size"] == odd["allgather_bucket_size"] == 1002
    huge = memory_settings.zero_memory_settings(10**12, 10**6, world_size=8, stage=2)
    assert huge["reduce_bucket_size"] == 500_000_000
    # Before the model is built (no parameter count): the same rule, uncapped.
    assert memory_settings.bucket_elements(384) == 2**21
    assert memory_settings.bucket_elements(None) == 500_000_000


def test_zero_settings_follow_the_measurements():
    cpu2 = memory_settings.zero_memory_settings(**MINILM, world_size=2, stage=2)
    assert cpu2["overlap_comm"] is False, "on CPU a second bucket that overlaps nothing"
    # MiniLM's word embedding (51.6% of the model) is reduced alone beside the pre-sized
    # partition buffer: off, under both stages.
    assert cpu2["contiguous_gradients"] is False
    stage1 = memory_settings.zero_memory_settings(**MINILM, world_size=4, stage=1)
    assert stage1["contiguous_gradients"] is False
    cuda2 = memory_settings.zero_memory_settings(**MINILM, world_size=2, stage=2, on_cuda=True)
    assert cuda2["overlap_comm"] is False, "without contiguous gradients: previous_reduced_grads"
    cuda1 = memory_settings.zero_memory_settings(**MINILM, world_size=2, stage=1, on_cuda=True)
    assert cuda1["overlap_comm"] is False, "ZeRO-1 would reduce inside backward"
    # No single parameter dominates a partition: keep contiguous buffers, and overlap
    # ZeRO-2's reduction with backward on CUDA.
    even = dict(num_params=10**9, hidden_size=4096, largest_param_numel=10**7)
    even_cpu = memory_settings.zero_memory_settings(**even, world_size=8, stage=2)
    assert even_cpu["contiguous_gradients"] is True and even_cpu["overlap_comm"] is False
    even_cuda = memory_settings.zero_memory_settings(**even, world_size=8, stage=2, on_cuda=True)
    assert even_cuda["overlap_comm"] is True
    assert set(cpu2) <= set(memory_settings.REASONS)


@pytest.mark.parametrize("bad", [dict(stage=4), dict(world_size=0)])
def test_zero_settings_reject_what_they_do_not_cover(bad):
    args = {"world_size": 2, "stage": 2, **bad}
    with pytest.raises(ValueError):
        memory_settings.zero_memory_settings(100, 8, **args)


def _allocated_after_a_warm_up_step(device: torch.device) -> float:
    """Bytes allocated once TiedModel's kinds of layers have run forward and backward on
    ``device``: other tests' live tensors, and the cuBLAS/cuBLASLt workspaces, which come
    from the caching allocator per thread (the forward's and autograd's) and stay."""
    warm = TiedModel(vocab=64, dim=64).to(device)
    warm(torch.randint(0, 64, (2, 8), device=device)).float().pow(2).mean().backward()
    del warm
    torch.cuda.synchronize(device)
    return float(torch.cuda.memory_allocated(device))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_report_matches_the_prediction_and_its_peak_lies_between_its_bounds():
    device = torch.device("cuda", torch.cuda.current_device())
    before = _allocated_after_a_warm_up_step(device)
    accelerator = SimpleNamespace(process_index=0, device=device)
    # 21M parameters (16 bytes each: 336 MB of model states) against a 2 x 8-token batch
    # (activations under 1 MB): the bounds below are the model states' and the step's.
    model = TiedModel(vocab=1024, dim=4096).to(device)
    params = list({id(p): p for p in model.parameters()}.values())
    param_bytes = _nbytes(params)
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=True)  # the step the bounds reason about
    tracker = MemoryTracker(accelerator, model, opt, strategy="ddp", precision="fp32")
    try:
        for _ in range(2):
            loss = model(torch.randint(0, 1024, (2, 8), device=device)).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        report = tracker.report(step=2).to_dict()
    finally:
        tracker.stop()
    row, peak = report["ranks"][0], report["ranks"][0]["peak"]
    assert report["device"] == str(device)
    assert peak["headline"] == "max_allocated" and peak["num_ooms"] == 0
    # fp32 DDP: 4 + 4 + 8 bytes per parameter and no master copy, as predicted, to the byte
    # but for AdamW's step counters (a 4-byte CPU scalar per parameter tensor).
    assert row["params"] == row["grads"] == param_bytes
    held = row["holders"]["optimizer"]
    assert held["exp_avg"] == held["exp_avg_sq"] == param_bytes
    step_counters = held.get("step", 0.0)
    assert step_counters <= 4 * len(params)
    for category in ("params", "grads", "optimizer", "master"):
        predicted = report["predicted"][category]
        assert report["measured"][category] - predicted == (
            step_counters if category == "optimizer" else 0.0
        ), category
    assert report["error_pct"]["total"] == pytest.approx(0.0, abs=1e-4)
    # The peak of this test's tensors, between two bounds a wrong figure leaves:
    # lower, foreach AdamW's step holds every model state on the GPU plus one temporary the
    # size of the parameters (sqrt of exp_avg_sq) while the gradients live (zero_grad frees
    # them after it); a figure that is not the allocator's high-water falls below it.
    peak_of_test = peak["max_allocated"] - before
    on_gpu_states = row["model_state_total"] - step_counters
    assert peak_of_test >= on_gpu_states + param_bytes
    # Upper, nothing else this large is alive: backward holds the saved activations and at
    # most three more of their size (the loss's gradients), 8 MiB cover the batch, the loss
    # and the allocator's rounding. A second copy of any category (21-168 MB) breaks it.
    activations = row["activations"]
    assert 0 < activations < 2**20
    assert peak_of_test <= (
        on_gpu_states + row["buffers_total"] + param_bytes + 4 * activations + 8 * 2**20
    )
    assert row["largest_moment"]["total"] - step_counters <= peak_of_test
    assert "GiB" in memory.current_summary(device)
