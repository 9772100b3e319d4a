"""dpkit as a user gets it: a wheel built from this repository, installed into a fresh venv outside the checkout.

The venv reuses the dependencies already installed for the tests (torch, accelerate,
DeepSpeed, transformers...: a ``.pth`` file puts the test venv's site-packages on its
path, without running that venv's own ``.pth`` files, so the checkout's editable dpkit
stays invisible), and gets the launchers' console scripts (``accelerate``, ``torchrun``,
``deepspeed``) bound to its own Python. Nothing it runs imports dpkit from the checkout:
:func:`WheelEnv.run` asserts where dpkit was imported from.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tests.harness import REPO, launch_env

LAUNCHERS = {
    "accelerate": "from accelerate.commands.accelerate_cli import main",
    "torchrun": "from torch.distributed.run import main",
    "deepspeed": "from deepspeed.launcher.runner import main",
}


@dataclass(frozen=True)
class WheelEnv:
    root: Path
    wheel: Path

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    @property
    def python(self) -> Path:
        return self.bin / "python"

    def env(self) -> dict[str, str]:
        env = launch_env()
        env["PATH"] = f"{self.bin}{os.pathsep}{env['PATH']}"
        env.pop("PYTHONPATH", None)
        return env

    def run(
        self,
        cmd: list[str],
        cwd: Path,
        timeout: int = 600,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess:
        """``cmd`` (its first word found in the venv's bin) from ``cwd``, output captured;
        ``env``: variables set for it on top of the venv's environment."""
        first = self.bin / cmd[0]
        argv = [str(first) if first.exists() else cmd[0], *cmd[1:]]
        return subprocess.run(
            argv,
            cwd=cwd,
            env={**self.env(), **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
            start_new_session=True,
        )


def build(tmp: Path) -> WheelEnv:
    """Build the wheel (``pip wheel``, no build isolation: setuptools is installed) from a
    copy of the sources (setuptools writes build/ into the tree it builds), and install
    it, without dependencies, into a new venv under ``tmp``."""
    source = tmp / "source"
    shutil.copytree(
        REPO,
        source,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "runs", "bench_results", "__pycache__", "*.egg-info"
        ),
    )
    wheels = tmp / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(wheels), str(source)],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    (wheel,) = wheels.glob("dpkit-*.whl")
    root = tmp / "venv"
    venv.create(root, with_pip=False, system_site_packages=True)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(root), "platbase": str(root)}))
    # The test venv's packages, as a plain path entry (its .pth files are not run).
    (site / "test_venv_packages.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run(
        [str(root / "bin" / "python"), "-m", "pip", "install", "--no-deps", "-q", str(wheel)],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    for name, import_line in LAUNCHERS.items():
        script = root / "bin" / name
        script.write_text(
            f"#!{root / 'bin' / 'python'}\nimport sys\n{import_line}\nsys.exit(main())\n"
        )
        script.chmod(0o755)
    return WheelEnv(root=root, wheel=wheel)
