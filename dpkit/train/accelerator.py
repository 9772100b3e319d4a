"""The Accelerator for a resolved run, and its process group, started once.

What the bare stack gets wrong here (docs/stack-notes.md) is worked around in one place:
the process-group backend named so that ``accelerate launch --use_deepspeed`` forms a
real N-process group on CPU, a one-process rendezvous for a backend that needs a group
even alone, and NCCL's ranks-per-GPU check before the group starts.
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta
from typing import Any

from dpkit.train.launcher import check_ranks_per_gpu, local_process_count
from dpkit.train.logs import log_once_per_job
from dpkit.train.resolution import Resolution

logger = logging.getLogger("dpkit")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_accelerator(
    resolution: Resolution,
    *,
    data_seed: int | None = None,
    step_scheduler_with_optimizer: bool = True,
    log_with: str | None = None,
    project_dir: str | None = None,
) -> Any:
    """Build the Accelerator for ``resolution`` (its engine says what accelerate needs) and
    start the process group.

    Under NCCL, first refuses (:class:`~dpkit.errors.UsageError`, before the group) more
    processes on this node than visible GPUs, and logs once how a collective timeout
    ends the run (:func:`~dpkit.train.guards.nccl_timeout_notice`).

    Args:
        data_seed: seed accelerate's sampler (``use_seedable_sampler``): the shuffle order
            of epoch e is then a function of (data_seed, e) alone, the same on every rank and
            world size and reproducible on resume. None: accelerate's default sampler.
        step_scheduler_with_optimizer: accelerate's switch (its default: True steps a
            prepared scheduler once per process per step, for schedules counted in
            unsharded batches). dpkit's recipes count optimizer steps and pass False.
        log_with, project_dir: accelerate's trackers.
    """
    from dpkit.train.guards import nccl_timeout_notice

    if resolution.backend == "nccl":
        import torch

        # Here, before the group: NCCL itself refuses two ranks on one GPU only once the
        # group is up, in an error that names neither the launch flag nor the count.
        local_processes, source = local_process_count(os.environ)
        check_ranks_per_gpu(local_processes, torch.cuda.device_count(), source=source)
    # Read before the group starts, from the environment torch's NCCL backend reads;
    # dpkit sets none of its variables (why: nccl_timeout_notice).
    timeout_notice = nccl_timeout_notice(
        resolution.backend, os.environ, resolution.collective_timeout_s
    )

    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs

    engine = resolution.engine
    handlers: list = []
    if resolution.world_size > 1 or engine.needs_process_group:
        # Naming the backend is what makes `accelerate launch --use_deepspeed` form a
        # real N-process group on CPU; a single plain process must not get one.
        handlers.append(
            InitProcessGroupKwargs(
                backend=resolution.backend,
                timeout=timedelta(seconds=resolution.collective_timeout_s),
            )
        )
    if engine.needs_process_group and "RANK" not in os.environ:
        # The rendezvous reads these even for one process (plain `python recipe.py
        # --strategy zero2`); this process is then the whole job.
        os.environ.update(
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
        )
    options = engine.accelerator_options(resolution.strategy, resolution)
    handlers += options.pop("kwargs_handlers", [])
    dataloader_config = None
    if data_seed is not None:
        dataloader_config = DataLoaderConfiguration(use_seedable_sampler=True, data_seed=data_seed)
    accelerator = Accelerator(
        mixed_precision=resolution.precision,
        gradient_accumulation_steps=resolution.gradient_accumulation_steps,
        step_scheduler_with_optimizer=step_scheduler_with_optimizer,
        dataloader_config=dataloader_config,
        kwargs_handlers=handlers,
        log_with=log_with,
        project_dir=project_dir,
        **options,
    )
    log_once_per_job(accelerator.is_main_process)
    if timeout_notice is not None and accelerator.num_processes > 1:
        logger.info("%s", timeout_notice)
    for note in resolution.notes:
        logger.info("%s", note)
    if accelerator.num_processes > 1:
        # A lazily connected process group (NCCL's default; TORCH_GLOO_LAZY_INIT=1 on CPU)
        # lets the main process run ahead of a slower rank still parsing its arguments,
        # which then refused --output-dir as "holds another run" the main process had just
        # started (measured): every rank passes here before anything is written.
        accelerator.wait_for_everyone()
    return accelerator
