"""``dpkit plan``: per-GPU memory of DDP, ZeRO and FSDP2 before launching, and the least sharding that fits.

One job per module, each importing only those above it in this list:

* :mod:`~dpkit.plan.inputs`: flag values (sizes, counts) and the model, built on the
  meta device (:class:`ModelSpec`, :func:`load_model`, :func:`parse_memory`);
* :mod:`~dpkit.plan.activations`: activation bytes, traced on the meta device or from
  the Korthikanti et al. formula;
* :mod:`~dpkit.plan.estimate`: one strategy's bytes per GPU at one micro-batch
  (:class:`PlanInputs`, :class:`StrategyEstimate`, :func:`estimate`), model states
  from :mod:`dpkit.memory.analytic`;
* :mod:`~dpkit.plan.recommend`: every strategy's estimate and the least sharding that
  fits (:func:`make_plan`, :class:`Plan`);
* :mod:`~dpkit.plan.output`: the plan as a table and as JSON;
* :mod:`~dpkit.plan.check`: ``dpkit plan --against RUN_DIR``, the plan of a finished
  run beside its measurement (:func:`check_run`);
* :mod:`~dpkit.plan.cli`: the ``dpkit plan`` command.

Strategies are :class:`dpkit.core.strategy.Strategy` values; functions take one or its name.
Nothing here imports torch at import time (``dpkit plan --help`` stays fast). The
function :func:`dpkit.plan.estimate.estimate` is not re-exported here: its name would
hide the module of the same name.
"""

from __future__ import annotations

from dpkit.core.spec import ModelSpec, PlanInputs
from dpkit.plan.activations import ActivationProfile, activation_profile
from dpkit.plan.check import PlanCheck, check_dict, check_run, format_check
from dpkit.plan.estimate import (
    StrategyEstimate,
    buffer_bytes,
    buffer_settings,
    gradient_layout,
    largest_micro_batch,
    step_bytes,
)
from dpkit.plan.inputs import load_model, parse_count, parse_memory
from dpkit.plan.output import NOT_COUNTED, format_table, plan_dict
from dpkit.plan.recommend import Plan, make_plan

__all__ = [
    "NOT_COUNTED",
    "ActivationProfile",
    "ModelSpec",
    "Plan",
    "PlanCheck",
    "PlanInputs",
    "StrategyEstimate",
    "activation_profile",
    "buffer_bytes",
    "buffer_settings",
    "check_dict",
    "check_run",
    "format_check",
    "format_table",
    "gradient_layout",
    "largest_micro_batch",
    "load_model",
    "make_plan",
    "parse_count",
    "parse_memory",
    "plan_dict",
    "step_bytes",
]
