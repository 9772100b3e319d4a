"""Bad input over every ``dpkit`` command and the recipe's flags (issue 34's sweep): each
case exits with code 2 and exactly one line on stderr naming the field and the value,
no traceback, nothing written, and nothing already saved lost (the folder the command
runs in, with a file, an earlier export and a checkpoint-looking folder in it, is byte
for byte the same afterwards).

The commands run in this process (``dpkit.cli.main``, as ``python -m dpkit`` runs it):
every case is refused before anything starts, so no process is needed. The recipe's
cases run as ``python recipes/finetune.py`` forked from a warm process
(tests/harness.py ``WarmRecipe``). Cases tested elsewhere before this file are not
repeated here (test_bad_input.py, test_plan_check.py, test_tune_decide.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from dpkit.cli import main
from dpkit.errors import UsageError
from dpkit.train.guards import print_usage_error
from tests.harness import (
    ELASTIC_TRACEBACK,
    accelerate_cmd,
    assert_refused,
    run,
    torchrun_cmd,
)

# (id, argv, what the one line must contain). Messages are the lines a user sees,
# written out; the folder holds: afile (a file), saved/ (an earlier export), ckpt/ (an
# empty folder).
CLI_CASES = [
    ("no-command", [], "dpkit: error: the following arguments are required: command"),
    ("misspelled-command", ["plann"], "argument command: invalid choice: 'plann'"),
    (
        "plan-unknown-flag",
        ["plan", "--nproc", "2"],
        "dpkit plan: error: --nproc=2: not a flag of this command",
    ),
    (
        "plan-zero-nodes",
        ["plan", "--params", "1B", "--nodes", "0"],
        "--nodes='0': must be positive",
    ),
    (
        "plan-negative-gpus",
        ["plan", "--params", "1B", "--gpus-per-node", "-1"],
        "--gpus-per-node='-1': must be positive",
    ),
    (
        "plan-gpu-memory-unit",
        ["plan", "--params", "1B", "--gpu-memory", "80XB"],
        "--gpu-memory='80XB': unknown or missing unit",
    ),
    (
        "plan-precision",
        ["plan", "--params", "1B", "--precision", "fp8"],
        "--precision='fp8': not one of fp32, bf16, fp16",
    ),
    (
        "plan-optimizer",
        ["plan", "--params", "1B", "--optimizer", "lion"],
        "--optimizer='lion': not one of adamw, sgd, sgd_momentum, cpu_adam",
    ),
    (
        "plan-negative-micro-batch",
        ["plan", "--params", "1B", "--micro-batch", "-1"],
        "--micro-batch='-1': must be positive",
    ),
    (
        "plan-zero-seq-len",
        ["plan", "--params", "1B", "--seq-len", "0"],
        "--seq-len='0': must be positive",
    ),
    (
        "plan-headroom",
        ["plan", "--params", "1B", "--headroom", "1.5"],
        "--headroom='1.5': must be at least 0 and below 1",
    ),
    (
        "plan-reserve",
        ["plan", "--params", "1B", "--reserve", "lots"],
        "--reserve='lots': not a memory size",
    ),
    (
        "plan-missing-model-file",
        ["plan", "--model", "no_such_model.json"],
        "--model='no_such_model.json': no such file or folder",
    ),
    (
        "plan-model-and-params",
        ["plan", "--model", "gpt2", "--params", "1B"],
        "--model='gpt2' / --params='1B': give exactly one of them",
    ),
    (
        "plan-against-a-folder-without-report",
        ["plan", "--against", "ckpt"],
        "--against='ckpt': no memory_report.json",
    ),
    (
        "plan-no-model",
        ["plan"],
        "dpkit plan: error: --model / --params: neither given; give --model NAME_OR_FOLDER "
        "(gpt2, minilm, a Hub name, a folder) or --params N (e.g. 1.5B)",
    ),
    (
        "plan-against-a-file",
        ["plan", "--against", "afile"],
        "--against='afile': a file, not a run folder; give the run's output folder "
        "(the one holding memory_report.json)",
    ),
    (
        "plan-against-a-json-file",
        ["plan", "--against", "saved/zero1.json"],
        "--against='saved/zero1.json': a file, not a run folder",
    ),
    (
        "tune-micro-batch-list",
        ["tune", "--micro-batch-sizes", "3,x"],
        "--micro-batch-sizes='3,x': comma-separated positive integers",
    ),
    (
        "tune-memory-budget-unit",
        ["tune", "--memory-budget", "10QB"],
        "--memory-budget='10QB': unknown or missing unit",
    ),
    (
        "tune-tie-tolerance",
        ["tune", "--tie-tolerance", "-1"],
        "tie_tolerance=-1.0: must be in [0, 1)",
    ),
    (
        "tune-output-dir-a-file",
        ["tune", "--output-dir", "afile"],
        "--output-dir='afile': exists and is not a directory",
    ),
    ("bench-size", ["bench", "--size", "huge"], "--size='huge': one of tiny, small"),
    ("bench-zero-steps", ["bench", "--steps", "0"], "--steps=0: must be >= 1"),
    ("bench-zero-nproc", ["bench", "--nproc", "0"], "--nproc=0: must be >= 1"),
    (
        "bench-zero-override",
        ["bench", "--zero-override", "bogus"],
        "--zero-override='bogus': expected KEY=VALUE",
    ),
    (
        "bench-output-dir-a-file",
        ["bench", "--output-dir", "afile"],
        "--output-dir='afile': exists and is not a directory",
    ),
    (
        "bench-precision",
        ["bench", "--mixed-precision", "fp16"],
        "argument --mixed-precision: invalid choice: 'fp16'",
    ),
    (
        "bench-strategies",
        ["bench", "--strategies", "ddp,zero9"],
        "--strategies='ddp,zero9': a list of distinct ddp, zero1, zero2",
    ),
    ("data-no-action", ["data"], "dpkit data: error: the following arguments are required"),
    (
        "configs-no-action",
        ["configs"],
        "dpkit configs: error: the following arguments are required",
    ),
    (
        "configs-export-into-a-file",
        ["configs", "export", "afile"],
        "DIR='afile': is a file, not a folder",
    ),
    (
        "configs-export-over-an-earlier-export",
        ["configs", "export", "saved"],
        "DIR='saved': already holds",
    ),
    (
        "consolidate-without-output-dir",
        ["consolidate", "ckpt"],
        "the following arguments are required: --output-dir",
    ),
    (
        "consolidate-missing-checkpoint",
        ["consolidate", "missing", "--output-dir", "out"],
        "checkpoint='missing': no such folder",
    ),
    (
        "consolidate-output-dir-a-file",
        ["consolidate", "ckpt", "--output-dir", "afile"],
        "--output-dir='afile': exists and is not a directory",
    ),
    (
        "consolidate-into-its-checkpoint",
        ["consolidate", "ckpt", "--output-dir", "ckpt/model", "--overwrite"],
        "--output-dir='ckpt/model': inside the checkpoint it reads",
    ),
    (
        "consolidate-not-a-checkpoint",
        ["consolidate", "ckpt", "--output-dir", "out"],
        "checkpoint='ckpt': neither a dpkit checkpoint (manifest.json) nor a DeepSpeed one",
    ),
    (
        "plan-unknown-task",
        ["plan", "--model", "minilm", "--task", "seq2seq"],
        "--task='seq2seq': not one of auto, causal_lm, classification",
    ),
    (
        "plan-zero-labels",
        ["plan", "--model", "minilm", "--task", "classification", "--num-labels", "0"],
        "--num-labels='0': must be positive",
    ),
    (
        "plan-labels-for-an-lm",
        ["plan", "--model", "gpt2", "--num-labels", "3"],
        "--num-labels=3: the plan is for a causal LM (--task auto: the config names "
        "GPT2LMHeadModel); --num-labels needs --task classification",
    ),
    (
        "plan-task-of-a-bare-count",
        ["plan", "--params", "1B", "--task", "classification"],
        "--task='classification': needs --model (the head's shapes come from its config), "
        "not a bare --params",
    ),
]


def _snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every path under ``folder``: a file's bytes, None for a folder."""
    return {
        str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None
        for p in sorted(folder.rglob("*"))
    }


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """A user's folder: a file, an earlier export (edited), an empty folder."""
    (tmp_path / "afile").write_text("a file the user keeps\n")
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "zero1.json").write_text('{"edited": "by the user"}\n')
    (tmp_path / "ckpt").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize(("argv", "message"), [pytest.param(a, m, id=i) for i, a, m in CLI_CASES])
def test_dpkit_command_refuses(argv, message, workdir, capsys):
    before = _snapshot(workdir)
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse's own errors
        code = stop.code
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert code == 2, captured.err
    assert len(lines) == 1, lines  # exactly one line: no usage, no traceback
    assert lines[0].startswith("dpkit") and " error: " in lines[0], lines
    assert message in lines[0], lines[0]
    assert captured.out == ""
    assert _snapshot(workdir) == before, "a refused command must write and remove nothing"


def test_the_sweep_has_thirty_commands_cases():
    assert len({case_id for case_id, _, _ in CLI_CASES}) == len(CLI_CASES) >= 30


# The recipe: (id, flags given the work folder, what the one line must contain).
ARGS = ["--max-steps", "2", "--micro-batch-size", "16", "--max-seq-length", "64"]
RECIPE_CASES = [
    (
        "deepspeed-missing-names-the-shipped",
        lambda t: ["--deepspeed", str(t / "zero9.json")],
        "zero9.json': no such file in the current directory, and not one of dpkit's shipped "
        "configs (zero1.json, zero2.json, zero2_offload.json, zero3.json, zero3_offload.json)",
    ),
    (
        "deepspeed-given-a-yaml",
        lambda t: ["--deepspeed", _write(t / "z.yaml", "distributed_type: DEEPSPEED\n")],
        "z.yaml': not valid JSON",
    ),
    (
        "deepspeed-json-not-an-object",
        lambda t: ["--deepspeed", _write(t / "list.json", "[1, 2]")],
        "list.json': must be a JSON object",
    ),
    (
        "resume-missing-checkpoint",
        lambda t: ["--resume", str(t / "nowhere" / "step-3")],
        "step-3': no such checkpoint folder",
    ),
    (
        "strategy-against-the-jsons-stage",
        lambda t: ["--strategy", "zero2", "--deepspeed", "ds_configs/zero1.json"],
        "--strategy=zero2 conflicts with --deepspeed ds_configs/zero1.json (zero1): drop one of them",
    ),
    (
        "zero-collective-timeout",
        lambda t: ["--collective-timeout", "0"],
        "--collective-timeout=0.0: must be > 0 seconds",
    ),
    (
        "empty-fsdp-layer-classes",
        lambda t: ["--fsdp-layer-classes", ","],
        "--fsdp-layer-classes=',': name at least one class",
    ),
    ("negative-eval-steps", lambda t: ["--eval-steps", "-1"], "--eval-steps=-1: must be >= 0"),
]


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    ("make_args", "message"), [pytest.param(a, m, id=i) for i, a, m in RECIPE_CASES]
)
def test_recipe_refuses(make_args, message, tmp_path, warm_recipe):
    out = tmp_path / "run"
    result = warm_recipe.run(*ARGS, *make_args(tmp_path), "--output-dir", str(out))
    assert_refused(result, message, out, exit_code=2)


def test_resuming_a_run_without_checkpoints_keeps_the_run(tmp_path, warm_recipe):
    """--resume latest into a folder whose run saved no checkpoint: refused, and the
    earlier run's files are as they were."""
    previous = tmp_path / "previous"
    previous.mkdir()
    (previous / "run_config.json").write_text(json.dumps({"argv": ["earlier run"]}))
    (previous / "train_log.jsonl").write_text('{"step": 1, "loss": 0.69}\n')
    before = _snapshot(previous)
    result = warm_recipe.run(*ARGS, "--resume", "latest", "--output-dir", str(previous))
    assert_refused(result, "--resume=latest: no checkpoint under", None, exit_code=2)
    assert _snapshot(previous) == before


# Under the launchers users type, two processes each: torchrun, and accelerate launch
# (whose several-process launch is torch elastic too). A few cases per launcher: each
# costs a launch (about 10 s for torchrun, 20 s for accelerate on 2 CPU cores).
WARMUP_RATIO = (
    "warmup-ratio-out-of-range",
    lambda t: ["--warmup-ratio", "1.5"],
    "--warmup-ratio=1.5: must be in [0, 1)",
)
LAUNCHED_CASES = [
    ("torchrun", *WARMUP_RATIO),
    ("torchrun", *RECIPE_CASES[3]),  # --resume of a checkpoint that is not there
    ("accelerate", *WARMUP_RATIO),
    ("accelerate", *RECIPE_CASES[0]),  # --deepspeed naming a JSON that is not there
]


def _launched(launcher: str, args: list[str]) -> list[str]:
    if launcher == "torchrun":
        return torchrun_cmd(2, *args)
    return accelerate_cmd(
        ["--config_file", "ds_configs/accelerate/ddp.yaml", "--num_processes", "2"], *args
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("launcher", "make_args", "message"),
    [pytest.param(launcher, a, m, id=f"{launcher}-{i}") for launcher, i, a, m in LAUNCHED_CASES],
)
def test_under_a_launcher_the_refusal_is_the_root_cause_and_the_last_line(
    launcher, make_args, message, tmp_path
):
    """torch elastic answers a failed worker with its own traceback and a report; the
    refusal is that report's root cause (read from the worker's error file), shown once,
    and nothing follows it but the report's closing rule. The launcher exits 1; the
    refusing rank's 2 is in the report."""
    out = tmp_path / "run"
    result = run(_launched(launcher, [*ARGS, *make_args(tmp_path), "--output-dir", str(out)]))
    assert_refused(result, message, out, exit_code=1)
    root_cause = result.output.split("Root Cause (first observed failure):")[-1]
    assert "exitcode  : 2" in root_cause, result.output[-3000:]
    shown = [line for line in result.output.splitlines() if line.strip("= ")]
    assert shown[-1].startswith(ELASTIC_TRACEBACK + "finetune.py: error: "), shown[-12:]
    assert message in shown[-1], shown[-1]


@pytest.mark.parametrize("error_file_env", [None, ""], ids=["no-launcher", "log-dir-off"])
def test_without_torch_elastic_the_refusal_is_printed(
    error_file_env, tmp_path, monkeypatch, capsys
):
    """python, deepspeed and accelerate's one-process launch set no error file; torch
    elastic sets it empty when its log folder is off. The line goes to stderr."""
    if error_file_env is None:
        monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    else:
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", error_file_env)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(sys, "argv", ["recipes/finetune.py", "--warmup-ratio", "1.5"])
    print_usage_error(UsageError("--warmup-ratio=1.5: must be in [0, 1)"))
    assert capsys.readouterr().err == "finetune.py: error: --warmup-ratio=1.5: must be in [0, 1)\n"


def test_under_torch_elastic_the_refusal_is_the_error_file_the_launcher_reads(
    tmp_path, monkeypatch, capsys
):
    """Rank 0's line goes to the worker's error file, read back by torch's own reader (the
    one torchrun's report uses), and is not printed as well: it appears once."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(sys, "argv", ["recipes/finetune.py", "--warmup-ratio", "1.5"])
    print_usage_error(UsageError("--warmup-ratio=1.5: must be in [0, 1)"))
    assert capsys.readouterr().err == ""
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(error_file))
    assert failure.message == "finetune.py: error: --warmup-ratio=1.5: must be in [0, 1)"
