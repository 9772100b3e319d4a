"""dpkit for the Transformers ``Trainer``: the per-rank memory report, ZeRO settings sized to the model, a run check.

One line gives any ``Trainer`` (DDP under ``torchrun``/``accelerate launch``, DeepSpeed
ZeRO-1/2/3 and ZeRO-2 offload through ``TrainingArguments(deepspeed=...)``) dpkit's
measured per-rank memory report (under ZeRO-3, create the ``TrainingArguments`` before
``from_pretrained``: the model then loads partitioned)::

    from dpkit.integrations.transformers import (
        MemoryReportCallback, deepspeed_config, device_arguments)

    args = TrainingArguments(
        output_dir="out",
        deepspeed=deepspeed_config(model, "zero2"),  # or a JSON path, a dict; None: no DeepSpeed
        **device_arguments(),                        # use_cpu + gloo on a machine without CUDA
    )
    trainer = Trainer(model=model, args=args, ..., callbacks=[MemoryReportCallback()])

* :class:`MemoryReportCallback` probes the Trainer's real model and optimizer (the ZeRO
  optimizer under DeepSpeed) on every rank, and at the end of training (and every K
  steps if asked) writes ``memory_report.json`` into ``output_dir``, prints the report
  and ``dpkit plan``'s layout check, and sends ``memory/*`` scalars to ``report_to``.
  It refuses, in one line, a run that trains unconnected copies or that asked for
  DeepSpeed and runs without it (both exit 0 silently otherwise: see
  :func:`check_trainer_run`).
* :class:`StepPhasesCallback` adds where each step's time went (``time/*``: data,
  forward, backward, gradient sync, optimizer, other; :class:`dpkit.StepPhases`) to the
  Trainer's logs.
* :func:`deepspeed_config` fills a DeepSpeed config's bucket and gradient-layout keys
  with dpkit's model-sized values (:mod:`dpkit.engines.deepspeed.settings`) and leaves the
  Trainer's own ``"auto"`` values (batch sizes, clipping, optimizer) to the Trainer.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from dpkit.core.strategy import Strategy
from dpkit.core.walk import inner_torch_optimizer, unwrap_optimizer
from dpkit.engines import ENGINES, engine_of
from dpkit.errors import UsageError
from dpkit.memory.tracker import (  # model_record: re-exported
    MemoryTracker,
    model_record,
    write_timeline_next_to,
)
from dpkit.models import ModelSizes
from dpkit.resources import metric_dir  # re-exported: a Trainer script's offline metrics
from dpkit.train.guards import refuse_and_exit
from dpkit.train.launcher import check_ranks_per_gpu, local_process_count
from dpkit.train.logs import log_once_per_job  # re-exported: for a Trainer script's start
from dpkit.train.phases import PHASES, StepPhases

logger = logging.getLogger(__name__)

__all__ = [
    "MemoryReportCallback",
    "StepPhasesCallback",
    "check_trainer_run",
    "deepspeed_config",
    "device_arguments",
    "log_once_per_job",
    "metric_dir",
]

REPORT_FILE = "memory_report.json"
# The Trainer's evaluation and prediction log lines (their metric_key_prefix).
EVAL_PREFIXES = ("eval_", "test_")


def device_arguments(deepspeed: str | Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``TrainingArguments`` a run on this machine needs beyond the Trainer's defaults.

    On a machine without CUDA: ``use_cpu=True``, and under a launcher of several
    processes ``ddp_backend="gloo"``. Without ``use_cpu`` the Trainer's ranks train as
    unconnected copies (DDP) or DeepSpeed fails its batch-size check (ZeRO);
    ``ACCELERATE_USE_CPU=true`` in the environment instead turns DeepSpeed off without a
    word. On CUDA: nothing (the Trainer picks nccl), after refusing in one line more
    processes on this node than visible GPUs (:func:`dpkit.train.launcher.check_ranks_per_gpu`).

    Call it before ``TrainingArguments``: on CPU it also keeps DeepSpeed from building
    its shared-memory all-reduce op, which training never uses and whose 66 MB
    ``/dev/shm`` segment per rank DeepSpeed never removes.

    Args:
        deepspeed: the DeepSpeed config the run gives ``TrainingArguments(deepspeed=...)``
            (None: none). On CPU under a launcher of several processes, a ZeRO-3 config
            starts DeepSpeed's comm here (gloo): ``from_pretrained`` builds the model
            under ``deepspeed.zero.Init``, which reads the world size from it, and on CPU
            the Trainer's arguments start torch's group only.
    """
    if torch.cuda.is_available():
        # Here, before TrainingArguments starts the group: NCCL refuses two ranks on one
        # GPU only once the group is up, in an error naming neither the flag nor the count.
        local_processes, source = local_process_count(os.environ)
        check_ranks_per_gpu(local_processes, torch.cuda.device_count(), source=source)
        return {}
    for engine in ENGINES:
        engine.before_process_group(on_cuda=False)
    if deepspeed is not None:
        _config_file_engine().before_trainer_arguments(deepspeed, on_cuda=False)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return {"use_cpu": True, "ddp_backend": "gloo"}
    return {"use_cpu": True}  # one process: a backend would make accelerate expect a group


def deepspeed_config(
    model: Any,
    config: str | Mapping[str, Any] | None = None,
    *,
    world_size: int | None = None,
) -> dict[str, Any] | None:
    """A DeepSpeed config for ``TrainingArguments(deepspeed=...)`` with dpkit's ZeRO settings.

    Every key of :data:`dpkit.engines.deepspeed.settings.ZERO_MEMORY_KEYS` (the bucket sizes,
    ``contiguous_gradients``, ``overlap_comm``...) that the config leaves out or
    ``"auto"`` gets the value dpkit's recipes run with, sized to ``model``
    (:func:`dpkit.engines.deepspeed.settings.zero_memory_settings`); a value written in the config
    is kept. Left alone, DeepSpeed allocates 5e8-element buckets (1.9 GiB each in fp32)
    and the Trainer's ``"auto"`` gives hidden_size^2, which for small and mid-size models
    means many small, slow reductions. The Trainer fills the rest (:data:`dpkit.engines.deepspeed.trainer.TRAINER_FILLS`).
    Under ``offload_optimizer``, ``zero_force_ds_cpu_optimizer`` left out becomes false:
    the Trainer's own optimizer steps the host partitions as built (true: accelerate
    swaps in DeepSpeed's CPU Adam, in L2 mode for anything but a torch AdamW).

    Args:
        model: the model to train (a ``torch.nn.Module`` (the meta device is enough), or a
            transformers config).
        config: ``"zero1"``, ``"zero2"``, ``"zero2_offload"``, ``"zero3"`` (dpkit's shipped
            configs), a JSON path or a dict;
            None: the config ``accelerate launch`` was given
            (``ACCELERATE_DEEPSPEED_CONFIG_FILE``), or None when there is none (no
            DeepSpeed, or accelerate's own plugin settings: returned untouched as None).
        world_size: data-parallel ranks; None: the launcher's ``WORLD_SIZE`` (1 without one).

    Raises:
        UsageError: an unreadable config, a ZeRO stage other than 1, 2 or 3, offload that
            DeepSpeed would not run as written, or an ``"auto"`` neither dpkit nor the
            Trainer fills.
    """
    from dpkit.config_files import accelerate_deepspeed_config

    if config is None:
        found = accelerate_deepspeed_config(os.environ)
        if found is None:
            return None
        if found.note:
            logger.info("dpkit: %s", found.note)
        config = found.path
    world = int(world_size if world_size is not None else os.environ.get("WORLD_SIZE", "1"))
    return _config_file_engine().trainer_config(
        ModelSizes.of(model), config, world_size=world, on_cuda=torch.cuda.is_available()
    )


def _config_file_engine() -> Any:
    """The engine configured by a file the run names (DeepSpeed's JSON)."""
    return next(engine for engine in ENGINES if engine.reads_config_file)


# --- what runs -----------------------------------------------------------------------


def _asked_for_deepspeed(args: Any) -> bool:
    """Whether the run asked for DeepSpeed: ``TrainingArguments(deepspeed=...)``, or an
    ``accelerate launch`` DeepSpeed config."""
    launched = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in ("1", "true")
    return bool(getattr(args, "deepspeed", None)) or launched


def check_trainer_run(args: Any) -> None:
    """Refuse, in one line, a Trainer run that is not the data-parallel job the launcher started.

    Two runs exit 0 without a word otherwise (transformers 5, accelerate 1.15, on a
    machine without CUDA): ranks that each train alone (``torchrun``/``accelerate
    launch`` without ``use_cpu=True``: no process group, no DDP, the copies drift
    apart), and a run that asked for DeepSpeed and runs as plain DDP
    (``ACCELERATE_USE_CPU=true`` in the environment).

    Raises:
        UsageError: naming what the launcher started and what runs.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    launched = int(os.environ.get("WORLD_SIZE", "1"))
    state = PartialState()
    if launched > 1 and state.num_processes != launched:
        raise UsageError(
            f"WORLD_SIZE={launched}: the launcher started {launched} processes but each "
            f"trains alone (accelerate {state.distributed_type}): unconnected copies; on a "
            "machine without CUDA pass TrainingArguments(use_cpu=True, ddp_backend='gloo') "
            "(dpkit.integrations.transformers.device_arguments())"
        )
    if _asked_for_deepspeed(args) and state.distributed_type != DistributedType.DEEPSPEED:
        cause = (
            "ACCELERATE_USE_CPU=true in the environment turns it off: unset it and"
            if os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true")
            else "on a machine without CUDA"
        )
        raise UsageError(
            f"deepspeed={_describe_deepspeed(args)}: the run asked for DeepSpeed but runs "
            f"without it (accelerate {state.distributed_type}); {cause} pass "
            "TrainingArguments(use_cpu=True, ddp_backend='gloo')"
        )


def _describe_deepspeed(args: Any) -> str:
    value = getattr(args, "deepspeed", None)
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, Mapping):
        stage = (value.get("zero_optimization") or {}).get("stage")
        return f"<a dict, ZeRO stage {stage}>"
    return repr(os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "accelerate launch"))


def strategy_running(model: torch.nn.Module, optimizer: Any) -> Strategy | None:
    """The strategy the prepared model and optimizer run, as the engines recognise them
    (:meth:`~dpkit.engines.base.Engine.recognise`: ZeRO-1/2/3 and ZeRO-2 offload from
    DeepSpeed's optimizer, DDP from a DDP wrapper or a world of one); None for anything
    else (the Trainer's FSDP, unconnected copies)."""
    for engine in ENGINES:
        strategy = engine.recognise(model, optimizer)
        if strategy is not None:
            return strategy
    return None


def optimizer_name(optimizer: Any) -> str | None:
    """The analytic prediction's name for the torch optimizer inside ``optimizer``
    (``adamw``, ``sgd``, ``sgd_momentum``), or None for one it has no figures for."""
    torch_opt = inner_torch_optimizer(optimizer)
    if isinstance(torch_opt, (torch.optim.Adam, torch.optim.AdamW)):
        return "adamw"
    if isinstance(torch_opt, torch.optim.SGD):
        momentum = any(group.get("momentum", 0) for group in torch_opt.param_groups)
        return "sgd_momentum" if momentum else "sgd"
    return None


def precision_running(args: Any, optimizer: Any, strategy: Strategy) -> str:
    """``no``, ``bf16`` or ``fp16``: as the backend keeps the parameters where it casts
    them (DeepSpeed's 16-bit partitions), otherwise from the Trainer's arguments (autocast)."""
    found = engine_of(strategy).memory.precision_in_effect(optimizer)
    if found is not None:
        return found
    return (
        "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "no"
    )


def optimizer_groups(optimizer: Any, strategy: Strategy) -> list[list[torch.nn.Parameter]]:
    """The parameters of each optimizer group as the backend holds them (the layout ZeRO
    flattens and partitions: DeepSpeed's ``bit16_groups``), or the torch groups."""
    return engine_of(strategy).memory.optimizer_groups(optimizer)


def _calling_trainer(callback: TrainerCallback) -> Any | None:
    """The ``Trainer`` whose callback handler is calling ``callback``.

    The callback API passes the unwrapped model and neither the Trainer nor its
    wrapped model; the DDP wrapper (whose reducer buckets are memory) and the callback
    list (the memory scalars must reach ``report_to`` before its loggers run) are the
    Trainer's. Every event is called from a Trainer method, a few frames up; the whole
    stack is searched (a frame holding neither costs a dict lookup), so that wrappers
    around the events (a profiler, a subclass's own methods) do not hide it.
    """
    frame = inspect.currentframe()
    try:
        while frame is not None:
            owner = frame.f_locals.get("self")
            handler = getattr(owner, "callback_handler", None)
            if handler is not None and any(cb is callback for cb in handler.callbacks):
                return owner
            frame = frame.f_back
        return None
    finally:
        del frame


def _log_first(callback: TrainerCallback, trainer: Any) -> None:
    """Move ``callback`` to the front of the Trainer's list: the reporting callbacks
    (wandb, tensorboard...) come before user callbacks there, and must see the scalars
    ``callback`` adds to a step's logs."""
    handler = getattr(trainer, "callback_handler", None)
    if handler is not None:
        handler.callbacks.remove(callback)
        handler.callbacks.insert(0, callback)


def _is_main() -> bool:
    from accelerate.state import PartialState

    return PartialState().is_main_process


@contextlib.contextmanager
def _models_built_whole() -> Iterator[None]:
    """Inside: transformers builds models whole. Under ZeRO-3 the Trainer's arguments make
    every ``from_config`` a ``deepspeed.zero.Init`` build (``HfDeepSpeedConfig``, held by
    a module-level weak reference); the plan check traces a meta-device copy of the model,
    which zero.Init cannot partition (measured: ``Cannot copy out of meta tensor``)."""
    from transformers.integrations import deepspeed as hf_deepspeed

    ref = hf_deepspeed._hf_deepspeed_config_weak_ref
    held = ref() if ref is not None else None
    if held is None:
        yield
        return
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed.set_hf_deepspeed_config(held)


class MemoryReportCallback(TrainerCallback):
    """dpkit's per-rank memory report for any Transformers ``Trainer``.

    Add it with ``Trainer(..., callbacks=[MemoryReportCallback()])``. At the first step
    it probes the Trainer's model and optimizer on every rank where each strategy holds
    its gradients (DDP's buckets, ZeRO's partitions and buckets); after ``probe_steps``
    optimizer steps the probes come off, so later steps run as without it. At the last
    step (and every ``report_every`` steps) every rank is measured and the main process
    writes ``output_dir/memory_report.json`` (read by ``dpkit plan --against``), prints
    the report with ``dpkit plan``'s layout check and adds ``memory/*`` scalars to that
    step's logs, for ``report_to``.
    """

    def __init__(
        self,
        report_every: int = 0,
        probe_steps: int = 3,
        print_report: bool = True,
        plan_check: bool = True,
        model_name: str | None = None,
    ) -> None:
        """
        Args:
            report_every: also report every N optimizer steps (0: at the end only).
            probe_steps: probe the first N optimizer steps (-1: every step; each probe
                walks the rank's tensors, so later steps are left unprobed by default:
                the model states' high-water is reached by the second step).
            print_report: print the report (and the plan check) on the main process.
            plan_check: set the report against ``dpkit plan --against``'s layout.
            model_name: what the report calls the model (None: its config's
                ``name_or_path``, or its class).
        """
        if report_every < 0:
            raise UsageError(f"report_every={report_every!r}: must be 0 (end only) or positive")
        if probe_steps < -1 or probe_steps == 0:
            raise UsageError(
                f"probe_steps={probe_steps!r}: must be positive, or -1 (every step): "
                "gradients live only inside a step"
            )
        self.report_every = report_every
        self.probe_steps = probe_steps
        self.print_report = print_report
        self.plan_check = plan_check
        self.model_name = model_name
        self.tracker: MemoryTracker | None = None
        self.report_path: Path | None = None
        self._trainer: Any = None
        self._model_record: dict[str, Any] | None = None
        self._pending_scalars: dict[str, float] = {}
        self._reported_step: int | None = None
        self._notes: list[str] = []

    # --- Trainer events ---------------------------------------------------------------

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Refuse a run that is not the job the launcher started (before any step): one
        line and exit 2, as a command line refuses, since the Trainer calls this and a
        script following the docs has no ``run_and_exit`` around it."""
        with refuse_and_exit():
            check_trainer_run(args)
            if _asked_for_deepspeed(args):
                refusal = _config_file_engine().trainer_refusal(model=kwargs.get("model"))
                if refusal:
                    raise UsageError(refusal)
        self._trainer = _calling_trainer(self)
        _log_first(self, self._trainer)

    def on_train_begin(
        self,
        args: Any,
        state: Any,
        control: Any,
        model: Any = None,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        """Install the probes on the prepared model and optimizer, every rank."""
        from accelerate.state import PartialState

        # Again here: a callback given with trainer.add_callback() after the Trainer was
        # built never saw on_init_end.
        with refuse_and_exit():
            check_trainer_run(args)
        if self.tracker is not None:  # a second train() on the same Trainer
            self.tracker.stop()
            self.tracker = None
        self._reported_step = None
        trainer = self._trainer or _calling_trainer(self)
        wrapped = getattr(trainer, "model_wrapped", None) or model
        strategy = strategy_running(wrapped, optimizer)
        if strategy is None:  # FSDP...: the run is fine, dpkit cannot measure it
            if _is_main():
                logger.warning(
                    "dpkit: MemoryReportCallback: no memory report for this run: it is neither "
                    "DDP nor DeepSpeed ZeRO (optimizer %s, model %s)",
                    type(unwrap_optimizer(optimizer)).__name__,
                    type(wrapped).__name__,
                )
            return
        if _asked_for_deepspeed(args) and not engine_of(strategy).reads_config_file:
            with refuse_and_exit():
                raise UsageError(
                    f"deepspeed={_describe_deepspeed(args)}: the run asked for DeepSpeed but "
                    f"trains with {type(unwrap_optimizer(optimizer)).__name__}"
                )
        refusal = engine_of(strategy).trainer_refusal(optimizer=optimizer)
        if refusal:
            with refuse_and_exit():
                raise UsageError(refusal)
        name = optimizer_name(optimizer)
        offload = engine_of(strategy).memory.offload_in_effect(optimizer)
        self.tracker = MemoryTracker(
            PartialState(),
            wrapped,
            optimizer,
            strategy=strategy,
            precision=precision_running(args, optimizer, strategy),
            optimizer_name=name or "adamw",
            offload_optimizer=offload,
            probe_steps=self.probe_steps,
        )
        self._notes = []
        if name is None:
            self._notes.append(
                f"optimizer {type(inner_torch_optimizer(optimizer)).__name__}: the prediction "
                "assumes AdamW's 8 bytes of state per parameter"
            )
        if trainer is None:
            self._notes.append(
                "the Trainer was not found from the callback: DDP's reducer buckets are not counted"
            )
        self._model_record = model_record(
            model if model is not None else wrapped,
            optimizer,
            args.per_device_train_batch_size,
            self.model_name,
            args.gradient_accumulation_steps,
            strategy,
        )
        self.report_path = Path(args.output_dir) / REPORT_FILE

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """Remove the probes after ``probe_steps``; report when due (a collective)."""
        if self.tracker is None:
            return control
        step = state.global_step
        self.tracker.step_done(step)
        due = self.report_every > 0 and step % self.report_every == 0
        if due or step >= state.max_steps:
            self._report(step)
            control.should_log = True  # the memory scalars go out with this step's logs
        return control

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any
    ) -> None:
        """Add the pending ``memory/*`` scalars to the logs the Trainer sends to ``report_to``."""
        if self._pending_scalars and logs is not None:
            logs.update(self._pending_scalars)
            self._pending_scalars = {}

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Report once more if training stopped before the last step's report."""
        if self.tracker is None:
            return
        if self._reported_step != state.global_step:
            self._report(state.global_step)
        self.tracker.stop()

    # --- the report -------------------------------------------------------------------

    def _report(self, step: int) -> None:
        report = self.tracker.report(step)  # a collective: every rank measures
        self._reported_step = step
        if report is None:
            return
        report.notes.extend(self._notes)
        report.model = self._model_record
        report.save(self.report_path)
        write_timeline_next_to(report, self.report_path)
        self._pending_scalars = {
            key: value
            for key, value in report.tracker_scalars().items()
            if not key.startswith(("memory/rank", "memory/error_pct/"))
        }
        if self.print_report:
            text = f"dpkit memory report, step {step}\n{report.format_table()}"
            if self.plan_check:
                text += "\n\n" + self._plan_text()
            print(text, flush=True)

    def _plan_text(self) -> str:
        from dpkit.plan.check import check_run, format_check

        try:
            with _models_built_whole():
                return format_check(check_run(self.report_path.parent))
        except UsageError as err:
            return f"dpkit plan --against: not available for this run ({err})"


class StepPhasesCallback(TrainerCallback):
    """Where each optimizer step's time goes, in the Trainer's own logs.

    Add it with ``Trainer(..., callbacks=[StepPhasesCallback()])``. The same clock as
    dpkit's recipes (:class:`dpkit.StepPhases`: hooks on the model the Trainer prepared,
    its loss and the ``torch.optim.Optimizer`` inside the Trainer's wrappers) splits
    every step into ``data``, ``forward``, ``backward``, ``grad_sync`` (the gradient
    reduction still in flight after the backward, and clipping), ``optimizer`` and
    ``other``; each training log line gets their means over the steps since the last
    one, in seconds of the main process (``time/forward_s``, ...; ``time/step_s`` their
    sum), and so does ``report_to``. What the Trainer does between two steps
    (logging, evaluation, saving) counts as the next step's ``data``.
    """

    def __init__(self) -> None:
        self.phases: StepPhases | None = None
        self._sums = dict.fromkeys(PHASES, 0.0)
        self._steps = 0

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Go first, so that the loggers see the scalars this callback adds."""
        _log_first(self, _calling_trainer(self))

    def on_train_begin(
        self,
        args: Any,
        state: Any,
        control: Any,
        model: Any = None,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        """Put the clock's hooks on the prepared model (the DDP wrapper or DeepSpeed's
        engine, so their forward work counts) and optimizer."""
        if self.phases is not None:  # a second train() on the same Trainer
            self.phases.remove()
        trainer = _calling_trainer(self)
        wrapped = getattr(trainer, "model_wrapped", None) or model
        self.phases = StepPhases(wrapped, optimizer)
        self._sums = dict.fromkeys(PHASES, 0.0)
        self._steps = 0

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Close the step's phases."""
        if self.phases is None:
            return
        for phase, seconds in self.phases.take().items():
            self._sums[phase] += seconds
        self._steps += 1

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any
    ) -> None:
        """Add the mean phases of the steps since the last training log line."""
        if not self._steps or logs is None or any(k.startswith(EVAL_PREFIXES) for k in logs):
            return
        means = {f"time/{phase}": total / self._steps for phase, total in self._sums.items()}
        means["time/step_s"] = sum(means.values())
        logs.update({key: round(value, 6) for key, value in means.items()})
        self._sums = dict.fromkeys(PHASES, 0.0)
        self._steps = 0

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Take the hooks off: evaluation and prediction after training run without them."""
        if self.phases is not None:
            self.phases.remove()
            self.phases = None
