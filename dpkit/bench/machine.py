"""The machine and software a bench ran on: CPU/GPU, cores, memory, load, versions, git revision.

Everything here works from a wheel install as from this checkout: the git revision
is None unless dpkit is imported from a git checkout's own ``dpkit/`` folder.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

STACK = ("torch", "accelerate", "deepspeed", "transformers", "dpkit")
"""The distributions whose versions every bench records."""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_total_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def stack_versions() -> dict[str, str | None]:
    """Python's version and each installed distribution of :data:`STACK` (None if absent)."""
    from importlib.metadata import PackageNotFoundError, version

    versions: dict[str, str | None] = {"python": platform.python_version()}
    for package in STACK:
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = None
    return versions


def _git(checkout: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(checkout), *args],
        capture_output=True, text=True, timeout=10, check=True,
    ).stdout.strip()  # fmt: skip


def git_revision() -> str | None:
    """The short commit of the checkout dpkit is imported from, ``+dirty`` with tracked
    changes; None outside a checkout (a wheel in site-packages, no git)."""
    checkout = Path(__file__).resolve().parents[2]
    try:
        # A wheel installed into a venv that sits inside some repository would otherwise
        # report that repository's commit: only dpkit's own checkout counts.
        if Path(_git(checkout, "rev-parse", "--show-toplevel")).resolve() != checkout:
            return None
        rev = _git(checkout, "rev-parse", "--short", "HEAD")
        dirty = _git(checkout, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + ("+dirty" if dirty else "")


def machine_description(env: dict[str, str] | None = None) -> dict[str, Any]:
    """CPU/GPU model, cores, memory, load, and the versions of the stack; ``env`` is the
    environment the launches get (its ``OMP_NUM_THREADS`` is recorded)."""
    import torch

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "cpu_model": _cpu_model(),
        "cpu_cores_usable": usable_cores(),
        "memory_bytes": _mem_total_bytes(),
        # Other work on the machine changes every timing: the load at the start says how much.
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "gpus": gpus,
        "cuda": torch.version.cuda,
        "platform": platform.platform(),
        "versions": stack_versions(),
        "git_revision": git_revision(),
        "omp_num_threads": (env or os.environ).get("OMP_NUM_THREADS"),
    }
