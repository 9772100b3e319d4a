"""``dpkit tune``: the fastest configuration that fits, found by measuring.

Strategy x micro-batch (accumulation keeping the global batch fixed) x ZeRO buckets,
pruned by ``dpkit plan`` against a memory budget, each survivor a real launch of the
recipe; the fastest whose measured peak fits and whose losses agree with DDP wins.

* :mod:`~dpkit.tune.config`: :class:`TuneConfig` (what is asked), resolved once
  against the machine and the recipe (:func:`tune_settings`);
* :mod:`~dpkit.tune.space`: the candidates and their predicted memory;
* :mod:`~dpkit.tune.trials`: one trial: launch (``dpkit bench``'s launcher), read,
  reuse;
* :mod:`~dpkit.tune.decide`: the winner and why;
* :mod:`~dpkit.tune.report`: results.json, results.md, chart.png, the winner's files;
* :mod:`~dpkit.tune.run`: :func:`run_tune`, all of it; :mod:`~dpkit.tune.cli` the command.
"""

from __future__ import annotations

from dpkit.tune.config import TuneConfig
from dpkit.tune.run import run_tune

__all__ = ["TuneConfig", "run_tune"]
