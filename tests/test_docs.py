"""The docs checked against the code, where a check is cheap (fast, no launches).

* **Checkpoint files**: the listing in docs/checkpoints.md (and its LoRA paragraph)
  against real checkpoints, sharded and full, plain and LoRA: a tiny BERT trained one
  AdamW step by accelerate in this process (no process group) and saved by dpkit's
  Checkpointer, as tests/test_warm_start.py saves one.
* **Flags**: every ``--flag`` in README.md and docs/*.md against the ``--help`` of the
  command it is given to (``dpkit plan``, ``recipes/finetune.py``, ``accelerate launch``,
  ``torchrun``, ``deepspeed``...), each parser built in this process; a flag named in
  prose, outside a command, must be a flag of one of them.
* **Links**: every relative markdown link resolves (the repository paths the docs name
  in their text are checked with every other file's by tests/test_architecture.py).
* **The shipped YAMLs' headers**: true wherever ``dpkit configs export`` puts them.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.harness import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def relative(path: Path) -> str:
    return str(path.relative_to(REPO))


# ---- checkpoint files ---------------------------------------------------------------------


def save_tiny_checkpoint(out: Path, checkpoint_format: str, lora: bool) -> Path:
    """A real checkpoint of a 2-layer BERT classifier after one AdamW step, with an lr
    scheduler and no tokenizer, as a 1-process DDP run writes it."""
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from transformers import BertConfig, BertForSequenceClassification

    from dpkit.checkpoints.checkpointer import Checkpointer, Position
    from dpkit.engines import STRATEGIES, engine_of
    from dpkit.lora import LoraSettings, apply_lora
    from dpkit.train.output import RunOutput
    from dpkit.train.run import RunInfo

    accelerator = Accelerator(cpu=True)
    try:
        torch.manual_seed(0)
        config = BertConfig(
            vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=64,
        )  # fmt: skip
        model = BertForSequenceClassification(config)
        if lora:
            model = apply_lora(model, LoraSettings(r=2, alpha=2.0))
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        tokens = torch.arange(16).reshape(2, 8)
        accelerator.backward(model(input_ids=tokens, labels=torch.tensor([0, 1])).loss)
        optimizer.step()
        scheduler.step()
        info = RunInfo(
            strategy="ddp", strategy_source="test", distributed_type="NO", world_size=1,
            backend=None, device="cpu", wrapper=type(model).__name__, zero_stage=0,
            precision="no", micro_batch_size=2, gradient_accumulation_steps=1,
            global_batch_size=2, learning_rate=1e-2, num_params=0,
        )  # fmt: skip
        strategy = STRATEGIES["ddp"]
        run = SimpleNamespace(
            accelerator=accelerator, output=RunOutput(str(out), True), info=info,
            strategy=strategy, engine=engine_of(strategy),
        )  # fmt: skip
        checkpointer = Checkpointer(
            run, out, seed=0, model_name="tiny-bert", checkpoint_format=checkpoint_format
        )
        return checkpointer.save(model, optimizer, scheduler, Position(step=1))
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[tuple[str, bool], Path]:
    """(format, LoRA) -> a checkpoint folder, for both formats, with and without LoRA."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        (fmt, lora): save_tiny_checkpoint(root / f"{fmt}-lora{int(lora)}", fmt, lora)
        for fmt in ("sharded", "full")
        for lora in (False, True)
    }


def documented_layout() -> dict[str, str]:
    """docs/checkpoints.md's listing of a checkpoint folder: file name -> its qualifier
    (``sharded``, ``full only``, ``fp16 only``, or ``""`` for every checkpoint)."""
    text = (REPO / "docs" / "checkpoints.md").read_text()
    block = text.split("```\nstep-000100/\n", 1)[1].split("```", 1)[0]
    layout = {}
    for line in block.splitlines():
        if not line.startswith("  ") or line.startswith("   "):
            continue  # a description's continuation line
        names, description = re.split(r"\s{2,}", line.strip(), maxsplit=1)
        qualifier = re.match(r"(sharded|full only|fp16 only):", description)
        for name in names.split(", "):
            if name != "tokenizer files":  # none here: the checkpoints are saved without one
                layout[name.rstrip("/")] = qualifier.group(1) if qualifier else ""
    return layout


def test_the_listing_is_read_as_the_doc_writes_it():
    """The parse itself, on the names the doc has always listed (so a listing that stops
    parsing fails here, not as an empty comparison)."""
    layout = documented_layout()
    assert layout["shards"] == "sharded" and layout["model.safetensors"] == "full only"
    assert layout["loss_scale.json"] == "fp16 only" and layout["manifest.json"] == ""


@pytest.mark.parametrize("checkpoint_format", ["sharded", "full"])
def test_a_checkpoint_holds_the_files_the_listing_names(checkpoints, checkpoint_format):
    """Every file of a fp32 checkpoint is listed, and every listed file is there unless
    the listing says it belongs to the other format or to fp16 (whose loss scaler needs
    a CUDA device: not produced here)."""
    other = {"sharded": "full only", "full": "sharded"}[checkpoint_format]
    expected = {
        name
        for name, qualifier in documented_layout().items()
        if qualifier not in (other, "fp16 only")
    }
    path = checkpoints[(checkpoint_format, False)]
    assert {p.name for p in path.iterdir()} == expected
    if checkpoint_format == "sharded":  # ".metadata and __<rank>_0.distcp, one file per rank"
        assert sorted(p.name for p in (path / "shards").iterdir()) == [".metadata", "__0_0.distcp"]


def lora_paragraph() -> str:
    text = (REPO / "docs" / "checkpoints.md").read_text()
    return text.split("- **LoRA** (`--lora-r`):", 1)[1].split("\n- ", 1)[0].split("\n\n", 1)[0]


def test_the_lora_paragraph_names_the_files_a_lora_checkpoint_adds(checkpoints):
    """The files the LoRA paragraph names are those a LoRA checkpoint holds beyond a plain
    one: named before ``--checkpoint-format full`` in the paragraph, in every LoRA
    checkpoint; named after it, in a full one only."""
    paragraph = lora_paragraph()
    before, _, after = paragraph.partition("`--checkpoint-format full`")
    assert after, "the LoRA paragraph no longer says what a full checkpoint adds"
    files = r"`([\w.-]+\.(?:json|safetensors|pt|md|bin))`"
    in_every = set(re.findall(files, before)) - {"model.safetensors"}  # a full file, said so
    in_full = set(re.findall(files, after)) - {"model.safetensors"}
    for fmt, named in (("sharded", in_every), ("full", in_every | in_full)):
        added = {p.name for p in checkpoints[(fmt, True)].iterdir()} - {
            p.name for p in checkpoints[(fmt, False)].iterdir()
        }
        assert added == named, (fmt, added, named)


# ---- flags --------------------------------------------------------------------------------


def help_of(build: object, argv: tuple[str, ...] = ("prog", "--help")) -> str:
    """What ``--help`` prints, in this process: ``build()`` either returns a parser or
    parses ``--help`` itself (and exits, as argparse does). ``argv``: the command line
    while it runs (accelerate's help formatter hides flags by what ``sys.argv`` holds)."""
    out = io.StringIO()
    saved = sys.argv
    sys.argv = list(argv)
    try:
        with contextlib.redirect_stdout(out):
            try:
                parser = build()  # type: ignore[operator]
            except SystemExit:
                return out.getvalue()
        return parser.format_help()
    finally:
        sys.argv = saved


def recipe_help(module_name: str) -> str:
    """A recipe's ``--help``: its ``main()`` run with ``--help`` as the command line (it
    parses before doing anything else); dpkit's logger left as it was."""
    import importlib

    dpkit_logger = logging.getLogger("dpkit")
    saved = (dpkit_logger.level, list(dpkit_logger.handlers), dpkit_logger.propagate)
    module = importlib.import_module(module_name)
    try:
        return help_of(module.main, (f"{module_name.rsplit('.', 1)[-1]}.py", "--help"))
    finally:
        dpkit_logger.setLevel(saved[0])
        dpkit_logger.handlers[:] = saved[1]
        dpkit_logger.propagate = saved[2]


def dpkit_help(command: str) -> str:
    from dpkit.cli import build_parser

    return help_of(lambda: build_parser(command).parse_args([command, "--help"]))


def deepspeed_help() -> str:
    from deepspeed.launcher.runner import parse_args

    return help_of(lambda: parse_args(["--help"]))


def flags_in(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[A-Za-z][\w-]*", text))


@pytest.fixture(scope="module")
def command_flags() -> dict[str, set[str]]:
    """Each command the docs give flags to -> the flags its ``--help`` names."""
    from accelerate.commands.launch import launch_command_parser
    from torch.distributed.run import get_args_parser

    from dpkit.cli import COMMANDS, build_parser

    helps = {f"dpkit {name}": dpkit_help(name) for name in COMMANDS}
    helps["dpkit"] = help_of(build_parser)
    helps["recipes/finetune.py"] = recipe_help("recipes.finetune")
    helps["recipes/finetune_lm.py"] = recipe_help("recipes.finetune_lm")
    helps["recipes/train_lm.py"] = recipe_help("recipes.train_lm")
    helps["recipes/trainer_finetune.py"] = recipe_help("recipes.trainer_finetune")
    helps["accelerate launch"] = help_of(launch_command_parser, ("accelerate", "launch", "--help"))
    helps["torchrun"] = help_of(get_args_parser)
    helps["deepspeed"] = deepspeed_help()
    from tests import mutation_report

    helps["tests/mutation_report.py"] = help_of(lambda: mutation_report.main(["--help"]))
    # The README's own script: dpkit.setup(args=None) parses the strategy's flags.
    from dpkit.arguments import dataclass_parser
    from dpkit.train.config import StrategyConfig

    helps["train.py"] = help_of(lambda: dataclass_parser([StrategyConfig]))
    return {command: flags_in(text) for command, text in helps.items()}


# Flags of programs dpkit does not parse, as docs/multinode.md and docs/checkpoints.md use
# them: Slurm's sbatch/srun and pytest.
OTHER_PROGRAMS = {
    "slurm": {"--nodes", "--ntasks-per-node", "--cpus-per-task", "--job-name", "--time",
              "--kill-on-bad-exit", "--gpus-per-node"},
    "pytest": {"--basetemp"},
}  # fmt: skip
# Placeholders in the docs' examples of a refusal (``--flag='value': ...``, ``--x=3``).
PLACEHOLDERS = {"--flag", "--x"}

RECIPES = (
    "recipes/finetune.py",
    "recipes/finetune_lm.py",
    "recipes/train_lm.py",
    "recipes/trainer_finetune.py",
)
SUBCOMMANDS = ("data", "plan", "bench", "tune", "configs", "report", "consolidate")


def command_at(tokens: list[str], index: int) -> str | None:
    """The command that ``tokens[index]`` starts, or None."""
    token = tokens[index].strip("`'\"();,")
    following = tokens[index + 1].strip("`'\"();,") if index + 1 < len(tokens) else ""
    for script in (*RECIPES, "tests/mutation_report.py"):
        if token in (script, Path(script).name):
            return script
    if token == "train.py":
        return "train.py"
    if token.endswith(".py"):
        return "unknown"  # a script the docs do not give flags to (docs/scripts/*.py)
    if token == "--":
        return "unknown"  # dpkit tune's arguments for the recipe it names
    # A program's name starts a command where a flag or a script follows it (not in
    # prose such as "# torchrun (any strategy through --strategy)").
    starts = following.startswith("-") or following.endswith(".py")
    if token == "dpkit":
        if following in SUBCOMMANDS:
            return f"dpkit {following}"
        return "dpkit" if starts else None
    if token == "accelerate" and following == "launch":
        return "accelerate launch"
    if token in ("torchrun", "deepspeed") and starts:
        return token
    if token in ("srun", "sbatch", "#SBATCH"):
        return "slurm"
    if token == "pytest":
        return "pytest"
    if token in ("make", "pip"):
        return "unknown"
    return None


def commands_in(text: str) -> list[str]:
    """The pieces of ``text`` that hold commands: inline code spans (which may wrap over
    lines) and the lines of fenced code blocks (a trailing ``\\`` joins the next)."""
    pieces = []
    fence = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
    for block in fence.findall(text):
        pieces += block.replace("\\\n", " ").splitlines()
    prose = fence.sub("", text)
    pieces += re.findall(r"`([^`]+)`", prose)
    pieces.append(re.sub(r"`[^`]+`", " ", prose))  # flags named in plain prose
    return pieces


def flag_uses() -> list[tuple[str, str, str | None]]:
    """(doc, flag, the command it is given to or None) for every flag the docs name."""
    uses = []
    for doc in DOCS:
        for piece in commands_in(doc.read_text()):
            tokens = piece.split()
            command = None
            for index, token in enumerate(tokens):
                command = command_at(tokens, index) or command
                for flag in flags_in(token):
                    uses.append((relative(doc), flag, command))
    return uses


def test_the_docs_name_flags_of_every_kind():
    """The scan finds flags given to each kind of command (so a scan that stops finding
    them fails here, not as an empty check)."""
    commands = {command for _, _, command in flag_uses()}
    for command in ("dpkit plan", "dpkit bench", "dpkit tune", "dpkit consolidate",
                    "recipes/finetune.py", "recipes/finetune_lm.py", "recipes/train_lm.py",
                    "accelerate launch",
                    "torchrun", "deepspeed", "train.py", None):  # fmt: skip
        assert command in commands, command


def test_every_flag_the_docs_name_is_a_flag_of_its_command(command_flags):
    every = set().union(*command_flags.values(), *OTHER_PROGRAMS.values(), PLACEHOLDERS)
    wrong = []
    for doc, flag, command in flag_uses():
        if command in command_flags:
            known = command_flags[command] | PLACEHOLDERS
        elif command in OTHER_PROGRAMS:
            known = OTHER_PROGRAMS[command]
        else:  # prose, or a script whose flags are its own: a flag of some command
            known = every
        if flag not in known:
            wrong.append(f"{doc}: {flag} ({command or 'no command'})")
    assert not wrong, "flags the docs name that their command does not take:\n" + "\n".join(
        sorted(set(wrong))
    )


# ---- links -------------------------------------------------------------------------------
# Repository paths named in the text (recipes/finetune.py, ds_configs/zero2.json,
# docs/plan.md) are checked for every file of the tree, docs included, by
# tests/test_architecture.py::test_every_cited_path_exists; links are relative to the doc.


def test_every_relative_link_resolves():
    """``[text](target)`` links that are not URLs, relative to the doc's own folder."""
    missing = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            file = target.split("#", 1)[0]
            if file and not re.match(r"[a-z]+:", file) and not (doc.parent / file).exists():
                missing.append(f"{relative(doc)}: {target}")
    assert not missing, "links to nothing:\n" + "\n".join(missing)


# ---- the shipped configs' own comments ------------------------------------------------------


def test_an_exported_yaml_says_how_to_launch_it_from_where_it_lands(tmp_path, monkeypatch):
    """``dpkit configs export`` copies the YAMLs anywhere: their header names the file by
    its own name from any folder, and the checkout's paths only for a checkout."""
    from dpkit.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["configs", "export", "exported"]) == 0
    yamls = sorted((tmp_path / "exported" / "accelerate").glob("*.yaml"))
    assert [p.name for p in yamls] == [
        "ddp.yaml", "fsdp2_full_shard.yaml", "fsdp2_full_shard_offload.yaml",
        "fsdp2_shard_grad_op.yaml", "zero1.yaml", "zero2.yaml", "zero2_offload.yaml", "zero3.yaml",
        "zero3_offload.yaml",
    ]  # fmt: skip
    for path in yamls:
        comments = [line for line in path.read_text().splitlines() if line.lstrip().startswith("#")]
        header = "\n".join(comments)
        assert "repository root" not in header, path.name
        assert f"accelerate launch --config_file path/to/{path.name} " in header, path.name
        for line in comments:  # a checkout's path is said to be one
            if "ds_configs/" in line or "recipes/" in line:
                assert "in a dpkit checkout" in line, (path.name, line)
