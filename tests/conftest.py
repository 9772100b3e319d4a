"""Shared fixtures; with DPKIT_REQUIRE_MULTIPROCESS=1 (CI) a skipped multi-process test fails."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHM = Path("/dev/shm")


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_leaks():
    """Fail the session if any run left DeepSpeed's /dev/shm segments behind (66 MB each)."""
    before = set(SHM.glob("deepspeed_*")) if SHM.is_dir() else set()
    yield
    after = set(SHM.glob("deepspeed_*")) if SHM.is_dir() else set()
    leaked = sorted(p.name for p in after - before)
    assert not leaked, f"runs left {len(leaked)} DeepSpeed /dev/shm segments: {leaked[:4]}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    required = os.environ.get("DPKIT_REQUIRE_MULTIPROCESS") == "1"
    if required and report.skipped and item.get_closest_marker("multiprocess"):
        report.outcome = "failed"
        report.longrepr = (
            f"multi-process test skipped under DPKIT_REQUIRE_MULTIPROCESS=1: {report.longrepr}"
        )
