"""Training setup: everything between the command line and the training loop.

* :mod:`~dpkit.train.config`: the flags, as dataclasses validated when built;
* :mod:`~dpkit.train.launch`: the strategy and precision the flags and the launcher ask for;
* :mod:`~dpkit.train.deepspeed_config`: DeepSpeed JSON read, checked and resolved in one pass
  (:mod:`~dpkit.train.ds_config_keys`: the keys the installed DeepSpeed knows);
* :mod:`~dpkit.train.resolve`: the run resolved once, before any process group;
* :mod:`~dpkit.train.run`: the Accelerator for it, and the check after ``prepare``;
* :mod:`~dpkit.train.guards`: stop requests, non-finite losses, collective failures, exit codes;
* :mod:`~dpkit.train.checkpoint` and :mod:`~dpkit.train.full_state`: portable checkpoints;
  :mod:`~dpkit.train.consolidate`: ``dpkit consolidate``;
* :mod:`~dpkit.train.run_output` and :mod:`~dpkit.train.progress`: the run's files, its log and throughput.

The names scripts use are exported from the top-level ``dpkit`` package.
"""
