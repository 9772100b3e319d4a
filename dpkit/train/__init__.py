"""Training setup: everything between the command line and the training loop.

Its modules import one way, in this order:

* :mod:`~dpkit.train.config`: the flags every recipe shares, as dataclasses validated
  when built (:mod:`~dpkit.train.finetune_config`: the fine-tuning recipe's own flags
  and schedule);
* :mod:`~dpkit.train.logs`: dpkit's lines from the main process, library warnings once per job;
* :mod:`~dpkit.train.launcher`: the strategy and precision the flags and the launcher ask for;
* :mod:`~dpkit.train.resolution`: the run resolved once, before any process group (the
  strategy's engine builds its settings: :mod:`dpkit.engines`);
* :mod:`~dpkit.train.parsing`: the command line into those dataclasses, one-line refusals;
* :mod:`~dpkit.train.accelerator`: the Accelerator and its process group, started once;
* :mod:`~dpkit.train.run`: the :class:`~dpkit.train.run.Run` a script drives (prepare,
  checkpoints, the report);
* :mod:`~dpkit.train.setup`: :func:`~dpkit.train.setup.setup`, the way in;
* :mod:`~dpkit.train.guards`: stop requests, non-finite losses, collective failures, exit codes;
* :mod:`~dpkit.train.output`, :mod:`~dpkit.train.progress`, :mod:`~dpkit.train.phases`:
  the run's files, its per-step log and throughput, and where each step's time went;
* :mod:`~dpkit.train.evaluation`: a classifier's metrics over every rank.

Checkpoints are :mod:`dpkit.checkpoints`. The names scripts use are exported from the
top-level ``dpkit`` package.
"""
