"""dpkit: data-parallel training on Accelerate and DeepSpeed (DDP, ZeRO-1, ZeRO-2, FSDP2) with measured per-GPU memory.

A training script of your own needs four calls (``docs/api.md``)::

    run = dpkit.setup(model=model, micro_batch_size=16, output_dir="out")
    model, optimizer, loader = run.prepare(model, optimizer, loader)
    run.save_checkpoint(model, optimizer, step=step)
    run.finish(step=step)

:func:`setup` turns ``--strategy``/``--deepspeed``/the launcher into a resolved run
(bad input: one line, exit code 2, before any process group); :class:`Run` prepares the
model as the strategy's engine does it (:mod:`dpkit.engines`), checks that what runs is
what was asked, measures every rank's memory and writes the report and checkpoints.
The rest of this namespace serves dpkit's recipes (their flags, log and evaluation);
``dpkit.data``, ``dpkit.models`` and ``dpkit.integrations.transformers`` hold the
helpers for data, models and the Transformers ``Trainer``.

Names are imported on first use: ``import dpkit`` is cheap, changes nothing in the
process, and ``dpkit plan`` never imports torch.
"""

from __future__ import annotations

from dpkit.lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # a run
    "setup": "dpkit.train.setup",
    "Run": "dpkit.train.run",
    "RunInfo": "dpkit.train.run",
    # flags
    "parse_args": "dpkit.train.parsing",
    "StrategyConfig": "dpkit.train.config",
    "RunOptions": "dpkit.train.config",
    "ModelConfig": "dpkit.train.finetune_config",
    "DataConfig": "dpkit.train.finetune_config",
    "TrainConfig": "dpkit.train.finetune_config",
    "DecoderModelConfig": "dpkit.train.causal_config",
    "CausalDataConfig": "dpkit.data.causal",
    "CausalTrainConfig": "dpkit.train.causal_config",
    # errors and exits
    "UsageError": "dpkit.errors",
    "run_and_exit": "dpkit.train.guards",
    # the training loop
    "StepGuard": "dpkit.train.guards",
    "TrainingLog": "dpkit.train.progress",
    "StepPhases": "dpkit.train.phases",
    "ClassifierMetrics": "dpkit.train.evaluation",
    "CausalLMMetrics": "dpkit.train.evaluation",
    # checkpoints and reports
    "find_resume": "dpkit.checkpoints.resume",
    "check_init_from": "dpkit.checkpoints.warm_start",
    "init_from": "dpkit.checkpoints.warm_start",
    "MemoryReport": "dpkit.memory.report",
    # strategies
    "Strategy": "dpkit.core.strategy",
    "STRATEGIES": "dpkit.engines",
}
__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
