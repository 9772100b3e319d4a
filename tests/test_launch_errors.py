"""Bad launches stop with one line and exit code 2, before any process group starts or any file is written."""

from __future__ import annotations

import json

import pytest

from tests.harness import (
    REPO,
    SHORT_RUN,
    accelerate_cmd,
    assert_refused,
    deepspeed_cmd,
    python_cmd,
    run,
)

pytestmark = pytest.mark.multiprocess


def test_sequence_length_over_the_model_limit(tmp_path):
    out = tmp_path / "run"
    result = run(python_cmd(*SHORT_RUN, "--max-seq-length", "4096", "--output-dir", str(out)))
    assert result.returncode == 2
    assert_refused(result, "--max-seq-length=4096: over the model's limit of 512 positions", out)


def test_missing_model_folder(tmp_path):
    out = tmp_path / "run"
    result = run(python_cmd(*SHORT_RUN, "--model", "./no/such/model", "--output-dir", str(out)))
    assert result.returncode == 2
    assert_refused(result, "--model='./no/such/model': no such model folder", out)


def test_strategy_flag_that_contradicts_the_deepspeed_config(tmp_path):
    out = tmp_path / "run"
    cmd = deepspeed_cmd(
        2,
        *SHORT_RUN,
        "--deepspeed",
        "ds_configs/zero2.json",
        "--strategy",
        "zero1",
        "--output-dir",
        str(out),
    )
    assert_refused(
        run(cmd), "--strategy=zero1 conflicts with --deepspeed ds_configs/zero2.json (zero2)", out
    )


def test_accelerate_cpu_flag_with_several_processes_says_what_to_use(tmp_path):
    out = tmp_path / "run"
    cmd = accelerate_cmd(["--cpu", "--num_processes", "2"], *SHORT_RUN, "--output-dir", str(out))
    result = run(cmd)
    assert_refused(result, "use `accelerate launch --multi_gpu --num_processes N`", out)


def test_deepspeed_json_value_that_contradicts_the_flags(tmp_path):
    config = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    config["train_micro_batch_size_per_gpu"] = 4
    path = tmp_path / "my_zero2.json"
    path.write_text(json.dumps(config))
    out = tmp_path / "run"
    result = run(python_cmd(*SHORT_RUN, "--deepspeed", str(path), "--output-dir", str(out)))
    assert result.returncode == 2
    assert_refused(result, "train_micro_batch_size_per_gpu=4 disagrees with the recipe's 16", out)
