"""``make gpu-check``'s helpers (dpkit/bench/gpu_check.py), the parts that need no GPU.

The assertions run on report dicts built by :class:`dpkit.memory.report.MemoryReport`
itself (its ``to_dict`` is what ``memory_report.json`` holds), with rows shaped like a
CUDA run's; the expected FLOP counts are worked out by hand from the model shapes. The
launches' kill on a timeout is tests/test_gpu_runs.py's own helper, on a sleeping process
tree; the one launch of dpkit is the CUDA check without CUDA: one line, exit code 2.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dpkit.bench import gpu_check
from dpkit.memory.analytic import model_state_bytes
from dpkit.memory.report import MemoryReport
from dpkit.plan.check import PlanCheck, check_run
from tests.harness import REPO, launch_env
from tests.test_gpu_runs import run_logged

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


# The bounds tests/test_gpu_runs.py applies (argued there), written out again here: a test
# of the helpers must not loosen with the GPU tests' constants.
STATES_PCT, GRADS_PCT = 1.0, 2.0


def memory_failures(run: str, report: dict, plan: PlanCheck) -> list[gpu_check.Failure]:
    """Every memory figure a finetune run's GPU tests assert, in their order."""
    failures = gpu_check.cuda_peak_failures(run, report)
    for category in gpu_check.PREDICTED_CATEGORIES:
        failures += gpu_check.model_state_failures(run, report, category, STATES_PCT)
    return failures + gpu_check.grads_failures(run, report, plan, GRADS_PCT)


# ---- memory report and plan check ---------------------------------------------------------


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_a_report_as_predicted_passes(strategy):
    report = cuda_report(strategy)
    assert memory_failures("run", report, matching_plan(report)) == []


def test_grads_are_judged_against_dpkit_plan_not_the_analytic_prediction():
    # DeepSpeed's gradient high-water follows its layout (parameters straddling the
    # partition, the step's flat copies), which `dpkit plan --against` models.
    analytic = model_state_bytes(NUM_PARAMS, "zero2", 1, "bf16").grads
    report = cuda_report("zero2", cuda_row("zero2", grads=1.5 * analytic))
    assert report["error_pct"]["grads"] == pytest.approx(-100.0 / 3)
    plan = plan_check("zero2", measured_grads=1.5 * analytic, planned_grads=1.5 * analytic)
    assert memory_failures("finetune-zero2", report, plan) == []


@pytest.mark.parametrize("category", gpu_check.PREDICTED_CATEGORIES)
@pytest.mark.parametrize(("ratio", "fails"), [(1.015, True), (0.985, True), (1.005, False)])
def test_params_optimizer_master_must_be_within_1pct_of_the_prediction(category, ratio, fails):
    predicted = model_state_bytes(NUM_PARAMS, "zero2", 1, "bf16").as_dict()[category]
    report = cuda_report("zero2", cuda_row("zero2", **{category: predicted * ratio}))
    failures = gpu_check.model_state_failures("finetune-zero2", report, category, 1.0)
    assert len(failures) == int(fails)
    if fails:
        (failure,) = failures
        assert failure.figure.startswith(f"{category} (worst rank) vs the prediction")
        assert failure.bound == "within 1%"
    # Each category is judged on its own figure: the others stay within their bound.
    others = [c for c in gpu_check.PREDICTED_CATEGORIES if c != category]
    assert [f for c in others for f in gpu_check.model_state_failures("r", report, c, 1.0)] == []


def test_a_master_copy_where_ddp_keeps_none_fails():
    report = cuda_report("ddp", cuda_row("ddp", master=2.0**20))
    (failure,) = gpu_check.model_state_failures("finetune-ddp", report, "master", 1.0)
    assert failure.figure == "master (worst rank) vs the prediction 0.0 MiB"
    assert failure.value == "1.0 MiB (100.00% off)"


@pytest.mark.parametrize(("deviation", "fails"), [(0.025, True), (-0.025, True), (0.015, False)])
def test_grads_must_be_within_2pct_of_dpkit_plan(deviation, fails):
    report = cuda_report("zero2")
    measured = report["measured"]["grads"]
    plan = plan_check("zero2", measured, planned_grads=measured * (1 + deviation))
    failures = gpu_check.grads_failures("finetune-zero2", report, plan, 2.0)
    assert [f.bound for f in failures] == (["within 2%"] if fails else [])
    if fails:
        assert failures[0].figure.startswith("grads (worst rank) vs dpkit plan --against")
        assert "(2.50% off)" in failures[0].value


def test_a_cpu_style_headline_peak_fails_naming_it():
    row = cuda_row("ddp")
    row["peak"] = {"headline": "rss_high_water", "rss_high_water": 3.0 * GIB}
    report = cuda_report("ddp", row)
    (failure,) = gpu_check.cuda_peak_failures("finetune-ddp", report)
    assert (failure.figure, failure.value, failure.bound) == (
        "rank 0 headline peak",
        "rss_high_water",
        "max_allocated",
    )


def test_tensors_held_at_once_above_max_allocated_fail():
    row = cuda_row("ddp")
    row["peak"]["max_allocated"] = row["largest_moment"]["total"] - 2.0**20
    report = cuda_report("ddp", row)
    (failure,) = gpu_check.cuda_peak_failures("finetune-ddp", report)
    assert failure.figure == "rank 0 tensors held at the worst moment"
    assert failure.bound.startswith("<= max_allocated")


def test_every_failure_is_reported_and_each_is_one_line():
    report = cuda_report(
        "zero2", cuda_row("zero2", optimizer=1.0, num_ooms=1, max_reserved=0.5 * GIB)
    )
    report["device"] = "cpu"
    report["grads_measured"] = False
    measured = report["measured"]["grads"]
    plan = plan_check("zero2", measured, planned_grads=measured * 1.1)
    failures = memory_failures("finetune-zero2", report, plan)
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
    # A failing GPU test's message: every failure, one line each.
    assert gpu_check.failure_lines(failures).splitlines() == [f.line() for f in failures]


def test_a_finetune_runs_files_are_checked_against_dpkit_plan_in_process(tmp_path):
    # The folder a DDP run of recipes/finetune.py leaves: its config names the model the
    # plan is made for (MiniLM-L6 with a 2-class head: NUM_PARAMS), its report the figures.
    config = {"ModelConfig": {"model": "sentence-transformers/all-MiniLM-L6-v2",
                              "max_seq_length": 128},
              "TrainConfig": {"micro_batch_size": 32}}  # fmt: skip
    (tmp_path / "run_config.json").write_text(json.dumps(config))
    (tmp_path / "memory_report.json").write_text(json.dumps(cuda_report("ddp")))
    plan = check_run(tmp_path)  # as tests/test_gpu_runs.py makes it of a run's folder
    report = json.loads((tmp_path / "memory_report.json").read_text())
    assert memory_failures("finetune-ddp", report, plan) == []
    # bf16 DDP is autocast: fp32 gradients, 4 bytes per parameter, planned and measured.
    assert plan.predicted["grads"] == plan.measured["grads"] == 4 * NUM_PARAMS
    assert gpu_check.deviation_pct(plan.measured["grads"], plan.predicted["grads"]) == 0.0


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
    figures = gpu_check.lm_figures(tmp_path, gpu_check.lookup_peak_flops("NVIDIA H200"))
    assert figures["tokens_per_s"] == pytest.approx(163_840.0)
    assert figures["median_step_time_s"] == pytest.approx(0.05)
    assert figures["timed_steps"] == gpu_check.LM_TIMED_STEPS
    assert figures["flops_per_token"] == 855_166_464  # GPT-2 124M at 1024 tokens, as below
    assert figures["mfu"] == pytest.approx(855_166_464 * 163_840.0 / 989e12)
    unknown = gpu_check.lm_figures(tmp_path, None)
    assert unknown["mfu"] is None and unknown["tokens_per_s"] == figures["tokens_per_s"]


# ---- run_info.json, throughput ------------------------------------------------------------

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


@pytest.mark.parametrize(("tokens_per_s", "fails"), [(2e5, False), (1e-3, False), (0.0, True)])
def test_tokens_per_s_must_be_positive(tokens_per_s, fails):
    failures = gpu_check.tokens_per_s_failures("lm-ddp", tokens_per_s)
    assert [(f.figure, f.bound) for f in failures] == ([("tokens/s", "> 0")] if fails else [])


@pytest.mark.parametrize(("mfu", "fails"), [(0.3, False), (1.0, False), (1.2, True), (0.0, True)])
def test_mfu_must_be_in_0_to_1(mfu, fails):
    failures = gpu_check.mfu_failures("lm-ddp", mfu)
    assert [(f.figure, f.bound) for f in failures] == ([("MFU", "in (0, 1]")] if fails else [])


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


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


class _CutShort(Exception):
    pass


def test_a_launch_cut_short_is_killed_with_its_children(tmp_path):
    # The launch's work runs in a grandchild in a session of its own, as torchrun starts
    # its workers: killing the direct child, or its process group, would leave it running
    # on the GPU. pytest-timeout cuts a test short as this alarm does: an exception raised
    # in the waiting main thread (its signal method).
    pid_file = tmp_path / "grandchild.pid"
    script = (
        "import subprocess, sys; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'], "
        "start_new_session=True); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); p.wait()"
    )

    def cut_short(signum, frame):
        raise _CutShort

    previous = signal.signal(signal.SIGALRM, cut_short)
    started = time.perf_counter()
    try:
        signal.setitimer(signal.ITIMER_REAL, 2.0)
        with pytest.raises(_CutShort):
            run_logged([sys.executable, "-c", script], tmp_path / "log", tmp_path, launch_env())
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert 2.0 <= time.perf_counter() - started < 10.0
    grandchild = int(pid_file.read_text())
    deadline = time.perf_counter() + 5.0
    while _alive(grandchild) and time.perf_counter() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild)


def test_a_finished_launch_gives_its_exit_code_and_its_output_in_the_log(tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('to the log'); sys.exit(3)"]
    assert run_logged(cmd, tmp_path / "log", tmp_path, launch_env()) == 3
    assert (tmp_path / "log").read_text() == "to the log\n"


def test_without_cuda_it_stops_with_one_line_and_exit_2():
    proc = subprocess.run(
        [sys.executable, "-m", "dpkit.bench.gpu_check"],
        cwd=REPO, env=launch_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == gpu_check.EXIT_NO_CUDA == 2
    assert proc.stderr.splitlines() == [gpu_check.NO_CUDA_LINE]
    assert proc.stdout == ""


@pytest.mark.parametrize(
    ("device_name", "line"),
    [
        ("NVIDIA H200", "gpu-check: NVIDIA H200, bf16 peak 989 TFLOPS (H200)"),
        ("NVIDIA H100 PCIe", "gpu-check: NVIDIA H100 PCIe, bf16 peak unknown (no MFU)"),
    ],
)
def test_with_cuda_it_names_the_device_and_its_peak_and_lets_pytest_run(
    monkeypatch, capsys, device_name, line
):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: device_name)
    assert gpu_check.main() == 0
    assert capsys.readouterr().out.splitlines() == [line]
