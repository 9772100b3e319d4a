"""The recipe's short runs under every documented launch form, shared by the modules that check them.

Each named run (2 CPU processes unless said, real MiniLM and data, ``SHORT_RUN``) is
launched at most once per test session, on first use, by the session fixture
``recipe_runs`` (tests/conftest.py): tests/test_launchers.py checks what each launch form
runs, tests/test_memory_multiprocess.py the memory report of its 2-process DDP,
ZeRO-1 and ZeRO-2 runs, tests/test_multinode.py compares two nodes with its
one-node runs. One launch, checked many ways, instead of the same launch per module.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.harness import SHORT_RUN, Launch, accelerate_cmd, deepspeed_cmd, python_cmd, run


def _shipped_yaml(strategy: str) -> Callable[[str], list[str]]:
    """``accelerate launch`` with the shipped YAML of ``strategy`` (2 processes, as written)."""
    config = ["--config_file", f"ds_configs/accelerate/{strategy}.yaml"]
    return lambda out: accelerate_cmd(config, *SHORT_RUN, "--output-dir", out)


ZERO2_CHECKPOINTED = ("--deepspeed", "ds_configs/zero2.json", "--gradient-checkpointing")

# name: (command for an output folder, what must really run under it:
#        (strategy, world size, accelerate's distributed type, backend))
LAUNCHES: dict[str, tuple[Callable[[str], list[str]], tuple[str, int, str, str | None]]] = {
    "python": (
        lambda out: python_cmd(*SHORT_RUN, "--report-to", "tensorboard", "--output-dir", out),
        ("ddp", 1, "NO", None),
    ),
    **{
        f"accelerate_{strategy}_yaml": (_shipped_yaml(strategy), (strategy, 2, kind, "gloo"))
        for strategy, kind in (("ddp", "MULTI_CPU"), ("zero1", "DEEPSPEED"), ("zero2", "DEEPSPEED"))
    },
    "accelerate_multi_gpu": (
        lambda out: accelerate_cmd(
            ["--multi_gpu", "--num_processes", "2"], *SHORT_RUN, "--output-dir", out
        ),
        ("ddp", 2, "MULTI_CPU", "gloo"),
    ),
    # With gradient checkpointing: the lever through a launcher (the same losses, fewer
    # activations; what the modules that check this run see of it is planned so).
    "deepspeed_zero2": (
        lambda out: deepspeed_cmd(2, *SHORT_RUN, *ZERO2_CHECKPOINTED, "--output-dir", out),
        ("zero2", 2, "DEEPSPEED", "gloo"),
    ),
}


class RecipeRuns:
    """``runs(name)``: the named launch, run on first use into ``root / name`` and checked
    to have exited 0; the same :class:`~tests.harness.Launch` afterwards."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._done: dict[str, Launch] = {}

    def __call__(self, name: str) -> Launch:
        if name not in self._done:
            out = self.root / name
            build, _ = LAUNCHES[name]
            self._done[name] = run(build(str(out)), out).check()
        return self._done[name]
