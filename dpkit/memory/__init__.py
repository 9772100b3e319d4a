"""Memory per rank: what each strategy holds, measured, and what the ZeRO accounting predicts.

* :mod:`~dpkit.memory.tracker`: :class:`MemoryTracker`, the per-rank measurement of a run
  and its report (the entry point; :meth:`dpkit.Run.prepare` starts one);
* :mod:`~dpkit.core.walk`: counts the bytes one rank holds, by category and holder, where
  the run's engine says its backend keeps them (``dpkit/engines/*/memory.py``);
* :mod:`~dpkit.memory.probes`: runs the walk inside each step, where gradients exist;
* :mod:`~dpkit.memory.peak`: the process's or the CUDA allocator's peak;
* :mod:`~dpkit.memory.report`: measured rows against the prediction, as a table and JSON;
* :mod:`~dpkit.memory.analytic`: the ZeRO paper's per-rank accounting (the prediction;
  each engine's arithmetic in ``dpkit/engines/*/plan.py``).

Names are imported on first use, so ``dpkit plan`` can read the accounting without torch.
"""

from __future__ import annotations

from dpkit.lazy import lazy_exports

_EXPORTS = {
    "MemoryTracker": "dpkit.memory.tracker",
    "measure_rank": "dpkit.memory.tracker",
    "MemoryReport": "dpkit.memory.report",
    "ModelStateBytes": "dpkit.memory.analytic",
    "model_state_bytes": "dpkit.memory.analytic",
    "full_replication_bytes": "dpkit.memory.analytic",
    "peak_figures": "dpkit.memory.peak",
    "reset_peak": "dpkit.memory.peak",
    "current_summary": "dpkit.memory.peak",
    "MODEL_STATES": "dpkit.core.categories",
}
__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
