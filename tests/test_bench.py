"""``dpkit bench``: the JSON of a real tiny bench is consistent; the pieces behave.

The multi-process test runs the whole bench (3 dpkit strategies under
``accelerate launch``, bare DDP under ``torchrun``, bare ZeRO-1/2 under
``deepspeed``) on a tiny model and checks what the numbers must satisfy by
construction, not how fast anything was.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import pytest

from dpkit.bench import cli as bench_cli
from dpkit.bench import launch as bench
from dpkit.bench import results as bench_report
from dpkit.data import lm as lm_data
from dpkit.errors import UsageError
from dpkit.memory.analytic import model_state_bytes

NPROC = 2
WARMUP, STEPS = 1, 2
TINY_BENCH = [
    "--nproc", str(NPROC), "--size", "tiny", "--synthetic",
    "--warmup", str(WARMUP), "--steps", str(STEPS), "--seq-len", "64",
]  # fmt: skip


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    return parser.parse_args(list(argv))


# ---- in-process: settings, data order, failure reporting -------------------------------------


def test_settings_defaults_on_cpu():
    settings = bench_cli.resolve_settings(_args(), gpu_count=0)
    assert settings["nproc"] == 2
    assert settings["size"] == "small"
    assert settings["strategies"] == ["ddp", "zero1", "zero2"]
    assert settings["total_steps"] == settings["warmup_steps"] + settings["timed_steps"]
    assert settings["threads_per_process"] >= 1
    assert bench_cli.resolve_settings(_args("--nproc", "4"), gpu_count=0)["nproc"] == 4


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--strategies", "ddp,zero3"], "--strategies"),
        (["--strategies", "ddp,ddp"], "--strategies"),
        (["--size", "huge"], "--size"),
        (["--warmup", "0"], "--warmup"),
        (["--steps", "0"], "--steps"),
        (["--nproc", "0"], "--nproc"),
        (["--size", "tiny", "--seq-len", "4096"], "--seq-len"),
        (["--zero-override", "overlap_comm"], "KEY=VALUE"),
        (["--zero-override", "stage=3"], "stage"),
        (["--model-config", "no/such/config.json"], "--model-config"),
    ],
)
def test_bad_settings_are_refused_before_launching(argv, message):
    with pytest.raises(UsageError, match=message):
        bench_cli.resolve_settings(_args(*argv), gpu_count=0)


def test_zero_overrides_parse_json_values():
    settings = bench_cli.resolve_settings(
        _args("--zero-override", "overlap_comm=true", "--zero-override", "reduce_bucket_size=5e8"),
        gpu_count=0,
    )
    assert settings["zero_overrides"] == {"overlap_comm": True, "reduce_bucket_size": 500_000_000}


def test_bare_batches_are_the_ones_accelerate_gives_each_rank():
    """Global micro-batch i goes to rank i % N, on both sides."""
    workload = lm_data.LMWorkload(size="tiny", synthetic=True, seq_len=16, micro_batch_size=3)
    dataset = lm_data.token_blocks(workload, vocab_size=8192)
    for rank in range(NPROC):
        batches = lm_data.rank_batches(dataset, 3, rank, NPROC)
        for local_index in range(3):
            global_index = local_index * NPROC + rank
            expected = [
                dataset[i]["input_ids"] for i in range(global_index * 3, global_index * 3 + 3)
            ]
            got = next(batches)["input_ids"]
            assert all(got[j].equal(expected[j]) for j in range(3))
    again = lm_data.token_blocks(workload, vocab_size=8192)
    assert dataset[12345]["input_ids"].equal(again[12345]["input_ids"])


def test_byte_tokens_need_a_vocabulary_of_256(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 100, "n_embd": 32}))
    with pytest.raises(UsageError, match="byte tokens"):
        lm_data.lm_config(lm_data.LMWorkload(model_config=str(config)))
    lm_data.lm_config(lm_data.LMWorkload(model_config=str(config), synthetic=True))


def test_a_failed_launch_stops_the_bench_with_its_output(tmp_path):
    phase = bench.Phase(
        name="ddp",
        strategy="ddp",
        bare=False,
        launcher="python",
        cmd=[sys.executable, "-c", "import sys; print('something broke here'); sys.exit(3)"],
        run_dir=tmp_path / "runs" / "ddp",
    )
    settings = {"nproc": 1, "total_steps": 3, "launch_timeout_s": 60}
    with pytest.raises(bench.BenchError, match="exit code 3") as err:
        bench.run_phase(phase, 1, 1, settings, env=dict(os.environ))
    assert "something broke here" in str(err.value)


def test_gradients_are_bucketed_as_they_arrive():
    from dpkit.bench.collectives import greedy_buckets

    # A gradient that would overflow the bucket sends it first; one larger than the
    # bucket goes alone; a smaller first bucket (DDP's) closes early.
    assert greedy_buckets([3, 3, 3, 10, 1], cap=6) == [6, 3, 10, 1]
    assert greedy_buckets([3, 3, 3, 10, 1], cap=6, first_cap=2) == [3, 6, 10, 1]
    assert greedy_buckets([5], cap=100) == [5]
    assert sum(greedy_buckets(list(range(1, 50)), cap=7)) == sum(range(1, 50))


# ---- the real bench ---------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_tiny_bench_results_are_consistent(tmp_path, wheel_env):
    """The real bench, as a user who installed dpkit's wheel runs it, from another folder:
    every launch takes its recipe and configs from the installed package."""
    out = tmp_path / "bench"
    launch = wheel_env.run(["dpkit", "bench", *TINY_BENCH, "--output-dir", str(out)], tmp_path)
    output = launch.stdout + launch.stderr
    assert launch.returncode == 0, output[-6000:]
    results = json.loads((out / "results.json").read_text())
    assert (out / "chart.png").stat().st_size > 10_000
    table = (out / "results.md").read_text()
    assert table.strip() in output  # the table is printed at the end
    for run_ in results["runs"].values():  # the installed copies, not the checkout's
        assert any(str(wheel_env.root) in part for part in run_["command"]), run_["command"]
    for label in ("| DDP |", "| ZeRO-1 |", "| ZeRO-2 |"):
        assert label in table

    runs, comparison = results["runs"], results["comparison"]
    assert set(results["strategies"]) == {"ddp", "zero1", "zero2"} == set(comparison)
    assert set(runs) == {"ddp", "zero1", "zero2", "bare_ddp", "bare_zero1", "bare_zero2"}
    assert results["machine"]["cpu_model"] and results["machine"]["versions"]["torch"]
    assert results["machine"]["versions"]["deepspeed"]

    num_params = results["num_params"]
    total_steps = WARMUP + STEPS
    for name, r in runs.items():
        # Every run trained the same steps on the same numbers of tokens.
        assert len(r["losses"]) == total_steps and all(math.isfinite(x) for x in r["losses"]), name
        assert r["timed_steps"] == STEPS
        assert r["tokens_per_step_per_rank"] == 4 * 64
        assert r["tokens_per_s"] == pytest.approx(
            r["tokens_per_step_per_rank"] / r["median_step_time_s"] * NPROC
        )
        assert r["samples_per_s"] == pytest.approx(r["samples_per_s_per_rank"] * NPROC)
        if r["bare"]:
            continue
        assert r["run_info"]["world_size"] == NPROC
        assert r["run_info"]["strategy"] == name
        memory = r["memory"]
        assert memory["num_params"] == num_params and len(memory["ranks"]) == NPROC
        for rank in memory["ranks"]:
            # The categories add up to the total, rank by rank.
            parts = sum(rank[c] for c in bench_report.CATEGORIES)
            assert rank["total"] == pytest.approx(parts)
        worst = next(x for x in memory["ranks"] if x["rank"] == memory["worst_rank"])
        assert memory["per_rank"] == {c: worst[c] for c in (*bench_report.CATEGORIES, "total")}
        assert worst["total"] == max(x["total"] for x in memory["ranks"])

    ddp_total = runs["ddp"]["memory"]["per_rank"]["total"]
    ddp_predicted = model_state_bytes(num_params, "ddp", NPROC).total
    for name, row in comparison.items():
        total = runs[name]["memory"]["per_rank"]["total"]
        # Savings follow from the bytes.
        assert row["saved_vs_ddp_measured"] == pytest.approx(ddp_total - total)
        assert row["ratio_vs_ddp_measured"] == pytest.approx(total / ddp_total)
        predicted = model_state_bytes(num_params, name, NPROC).total
        assert row["predicted_model_states"] == pytest.approx(predicted)
        assert row["saved_vs_ddp_predicted"] == pytest.approx(ddp_predicted - predicted)
        assert row["dpkit_over_bare_step_time"] == pytest.approx(
            runs[name]["median_step_time_s"] / runs[bench.bare_run_name(name)]["median_step_time_s"]
        )
        assert math.isfinite(row["loss_max_rel_dev_vs_ddp"])
        # The bare twin trains the same model on the same batches.
        assert row["bare_loss_max_rel_dev"] < bench_report.LOSS_RTOL

    # dpkit plan for each run, gradients laid out as DeepSpeed holds them: close to the bytes.
    for name, row in comparison.items():
        plan = runs[name]["plan"]
        assert plan["strategy"] == name and plan["world_size"] == NPROC
        assert row["plan_model_states"] == plan["predicted_bytes"]["total"]
        assert abs(row["plan_error_pct"]) <= bench_report.TARGET_PLAN_ERROR_PCT, plan
    # ZeRO-2's own gradient partition is DDP's / N on every rank.
    ddp_grads = runs["ddp"]["memory"]["per_rank"]["grads"]
    for rank in runs["zero2"]["memory"]["ranks"]:
        assert rank["grads_partition"] == pytest.approx(ddp_grads / NPROC, rel=0.01)
    assert "ZeRO-2 gradients: each rank's own partition is" in table

    ddp_optimizer = runs["ddp"]["memory"]["per_rank"]["optimizer"]
    for name in ("zero1", "zero2"):
        optimizer = runs[name]["memory"]["per_rank"]["optimizer"]
        assert optimizer == pytest.approx(ddp_optimizer / NPROC, rel=0.01), name
        assert comparison[name]["loss_max_rel_dev_vs_ddp"] < bench_report.LOSS_RTOL
    assert {c["strategy"] for c in results["checks"]} == {"ddp", "zero1", "zero2"}

    # The collectives phase timed the same model's bytes in each strategy's pattern.
    comm = results["collectives"]
    assert comm["world_size"] == NPROC and comm["num_params"] == num_params
    assert (
        comm["zero_bucket_elements"]
        == runs["zero2"]["ds_config"]["zero_optimization"]["reduce_bucket_size"]
    )
    for name, pattern in comm["patterns"].items():
        assert pattern["bytes"] >= 4 * num_params, name  # fp32; the all-gather pads
        assert len(pattern["times_s"]) == comm["repeats"]
        assert pattern["median_s"] > 0 and pattern["calls"] >= 1
    assert "Communication of one step, each pattern timed alone" in table
