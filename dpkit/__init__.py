"""dpkit: data-parallel training on Accelerate and DeepSpeed (DDP, ZeRO-1, ZeRO-2) with measured per-GPU memory.

The public API, for a training script of your own (see the README's "Use dpkit in
your own script") and for dpkit's recipes, which use nothing else:

* run setup (:mod:`dpkit.train`): :func:`setup` (or :func:`resolve` then :func:`start`)
  turns ``--strategy``/``--deepspeed``/the launcher into an ``Accelerator`` and one
  resolved DeepSpeed config, right on CPU and GPU under every launcher;
  :meth:`Run.check` after ``prepare`` refuses a run that is not what was asked;
* memory (:mod:`dpkit.memory`): :class:`MemoryTracker`, the measured per-rank
  breakdown against the ZeRO accounting and ``dpkit plan``'s layout;
* guards: :class:`StepGuard` (loss over ranks, NaN stop, SIGTERM/SIGINT stop at a
  step boundary) and :func:`run_and_exit` (one exit path, one-line errors);
* checkpoints: :func:`save_checkpoint`, :func:`load_checkpoint`, :func:`save_model`,
  portable across strategies and world sizes;
* throughput and run files: :class:`Throughput`, :class:`RunOutput`.

Names are imported on first use: ``import dpkit`` is cheap, and ``dpkit plan``
never imports torch.
"""

from __future__ import annotations

from dpkit.lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # strategies
    "Strategy": "dpkit.strategy",
    "STRATEGIES": "dpkit.strategy",
    "DDP": "dpkit.strategy",
    "ZERO1": "dpkit.strategy",
    "ZERO2": "dpkit.strategy",
    "get_strategy": "dpkit.strategy",
    # errors
    "UsageError": "dpkit.errors",
    # configuration and command lines
    "StrategyConfig": "dpkit.train.config",
    "ModelConfig": "dpkit.train.finetune_config",
    "DataConfig": "dpkit.train.finetune_config",
    "TrainConfig": "dpkit.train.finetune_config",
    "parse_args": "dpkit.train.config",
    "config_dict": "dpkit.train.config",
    # run setup
    "Resolution": "dpkit.train.resolve",
    "resolve": "dpkit.train.resolve",
    "scaled_learning_rate": "dpkit.train.resolve",
    "Run": "dpkit.train.run",
    "RunInfo": "dpkit.train.run",
    "setup": "dpkit.train.run",
    "start": "dpkit.train.run",
    "log_once_per_job": "dpkit.train.run",
    # guards
    "StepGuard": "dpkit.train.guards",
    "NonFiniteLossError": "dpkit.train.guards",
    "run_and_exit": "dpkit.train.guards",
    # checkpoints
    "TrainerState": "dpkit.train.checkpoint",
    "save_checkpoint": "dpkit.train.checkpoint",
    "load_checkpoint": "dpkit.train.checkpoint",
    "resolve_resume": "dpkit.train.checkpoint",
    "check_resumable": "dpkit.train.checkpoint",
    "check_output_dir": "dpkit.train.run_output",
    "carry_over_note": "dpkit.train.checkpoint",
    "Checkpointer": "dpkit.train.checkpointer",
    "Position": "dpkit.train.checkpointer",
    "save_model": "dpkit.train.full_state",
    # run output and throughput
    "RunOutput": "dpkit.train.run_output",
    "read_jsonl": "dpkit.train.run_output",
    "Throughput": "dpkit.train.progress",
    "TrainingLog": "dpkit.train.progress",
    "StepPhases": "dpkit.train.phases",
    # tuning
    "TuneConfig": "dpkit.tune.config",
    "run_tune": "dpkit.tune.run",
    # memory
    "MemoryTracker": "dpkit.memory.tracker",
    "MemoryReport": "dpkit.memory.report",
    # models
    "ModelSizes": "dpkit.models",
    "load_model_config": "dpkit.models",
    "resolve_model_path": "dpkit.models",
    "load_tokenizer": "dpkit.models",
    "classifier_labels": "dpkit.models",
    "adamw_param_groups": "dpkit.models",
    "max_positions": "dpkit.models",
    # data
    "load_data_splits": "dpkit.data.classification",
    "check_classification_data": "dpkit.data.classification",
    "LMWorkload": "dpkit.data.lm",
    "lm_config": "dpkit.data.lm",
    "build_lm": "dpkit.data.lm",
    "token_blocks": "dpkit.data.lm",
    "check_enough_blocks": "dpkit.data.lm",
    # package data
    "metric_dir": "dpkit.resources",
    "ClassifierMetrics": "dpkit.train.evaluation",
}
__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
