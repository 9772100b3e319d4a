"""Imports run one way through dpkit: ground types, engines, the registry, the subsystems, the commands.

Every import statement of every module is read, those inside functions and under
``if TYPE_CHECKING:`` included (an import inside a function that goes back up is still a
circle; it only hides from the interpreter until the function runs). The floors, lowest
first, are written out here, not read from dpkit (docs/architecture.md draws them):

0. ground: plain types, units and helpers that know no backend (``dpkit/core/``,
   ``errors``, ``lazy``, ``resources``, ``models``, ``config_files``);
1. engines: one package per backend and what they share (``dpkit/engines/*`` but the registry);
2. the registry: ``dpkit/engines/__init__.py``, the one module that imports the backends;
3. subsystems: train, memory, plan, checkpoints, data, lora, metrics;
4. commands and integrations: bench, tune, the Trainer integration, the CLI, ``dpkit`` itself.

A module may import from its own floor or any floor below; nothing imports upward, no
module outside ``dpkit/engines/`` imports a backend's package, and there is no cycle.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "dpkit"
BACKENDS = ("ddp", "deepspeed", "fsdp2")
# The bench's bare baselines are a backend each on purpose (a plain loop with no dpkit
# engine in it, the yardstick dpkit's runs are timed against), as tests/test_architecture.py
# says, and so is its collectives phase (each backend's communication pattern timed alone
# with torch.distributed, sized by that backend's bucket settings); they may reach a
# backend's settings directly.
BARE_BASELINES = {
    "dpkit.bench.bare_ddp",
    "dpkit.bench.bare_deepspeed",
    "dpkit.bench.bare_fsdp2",
    "dpkit.bench.collectives",
}

GROUND = ("dpkit.core", "dpkit.errors", "dpkit.lazy", "dpkit.resources", "dpkit.models")
GROUND += ("dpkit.config_files",)
COMMANDS = ("dpkit.bench", "dpkit.tune", "dpkit.integrations", "dpkit.cli", "dpkit.__main__")


def floor_of(module: str) -> int:
    """The floor of ``module`` (a dotted name under dpkit), by the list in the docstring."""
    if module == "dpkit":
        return 4  # the package's lazy exports reach every floor
    if any(module == g or module.startswith(g + ".") for g in GROUND):
        return 0
    if module == "dpkit.engines":
        return 2
    if module.startswith("dpkit.engines."):
        return 1
    if any(module == c or module.startswith(c + ".") for c in COMMANDS):
        return 4
    return 3


def _modules(root: Path = PACKAGE) -> dict[str, Path]:
    modules = {}
    for path in root.rglob("*.py"):
        dotted = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        modules[dotted.removesuffix(".__init__")] = path
    return modules


def imports_of(path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(module imported, line) for every dpkit import in ``path``, at any depth: a
    ``from a.b import c`` names ``a.b.c`` where that is a module, else ``a.b``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                target = f"{node.module}.{alias.name}"
                target = target if target in modules else node.module
                if target in modules:
                    found.append((target, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name in modules]
    return found


def import_graph(root: Path = PACKAGE) -> dict[str, dict[str, int]]:
    """Module -> {module it imports: first line}, for every module under ``root``."""
    modules = _modules(root)
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        graph[module] = {}
        for target, line in imports_of(path, modules):
            if target != module:
                graph[module].setdefault(target, line)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    return [
        f"{module}:{line} imports {target} (floor {floor_of(module)} -> {floor_of(target)})"
        for module, targets in sorted(graph.items())
        for target, line in sorted(targets.items())
        if floor_of(target) > floor_of(module)
    ]


def backend_imports_outside_the_engines(graph: dict[str, dict[str, int]]) -> list[str]:
    return [
        f"{module}:{line} imports {target}"
        for module, targets in sorted(graph.items())
        if not module.startswith("dpkit.engines") and module not in BARE_BASELINES
        for target, line in sorted(targets.items())
        if any(target.startswith(f"dpkit.engines.{b}") for b in BACKENDS)
    ]


@pytest.fixture(scope="module")
def graph() -> dict[str, dict[str, int]]:
    return import_graph()


def test_no_import_cycle(graph):
    assert not cycles(graph), "import cycles (function-level imports count):\n" + "\n".join(
        " <-> ".join(c) for c in cycles(graph)
    )


def test_no_import_goes_up_a_floor(graph):
    assert not upward_imports(graph), "\n".join(upward_imports(graph))


def test_only_the_registry_imports_a_backend(graph):
    found = backend_imports_outside_the_engines(graph)
    assert not found, "ask the registry (dpkit.engines) instead:\n" + "\n".join(found)


def test_the_floors_are_the_ones_documented():
    """The floor list above, spot-checked on modules named in docs/architecture.md."""
    assert [
        floor_of(m)
        for m in (
            "dpkit.core.units",
            "dpkit.errors",
            "dpkit.engines.base",
            "dpkit.engines.deepspeed.plan",
            "dpkit.engines",
            "dpkit.train.run",
            "dpkit.plan.estimate",
            "dpkit.bench.cli",
            "dpkit",
        )
    ] == [0, 0, 1, 1, 2, 3, 3, 4, 4]


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "dpkit" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "dpkit"


def test_the_checks_catch_a_function_level_circle_and_an_upward_import(tmp_path):
    """A control: a tree that breaks each rule, the imports hidden where a reviewer
    would miss them (inside a function, under TYPE_CHECKING)."""
    root = _write(
        tmp_path,
        {
            "__init__.py": "",
            "core/__init__.py": "",
            "core/units.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from dpkit.plan.estimate import Row\n"
            ),
            "engines/__init__.py": "from dpkit.engines.ddp import engine\n",
            "engines/ddp/__init__.py": "",
            "engines/ddp/engine.py": "def f():\n    from dpkit.train.run import Run\n",
            "plan/__init__.py": "",
            "plan/estimate.py": "from dpkit.engines.ddp.engine import f\n",
            "train/__init__.py": "",
            "train/run.py": "def g():\n    from dpkit.train import config\n",
            "train/config.py": "from dpkit.train.run import g\n",
        },
    )
    graph = import_graph(root)
    assert cycles(graph) == [["dpkit.train.config", "dpkit.train.run"]]
    assert upward_imports(graph) == [
        "dpkit.core.units:3 imports dpkit.plan.estimate (floor 0 -> 3)",
        "dpkit.engines.ddp.engine:2 imports dpkit.train.run (floor 1 -> 3)",
    ]
    assert backend_imports_outside_the_engines(graph) == [
        "dpkit.plan.estimate:1 imports dpkit.engines.ddp.engine"
    ]


def test_the_picture_in_docs_architecture_md_is_these_floors():
    """Each module the floors picture in docs/architecture.md draws on a floor (a line
    ``N  name  dpkit/...``, with its continuation lines) is on that floor here."""
    text = (REPO / "docs" / "architecture.md").read_text()
    picture = text.split("## The floors", 1)[1].split("```", 2)[1]
    drawn: dict[str, int] = {}
    floor = None
    for line in picture.splitlines():
        head = line.strip().split(" ", 1)[0]
        if head.isdigit():
            floor = int(head)
        if floor is None:
            continue
        for cited in re.findall(r"dpkit(?:/[\w.]+)*/?", line):
            module = cited.rstrip("/").removesuffix(".py").replace("/", ".")
            drawn[module.removesuffix(".__init__")] = floor
    assert len(drawn) >= 15, drawn
    wrong = {m: (f, floor_of(m)) for m, f in drawn.items() if floor_of(m) != f}
    assert not wrong, f"drawn floor vs tests/test_layers.py's floor: {wrong}"
