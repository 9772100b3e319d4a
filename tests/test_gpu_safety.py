"""What keeps a CUDA box from breaking a run or the suite: the CPU suite sees no GPU,
NCCL launches with more processes than GPUs are refused before the group starts, and a
NCCL run says how a collective timeout will end it. Fast, in process, no GPU needed
(device counts are faked)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from dpkit.errors import EXIT_USAGE, UsageError
from dpkit.train import guards, run
from dpkit.train.guards import nccl_timeout_notice
from dpkit.train.launcher import check_ranks_per_gpu, local_process_count
from tests.conftest import hides_gpus

EIGHT_ON_ONE = (
    "LOCAL_WORLD_SIZE=8 processes on this node but 1 visible CUDA device: NCCL refuses "
    "two ranks on one GPU; start one process per visible GPU (torchrun --nproc_per_node 1, "
    "deepspeed --num_gpus 1, accelerate launch --num_processes 1 per machine) or make more "
    "GPUs visible (CUDA_VISIBLE_DEVICES)"
)


def test_the_cpu_suite_runs_with_the_gpus_hidden():
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert torch.cuda.device_count() == 0


@pytest.mark.parametrize(
    "markexpr, hidden",
    [
        ("", True),  # `make test`: CPU and GPU tests together
        ("not multiprocess", True),  # `make test-fast`
        ("gpu or multiprocess", True),
        ("gpu", False),  # `make gpu-check`'s pytest -m gpu
    ],
)
def test_only_the_gpu_selection_keeps_the_gpus(markexpr, hidden):
    assert hides_gpus(markexpr) is hidden


def test_more_local_processes_than_gpus_is_refused_naming_both_counts():
    with pytest.raises(UsageError) as refused:
        check_ranks_per_gpu(8, 1)
    assert str(refused.value) == EIGHT_ON_ONE


@pytest.mark.parametrize("processes, devices", [(1, 1), (2, 2), (2, 8), (4, 0)])
def test_one_process_per_gpu_or_a_cpu_run_passes(processes, devices):
    check_ranks_per_gpu(processes, devices)


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"LOCAL_WORLD_SIZE": "8", "LOCAL_RANK": "3"}, (8, "LOCAL_WORLD_SIZE=8")),
        ({"LOCAL_SIZE": "2", "LOCAL_RANK": "1"}, (2, "LOCAL_SIZE=2")),  # deepspeed launcher
        ({"LOCAL_RANK": "3"}, (4, "LOCAL_RANK=3, so at least 4")),
        ({}, (1, "1")),  # python recipe.py
    ],
)
def test_local_process_count_reads_each_launchers_variable(env, expected):
    assert local_process_count(env) == expected


def test_start_refuses_before_any_process_group_with_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    def code_instead_of_exit(code: int):
        raise SystemExit(code)

    monkeypatch.setattr(guards, "exit_process", code_instead_of_exit)
    resolution = SimpleNamespace(backend="nccl", collective_timeout_s=600.0)
    with pytest.raises(SystemExit) as exited:
        guards.run_and_exit(lambda: run.start_accelerator(resolution))
    assert exited.value.code == EXIT_USAGE == 2
    assert not dist.is_initialized()
    assert capsys.readouterr().err == f"{Path(sys.argv[0]).name}: error: {EIGHT_ON_ONE}\n"


def test_gloo_timeouts_need_no_notice():
    assert nccl_timeout_notice("gloo", {}, 600) is None


@pytest.mark.parametrize(
    "env, mode",
    [
        ({}, "3"),  # torch's default
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, "1"),  # what torchrun sets
        ({"TORCH_NCCL_BLOCKING_WAIT": "0"}, "3"),
        # torch reads the TORCH_ name first; the old name does not override it.
        ({"TORCH_NCCL_BLOCKING_WAIT": "0", "NCCL_BLOCKING_WAIT": "1"}, "3"),
    ],
)
def test_under_nccl_defaults_the_notice_names_the_timeout_and_the_watchdog(env, mode):
    notice = nccl_timeout_notice("nccl", env, 600)
    assert notice == (
        "backend nccl: a collective that does not complete within 600 s "
        "(--collective-timeout) ends every rank from torch's NCCL watchdog "
        f"(TORCH_NCCL_ASYNC_ERROR_HANDLING={mode}: 'Watchdog caught collective operation "
        "timeout', then SIGABRT), not with dpkit's one-line error; TORCH_NCCL_BLOCKING_WAIT=1 "
        "gives that line at the cost of blocking the host in every collective"
    )


@pytest.mark.parametrize("value", ["1", "true", "Y"])
def test_a_users_blocking_wait_is_kept_and_dpkits_own_line_applies(value):
    env = {"TORCH_NCCL_BLOCKING_WAIT": value}
    assert nccl_timeout_notice("nccl", env, 600) is None
    assert env == {"TORCH_NCCL_BLOCKING_WAIT": value}


def test_a_users_async_error_handling_0_is_kept_and_the_notice_says_a_hang_hangs():
    notice = nccl_timeout_notice("nccl", {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}, 30)
    assert notice == (
        "backend nccl with TORCH_NCCL_ASYNC_ERROR_HANDLING=0: a collective that does not "
        "complete within 30 s (--collective-timeout) is only logged by torch's watchdog; "
        "a hung rank hangs the job"
    )
