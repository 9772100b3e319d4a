"""One argument system (dpkit/arguments.py): every ``dpkit`` command and every recipe
refuses bad input with one line, ``PROG: error: MESSAGE``, exit code 2, and an unknown
flag is named with the closest flag there is, whichever parser met it.

The lines are written out as a user sees them. The commands run in this process
(``dpkit.cli.main``); the recipe's flags through ``dpkit.parse_args``, as a recipe calls it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import dpkit
from dpkit.arguments import OneLineParser, unknown_flag_message
from dpkit.cli import main


def _refused(capsys, call) -> str:
    """What ``call`` printed on stderr, once it exited with code 2 and printed nothing else."""
    try:
        code = call()
    except SystemExit as stop:
        code = stop.code
    captured = capsys.readouterr()
    assert code == 2, captured.err
    assert captured.out == ""
    return captured.err


@pytest.fixture
def recipe(monkeypatch):
    """The process as a recipe started by a launcher's rank 0: ``finetune.py``."""
    monkeypatch.setattr(sys, "argv", ["finetune.py"])
    monkeypatch.setenv("RANK", "0")


# ---- the same misspelled flag, under the dpkit command and under a recipe ------------------


def test_a_misspelled_flag_under_dpkit_plan_is_one_line_naming_the_closest(capsys):
    err = _refused(capsys, lambda: main(["plan", "--params", "1B", "--lora-rr", "8"]))
    assert (
        err
        == "dpkit plan: error: --lora-rr=8: not a flag of this command; did you mean --lora-r?\n"
    )


def test_a_misspelled_flag_under_a_recipe_is_one_line_naming_the_closest(capsys, recipe):
    err = _refused(capsys, lambda: dpkit.parse_args(dpkit.StrategyConfig, argv=["--lora-rr", "8"]))
    assert (
        err
        == "finetune.py: error: --lora-rr=8: not a flag of this recipe; did you mean --lora-r?\n"
    )


# argparse takes a flag's unique prefix for the flag (``--lora-target-module`` is
# ``--lora-target-modules``), so the misspellings here are not prefixes.
@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["--lora-target-modles", "q"],
            "--lora-target-modles=q: not a flag of this {}; did you mean --lora-target-modules?",
        ),
        (["--lora_rr=8"], "--lora_rr=8: not a flag of this {}; did you mean --lora-r?"),
        (["--no-such-flag"], "--no-such-flag: not a flag of this {}"),
    ],
)
def test_the_command_and_the_recipe_refuse_the_same_flag_in_the_same_shape(
    argv, said, capsys, recipe
):
    command = _refused(capsys, lambda: main(["plan", *argv]))
    assert command == f"dpkit plan: error: {said.format('command')}\n"
    script = _refused(capsys, lambda: dpkit.parse_args(dpkit.StrategyConfig, argv=argv))
    assert script == f"finetune.py: error: {said.format('recipe')}\n"


def test_a_bare_word_is_the_same_refusal_under_both(capsys, recipe):
    command = _refused(capsys, lambda: main(["plan", "zero2"]))
    script = _refused(capsys, lambda: dpkit.parse_args(dpkit.StrategyConfig, argv=["zero2"]))
    unexpected = "'zero2': unexpected argument (flags take the form --name value)\n"
    assert command == f"dpkit plan: error: {unexpected}"
    assert script == f"finetune.py: error: {unexpected}"


# ---- subcommands: the refusal names the subcommand and its flags, no usage block ----------


def test_an_unknown_flag_of_a_subcommand_is_one_line_without_usage(capsys, tmp_path):
    out = tmp_path / "out"
    err = _refused(
        capsys,
        lambda: main(["consolidate", str(tmp_path), "--output-dir", str(out), "--overwirte"]),
    )
    assert err == (
        "dpkit consolidate: error: --overwirte: not a flag of this command; "
        "did you mean --overwrite?\n"
    )
    assert not out.exists()


def test_an_unknown_flag_of_a_nested_subcommand_names_it(capsys, tmp_path):
    err = _refused(capsys, lambda: main(["configs", "export", str(tmp_path / "d"), "--force"]))
    assert err == "dpkit configs export: error: --force: not a flag of this command\n"
    assert "usage" not in err
    assert not (tmp_path / "d").exists()


def test_argparse_own_errors_stay_one_line(capsys):
    err = _refused(capsys, lambda: main(["bench", "--mixed-precision", "fp16"]))
    assert err.startswith("dpkit bench: error: argument --mixed-precision: invalid choice: 'fp16'")
    assert err.count("\n") == 1


def test_the_trainer_baseline_refuses_as_the_commands_do(capsys):
    from dpkit.bench.trainer_baseline import parse_args

    flags = ["--strategy", "ddp", "--micro-batch-size", "4", "--max-steps", "1"]
    flags += ["--max-seq-length", "8", "--output-dir", "out", "--max-eval-sampels", "10"]
    err = _refused(capsys, lambda: parse_args(flags))
    assert err == (
        "dpkit.bench.trainer_baseline: error: --max-eval-sampels=10: not a flag of this "
        "command; did you mean --max-eval-samples?\n"
    )


# ---- the message itself ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("remaining", "message"),
    [
        (["--max_stpes", "3"], "--max_stpes=3: not a flag of this recipe; did you mean --max-steps?"),
        (["--max-stpes=3", "--x"], "--max-stpes=3: not a flag of this recipe; did you mean --max-steps?"),
        (["--max-stpes", "--seed", "1"], "--max-stpes: not a flag of this recipe; did you mean --max-steps?"),
        (["--zzz", "1"], "--zzz=1: not a flag of this recipe"),
        (["zero2"], "'zero2': unexpected argument (flags take the form --name value)"),
    ],
)  # fmt: skip
def test_the_unknown_flag_message(remaining, message):
    # transformers adds both spellings of a field's flag: the dashed one is suggested.
    flags = ["--max_steps", "--max-steps", "--seed", "--help"]
    assert unknown_flag_message(remaining, flags, "recipe") == message


def test_a_flag_hidden_from_help_is_not_suggested(capsys):
    parser = OneLineParser(prog="prog")
    parser.add_argument("--secret-knob", help=__import__("argparse").SUPPRESS)
    parser.add_argument("--seed")
    err = _refused(capsys, lambda: parser.parse_args(["--secret-knb", "1"]))
    assert err == "prog: error: --secret-knb=1: not a flag of this command\n"


@pytest.mark.subprocess_only
def test_the_parser_imports_neither_torch_nor_transformers():
    code = (
        "import sys, dpkit.arguments, dpkit.cli\n"
        "print(*(m in sys.modules for m in ('torch', 'transformers', 'deepspeed')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["False", "False", "False"], done.stderr[-2000:]
