"""A run: the Accelerator for a :class:`~dpkit.train.resolution.Resolution`, and everything a training script asks of it.

One way in, four calls::

    run = dpkit.setup(model=model, micro_batch_size=16, output_dir="out")  # checked; nothing started
    model, optimizer, loader = run.prepare(model, optimizer, loader)        # wrap, check, track
    run.save_checkpoint(model, optimizer, step=step)                        # every rank
    run.finish(step=step)                                                   # every rank: the report

:func:`setup` resolves the strategy from the flags and the launcher (bad input: one
line and exit code 2, before any process group); the Accelerator starts at its first use,
working around what the bare stack gets wrong (docs/stack-notes.md):

* ``accelerate launch --multi_gpu`` without CUDA starts N processes that each train
  alone unless the Accelerator is built with ``cpu=True``;
* ``accelerate launch --use_deepspeed`` without CUDA counts one process and
  DeepSpeed's batch assertion fails unless the process-group backend is named (gloo);
* ``python recipe.py --strategy zero2`` (or an FSDP2 strategy) has no process group: a
  one-process rendezvous on localhost is set up;
* accelerate's FSDP2 path needs an accelerator device (on CPU an FSDP YAML runs
  unconnected copies): the FSDP2 engine applies ``fully_shard`` itself.

:meth:`Run.prepare` wraps the model, optimizer and loaders as the strategy's engine
does it (any order, as ``accelerator.prepare`` takes them), turns a silent mis-launch
(processes that would train unconnected copies, a model not wrapped as asked) into an
error, logs once what really runs (:class:`RunInfo`), writes it to the run folder,
restores a checkpoint being resumed and starts the per-rank memory accounting.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from dpkit.core.strategy import Strategy
from dpkit.engines import engine_of
from dpkit.errors import UsageError
from dpkit.train.accelerator import start_accelerator
from dpkit.train.config import RunOptions
from dpkit.train.resolution import Resolution

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
    """Where the optimizer state lives off the device (DeepSpeed offload), or None."""
    gradient_checkpointing: bool = False
    """Whether the model recomputes its layers' activations in backward (read from it)."""
    frozen_params: int = 0
    """Parameters that do not train (LoRA's frozen pretrained weights): held, no
    gradients, no optimizer state."""
    lora: dict | None = None
    """The LoRA adapters trained (:class:`~dpkit.lora.LoraSettings`), or None."""
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
        if self.gradient_checkpointing:
            lr += " | gradient checkpointing"
        if self.lora is not None:
            lr += (
                f" | LoRA r={self.lora['r']} alpha={self.lora['alpha']:g}: "
                f"{self.num_params:,} trainable, {self.frozen_params:,} frozen params"
            )
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


class Run:
    """A resolved run and its Accelerator: what a training script asks of the strategy.

    Made by :func:`setup`. Every rank makes every call: :meth:`prepare`,
    :meth:`save_checkpoint`, :meth:`save_model` and :meth:`finish` are collectives.
    """

    def __init__(
        self,
        resolution: Resolution,
        options: RunOptions,
        *,
        run_config: dict | None = None,
        model_name: str | None = None,
    ) -> None:
        self.resolution = resolution
        self.options = options
        """What the run does besides its strategy (:class:`~dpkit.train.config.RunOptions`)."""
        self._accelerator: Any = None
        self._run_config = run_config or {}
        self.output: Any = None
        """The run folder (:class:`~dpkit.train.output.RunOutput`), once the run has
        started, or None without one."""
        self.resume = options.resume
        """The checkpoint :meth:`prepare` restores (:class:`~dpkit.checkpoints.resume.Resume`)."""
        self.model_name = model_name
        """What the run trains from, as named (recorded with each checkpoint)."""
        self.info: RunInfo | None = None
        """What runs, once :meth:`prepare` checked it."""
        self.memory: Any = None
        """The per-rank memory tracker (:class:`~dpkit.memory.MemoryTracker`), from
        :meth:`prepare` on."""
        self.checkpoints: Any = None
        """The run's :class:`~dpkit.checkpoints.checkpointer.Checkpointer`, from
        :meth:`prepare` on (when the run has an output folder)."""
        self.lr_plan: Any = None
        """The lr schedule :meth:`make_scheduler` planned
        (:class:`~dpkit.checkpoints.folder.LrPlan`): recorded with each checkpoint,
        continued by a resume; None before it, or for a backend config's own scheduler."""
        self.position: Any = None
        """Where training stands (:class:`~dpkit.checkpoints.checkpointer.Position`): a
        fresh start, or the resumed checkpoint's step, epoch and place in the epoch."""

    @property
    def accelerator(self) -> Any:
        """The run's Accelerator. The first use starts it, and with it the process group
        (and writes ``run_config.json`` into the run folder): until then the run is only
        resolved, and checks that need the world size can still refuse bad input."""
        if self._accelerator is None:
            from dpkit.train.output import RunOutput

            options = self.options
            self._accelerator = start_accelerator(
                self.resolution,
                data_seed=options.data_seed,
                step_scheduler_with_optimizer=options.step_scheduler_with_optimizer,
                log_with=options.log_with,
                project_dir=options.output_dir,
            )
            if options.output_dir is not None:
                self.output = RunOutput(options.output_dir, self._accelerator.is_main_process)
                resume_step = self.resume.state.step if self.resume else None
                self.output.start(self._run_config, resume_step=resume_step)
        return self._accelerator

    @property
    def strategy(self) -> Strategy:
        return self.resolution.strategy

    @property
    def engine(self) -> Any:
        """The backend that runs the strategy (:mod:`dpkit.engines`)."""
        return engine_of(self.resolution.strategy)

    @property
    def world_size(self) -> int:
        """Processes the launcher started (the process group's size, checked by
        :meth:`prepare`); known before the run starts."""
        return self.resolution.world_size

    @property
    def global_batch_size(self) -> int:
        return self.resolution.global_batch_size

    @property
    def learning_rate(self) -> float | None:
        """The peak learning rate, scaled with the global batch if asked."""
        return self.resolution.learning_rate

    @property
    def backend_config(self) -> dict | None:
        """The backend's configuration as its engine got it (DeepSpeed's dict, accelerate's
        own, not a copy kept beside it), or None where the backend has no such file."""
        return self.engine.config_in_effect(self.accelerator)

    # ---- building what prepare takes ---------------------------------------------------

    def building_model(self) -> Any:
        """``with run.building_model(): model = ...from_pretrained(...)``: the context the
        strategy builds a model in. ZeRO-3 starts the Accelerator (the process group) here,
        so that the model is partitioned as it loads; every other strategy: nothing."""
        return self.engine.building_model(self)

    def apply_lora(self, model: Any) -> Any:
        """With ``--lora-r``: ``model`` with LoRA adapters (peft; :mod:`dpkit.lora`), its
        pretrained weights frozen; without: ``model`` as it is. Call it after loading the
        weights and before building the optimizer (which then holds what trains);
        :meth:`prepare` refuses a LoRA run whose model or optimizer skipped it."""
        if self.resolution.lora is None:
            return model
        import torch

        from dpkit.lora import apply_lora

        # The adapters' initial values from the run's seed, the same on every rank (FSDP2
        # broadcasts nothing) and whatever the RNG has drawn so far, which stays untouched.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.options.seed)
            return apply_lora(model, self.resolution.lora)

    def make_optimizer(self, params: Any, lr: float, weight_decay: float) -> Any:
        """torch AdamW under every strategy, fused where torch has the kernel
        (:func:`dpkit.models.adamw`), so losses compare across strategies; a backend
        config that builds its own optimizer (a DeepSpeed JSON's ``optimizer`` section)
        gets accelerate's placeholder."""
        from accelerate.utils import DummyOptim

        from dpkit.models import adamw

        if self.engine.optimizer_in_config(self.resolution.settings):
            return DummyOptim(params, lr=lr, weight_decay=weight_decay)
        built = self.engine.build_optimizer(self.resolution.settings, params, lr, weight_decay)
        if built is not None:
            return built
        return adamw(params, lr=lr, weight_decay=weight_decay)

    def make_scheduler(self, name: str, optimizer: Any, warmup_steps: int, total_steps: int) -> Any:
        """transformers' ``get_scheduler``, its plan kept in :attr:`lr_plan` (each
        checkpoint records it; a resume continues this plan from the checkpoint's step,
        :func:`~dpkit.checkpoints.resume.continue_schedule`); a backend config with its own
        ``scheduler`` section gets accelerate's placeholder."""
        from accelerate.utils import DummyScheduler
        from transformers import get_scheduler

        from dpkit.checkpoints.folder import LrPlan

        if self.engine.scheduler_in_config(self.resolution.settings):
            return DummyScheduler(
                optimizer, total_num_steps=total_steps, warmup_num_steps=warmup_steps
            )
        # The peak is the optimizer's lr as built: get_scheduler sets it to warm-up's first.
        groups = getattr(optimizer, "param_groups", None)
        peak_lr = float(groups[0]["lr"]) if groups else self.learning_rate
        self.lr_plan = LrPlan(name, peak_lr, warmup_steps, total_steps)
        return get_scheduler(
            name, optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps
        )

    # ---- prepare -----------------------------------------------------------------------

    def prepare(self, *objects: Any, **run_info: Any) -> Any:
        """Wrap ``objects`` (the model, its optimizer, loaders, a scheduler; any order, as
        ``accelerator.prepare`` takes them) as the strategy's engine does it, and return
        them prepared, in the same order. With ``--gradient-checkpointing`` the model's
        layers are checkpointed first (:func:`dpkit.models.enable_gradient_checkpointing`).

        Then: checks that what runs is what was asked for (a mismatch is an error, not a
        warning) and logs it once; writes ``run_info.json`` (with ``run_info``'s extra
        fields, the schedule say) and the backend's resolved config to the run folder;
        restores the checkpoint being resumed (:attr:`position` says where training
        stands); starts the per-rank memory accounting (:attr:`memory`). Every rank calls.
        Under FSDP2 the model is sharded first and an optimizer built over its whole
        parameters is switched onto the shards (it must not have stepped yet).
        """
        from dpkit.checkpoints.checkpointer import Checkpointer, Position
        from dpkit.core.walk import unwrap_module
        from dpkit.memory.tracker import model_record

        if self.resolution.gradient_checkpointing:
            from dpkit.models import enable_gradient_checkpointing

            for module in (o for o in objects if is_module(o)):
                enable_gradient_checkpointing(module)
        _check_lora(self.resolution.lora, objects)
        prepared = self.engine.prepare(self, objects)
        model = next((o for o in prepared if is_module(o)), None)
        optimizer = next((o for o in prepared if _is_optimizer(o)), None)
        if model is None or optimizer is None:
            raise UsageError("run.prepare: give it the model and its optimizer (and the loaders)")
        scheduler = next((o for o in prepared if _is_scheduler(o)), None)
        self.info = self._check(model, optimizer)
        if self.output is not None:
            from dpkit.checkpoints.resume import schedule_record

            lr_schedule = schedule_record(self.lr_plan, self.resume)
            if lr_schedule is not None:  # the plan, and what a resume did with it
                run_info = {**run_info, "lr_schedule": lr_schedule}
            self.output.write_json("run_info.json", {**self.info.as_dict(), **run_info})
            config = self.backend_config
            if config is not None and self.engine.config_file:
                self.output.write_json(self.engine.config_file, config)
            self.checkpoints = Checkpointer(
                self,
                self.output.path,
                seed=self.options.seed,
                keep_last=self.options.keep_last,
                tokenizer=self.options.tokenizer,
                enabled=self.options.save_checkpoints,
                model_name=self.model_name,
                checkpoint_format=self.options.checkpoint_format,
                async_save=self.options.async_save,
            )
            self.position = self.checkpoints.restore(model, optimizer, scheduler, self.resume)
        else:
            self.position = Position()
        self.memory = self.track_memory(
            model,
            optimizer,
            probe_steps=self.options.memory_probe_steps,
            # What `dpkit plan --against` reads of a script of the user's own (a recipe's
            # run_config.json names its model; a script's names only the strategy flags).
            model_record=model_record(
                unwrap_module(model),
                optimizer,
                self.resolution.micro_batch_size,
                gradient_accumulation_steps=self.resolution.gradient_accumulation_steps,
                strategy=self.strategy,
            ),
        )
        return prepared[0] if len(prepared) == 1 else prepared

    def _check(self, model: Any, optimizer: Any) -> RunInfo:
        """What runs, from the live objects, or an error."""
        import torch.distributed as dist

        from dpkit.lora import frozen_and_trainable, lora_settings
        from dpkit.models import is_gradient_checkpointing

        acc, asked = self.accelerator, self.resolution
        if acc.num_processes != asked.world_size:
            raise RuntimeError(
                f"the launcher started {asked.world_size} processes but the process group has "
                f"{acc.num_processes}: the processes would train unconnected copies"
            )
        found = self.engine.after_prepare(self, model, optimizer)
        frozen, trainable = frozen_and_trainable(acc.unwrap_model(model))
        checkpointing = is_gradient_checkpointing(acc.unwrap_model(model))
        if checkpointing != asked.gradient_checkpointing:
            raise RuntimeError(
                f"gradient checkpointing asked {'on' if asked.gradient_checkpointing else 'off'}"
                f" but the prepared model has it {'on' if checkpointing else 'off'}"
            )
        backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else None
        info = RunInfo(
            strategy=asked.strategy.name,
            strategy_source=asked.source,
            distributed_type=str(acc.distributed_type).split(".")[-1],
            world_size=acc.num_processes,
            backend=backend,
            device=str(acc.device),
            wrapper=found.wrapper,
            zero_stage=found.zero_stage,
            precision=asked.precision,
            micro_batch_size=asked.micro_batch_size,
            gradient_accumulation_steps=asked.gradient_accumulation_steps,
            global_batch_size=asked.global_batch_size,
            learning_rate=asked.learning_rate,
            num_params=trainable,
            gradient_checkpointing=checkpointing,
            frozen_params=frozen,
            lora=lora_settings(acc.unwrap_model(model)),
            notes="; ".join(asked.notes),
            **{**asked.settings.run_info(), **found.run_info},
        )
        if acc.is_main_process:
            logger.info("%s", info.describe())
        return info

    def track_memory(self, model: Any, optimizer: Any, **kwargs: Any) -> Any:
        """:class:`dpkit.memory.MemoryTracker` for the prepared model and optimizer:
        probes where this strategy's engine holds its memory, and the per-rank report
        (:meth:`prepare` starts one; this is for a second model)."""
        from dpkit.memory import MemoryTracker

        return MemoryTracker(
            self.accelerator,
            model,
            optimizer,
            strategy=self.strategy,
            precision=self.resolution.precision,
            offload_optimizer=self.resolution.settings.run_info().get("offload_optimizer"),
            **kwargs,
        )

    # ---- during and after training -----------------------------------------------------

    def evaluation_done(self, model: Any) -> None:
        """After an evaluation (forwards without a backward): give back what the backend
        kept whole for a backward that never came (FSDP2 shard-grad-op's parameters)."""
        self.engine.after_evaluation(model)

    def save_checkpoint(
        self,
        model: Any,
        optimizer: Any,
        lr_scheduler: Any = None,
        *,
        step: int | None = None,
    ) -> Any:
        """The full training state under ``<output_dir>/checkpoints/step-N``, at
        :attr:`position` (``step`` moves it there first, for a loop of your own); every
        rank calls and, sharded (the default), writes its own part. Returns the folder
        (with ``async_save``, complete after the next save or :meth:`finish`), or None
        when the run saves no checkpoints."""
        if self.checkpoints is None:
            raise UsageError(
                "run.save_checkpoint: the run has no output folder (setup output_dir=)"
            )
        if step is not None:
            self.position.step = step
        return self.checkpoints.save(model, optimizer, lr_scheduler, self.position)

    def save_model(self, model: Any, path: Any, tokenizer: Any = None) -> None:
        """The model as a Hugging Face folder in fp32, shards consolidated (loads with
        ``from_pretrained``, without DeepSpeed); every rank calls, the main process writes."""
        from dpkit.checkpoints.state import save_model

        save_model(self.engine, self.accelerator, model, path, tokenizer or self.options.tokenizer)

    def finish(self, step: int | None = None) -> Any:
        """The end of the run, on every rank (like ``accelerator.end_training``): gathers
        every rank's memory, writes ``memory_report.json`` to the run folder and logs the
        table (main process), then ends the trackers. Returns the
        :class:`~dpkit.memory.report.MemoryReport` on the main process, None elsewhere."""
        report = None
        if self.checkpoints is not None:
            self.checkpoints.wait()  # an async save still being written
        if self.memory is not None:
            path = None if self.output is None else self.output.path / "memory_report.json"
            report = self.memory.write_report(path, step=step)
        self.accelerator.wait_for_everyone()
        self.accelerator.end_training()
        return report


def _check_lora(asked: Any, objects: Sequence[Any]) -> None:
    """Refuse a LoRA run whose model has no adapters (``run.apply_lora`` skipped) or
    whose optimizer was built before them (the adapters would never step). A peft model
    the script made itself, without ``--lora-r``, runs as it is (and is counted so)."""
    from dpkit.lora import is_lora_model

    model = next((o for o in objects if is_module(o)), None)
    optimizer = next(
        (o for o in objects if _is_optimizer(o) or type(o).__name__ == "DummyOptim"), None
    )
    if model is None:
        return
    has_lora = is_lora_model(model)
    if asked is not None and not has_lora:
        raise UsageError(
            f"--lora-r={asked.r}: the model has no LoRA adapters; call "
            "run.apply_lora(model) after loading it and before building the optimizer"
        )
    if asked is None or optimizer is None:
        return
    # A DeepSpeed JSON's optimizer comes as accelerate's DummyOptim, which has .params.
    groups = getattr(optimizer, "param_groups", None) or list(getattr(optimizer, "params", []))
    held = {
        id(p) for group in groups for p in (group["params"] if isinstance(group, dict) else [group])
    }
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in held]
    if missing:
        raise UsageError(
            f"--lora-r={asked.r}: the optimizer does not hold {len(missing)} trainable "
            f"parameter(s) ({missing[0]}, ...); build it after run.apply_lora(model)"
        )


def is_module(obj: Any) -> bool:
    import torch

    return isinstance(obj, torch.nn.Module)


def _is_optimizer(obj: Any) -> bool:
    import torch

    return isinstance(obj, torch.optim.Optimizer)


def _is_scheduler(obj: Any) -> bool:
    from accelerate.scheduler import AcceleratedScheduler

    return isinstance(obj, AcceleratedScheduler)
