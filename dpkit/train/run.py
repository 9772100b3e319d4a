"""Starting a run: the Accelerator for a :class:`~dpkit.train.resolve.Resolution`, and what a script asks of it.

Three steps, each usable alone::

    resolution = resolve(args, model=model, micro_batch_size=16)  # pure: no process group
    run = start(resolution)                                        # the Accelerator
    model = run.shard_model(model)                                 # FSDP2; else unchanged
    ...optimizer over model.parameters()..., accelerator.prepare(...)...
    info = run.check(model, optimizer)                             # what really runs, or an error

:func:`setup` is the first two in one call.

What :func:`start` works around (measured, see ``../shared/STACK-NOTES.md``):

* ``accelerate launch --multi_gpu`` without CUDA starts N processes that each train
  alone unless the Accelerator is built with ``cpu=True``;
* ``accelerate launch --use_deepspeed`` without CUDA counts one process and
  DeepSpeed's batch assertion fails unless the process-group backend is named (gloo);
* ``python recipe.py --strategy zero2`` (or an FSDP2 strategy) has no process group: a
  one-process rendezvous on localhost is set up;
* accelerate's FSDP2 path needs an accelerator device (on CPU an FSDP YAML runs
  unconnected copies): dpkit applies ``fully_shard`` itself (:meth:`Run.shard_model`)
  and accelerate prepares the sharded model without a wrapper.

:meth:`Run.check`, after ``accelerator.prepare``, turns a silent mis-launch (processes
that would train unconnected copies, a model not wrapped as asked) into an error and
logs, once, what really runs (:class:`RunInfo`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import socket
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

from dpkit.strategy import Strategy
from dpkit.train.config import StrategyConfig
from dpkit.train.deepspeed_config import skip_deepspeed_cpu_shm_op
from dpkit.train.launch import check_ranks_per_gpu, local_process_count
from dpkit.train.resolve import Resolution, resolve

logger = logging.getLogger("dpkit")


@dataclass
class RunInfo:
    """What really runs, read back from accelerate/torch after ``prepare``."""

    strategy: str
    strategy_source: str
    distributed_type: str
    world_size: int
    backend: str | None
    device: str
    wrapper: str
    zero_stage: int
    precision: str
    micro_batch_size: int
    gradient_accumulation_steps: int
    global_batch_size: int
    learning_rate: float | None
    num_params: int
    offload_optimizer: str | None = None
    ddp_forward_sync_buffers: bool | None = None
    """DDP: whether buffers are re-broadcast before each forward (None: not DDP)."""
    notes: str = ""
    """What the run does otherwise than a flag reads (:attr:`Resolution.notes`, joined by
    "; "): a string, as trackers take only scalars and strings for a run's config."""

    def describe(self) -> str:
        """The one line every run logs."""
        lr = "" if self.learning_rate is None else f" | lr={self.learning_rate:g}"
        if self.offload_optimizer:
            lr += f" | offload_optimizer={self.offload_optimizer}"
        if self.ddp_forward_sync_buffers is False:
            lr += " | buffers synced at init only (all constants)"
        return (
            f"strategy={self.strategy} ({self.strategy_source}) | world_size={self.world_size} | "
            f"distributed_type={self.distributed_type} | wrapper={self.wrapper} | "
            f"zero_stage={self.zero_stage} | backend={self.backend} | device={self.device} | "
            f"precision={self.precision} | global_batch={self.global_batch_size} "
            f"(micro {self.micro_batch_size} x accumulation {self.gradient_accumulation_steps} "
            f"x processes {self.world_size}){lr}"
        )

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Run:
    """A resolved run and its Accelerator: what a training script asks about the strategy."""

    resolution: Resolution
    accelerator: Any

    @property
    def strategy(self) -> Strategy:
        return self.resolution.strategy

    @property
    def world_size(self) -> int:
        return self.accelerator.num_processes

    @property
    def global_batch_size(self) -> int:
        return self.resolution.global_batch_size

    @property
    def ds_config(self) -> dict | None:
        """The DeepSpeed config as the engine got it (ZeRO only): accelerate's own dict,
        not a copy kept beside it."""
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        return None if plugin is None else plugin.deepspeed_config

    def shard_model(self, model: Any) -> Any:
        """FSDP2: shard ``model`` (each layer a unit, then the root; see
        :mod:`dpkit.train.fsdp2`) and hand it to accelerate, which then prepares it
        without a wrapper; other strategies: ``model`` unchanged (``accelerator.prepare``
        wraps it). Call it before building the optimizer: FSDP2 replaces the parameters
        by their shards, and an optimizer built earlier would hold the old ones.
        """
        if not self.strategy.uses_fsdp2:
            return model
        from dpkit.train.fsdp2 import layer_classes, shard_model
        from dpkit.train.resolve import fsdp_asked_by

        resolution = self.resolution
        classes = resolution.fsdp_layer_classes or layer_classes(
            model, resolution.fsdp_layer_override, asked_by=fsdp_asked_by(resolution.source)
        )
        model = shard_model(
            model,
            layer_class_names=classes,
            reshard_after_forward=self.strategy.reshard_after_forward,
            precision=resolution.precision,
            device_type=self.accelerator.device.type,
        )
        # evaluation_mode: accelerate applies what it applies to every model (autocast
        # under mixed precision) and no DDP wrapper; the later prepare() passes it through.
        return self.accelerator.prepare_model(model, evaluation_mode=True)

    def make_optimizer(self, params: Any, lr: float, weight_decay: float) -> Any:
        """torch AdamW under every strategy, fused where torch has the kernel
        (:func:`dpkit.models.adamw`), so losses compare across strategies; a DeepSpeed
        JSON with its own ``optimizer`` section gets accelerate's DummyOptim."""
        from accelerate.utils import DummyOptim

        from dpkit.models import adamw

        if "optimizer" in (self.resolution.ds_config or {}):
            return DummyOptim(params, lr=lr, weight_decay=weight_decay)
        return adamw(params, lr=lr, weight_decay=weight_decay)

    def make_scheduler(self, name: str, optimizer: Any, warmup_steps: int, total_steps: int) -> Any:
        """transformers' ``get_scheduler``; a DeepSpeed JSON with its own ``scheduler``
        section gets accelerate's DummyScheduler."""
        from accelerate.utils import DummyScheduler
        from transformers import get_scheduler

        if "scheduler" in (self.resolution.ds_config or {}):
            return DummyScheduler(
                optimizer, total_num_steps=total_steps, warmup_num_steps=warmup_steps
            )
        return get_scheduler(
            name, optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps
        )

    def check(self, model: Any, optimizer: Any, output: Any = None, **extra: Any) -> RunInfo:
        """After ``accelerator.prepare``: check that what runs is what was asked for (a
        mismatch is an error, not a warning) and log it, once, from the main process.
        Under DDP, also set what DDP takes only once built: its per-forward buffer
        sync (:attr:`Resolution.ddp_forward_sync_buffers`).

        With ``output`` (a :class:`~dpkit.train.run_output.RunOutput`), also write
        ``run_info.json`` (with ``extra`` fields: the schedule, say) and, under DeepSpeed,
        ``ds_config.json`` as the engine got it.
        """
        import torch.distributed as dist

        from dpkit.models import count_parameters

        acc, asked = self.accelerator, self.resolution
        if acc.num_processes != asked.world_size:
            raise RuntimeError(
                f"the launcher started {asked.world_size} processes but the process group has "
                f"{acc.num_processes}: the processes would train unconnected copies"
            )
        wrapper = type(model).__name__
        zero_stage = 0
        if asked.strategy.uses_deepspeed:
            engine = acc.deepspeed_engine_wrapped.engine if acc.deepspeed_engine_wrapped else model
            zero_stage = int(engine.zero_optimization_stage())
            inner = type(getattr(optimizer, "optimizer", optimizer)).__name__
            wrapper = f"{type(engine).__name__}+{inner}"
            if zero_stage != asked.strategy.zero_stage:
                raise RuntimeError(
                    f"asked for ZeRO-{asked.strategy.zero_stage}, DeepSpeed runs stage {zero_stage}"
                )
        elif asked.strategy.uses_fsdp2:
            zero_stage = asked.strategy.zero_stage
            wrapper = _check_fsdp2(model, optimizer)
        elif acc.num_processes > 1 and wrapper != "DistributedDataParallel":
            raise RuntimeError(
                f"{acc.num_processes} processes but the model is not wrapped in DDP ({wrapper})"
            )
        forward_sync_buffers = None
        if wrapper == "DistributedDataParallel":
            # A DDP attribute, not a constructor argument: accelerate's
            # DistributedDataParallelKwargs only has the deprecated broadcast_buffers
            # (a FutureWarning on every rank, and it also skips the init-time sync).
            model.forward_sync_buffers = asked.ddp_forward_sync_buffers
            forward_sync_buffers = bool(model.forward_sync_buffers)
        backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else None
        info = RunInfo(
            strategy=asked.strategy.name,
            strategy_source=asked.source,
            distributed_type=str(acc.distributed_type).split(".")[-1],
            world_size=acc.num_processes,
            backend=backend,
            device=str(acc.device),
            wrapper=wrapper,
            zero_stage=zero_stage,
            precision=asked.precision,
            micro_batch_size=asked.micro_batch_size,
            gradient_accumulation_steps=asked.gradient_accumulation_steps,
            global_batch_size=asked.global_batch_size,
            learning_rate=asked.learning_rate,
            num_params=count_parameters(acc.unwrap_model(model), trainable_only=True),
            offload_optimizer=asked.offload_optimizer,
            ddp_forward_sync_buffers=forward_sync_buffers,
            notes="; ".join(asked.notes),
        )
        if acc.is_main_process:
            logger.info("%s", info.describe())
        if output is not None:
            output.write_json("run_info.json", {**info.as_dict(), **extra})
            if self.ds_config is not None:
                output.write_json("ds_config.json", self.ds_config)
        return info

    def track_memory(self, model: Any, optimizer: Any, **kwargs: Any) -> Any:
        """:class:`dpkit.memory.MemoryTracker` for the prepared model and optimizer:
        probes where this strategy holds its gradients, and the per-rank report."""
        from dpkit.memory import MemoryTracker

        return MemoryTracker(
            self.accelerator,
            model,
            optimizer,
            strategy=self.strategy,
            precision=self.resolution.precision,
            offload_optimizer=self.resolution.offload_optimizer,
            **kwargs,
        )


def _check_fsdp2(model: Any, optimizer: Any) -> str:
    """The FSDP2 wrapper's description, or an error: the model must be sharded, and the
    optimizer must hold the shards (built after :meth:`Run.shard_model`)."""
    from torch.distributed.fsdp import FSDPModule

    from dpkit.memory.walk import inner_torch_optimizer
    from dpkit.train.fsdp2 import is_sharded, unit_count

    if not isinstance(model, FSDPModule):
        raise RuntimeError(
            f"FSDP2 was asked for but the model is not sharded ({type(model).__name__}): "
            "call run.shard_model(model) before building the optimizer"
        )
    torch_opt = inner_torch_optimizer(optimizer)
    params = [p for group in torch_opt.param_groups for p in group["params"]]
    if not all(is_sharded(p) for p in params):
        raise RuntimeError(
            "the optimizer holds the model's unsharded parameters: build it after "
            "run.shard_model(model)"
        )
    return f"FSDP2 fully_shard ({unit_count(model)} units)+{type(torch_opt).__name__}"


class _ErrorsOnly(logging.Filter):
    """Lets errors through, nothing else."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


class _WithoutCpuNotice(logging.Filter):
    """Drops DeepSpeed's "Setting accelerator to CPU" (dpkit's start-up line names the
    device; DeepSpeed's launchers print the notice themselves)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Setting accelerator to CPU" not in record.getMessage()


def log_once_per_job(is_main_process: bool | None = None) -> None:
    """dpkit's own lines from the main process; library warnings once per job.

    dpkit's logger gets a handler of its own only when the script configured none (so
    its lines show in a bare script); other ranks log warnings and errors only, and
    transformers, datasets and Python warnings stay quiet there: every rank would print
    the same copy. Errors on any rank still reach the terminal. ``None``: the main
    process is global rank 0 of the launcher's environment (before any process group;
    :func:`start` calls it again with accelerate's answer).
    """
    import warnings

    if is_main_process is None:
        is_main_process = os.environ.get("RANK", "0") == "0"
    dpkit_logger = logging.getLogger("dpkit")
    if not dpkit_logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
        dpkit_logger.addHandler(handler)
        dpkit_logger.propagate = False
    dpkit_logger.setLevel(logging.INFO if is_main_process else logging.WARNING)
    # DeepSpeed's logger is created on import, and its level set then: filters outlive that.
    deepspeed_logger = logging.getLogger("DeepSpeed")
    wanted = _WithoutCpuNotice if is_main_process else _ErrorsOnly
    if not any(isinstance(f, wanted) for f in deepspeed_logger.filters):
        deepspeed_logger.addFilter(wanted())
    if not is_main_process:
        import datasets
        import transformers

        transformers.logging.set_verbosity_error()
        datasets.logging.set_verbosity_error()
        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _without_env(name: str) -> Iterator[None]:
    """``name`` unset while the block runs, restored afterwards."""
    saved = os.environ.pop(name, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[name] = saved


def start(
    resolution: Resolution,
    *,
    data_seed: int | None = None,
    step_scheduler_with_optimizer: bool = True,
    log_with: str | None = None,
    project_dir: str | None = None,
) -> Run:
    """Build the Accelerator for ``resolution``: backend, CPU or GPU, DDP's kwargs or the
    resolved DeepSpeed config. Starts the process group.

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

    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.utils import (
        DataLoaderConfiguration,
        DistributedDataParallelKwargs,
        InitProcessGroupKwargs,
    )

    uses_deepspeed = resolution.strategy.uses_deepspeed
    # DeepSpeed and fully_shard need a process group even for one process.
    needs_group = uses_deepspeed or resolution.strategy.uses_fsdp2
    handlers: list = []
    if resolution.world_size > 1 or needs_group:
        # Naming the backend is what makes `accelerate launch --use_deepspeed` form a
        # real N-process group on CPU; a single plain process must not get one.
        handlers.append(
            InitProcessGroupKwargs(
                backend=resolution.backend,
                timeout=timedelta(seconds=resolution.collective_timeout_s),
            )
        )
    plugin = None
    if needs_group and "RANK" not in os.environ:
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
    if resolution.strategy.uses_fsdp2:
        # resolve() read the FSDP launch; accelerate would otherwise take its own FSDP
        # path on GPUs (and dpkit's sharded model would be sharded twice).
        os.environ.pop("ACCELERATE_USE_FSDP", None)
    if uses_deepspeed:
        skip_deepspeed_cpu_shm_op()
        # accelerate refuses a config dict when its YAML listed DeepSpeed fields beside a
        # config file (ACCELERATE_CONFIG_DS_FIELDS); resolve() honoured or refused each.
        with _without_env("ACCELERATE_CONFIG_DS_FIELDS"):
            plugin = DeepSpeedPlugin(hf_ds_config=copy.deepcopy(dict(resolution.ds_config)))
    elif resolution.ddp_kwargs:
        handlers.append(DistributedDataParallelKwargs(**resolution.ddp_kwargs))
    dataloader_config = None
    if data_seed is not None:
        dataloader_config = DataLoaderConfiguration(use_seedable_sampler=True, data_seed=data_seed)
    accelerator = Accelerator(
        # Without CUDA, plain multi-process runs need cpu=True to form a gloo group
        # (otherwise each process trains alone as rank 0); DeepSpeed finds its CPU
        # accelerator itself.
        cpu=not resolution.on_cuda and not uses_deepspeed,
        mixed_precision=resolution.precision,
        gradient_accumulation_steps=resolution.gradient_accumulation_steps,
        step_scheduler_with_optimizer=step_scheduler_with_optimizer,
        deepspeed_plugin=plugin,
        dataloader_config=dataloader_config,
        kwargs_handlers=handlers,
        log_with=log_with,
        project_dir=project_dir,
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
    return Run(resolution=resolution, accelerator=accelerator)


def setup(
    args: StrategyConfig | None = None,
    *,
    model: Any,
    micro_batch_size: int,
    gradient_accumulation_steps: int = 1,
    max_grad_norm: float = 0.0,
    learning_rate: float | None = None,
    scale_lr: str = "none",
    weight_decay: float | None = None,
    data_seed: int | None = None,
    step_scheduler_with_optimizer: bool = True,
    log_with: str | None = None,
    project_dir: str | None = None,
) -> Run:
    """:func:`resolve` then :func:`start`: the strategy from the flags and the launcher,
    and an Accelerator that runs it on CPU or GPU under every launcher."""
    resolution = resolve(
        args,
        model=model,
        micro_batch_size=micro_batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
        max_grad_norm=max_grad_norm,
        learning_rate=learning_rate,
        scale_lr=scale_lr,
        weight_decay=weight_decay,
    )
    return start(
        resolution,
        data_seed=data_seed,
        step_scheduler_with_optimizer=step_scheduler_with_optimizer,
        log_with=log_with,
        project_dir=project_dir,
    )
