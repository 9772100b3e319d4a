"""The tree keeps its shape: backend knowledge only in the engines, no import side effects,
and every path the code and docs cite exists in this repository.

These read the source as text, as a reviewer would grep it (docs/architecture.md).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENGINES = REPO / "dpkit" / "engines"
# The bench's bare baselines are a backend each on purpose (a plain torch DDP, DeepSpeed or
# fully_shard loop with no dpkit in it), the yardstick dpkit's runs are timed against.
BARE = {
    REPO / "dpkit" / "bench" / name
    for name in ("bare_ddp.py", "bare_deepspeed.py", "bare_fsdp2.py")
}

STRATEGY_NAMES = (
    "ddp|zero1|zero2|zero2_offload|zero3|zero3_offload|fsdp2_shard_grad_op|fsdp2_full_shard"
    "|fsdp2_full_shard_offload"
)
BACKEND_BRANCHES = {
    "a backend flag": re.compile(r"\buses_(deepspeed|fsdp2)\b"),
    "an engine compared by name": re.compile(r"\bengine(_of\([^)]*\))?(\.name)?\s*(==|!=)"),
    "a strategy or engine name compared": re.compile(
        rf"(==|!=)\s*['\"]({STRATEGY_NAMES}|deepspeed|fsdp2)['\"]"
        rf"|['\"]({STRATEGY_NAMES}|deepspeed|fsdp2)['\"]\s*(==|!=)"
    ),
    # What is sharded is the Strategy's to say (shards_optimizer, shards_gradients,
    # shards_parameters); a stage number compared outside the engines is a backend branch.
    "a ZeRO stage compared": re.compile(r"\b(zero_stage|sharding)\s*(==|!=|>=|<=|>|<)\s*\d"),
    "a strategy name looked up in a tuple": re.compile(
        rf"\bin\s*[\(\[{{]\s*['\"]({STRATEGY_NAMES})['\"]"
    ),
    "a backend's objects recognised by type": re.compile(
        r"isinstance\([^)]*\b(FSDPModule|DeepSpeedEngine|DistributedDataParallel)\b"
        r"|\bis_zero_optimizer\(|\bzero_optimizer\(|\bfsdp2_params\(|\bfind_ddp\("
    ),
}


# The strategy value says what is sharded from its stage (shards_gradients...): the one
# place outside the engines that reads the stage number.
STRATEGY_VALUE = REPO / "dpkit" / "core" / "strategy.py"


def _python_outside_engines() -> list[Path]:
    return [
        path
        for folder in (REPO / "dpkit", REPO / "recipes")
        for path in sorted(folder.rglob("*.py"))
        if ENGINES not in path.parents and path not in BARE and path != STRATEGY_VALUE
    ]


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """Lines of code, comments and docstrings left out (they may name backends freely)."""
    lines, in_docstring = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        quotes = stripped.count('"""') + stripped.count("'''")
        if in_docstring:
            in_docstring = quotes % 2 == 0
            continue
        if stripped.startswith(('"""', "'''")):
            in_docstring = quotes % 2 == 1
            continue
        code = line.split("#", 1)[0]
        if code.strip():
            lines.append((number, code))
    return lines


@pytest.mark.parametrize("what", sorted(BACKEND_BRANCHES))
def test_no_backend_branch_outside_the_engines(what):
    pattern = BACKEND_BRANCHES[what]
    found = [
        f"{path.relative_to(REPO)}:{number}: {code.strip()}"
        for path in _python_outside_engines()
        for number, code in _code_lines(path)
        if pattern.search(code)
    ]
    assert not found, f"{what} outside dpkit/engines/:\n" + "\n".join(found)


def test_the_grep_finds_what_it_looks_for(tmp_path):
    """A control: each pattern matches the branch it names (else the test above passes
    on anything)."""
    examples = {
        "a backend flag": "if strategy.uses_deepspeed:",
        "an engine compared by name": 'if engine_of(strategy).name == "ddp":',
        "a ZeRO stage compared": "if strategy.zero_stage == 2:",
        "a strategy or engine name compared": 'if name == "zero2":',
        "a strategy name looked up in a tuple": 'if strategy.name in ("zero1", "zero2"):',
        "a backend's objects recognised by type": "if isinstance(model, FSDPModule):",
    }
    assert set(examples) == set(BACKEND_BRANCHES)
    for what, line in examples.items():
        assert BACKEND_BRANCHES[what].search(line), what
    path = tmp_path / "example.py"
    path.write_text('"""a docstring naming uses_deepspeed"""\n# a comment: uses_deepspeed\nx = 1\n')
    assert [code for _, code in _code_lines(path)] == ["x = 1"]


def test_every_engine_answers_every_question():
    """Each engine, and each role object it hands out (``engine.memory``, ``.plan``,
    ``.checkpoints``), overrides what its backend must answer (the role's base raises)."""
    from dpkit.engines import ENGINES as engines
    from dpkit.engines.roles.checkpoint_io import CheckpointIO
    from dpkit.engines.roles.knobs import BenchKnobs
    from dpkit.engines.roles.measured import MeasuredMemory
    from dpkit.engines.roles.planned import PlanArithmetic
    from dpkit.engines.roles.settings import Settings
    from dpkit.engines.roles.wrapping import Wrapping

    roles = {
        None: (Settings, Wrapping, BenchKnobs),
        "memory": (MeasuredMemory,),
        "plan": (PlanArithmetic,),
        "checkpoints": (CheckpointIO,),
    }
    must = {
        role: [
            (base, name)
            for base in bases
            for name, member in vars(base).items()
            if callable(member) and "raise NotImplementedError" in _source(member)
        ]
        for role, bases in roles.items()
    }
    named = {name for found in must.values() for _, name in found}
    assert {"after_prepare", "walk", "model_state_bytes", "full_weights", "why"} <= named
    for engine in engines:
        for role, found in must.items():
            answers = engine if role is None else getattr(engine, role)
            assert not isinstance(answers, type), f"{engine.name}.{role} is not an object"
            missing = [
                name for base, name in found if getattr(type(answers), name) is vars(base)[name]
            ]
            assert not missing, f"{engine.name} ({role or 'engine'}) does not answer {missing}"


def _source(function) -> str:
    import inspect

    return inspect.getsource(function)


def test_importing_dpkit_changes_nothing_in_the_process():
    """No environment variable, warning filter, logging handler or DeepSpeed op table is
    touched by importing every module a script or CLI imports; only a run sets them."""
    probe = """
import logging, os, sys, warnings
# The libraries first: their own import-time filters and handlers are not dpkit's.
import accelerate, datasets, deepspeed, deepspeed.ops, evaluate, torch, transformers, safetensors
ops = dict(deepspeed.ops.__compatible_ops__)
env, filters = dict(os.environ), list(warnings.filters)
handlers = {name: list(logging.getLogger(name).handlers) for name in ("", "dpkit", "DeepSpeed")}
import dpkit
for name in dpkit.__all__:
    getattr(dpkit, name)
import dpkit.plan, dpkit.bench.cli, dpkit.tune.cli, dpkit.checkpoints.consolidate
import dpkit.integrations.transformers, dpkit.engines
changed = sorted(k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k))
assert not changed, changed
assert list(warnings.filters) == filters, "warning filters changed"
after = {name: list(logging.getLogger(name).handlers) for name in handlers}
assert after == handlers, "logging handlers changed"
assert deepspeed.ops.__compatible_ops__ == ops, "DeepSpeed's op table changed"
print("unchanged")
"""
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("unchanged")


# ---- the repository stands alone -----------------------------------------------------------

TEXT_FILES = ("*.py", "*.md", "*.yaml", "*.json", "*.toml", "Makefile", "*.sh", "run")
# A path into the repository: a top-level folder, then a file with its extension (or a
# folder, written with its trailing slash, or a glob). "dpkit/bare" (a ratio) is not one.
CITED_PATH = re.compile(
    r"(?<![\w./-])((?:dpkit|recipes|docs|tests|ds_configs|\.ci)/[\w./*-]*"
    r"(?:\.[a-z]{2,5}|/|\*[\w.]*))(?![\w/])"
)
THIS_FILE = Path(__file__).resolve()


def _repository_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [
        REPO / name
        for name in listed
        if any(Path(name).match(pattern) for pattern in TEXT_FILES) and (REPO / name).is_file()
    ]


# The team's notes outside the repository, which users do not have: spelt in pieces so
# that this file, checked with the others, does not cite them itself.
OUTSIDE_THE_REPOSITORY = ("/".join(("..", "shared")), "-".join(("STACK", "NOTES")))


def test_no_file_refers_outside_the_repository():
    found = [
        f"{path.relative_to(REPO)}:{number}"
        for path in _repository_files()
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if any(marker in line for marker in OUTSIDE_THE_REPOSITORY)
    ]
    assert not found, "cite docs/stack-notes.md instead:\n" + "\n".join(found)


def _exists(cited: str) -> bool:
    """A file or folder of the repository, or a glob that matches one (``dpkit/recipes/``
    is where pyproject.toml packages ``recipes/``)."""
    if cited.startswith("dpkit/recipes/"):
        cited = cited.removeprefix("dpkit/")
    if "*" in cited:
        return any(REPO.glob(cited))
    return (REPO / cited).exists()


def test_every_cited_path_exists():
    """Each path a comment, docstring, doc or config names (``dpkit/...``, ``docs/...``,
    ``recipes/...``) is in the repository (a glob matches something)."""
    missing = [
        f"{path.relative_to(REPO)}:{number}: {cited}"
        for path in _repository_files()
        if path != THIS_FILE
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        for cited in CITED_PATH.findall(line)
        if not _exists(cited)
    ]
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)


def test_the_path_check_catches_a_stale_path():
    """A control for the check above: paths that do not exist are reported, a ratio
    written with a slash is not a path."""
    line = "see ``dpkit/train/no_such_module.py``, docs/no-such-*.md and the dpkit/bare ratio"
    assert [c for c in CITED_PATH.findall(line) if not _exists(c)] == [
        "dpkit/train/no_such_module.py",
        "docs/no-such-*.md",
    ]
