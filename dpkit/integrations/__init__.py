"""dpkit for training code that is not dpkit's: integrations with other training loops.

* :mod:`dpkit.integrations.transformers`: the Transformers ``Trainer``: the per-rank
  memory report as a ``TrainerCallback``, dpkit's model-sized ZeRO settings as a
  DeepSpeed dict, and the arguments a CPU run needs.
"""
