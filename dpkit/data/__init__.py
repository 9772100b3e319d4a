"""Data: the embedded offline datasets (:mod:`~dpkit.data.embedded`), classification
splits (:mod:`~dpkit.data.classification`) and the causal-LM workload of ``dpkit bench``
(:mod:`~dpkit.data.lm`)."""
