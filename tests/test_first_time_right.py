"""A user's own files and folders (issue 34): shipped configs from any directory, config
paths found beside the YAML that names them, the input checked before the model loads,
transformers' load report said in one line when all it says is a new head.

Expectations are the shipped files' own bytes (read from ``ds_configs/`` in the
repository, not from dpkit's packaged copies) and the exact lines a user sees.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dpkit.config_files import find_config, launcher_yaml
from dpkit.errors import UsageError
from tests.harness import REPO, assert_refused, error_lines, launch_env

# What accelerate launch leaves in the environment for a DeepSpeed YAML (accelerate 1.15,
# utils/launch.py): the YAML's deepspeed_config_file as written, and its launch marker.
ACCELERATE_DS_ENV = {"ACCELERATE_USE_DEEPSPEED": "true"}
# Small and quick: the runs here are refused before any of it matters.
ARGS_QUICK = ["--max-steps", "2", "--micro-batch-size", "16", "--max-seq-length", "64"]


def test_a_shipped_name_is_dpkits_copy_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ds_configs/ here, as beside a user's own script
    shipped = (REPO / "ds_configs" / "zero2.json").read_bytes()
    for name in ("ds_configs/zero2.json", "zero2.json", "./ds_configs/zero2.json"):
        found = find_config(name, "--deepspeed")
        assert Path(found.path).read_bytes() == shipped, name
        assert found.note.startswith(f"--deepspeed: {name!r} is not in the current directory")
    # A path that merely ends like a shipped one is the user's, never ours.
    for name in ("other/zero2.json", str(tmp_path / "zero2.json")):
        with pytest.raises(UsageError, match="no such file"):
            find_config(name, "--deepspeed")


def test_a_local_file_wins_over_the_shipped_copy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds_configs").mkdir()
    (tmp_path / "ds_configs" / "zero2.json").write_text('{"zero_optimization": {"stage": 1}}')
    found = find_config("ds_configs/zero2.json", "--deepspeed")
    assert found.path == "ds_configs/zero2.json" and found.note is None


def test_a_yaml_key_is_found_beside_the_yaml(tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "mine.json").write_text("{}")
    found = find_config("mine.json", "cfg/run.yaml deepspeed_config_file", beside=tmp_path / "cfg")
    assert found.path == str(tmp_path / "cfg" / "mine.json")
    assert "relative to the YAML's folder" in found.note


def test_the_yaml_is_read_from_the_accelerate_command_line():
    env = {"ACCELERATE_USE_DEEPSPEED": "true"}
    argv = ["/venv/bin/accelerate", "launch", "--config_file", "/a/b/zero2.yaml", "own.py"]
    assert launcher_yaml(env, argv) == Path("/a/b/zero2.yaml")
    assert launcher_yaml(env, ["accelerate", "launch", "--config-file=/c/d.yaml", "x.py"]) == Path(
        "/c/d.yaml"
    )
    assert launcher_yaml(env, ["accelerate", "launch", "x.py"]) is None  # no --config_file
    # The script's own --config_file is the script's (accelerate's parser reads the line).
    own_flag = ["accelerate", "launch", "x.py", "--config_file", "/mine.yaml"]
    assert launcher_yaml(env, own_flag) is None
    assert launcher_yaml({}, argv) is None  # not an accelerate launch
    torchrun = ["/venv/bin/torchrun", "--config_file", "/a/b/zero2.yaml", "own.py"]
    assert launcher_yaml(env, torchrun) is None  # another launcher's flag


# A script of the user's own that resolves its run and starts it (the process group, and
# the run's notes logged), no model: enough to see which DeepSpeed JSON each rank runs.
_RESOLVE_SCRIPT = """
import os
import dpkit
from dpkit.models import ModelSizes
run = dpkit.setup(model=ModelSizes(num_params=1000, hidden_size=8, largest_param_numel=64),
                  micro_batch_size=2)
run.accelerator.wait_for_everyone()
line = f"resolved {run.strategy.name} {run.resolution.settings.ds_config_path}\\n"
os.write(1, line.encode())  # one write: the two ranks' lines do not interleave
"""


@pytest.mark.multiprocess
def test_a_yaml_from_another_folder_finds_its_json(tmp_path):
    """A real ``accelerate launch --config_file YAML --num_processes 2 own.py`` from a
    folder without ds_configs/: a user's YAML naming ``mine.json`` (not a shipped name)
    finds it beside the YAML, said once. (The shipped zero2.yaml from another folder,
    which finds dpkit's copy of ``ds_configs/zero2.json``, is tests/test_toolkit.py's
    README example launch, against the wheel.)"""
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    shipped_yaml = REPO / "ds_configs/accelerate/zero2.yaml"
    (cfg / "mine.json").write_text((REPO / "ds_configs/zero2.json").read_text())
    (cfg / "run.yaml").write_text(
        shipped_yaml.read_text().replace("ds_configs/zero2.json", "mine.json")
    )
    yaml_arg, note = "../cfg/run.yaml", "(relative to the YAML's folder)"
    script = tmp_path / "own.py"
    script.write_text(_RESOLVE_SCRIPT)
    work = tmp_path / "work"
    work.mkdir()
    accelerate = str(Path(sys.executable).parent / "accelerate")
    cmd = [accelerate, "launch", "--config_file", yaml_arg, "--num_processes", "2", str(script)]
    result = subprocess.run(
        cmd, cwd=work, env=launch_env(), capture_output=True, text=True, timeout=300
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    resolved = [line.split() for line in result.stdout.splitlines() if line.startswith("resolved")]
    assert len(resolved) == 2 and resolved[0] == resolved[1], output[-3000:]
    _, strategy, path = resolved[0]
    assert strategy == "zero2"
    assert path == str(cfg / "mine.json")
    # Said once for the job, by the main process, when the run starts.
    assert len([line for line in output.splitlines() if note in line]) == 1, output[-3000:]


@pytest.mark.multiprocess
def test_a_yaml_naming_a_missing_json_is_one_line_naming_the_yaml(tmp_path):
    """The same launch with a YAML whose deepspeed_config_file exists nowhere: one line
    (rank 0's) naming the YAML, its key, the path and where it was looked for."""
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    shipped_yaml = (REPO / "ds_configs/accelerate/zero2.yaml").read_text()
    (cfg / "run.yaml").write_text(shipped_yaml.replace("ds_configs/zero2.json", "missing.json"))
    (tmp_path / "own.py").write_text(_RESOLVE_SCRIPT)
    work = tmp_path / "work"
    work.mkdir()
    accelerate = str(Path(sys.executable).parent / "accelerate")
    cmd = [accelerate, "launch", "--config_file", "../cfg/run.yaml", "--num_processes", "2"]
    result = subprocess.run(
        [*cmd, str(tmp_path / "own.py")],
        cwd=work, env=launch_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    errors = error_lines(output, "own.py")
    assert errors == [
        f"own.py: error: {cfg / 'run.yaml'} deepspeed_config_file='missing.json': no such file "
        f"in the current directory or {cfg}, and not one of dpkit's shipped configs "
        "(zero1.json, zero2.json, zero2_offload.json, zero3.json, zero3_offload.json)"
    ], output[-3000:]
    assert "Traceback" not in result.stdout


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param('{"train_batch_size": "auto",}', "not valid JSON", id="malformed"),
        # The batch identity needs the flags and the world size, not the weights:
        # micro-batch 16 x accumulation 1 x 1 process (ARGS_QUICK) is not 48.
        pytest.param(
            '{"train_batch_size": 48, "zero_optimization": {"stage": 2}}',
            "train_batch_size=48 disagrees with the recipe's 16",
            id="batch-identity",
        ),
    ],
)
def test_a_bad_deepspeed_json_is_refused_before_the_model_loads(
    text, message, tmp_path, warm_recipe
):
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    out = tmp_path / "run"
    result = warm_recipe.run(*ARGS_QUICK, "--deepspeed", str(bad), "--output-dir", str(out))
    assert_refused(result, message, out, exit_code=2)
    # Loading the model logs its report (the table, or dpkit's line for a new head).
    assert "LOAD REPORT" not in result.output and "head (" not in result.output, result.output


def test_the_tune_winners_command_runs_without_the_virtualenv_on_path(tmp_path):
    """command.sh with PATH=/usr/bin:/bin (no virtualenv): it still starts the winner's
    launch. A flag the recipe refuses ends it at the recipe's argument parsing, so what
    is checked is that the launcher and the recipe ran, not 127 (command not found)."""
    from dpkit.tune import report
    from dpkit.tune.config import RecipeInfo, TuneConfig, TuneSettings
    from dpkit.tune.decide import Decision
    from dpkit.tune.space import Candidate
    from dpkit.tune.trials import OK, Trial

    settings = TuneSettings(
        config=TuneConfig(recipe_args=("--size", "tiny")),
        recipe=RecipeInfo(REPO / "recipes" / "train_lm.py", frozenset(), 4),
        nproc=2, device="cpu", global_batch_size=8, per_rank_batch=4, baseline_micro_batch=4,
        micro_batch_sizes=(4,), precision="no", memory_budget=None, threads_per_process=1,
        output_dir=tmp_path,
    )  # fmt: skip
    trial = Trial(Candidate("ddp", 4, 1), status=OK, figures={"median_step_time_s": 1.0})
    decision = Decision(trial, None, None, [trial.name], "fastest", {}, 2e-3)
    where = report.write_winner(settings, decision, tmp_path)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        ["bash", str(where / "command.sh"), "--no-such-flag"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode not in (0, 127), output[-3000:]
    refusals = error_lines(output, "train_lm.py")
    assert refusals == ["train_lm.py: error: --no-such-flag: not a flag of this recipe"], output[
        -3000:
    ]


# A script of the user's own on dpkit's API (README's four calls), one process, a tiny
# BERT classifier; it writes its parameter count as torch counts it, for the test (paths
# come in the environment: dpkit.setup() refuses command-line arguments it does not know).
_OWN_SCRIPT = """
import json, os, torch, transformers
import dpkit
config = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
    num_attention_heads=2, intermediate_size=32, max_position_embeddings=32, num_labels=2)
model = transformers.BertForSequenceClassification(config)
run = dpkit.setup(model=model, micro_batch_size=2, output_dir=os.environ["OUT"])
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = [{"input_ids": torch.randint(0, 64, (8,)), "labels": torch.tensor(i % 2)} for i in range(8)]
loader = torch.utils.data.DataLoader(data, batch_size=2)
model, optimizer, loader = run.prepare(model, optimizer, loader)
for step, batch in enumerate(loader, start=1):
    run.accelerator.backward(model(**batch).loss)
    optimizer.step()
    optimizer.zero_grad()
run.finish(step=step)
psi = sum(p.numel() for p in run.accelerator.unwrap_model(model).parameters())
json.dump({"params": psi}, open(os.environ["COUNTED"], "w"))
"""


def test_plan_against_a_run_of_an_own_api_script(tmp_path):
    from dpkit.plan.check import check_run

    script, out, counted = tmp_path / "own.py", tmp_path / "out", tmp_path / "counted.json"
    script.write_text(_OWN_SCRIPT)
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
        env=launch_env(OUT=str(out), COUNTED=str(counted)), timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    psi = json.loads(counted.read_text())["params"]
    check = check_run(out)
    # One fp32 DDP process with AdamW: 4 bytes of parameter and of gradient per parameter,
    # 8 of moments (ZeRO paper's accounting), nothing of a master copy.
    states = ("params", "grads", "optimizer", "master", "total")
    assert {k: check.predicted[k] for k in states} == {
        "params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi, "master": 0, "total": 16 * psi,
    }  # fmt: skip
    # Since issue #30 the check also sets buffers and activations beside the run's.
    assert {"buffers", "activations"} <= set(check.predicted) & set(check.measured)
    assert (check.strategy, check.world_size, check.precision) == ("ddp", 1, "fp32")


def test_configs_export_writes_every_shipped_config_naming_its_copies(tmp_path):
    """`dpkit configs export DIR`: the repository's ds_configs/ files, each YAML's
    deepspeed_config_file the exported JSON's absolute path (usable from anywhere)."""
    import yaml

    from dpkit.cli import main

    assert main(["configs", "export", str(tmp_path / "mine")]) == 0
    exported = sorted(
        str(p.relative_to(tmp_path / "mine")) for p in (tmp_path / "mine").rglob("*.*")
    )
    shipped = sorted(
        str(p.relative_to(REPO / "ds_configs")) for p in (REPO / "ds_configs").rglob("*.*")
    )
    assert exported == shipped
    for name in ("zero1", "zero2"):
        config = yaml.safe_load((tmp_path / "mine" / "accelerate" / f"{name}.yaml").read_text())
        named = Path(config["deepspeed_config"]["deepspeed_config_file"])
        assert named == tmp_path / "mine" / f"{name}.json"
        assert named.read_bytes() == (REPO / "ds_configs" / f"{name}.json").read_bytes()
    ddp = (tmp_path / "mine" / "accelerate" / "ddp.yaml").read_text()
    assert ddp == (REPO / "ds_configs" / "accelerate" / "ddp.yaml").read_text()


def test_the_trainer_recipe_refuses_a_bad_deepspeed_json_before_the_model_loads(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"zero_optimization": {"stage": 2},}')
    result = subprocess.run(
        [sys.executable, str(REPO / "recipes" / "trainer_finetune.py"), "--deepspeed", str(bad),
         "--output_dir", str(tmp_path / "out")],
        cwd=tmp_path, env=launch_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert errors == [
        f"trainer_finetune.py: error: deepspeed config {str(bad)!r}: not valid JSON "
        "(Expecting property name enclosed in double quotes: line 1 column 36 (char 35))"
    ], output[-3000:]
    assert "LOAD REPORT" not in output and "head (" not in output, output[-3000:]
    assert not (tmp_path / "out").exists()
