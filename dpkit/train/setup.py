"""``dpkit.setup``: the flags and the launcher turned into a resolved, checked :class:`~dpkit.train.run.Run`.

Bad input is one line and exit code 2 here, before any process group starts and before
anything is written; the Accelerator starts at the run's first use of it.
"""

from __future__ import annotations

from typing import Any

from dpkit.errors import UsageError
from dpkit.train.config import StrategyConfig, config_dict
from dpkit.train.logs import log_once_per_job
from dpkit.train.parsing import parse_args
from dpkit.train.resolution import resolve
from dpkit.train.run import Run, is_module


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
    output_dir: str | None = None,
    configs: tuple[Any, ...] = (),
    resume: Any = None,
    seed: int = 0,
    data_seed: int | None = None,
    tokenizer: Any = None,
    keep_last: int = 0,
    save_checkpoints: bool = True,
    checkpoint_format: str = "sharded",
    async_save: bool = False,
    memory_probe_steps: int = 1,
    step_scheduler_with_optimizer: bool = True,
    log_with: str | None = None,
) -> Run:
    """Build the run: the strategy from the flags and the launcher, resolved and checked,
    and the Accelerator that runs it on CPU or GPU under every launcher, started at its
    first use (:attr:`Run.accelerator`, or :meth:`Run.prepare`).

    Bad input (a flag, a DeepSpeed JSON, a launcher that contradicts the flag) prints
    one line naming the field and the value and exits with code 2, before any process
    group starts and before anything is written.

    Args:
        args: the strategy flags (:class:`~dpkit.train.config.StrategyConfig`); None
            parses them from the command line (``--strategy``, ``--deepspeed``,
            ``--mixed-precision``, ...; any other flag is refused).
        model: the model (a ``torch.nn.Module``, its transformers config, or
            :class:`~dpkit.models.ModelSizes`): ZeRO's buckets and FSDP2's units come from it.
        micro_batch_size, gradient_accumulation_steps: the batch layout per process.
        max_grad_norm: the clipping norm the loop uses (0: none); DeepSpeed clips inside
            its step, so its config gets it too.
        learning_rate, scale_lr, weight_decay: the peak lr (scaled with the global batch by
            ``linear`` or ``sqrt``), recorded, and given to a DeepSpeed JSON's optimizer.
        output_dir: the run folder (``run_config.json``, ``run_info.json``, checkpoints,
            ``memory_report.json``); None: nothing is written.
        configs: the script's other flag dataclasses, recorded in ``run_config.json``
            beside ``args`` and the launcher's environment.
        resume: a checkpoint to continue (:func:`dpkit.checkpoints.resume.find_resume`):
            its global batch, model (as named), labels and parameter shapes must be this
            run's (refused in one line otherwise); :meth:`Run.prepare` restores it, the
            weights included, whatever ``model`` was loaded from.
        seed, tokenizer, keep_last, save_checkpoints: recorded with / saved beside each
            checkpoint; keep the newest ``keep_last`` (0: all); ``False`` writes none.
        checkpoint_format: ``sharded`` (every rank writes its own part; the ranks share a
            file system) or ``full`` (gathered, written by the main process).
        async_save: sharded checkpoints written in the background: each rank copies its
            part to CPU memory and trains on (``--async-save``).
        data_seed: seed accelerate's sampler (the same shuffle on every strategy and world size).
        memory_probe_steps: probe the memory inside the first N optimizer steps (-1: all).
        step_scheduler_with_optimizer, log_with: accelerate's switches (its trackers).
    """
    from dpkit.checkpoints.resume import model_name
    from dpkit.lora import LoraSettings, meta_copy_with_lora
    from dpkit.train.guards import refuse_and_exit

    if args is None:
        (args,) = parse_args(StrategyConfig)
    log_once_per_job()
    with refuse_and_exit():
        if checkpoint_format not in ("sharded", "full"):
            raise UsageError(
                f"checkpoint_format={checkpoint_format!r}: must be 'sharded' or 'full'"
            )
        if async_save and checkpoint_format != "sharded":
            raise UsageError(
                f"async_save=True: only with sharded checkpoints (checkpoint_format="
                f"{checkpoint_format!r} gathers the state on the main process)"
            )
        name = model_name(model, configs)
        lora = LoraSettings.from_args(args)
        if lora is not None:
            # The adapters placed on a meta copy: a target that matches nothing is refused
            # here, ZeRO's buckets are sized to what trains, a resume compares the names
            # the run will have. run.apply_lora puts them on the loaded model.
            model = meta_copy_with_lora(model, lora)
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
        if args.gradient_checkpointing and is_module(model):
            from dpkit.models import check_gradient_checkpointing

            # Here, before any process group; run.prepare turns it on in the model it gets
            # (a recipe checks a meta-device copy here and loads the weights after).
            check_gradient_checkpointing(model)
        if resume is not None:
            resume.check(
                global_batch_size=resolution.global_batch_size, model=model, model_name=name
            )
    return Run(
        resolution,
        start_options={
            "data_seed": data_seed,
            "step_scheduler_with_optimizer": step_scheduler_with_optimizer,
            "log_with": log_with,
            "project_dir": output_dir,
        },
        output_dir=output_dir,
        # Read now: accelerate writes ACCELERATE_* variables of its own once it runs.
        run_config=config_dict(args, *configs),
        resume=resume,
        seed=seed,
        tokenizer=tokenizer,
        keep_last=keep_last,
        save_checkpoints=save_checkpoints,
        checkpoint_format=checkpoint_format,
        async_save=async_save,
        memory_probe_steps=memory_probe_steps,
        model_name=name,
    )
