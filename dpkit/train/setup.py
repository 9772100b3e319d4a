"""``dpkit.setup``: the flags and the launcher turned into a resolved, checked :class:`~dpkit.train.run.Run`.

Bad input is one line and exit code 2 here, before any process group starts and before
anything is written; the Accelerator starts at the run's first use of it.
"""

from __future__ import annotations

from typing import Any

from dpkit.engines import engine_of
from dpkit.errors import UsageError
from dpkit.train.config import RunOptions, StrategyConfig, config_dict
from dpkit.train.logs import log_once_per_job
from dpkit.train.parsing import parse_args
from dpkit.train.resolution import resolve
from dpkit.train.run import Run, is_module


def setup(
    args: StrategyConfig | None = None,
    *,
    model: Any,
    options: RunOptions | None = None,
    **keywords: Any,
) -> Run:
    """Build the run: the strategy from the flags and the launcher, resolved and checked,
    and the Accelerator that runs it on CPU or GPU under every launcher, started at its
    first use (:attr:`Run.accelerator`, or :meth:`Run.prepare`).

    Bad input (a flag, a DeepSpeed JSON, a launcher that contradicts the flag, an option)
    prints one line naming the field and the value and exits with code 2, before any
    process group starts and before anything is written.

    Args:
        args: the strategy flags (:class:`~dpkit.train.config.StrategyConfig`); None
            parses them from the command line (``--strategy``, ``--deepspeed``,
            ``--mixed-precision``, ...; any other flag is refused).
        model: the model (a ``torch.nn.Module``, its transformers config, or
            :class:`~dpkit.models.ModelSizes`): ZeRO's buckets and FSDP2's units come from it.
        options: what the run does besides its strategy
            (:class:`~dpkit.train.config.RunOptions`: ``micro_batch_size``, the optimizer's
            settings, ``output_dir``, checkpoints, ``resume``, memory probes...).
        keywords: the same options as keywords, for a script's convenience
            (``dpkit.setup(model=model, micro_batch_size=16, output_dir="out")``); give
            them or ``options``, not both.
    """
    from dpkit.checkpoints.resume import model_name
    from dpkit.lora import LoraSettings, meta_copy_with_lora
    from dpkit.train.guards import refuse_and_exit

    if args is None:
        (args,) = parse_args(StrategyConfig)
    log_once_per_job()
    with refuse_and_exit():
        if options is None:
            options = RunOptions.of(keywords)
        elif keywords:
            raise UsageError(
                f"setup({next(iter(keywords))}=...): give the options as RunOptions or as "
                "keywords, not both"
            )
        name = model_name(model, options.configs)
        lora = LoraSettings.from_args(args)
        if lora is not None:
            # The adapters placed on a meta copy: a target that matches nothing is refused
            # here, ZeRO's buckets are sized to what trains, a resume compares the names
            # the run will have. run.apply_lora puts them on the loaded model.
            model = meta_copy_with_lora(model, lora)
        resolution = resolve(
            args,
            model=model,
            micro_batch_size=options.micro_batch_size,
            gradient_accumulation_steps=options.gradient_accumulation_steps,
            max_grad_norm=options.max_grad_norm,
            learning_rate=options.learning_rate,
            scale_lr=options.scale_lr,
            weight_decay=options.weight_decay,
            lora=lora,
        )
        engine_of(resolution.strategy).check_options(
            resolution.strategy, checkpoint_format=options.checkpoint_format
        )
        if args.gradient_checkpointing and is_module(model):
            from dpkit.models import check_gradient_checkpointing

            # Here, before any process group; run.prepare turns it on in the model it gets
            # (a recipe checks a meta-device copy here and loads the weights after).
            check_gradient_checkpointing(model)
        if options.resume is not None:
            options.resume.check(
                global_batch_size=resolution.global_batch_size, model=model, model_name=name
            )
    return Run(
        resolution,
        options,
        # Read now: accelerate writes ACCELERATE_* variables of its own once it runs.
        run_config=config_dict(args, *options.configs),
        model_name=name,
    )
