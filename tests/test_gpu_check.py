"""``make gpu-check`` (dpkit/bench/gpu_check.py), the parts that need no GPU.

The assertions run on report dicts built by :class:`dpkit.memory.report.MemoryReport`
itself (its ``to_dict`` is what ``memory_report.json`` holds), with rows shaped like a
CUDA run's; the expected FLOP counts are worked out by hand from the model shapes.
The one launch is the script itself without CUDA: one line, exit code 2, nothing written.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from dpkit.bench import gpu_check
from dpkit.bench.gpu_check import Failure
from dpkit.memory.analytic import model_state_bytes
from dpkit.memory.report import MemoryReport
from dpkit.plan.check import PlanCheck
from tests.harness import REPO, launch_env

NUM_PARAMS = 22_713_986  # MiniLM-L6's classification model, as the finetune runs report it
GIB = 2.0**30


def cuda_row(strategy: str, **changes: float) -> dict:
    """Rank 0 of a bf16 run on one GPU, every category as predicted unless ``changes``
    says otherwise, its peak as :func:`dpkit.memory.peak.peak_figures` reports on CUDA."""
    states = model_state_bytes(NUM_PARAMS, strategy, 1, "bf16").as_dict()
    row = {c: states[c] for c in ("params", "grads", "optimizer", "master")}
    row.update({k: v for k, v in changes.items() if k in row})
    total = sum(row.values())
    peak = {
        "headline": "max_allocated",
        "max_allocated": total + 0.5 * GIB,
        "max_reserved": total + 1.0 * GIB,
        "device_capacity": 141.0 * GIB,
        "num_alloc_retries": 0,
        "num_ooms": 0,
    }
    peak.update({k: v for k, v in changes.items() if k in peak})
    return {
        "rank": 0,
        **row,
        "model_state_total": total,
        "buffers_total": 0.0,
        "buffers": {},
        "holders": {},
        "high_water_points": {},
        "largest_moment": {"point": "optimizer.step (pre)", "total": total},
        "activations": 0.2 * GIB,
        "peak": peak,
        "device": "cuda:0",
        "settings": {},
        "grads_measured": True,
    }


def cuda_report(strategy: str, row: dict | None = None) -> dict:
    """``memory_report.json`` of a one-GPU bf16 run with ``row`` as its only rank."""
    row = cuda_row(strategy) if row is None else row
    return MemoryReport(
        strategy=strategy,
        precision="bf16",
        world_size=1,
        num_params=NUM_PARAMS,
        ranks=[row],
        device="cuda:0",
    ).to_dict()


def plan_check(strategy: str, measured_grads: float, planned_grads: float) -> PlanCheck:
    """What ``dpkit plan --against`` returns, with the gradient figures given."""
    return PlanCheck(
        run_dir=Path("runs/gpu-check/finetune"),
        model="sentence-transformers/all-MiniLM-L6-v2",
        strategy=strategy,
        world_size=1,
        precision="bf16",
        predicted={"grads": planned_grads},
        measured={"grads": measured_grads},
        grads_paper=planned_grads,
        grads_where="",
    )


def matching_plan(report: dict) -> PlanCheck:
    grads = report["measured"]["grads"]
    return plan_check(report["strategy"], grads, grads)


# ---- memory report and plan check ---------------------------------------------------------


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_a_report_as_predicted_passes(strategy):
    report = cuda_report(strategy)
    assert gpu_check.memory_failures("run", report, matching_plan(report)) == []


def test_grads_are_judged_against_dpkit_plan_not_the_analytic_prediction():
    # DeepSpeed's gradient high-water follows its layout (parameters straddling the
    # partition, the step's flat copies), which `dpkit plan --against` models.
    analytic = model_state_bytes(NUM_PARAMS, "zero2", 1, "bf16").grads
    report = cuda_report("zero2", cuda_row("zero2", grads=1.5 * analytic))
    assert report["error_pct"]["grads"] == pytest.approx(-100.0 / 3)
    plan = plan_check("zero2", measured_grads=1.5 * analytic, planned_grads=1.5 * analytic)
    assert gpu_check.memory_failures("finetune-zero2", report, plan) == []


@pytest.mark.parametrize("category", gpu_check.PREDICTED_CATEGORIES)
@pytest.mark.parametrize(("ratio", "fails"), [(1.015, True), (0.985, True), (1.005, False)])
def test_params_optimizer_master_must_be_within_1pct_of_the_prediction(category, ratio, fails):
    predicted = model_state_bytes(NUM_PARAMS, "zero2", 1, "bf16").as_dict()[category]
    report = cuda_report("zero2", cuda_row("zero2", **{category: predicted * ratio}))
    failures = gpu_check.memory_failures("finetune-zero2", report, matching_plan(report))
    assert len(failures) == int(fails)
    if fails:
        (failure,) = failures
        assert failure.figure.startswith(f"{category} (worst rank) vs the prediction")
        assert failure.bound == "within 1%"


def test_a_master_copy_where_ddp_keeps_none_fails():
    report = cuda_report("ddp", cuda_row("ddp", master=2.0**20))
    (failure,) = gpu_check.memory_failures("finetune-ddp", report, matching_plan(report))
    assert failure.figure == "master (worst rank) vs the prediction 0.0 MiB"
    assert failure.value == "1.0 MiB (100.00% off)"


@pytest.mark.parametrize(("deviation", "fails"), [(0.025, True), (-0.025, True), (0.015, False)])
def test_grads_must_be_within_2pct_of_dpkit_plan(deviation, fails):
    report = cuda_report("zero2")
    measured = report["measured"]["grads"]
    plan = plan_check("zero2", measured, planned_grads=measured * (1 + deviation))
    failures = gpu_check.memory_failures("finetune-zero2", report, plan)
    assert [f.bound for f in failures] == (["within 2%"] if fails else [])
    if fails:
        assert failures[0].figure.startswith("grads (worst rank) vs dpkit plan --against")
        assert "(2.50% off)" in failures[0].value


def test_a_cpu_style_headline_peak_fails_naming_it():
    row = cuda_row("ddp")
    row["peak"] = {"headline": "rss_high_water", "rss_high_water": 3.0 * GIB}
    report = cuda_report("ddp", row)
    (failure,) = gpu_check.memory_failures("finetune-ddp", report, matching_plan(report))
    assert (failure.figure, failure.value, failure.bound) == (
        "rank 0 headline peak",
        "rss_high_water",
        "max_allocated",
    )


def test_tensors_held_at_once_above_max_allocated_fail():
    row = cuda_row("ddp")
    row["peak"]["max_allocated"] = row["largest_moment"]["total"] - 2.0**20
    report = cuda_report("ddp", row)
    (failure,) = gpu_check.memory_failures("finetune-ddp", report, matching_plan(report))
    assert failure.figure == "rank 0 tensors held at the worst moment"
    assert failure.bound.startswith("<= max_allocated")


def test_every_failure_is_collected_and_each_is_one_line():
    report = cuda_report(
        "zero2", cuda_row("zero2", optimizer=1.0, num_ooms=1, max_reserved=0.5 * GIB)
    )
    report["device"] = "cpu"
    report["grads_measured"] = False
    measured = report["measured"]["grads"]
    plan = plan_check("zero2", measured, planned_grads=measured * 1.1)
    failures = gpu_check.memory_failures("finetune-zero2", report, plan)
    figures = [f.figure.split(" vs ")[0] for f in failures]
    assert figures == [
        "memory_report.json device",
        "rank 0 max_allocated, max_reserved, device_capacity",
        "rank 0 num_ooms",
        "optimizer (worst rank)",
        "grads_measured",
        "grads (worst rank)",
    ]
    for failure in failures:
        line = failure.line()
        assert "\n" not in line
        assert line.startswith("gpu-check: FAILED finetune-zero2: ")
        assert failure.value in line and f"(bound: {failure.bound})" in line


def test_a_finetune_runs_files_are_checked_against_dpkit_plan_in_process(tmp_path):
    # The folder a DDP run of recipes/finetune.py leaves: its config names the model the
    # plan is made for (MiniLM-L6 with a 2-class head: NUM_PARAMS), its report the figures.
    config = {"ModelConfig": {"model": "sentence-transformers/all-MiniLM-L6-v2",
                              "max_seq_length": 128},
              "TrainConfig": {"micro_batch_size": 32}}  # fmt: skip
    (tmp_path / "run_config.json").write_text(json.dumps(config))
    (tmp_path / "memory_report.json").write_text(json.dumps(cuda_report("ddp")))
    record, failures = gpu_check.check_finetune("finetune-ddp", tmp_path)
    assert failures == []
    # bf16 DDP is autocast: fp32 gradients, 4 bytes per parameter, planned and measured.
    assert record["plan"]["predicted_bytes"]["grads"] == 4 * NUM_PARAMS
    assert record["grads_vs_plan_pct"] == 0.0
    assert record["max_allocated"] == [cuda_row("ddp")["peak"]["max_allocated"]]


def test_an_lm_runs_tokens_per_s_and_mfu_come_from_its_own_files(tmp_path):
    workload = {"size": "gpt2", "synthetic": True, "seq_len": 1024, "micro_batch_size": 8}
    (tmp_path / "run_config.json").write_text(json.dumps({"LMWorkload": workload}))
    # Warm-up steps slow, timed steps at 50 ms: 8 x 1024 tokens / 0.05 s.
    steps = [
        {"step": k, "loss": 5.0, "step_time_s": 1.0 if k <= gpu_check.LM_WARMUP_STEPS else 0.05,
         "tokens_per_rank": 8192, "samples_per_rank": 8}
        for k in range(1, gpu_check.LM_WARMUP_STEPS + gpu_check.LM_TIMED_STEPS + 1)
    ]  # fmt: skip
    (tmp_path / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    record, failures = gpu_check.check_lm(
        "lm-ddp", tmp_path, gpu_check.lookup_peak_flops("NVIDIA H200")
    )
    assert failures == []
    assert record["tokens_per_s"] == pytest.approx(163_840.0)
    assert record["timed_steps"] == gpu_check.LM_TIMED_STEPS
    assert record["flops_per_token"] == 855_166_464  # GPT-2 124M at 1024 tokens, as above
    assert record["mfu"] == pytest.approx(855_166_464 * 163_840.0 / 989e12)
    unknown = gpu_check.check_lm("lm-ddp", tmp_path, None)[0]
    assert unknown["mfu"] is None and unknown["tokens_per_s"] == record["tokens_per_s"]


# ---- run_info.json, throughput, pytest ----------------------------------------------------

GOOD_INFO = {"backend": "nccl", "device": "cuda:0", "strategy": "zero2", "zero_stage": 2,
             "precision": "bf16", "world_size": 1}  # fmt: skip


def test_run_info_of_an_nccl_job_on_cuda_passes():
    assert gpu_check.run_info_failures("lm-zero2", GOOD_INFO, "zero2") == []
    ddp = {**GOOD_INFO, "strategy": "ddp", "zero_stage": 0}
    assert gpu_check.run_info_failures("lm-ddp", ddp, "ddp") == []


def test_run_info_of_a_cpu_gloo_job_or_the_wrong_stage_fails_per_figure():
    info = {**GOOD_INFO, "backend": "gloo", "device": "cpu", "zero_stage": 1, "precision": "no"}
    failures = gpu_check.run_info_failures("finetune-zero2", info, "zero2")
    assert {(f.figure, f.value, f.bound) for f in failures} == {
        ("run_info.json backend", "'gloo'", "'nccl'"),
        ("run_info.json zero_stage", "1", "2"),
        ("run_info.json precision", "'no'", "'bf16'"),
        ("run_info.json device", "'cpu'", "cuda:N"),
    }


@pytest.mark.parametrize(
    ("tokens_per_s", "mfu", "figures"),
    [(2e5, 0.3, []), (2e5, None, []), (2e5, 1.2, ["MFU"]), (0.0, 0.0, ["tokens/s", "MFU"])],
)
def test_throughput_must_be_positive_and_mfu_at_most_1(tokens_per_s, mfu, figures):
    failures = gpu_check.throughput_failures("lm-ddp", tokens_per_s, mfu)
    assert [f.figure for f in failures] == figures


def test_junit_counts_of_a_real_pytest_run(tmp_path):
    (tmp_path / "test_two.py").write_text(
        "import pytest\n\ndef test_ok():\n    pass\n\n"
        "@pytest.mark.skip(reason='no GPU')\ndef test_skipped():\n    pass\n"
    )
    xml = tmp_path / "junit.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
         "test_two.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    counts = gpu_check.junit_counts(xml.read_text())
    assert counts == {"tests": 2, "failures": 0, "errors": 0, "skipped": 1, "passed": 1}
    # On a CUDA machine a skipped GPU test checked nothing: the check fails on it.
    assert [f.figure for f in gpu_check.pytest_failures(proc.returncode, counts)] == [
        "skipped tests"
    ]


@pytest.mark.parametrize(
    ("exit_code", "counts", "figures"),
    [
        (0, {"tests": 1, "failures": 0, "errors": 0, "skipped": 0, "passed": 1}, []),
        (1, {"tests": 2, "failures": 1, "errors": 0, "skipped": 0, "passed": 1}, ["failed tests"]),
        (5, {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "passed": 0}, ["passed tests"]),
        (0, {"tests": 1, "failures": 0, "errors": 0, "skipped": 1, "passed": 0},
         ["skipped tests", "passed tests"]),
        (None, None, ["junit report"]),
    ],
)  # fmt: skip
def test_pytest_gpu_must_pass_a_test_and_skip_none(exit_code, counts, figures):
    assert [f.figure for f in gpu_check.pytest_failures(exit_code, counts)] == figures


# ---- FLOPs, MFU, peaks ----------------------------------------------------------------------


def test_flops_per_token_is_torchtitans_for_gpt2_124m():
    # GPT-2 124M: 124,439,808 parameters less its 1024 x 768 position table; 12 layers of
    # 12 heads of 64 at 1024 tokens. 6 x 123,653,376 + 12 x 12 x 12 x 64 x 1024.
    assert gpu_check.flops_per_token(123_653_376, 12, 12, 64, 1024) == 855_166_464
    with pytest.raises(ValueError, match="seq_len"):
        gpu_check.flops_per_token(123_653_376, 12, 12, 64, 0)


@pytest.mark.parametrize("tied", [True, False])
def test_non_embedding_params_drop_lookup_tables_but_keep_the_output_head(tied):
    from transformers import GPT2Config

    from dpkit.data.lm import MODEL_SIZES, build_lm

    shape = MODEL_SIZES["tiny"]  # 4 layers, width 256, vocab 8192, 128 positions
    model = build_lm(GPT2Config(**shape, tie_word_embeddings=tied), seed=0)
    # Per layer: two LayerNorms (2 x 512), attention 256x768+768 and 256x256+256, MLP
    # 256x1024+1024 and 1024x256+256; then the final LayerNorm and the 8192 x 256 head
    # (tied: the token table itself; untied: its own weight, the table a lookup).
    per_layer = 2 * 512 + (196_608 + 768) + (65_536 + 256) + (262_144 + 1024) + (262_144 + 256)
    assert gpu_check.non_embedding_param_count(model) == 4 * per_layer + 512 + 2_097_152
    table_and_positions = 2_097_152 + 128 * 256
    total = sum(p.numel() for p in model.parameters())
    assert total == 4 * per_layer + 512 + table_and_positions + (0 if tied else 2_097_152)


def test_gpt2_124m_on_the_meta_device_has_123_7m_non_embedding_params():
    from transformers import GPT2Config

    from dpkit.data.lm import MODEL_SIZES
    from dpkit.models import build_meta_model

    model = build_meta_model(GPT2Config(**MODEL_SIZES["gpt2"]))
    assert gpu_check.non_embedding_param_count(model) == 124_439_808 - 1024 * 768


def test_mfu_is_model_flops_per_second_over_the_peak():
    # 1 GFLOP per token at 98,900 tokens/s on a 989 TFLOPS device: a tenth of its peak.
    assert gpu_check.model_flops_utilization(1e9, 98_900, 989e12) == pytest.approx(0.1)
    assert gpu_check.model_flops_utilization(1e9, 98_900, None) is None
    with pytest.raises(ValueError):
        gpu_check.model_flops_utilization(1e9, 0.0, 989e12)


@pytest.mark.parametrize(
    ("device_name", "label", "flops"),
    [
        ("NVIDIA H200", "H200", 989e12),
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 989e12),
        ("NVIDIA A100-SXM4-80GB", "A100", 312e12),
        ("NVIDIA A100-PCIE-40GB", "A100", 312e12),
        ("NVIDIA H100 PCIe", None, None),  # 756 TFLOPS: not credited with the SXM figure
        ("NVIDIA H200 NVL", None, None),
        ("NVIDIA GH200 480GB", None, None),
        ("NVIDIA GeForce RTX 4090", None, None),
    ],
)
def test_peak_flops_by_device_name(device_name, label, flops):
    entry = gpu_check.lookup_peak_flops(device_name)
    assert (entry and entry.label, entry and entry.flops) == (label, flops)


# ---- running ----------------------------------------------------------------------------------


def test_budget_gives_a_step_its_limit_or_what_is_left():
    budget = gpu_check.Budget(total_s=100.0, started=time.perf_counter() - 90.0)
    assert 9.0 < budget.limit(150.0) <= 10.0
    assert budget.limit(5.0) == 5.0
    assert gpu_check.Budget(100.0, started=time.perf_counter() - 200.0).limit(150.0) == 0.0


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_a_launch_past_its_limit_is_killed_with_its_children(tmp_path):
    # The launch's work runs in a grandchild (as torchrun's workers do): killing only the
    # direct child would leave it running on the GPU.
    pid_file = tmp_path / "grandchild.pid"
    script = (
        "import subprocess, sys; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); p.wait()"
    )
    code, wall = gpu_check._launch(
        [sys.executable, "-c", script], tmp_path / "log", tmp_path, launch_env(), 2.0
    )
    assert code is None and 2.0 <= wall < 10.0
    grandchild = int(pid_file.read_text())
    deadline = time.perf_counter() + 5.0
    while _alive(grandchild) and time.perf_counter() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild)


def test_summary_shows_each_run_and_each_failure_as_one_line():
    failure = Failure("lm-zero2", "MFU", "1.2000", "in (0, 1]")
    results = {
        "device_name": "NVIDIA H200",
        "peak": {"label": "H200", "flops": 989e12},
        "wall_s": 301.0,
        "runs": {
            "finetune-ddp": {"exit_code": 0, "run_info": {"backend": "nccl", "device": "cuda:0"},
                             "max_allocated": [1.5 * GIB], "deviation_pct": {"params": 0.0},
                             "grads_vs_plan_pct": 0.1},
            "lm-zero2": {"exit_code": 0, "tokens_per_s": 201_000.0, "mfu": 1.2},
        },
        "pytest_gpu": {"counts": {"passed": 1, "skipped": 0, "failures": 0, "errors": 0}},
        "failures": [asdict(failure)],
        "results_path": "runs/gpu-check/results.json",
    }  # fmt: skip
    lines = gpu_check.format_summary(results).splitlines()
    assert lines[0] == "gpu-check: NVIDIA H200, bf16 peak 989 TFLOPS (H200), 301 s"
    assert lines[2].split() == [
        "finetune-ddp",
        "0",
        "nccl",
        "cuda:0",
        "1.50",
        "0.00",
        "0.10",
        "-",
        "-",
    ]
    assert lines[3].split() == ["lm-zero2", "0", "-", "-", "-", "-", "-", "201,000", "120.0"]
    assert lines[4] == "pytest -m gpu: 1 passed, 0 skipped, 0 failures, 0 errors"
    assert lines[5] == failure.line()
    assert lines[6] == "gpu-check: 1 failed; results in runs/gpu-check/results.json"


def test_without_cuda_it_stops_with_one_line_and_exit_2_before_writing(tmp_path):
    out = tmp_path / "gpu-check"
    proc = subprocess.run(
        [sys.executable, "-m", "dpkit.bench.gpu_check", "--output-dir", str(out)],
        cwd=REPO, env=launch_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == gpu_check.EXIT_NO_CUDA == 2
    assert proc.stderr.splitlines() == [gpu_check.NO_CUDA_LINE]
    assert proc.stdout == ""
    assert not out.exists()
