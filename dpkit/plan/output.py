"""``dpkit plan``'s output: the table people read (:func:`format_table`) and ``--json``
(:func:`plan_dict`).

Both print every strategy's figures per GPU, the recommendation and what the
estimate leaves out (:data:`NOT_COUNTED`); the JSON keeps bytes as integers and
strategies by name.
"""

from __future__ import annotations

from typing import Any

from dpkit.core.spec import PlanInputs
from dpkit.core.units import GIB, format_gib
from dpkit.engines import STRATEGIES, engine_of, get_strategy
from dpkit.plan.estimate import StrategyEstimate
from dpkit.plan.inputs import PlannedTask
from dpkit.plan.peak import peak_dict
from dpkit.plan.recommend import Plan

# The first column fits the longest label ("FSDP2 shard-grad-op").
LABEL_WIDTH = max(len(s.label) for s in STRATEGIES.values()) + 2

# What the estimate leaves out: printed with every plan, so no figure is read as more.
NOT_COUNTED = (
    "other processes on the GPU, and CUDA/NCCL memory beyond --reserve",
    "in the total, the temporaries between operators (the peak counts them); in both, a "
    "kernel's own workspace inside one operator",
    "under DDP's autocast, the residual stream and norm inputs stay fp32: "
    "the 16-bit trace undercounts them by about 2 bytes per hidden unit per token per norm",
    "evaluation, generation and checkpoint saving (the plan is one training step)",
    "host memory other than what offload moves there (and the fp32 model each process "
    "loads at start-up)",
)


def _describe_inputs(inputs: PlanInputs, task: PlannedTask | None = None) -> list[str]:
    """The request, in the lines that open the table (the task's where there is one)."""
    model = inputs.model
    source = {"bundled": "bundled config", "path": "local config", "hub": "Hub config"}
    origin = f"{model.name} ({source[model.source]})" if model.source != "count" else "--params"
    precision = "fp32" if inputs.precision == "fp32" else f"{inputs.precision} mixed precision"
    return [
        f"model: {origin}, "
        + (
            f"{model.num_params:,} parameters"
            if not model.frozen_params
            else f"{model.num_params:,} trainable + {model.frozen_params:,} frozen parameters"
            + (f" (LoRA r={model.lora['r']} on {_targets(model.lora)})" if model.lora else "")
        ),
        *([f"task: {task.line(model.task)}"] if task is not None else []),
        f"GPUs: {inputs.world_size} ({inputs.nodes} node{'s' if inputs.nodes > 1 else ''} x "
        f"{inputs.gpus_per_node}) x "
        f"{format_gib(inputs.gpu_memory)}; usable per GPU {format_gib(inputs.usable)} "
        f"({inputs.headroom:.0%} headroom kept free)",
        f"step: {precision}, {inputs.optimizer}, micro-batch {inputs.micro_batch} x "
        f"{inputs.seq_len} tokens, accumulation {inputs.gradient_accumulation_steps}, "
        "activation checkpointing "
        f"{'on' if inputs.activation_checkpointing else 'off'}, attention {inputs.attention}",
    ]


def _describe_method(plan: Plan) -> str:
    """How activations were estimated, for the notes under the table."""
    activations = plan.activations
    if activations is None:
        return (
            "activations: NOT COUNTED (a bare --params has no shapes), except DDP autocast's "
            "16-bit weight copies; the totals are a floor and no micro-batch limit is given"
        )
    if activations.method == "trace":
        return (
            "activations: bytes saved for backward, traced by running the model's forward on the "
            "meta device (attention as a fused kernel, dropout masks 1 byte), plus the logits peak"
        )
    note = f" ({activations.note})" if activations.note else ""
    return (
        f"activations: Korthikanti et al. 2022 formula from the config's shapes{note}, "
        "plus the logits peak"
    )


def _row_line(row: StrategyEstimate, plan: Plan) -> str:
    """One strategy's line of the table."""
    inputs = plan.inputs
    if not row.applicable:
        return f"{row.label:<{LABEL_WIDTH}}  n/a: --optimizer {inputs.optimizer} needs offload"
    figures = (row.params, row.grads, row.optimizer, row.master, row.activations, row.step)
    free = (inputs.gpu_memory - row.total) / inputs.gpu_memory
    fits = f"{'yes' if plan.fits(row) else 'no'} ({free:.0%})"
    largest = plan.largest_micro_batches[row.strategy]
    largest_text = "-" if largest is None else str(largest)
    return (
        f"{row.label:<{LABEL_WIDTH}}"
        + "".join(f"{v / GIB:>8.2f}" for v in figures)
        + f"{row.buffers / GIB:>9.2f}{row.reserve / GIB:>9.2f}{row.total / GIB:>8.2f}"
        + f"  {fits:<13}{largest_text:>15}"
    )


def format_table(plan: Plan) -> str:
    """The human-readable plan."""
    inputs = plan.inputs
    header = (
        f"{'GiB per GPU':<{LABEL_WIDTH}}{'params':>8}{'grads':>8}{'optim':>8}{'master':>8}{'activ':>8}"
        f"{'step':>8}{'buffers':>9}{'reserve':>9}{'total':>8}  {'fits (free)':<13}"
        f"{'max micro-batch':>15}"
    )
    lines = [
        "dpkit plan",
        *("  " + line for line in _describe_inputs(inputs, plan.task)),
        "",
        header,
    ]
    total_rule = (
        "total = params + optim + master + buffers + reserve + the larger of backward's "
        "(grads then + activ) and the step's (grads then + step temporaries)"
    )
    lines += [_row_line(row, plan) for row in plan.rows]
    chosen = plan.row(plan.recommended)
    largest = plan.largest_micro_batches[plan.recommended]
    largest_text = (
        f"; largest micro-batch that fits under it: {largest}" if largest is not None else ""
    )
    offloaded = [r for r in plan.rows if r.applicable and r.host_offload]
    engines = list(dict.fromkeys(engine_of(r.strategy) for r in plan.rows))
    laid_out = [r for r in plan.rows if r.applicable and r.grads_where]
    lines += [
        total_rule,
        *(
            f"{r.label} grads: {engine_of(r.strategy).label}'s layout, worst "
            f"{r.grads_where}: {format_gib(r.grads)} (the ZeRO paper's figure: "
            f"{format_gib(r.grads_paper)})"
            for r in laid_out
        ),
        "",
        f"recommended: {chosen.label} at micro-batch {inputs.micro_batch} "
        f"({format_gib(chosen.total)} per GPU){largest_text}",
        f"  why: {plan.reason}",
        "",
        _describe_method(plan),
        *(
            f"host memory: {r.label} keeps {format_gib(r.host_offload)} per GPU in "
            f"host RAM ({format_gib(r.host_offload * inputs.gpus_per_node)} per node, of "
            f"{format_gib(inputs.host_per_node)}: "
            f"{'--host-memory' if inputs.host_memory is not None else 'this machine'})"
            for r in offloaded
        ),
        "buffers: "
        + "; ".join(text for e in engines if (text := e.plan.plan_settings_text(plan.settings))),
        *(
            note
            for r in plan.rows
            if r.applicable
            and (note := engine_of(r.strategy).plan.plan_row_note(get_strategy(r.strategy), r))
        ),
        *_peak_lines(plan),
        "not counted:",
        *(f"  - {item}" for item in NOT_COUNTED),
    ]
    return "\n".join(lines)


def _peak_lines(plan: Plan) -> list[str]:
    """Each strategy's whole-step peak of live tensors, with its point."""
    if not plan.peaks:
        return [f"peak: not predicted ({plan.peak_note})"] if plan.peak_note else []
    lines = [
        "peak: the step's high-water of live tensor bytes (temporaries included; what "
        "max_memory_allocated shows), a later step's (AdamW's state alive from the start), "
        "the first step's beside it; --reserve is not in it",
    ]
    for row in plan.rows:
        peak = plan.peaks.get(row.strategy)
        if peak is None:
            continue
        later, first = peak.later, peak.first
        lines.append(
            f"  {row.label:<{LABEL_WIDTH}}{later.bytes / GIB:>8.2f} GiB at {later.point:<20}"
            f" first step {first.bytes / GIB:.2f} GiB at {first.point}"
        )
    lines.append(
        f"reserve: --reserve {format_gib(plan.inputs.reserve)} per GPU is what a GPU holds "
        "beside tensors (the CUDA context, the caching allocator's rounding and slack): in "
        "the total, not in the peak; a CPU run has none"
    )
    return lines


def _row_dict(row: StrategyEstimate, plan: Plan) -> dict[str, Any]:
    """One strategy's entry of ``--json``."""
    if not row.applicable:
        return {"strategy": row.strategy, "applicable": False}
    return {
        "strategy": row.strategy,
        "applicable": True,
        "bytes_per_gpu": {
            "params": round(row.params),
            "grads": round(row.grads),
            "grads_backward": round(
                row.grads if row.grads_backward is None else row.grads_backward
            ),
            "grads_step": round(row.grads if row.grads_step is None else row.grads_step),
            "grads_paper": round(row.grads_paper),
            "optimizer": round(row.optimizer),
            "master": round(row.master),
            "activations": round(row.activations),
            "step": round(row.step),
            "buffers": round(row.buffers),
            "reserve": round(row.reserve),
            "total": round(row.total),
        },
        "grads_where": row.grads_where or None,
        "buffer_parts": {k: round(v) for k, v in row.buffer_parts.items()},
        "step_parts": {k: round(v) for k, v in row.step_parts.items()},
        "activation_parts": {k: round(v) for k, v in row.activation_parts.items()},
        "host_offload_bytes_per_gpu": round(row.host_offload),
        "fits": plan.fits(row),
        "free_fraction": (plan.inputs.gpu_memory - row.total) / plan.inputs.gpu_memory,
        "largest_micro_batch": plan.largest_micro_batches[row.strategy],
        "peak": peak_dict(plan.peaks[row.strategy]) if row.strategy in plan.peaks else None,
    }


def plan_dict(plan: Plan) -> dict[str, Any]:
    """The plan for ``--json``: bytes as integers, per GPU unless named otherwise."""
    inputs = plan.inputs
    activations = plan.activations
    return {
        "model": {
            "name": inputs.model.name,
            "source": inputs.model.source,
            "num_params": inputs.model.num_params,
            "frozen_params": inputs.model.frozen_params,
            "lora": inputs.model.lora,
        },
        "task": None
        if plan.task is None
        else {
            "task": plan.task.task,
            "num_labels": plan.task.num_labels,
            "model_class": inputs.model.task,
            "chosen_by": plan.task.chosen_by,
            "why": plan.task.why or None,
        },
        "inputs": {
            "gpus_per_node": inputs.gpus_per_node,
            "nodes": inputs.nodes,
            "world_size": inputs.world_size,
            "gpu_memory_bytes": inputs.gpu_memory,
            "usable_bytes": round(inputs.usable),
            "host_memory_bytes_per_node": inputs.host_per_node,
            "host_usable_bytes_per_gpu": round(inputs.host_usable),
            "headroom": inputs.headroom,
            "reserve_bytes": inputs.reserve,
            "precision": inputs.precision,
            "optimizer": inputs.optimizer,
            "micro_batch": inputs.micro_batch,
            "gradient_accumulation_steps": inputs.gradient_accumulation_steps,
            "seq_len": inputs.seq_len,
            "activation_checkpointing": inputs.activation_checkpointing,
            "attention": inputs.attention,
        },
        "activations": None
        if activations is None
        else {
            "method": activations.method,
            "note": activations.note,
            "bytes_at_micro_batch_1": round(activations.at(1)),
            "bytes_per_sample_from_2": round(sum(activations.per_sample.values())),
        },
        "settings": plan.settings,
        "strategies": [_row_dict(row, plan) for row in plan.rows],
        "recommendation": {
            "strategy": plan.recommended,
            "reason": plan.reason,
            "largest_micro_batch": plan.largest_micro_batches[plan.recommended],
        },
        "peak_note": plan.peak_note or None,
        "not_counted": list(NOT_COUNTED),
    }


def _targets(lora: dict) -> str:
    targets = lora.get("target_modules")
    return targets if isinstance(targets, str) else ", ".join(targets or [])
