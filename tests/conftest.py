"""Shared fixtures; with DPKIT_REQUIRE_MULTIPROCESS=1 (CI) a skipped multi-process test fails."""

from __future__ import annotations

import os

import pytest


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
