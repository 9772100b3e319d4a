"""The chart of ``dpkit bench``: per-rank memory by category with the prediction, and throughput."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from dpkit.bench.launch import bare_run_name, checkpointed_run_name, repeat_name, trainer_run_name
from dpkit.bench.markdown import MIB
from dpkit.bench.results import REFERENCE, result_strategies
from dpkit.core.categories import CATEGORIES


def _median_rate(runs: dict[str, Any], name: str, repeats: int) -> float:
    """Tokens/s of run ``name``, the median over its repeats."""
    rates = [
        runs[repeat_name(name, r)]["tokens_per_s"]
        for r in range(1, repeats + 1)
        if repeat_name(name, r) in runs
    ]
    return statistics.median(rates)


def write_chart(results: dict[str, Any], path: Path) -> None:
    """Left: per-rank memory stacked by category, the paper's and dpkit plan's predictions
    marked. Right: tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    strategies = result_strategies(results)
    names = [s.name for s in strategies]
    runs, comparison = results["runs"], results["comparison"]
    # Two lines for a long label ("FSDP2 shard-grad-op"), so five strategies fit side by side.
    labels = [s.label.replace(" ", "\n", 1) if len(s.label) > 8 else s.label for s in strategies]
    colors = {
        "params": "#4c72b0",
        "grads": "#dd8452",
        "optimizer": "#55a868",
        "master": "#c44e52",
        "buffers": "#8172b3",
    }
    fig, (mem_ax, speed_ax) = plt.subplots(1, 2, figsize=(12, 5))
    positions = list(range(len(names)))
    bottoms = [0.0] * len(names)
    for category in CATEGORIES:
        heights = [runs[n]["memory"]["per_rank"][category] / MIB for n in names]
        mem_ax.bar(positions, heights, 0.6, bottom=bottoms, label=category, color=colors[category])
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    predicted = [comparison[n]["predicted_model_states"] / MIB for n in names]
    for x, value in zip(positions, predicted, strict=True):
        mem_ax.hlines(
            value, x - 0.38, x + 0.38, colors="black", linewidths=2.5, zorder=3,
            label="model states, ZeRO paper" if x == 0 else None,
        )  # fmt: skip
    planned = [comparison[n]["plan_model_states"] / MIB for n in names]
    for x, value in zip(positions, planned, strict=True):
        mem_ax.hlines(
            value, x - 0.38, x + 0.38, colors="black", linewidths=1.5, linestyles=":",
            zorder=3, label="model states, dpkit plan" if x == 0 else None,
        )  # fmt: skip
    if REFERENCE.name in runs:
        mem_ax.axhline(
            runs[REFERENCE.name]["memory"]["per_rank"]["total"] / MIB, color="grey", linestyle="--",
            linewidth=1, label=f"{REFERENCE.label} measured (full replica)",
        )  # fmt: skip
    for x, total in zip(positions, bottoms, strict=True):
        mem_ax.annotate(f"{total:,.0f}", (x, total), ha="center", va="bottom", fontsize=9)
    mem_ax.set_xticks(positions, labels)
    mem_ax.set_ylabel("MiB per rank (rank holding the most)")
    mem_ax.set_title(
        f"Memory per rank: {results['settings']['nproc']} ranks, "
        f"{results['num_params'] / 1e6:.1f}M params, {results['precision']}"
    )
    mem_ax.set_ylim(0, max(max(bottoms), max(predicted)) * 1.45)
    mem_ax.legend(fontsize=8, loc="upper center", ncol=3)

    width = 0.38
    repeats = results["settings"].get("repeats", 1)
    series = [("dpkit", names, "#4c72b0", -width / 2)]
    baseline = None
    if all(trainer_run_name(s) in runs for s in strategies):
        baseline = "trainer"
        series.append(("plain Trainer (torchrun)", [trainer_run_name(s) for s in strategies],
                       "#aaaaaa", width / 2))  # fmt: skip
    elif all(bare_run_name(s) in runs for s in strategies):
        baseline = "bare"
        series.append(("bare (torchrun / deepspeed)", [bare_run_name(s) for s in strategies],
                       "#aaaaaa", width / 2))  # fmt: skip
    top = 0.0
    for label, series_names, color, offset in series:
        rates = [_median_rate(runs, name, repeats) for name in series_names]
        xs = [x + offset for x in positions]
        speed_ax.bar(xs, rates, width, label=label, color=color)
        for x, rate in zip(xs, rates, strict=True):
            speed_ax.annotate(f"{rate:,.0f}", (x, rate), ha="center", va="bottom", fontsize=9)
        top = max(top, *rates)
    if baseline is not None:
        # The ratio the checks read: the median over the repeats of each pair's step times.
        for x, name in zip(positions, names, strict=True):
            ratio = comparison[name].get(f"dpkit_over_{baseline}_step_time")
            if ratio is not None:
                speed_ax.annotate(
                    f"dpkit/{'Trainer' if baseline == 'trainer' else 'bare'}\nstep {ratio:.2f}x",
                    (x, top * 1.1), ha="center", fontsize=8, fontweight="bold",
                )  # fmt: skip
    speed_ax.set_xticks(positions, labels)
    per_repeat = f", median of {repeats} repeats" if repeats > 1 else ""
    speed_ax.set_ylabel(
        f"tokens/s, all {results['settings']['nproc']} ranks (median step{per_repeat})"
    )
    speed_ax.set_title(
        f"Throughput ({results['machine']['cpu_model'] if not results['machine']['gpus'] else results['machine']['gpus'][0]})"
    )
    speed_ax.set_ylim(0, top * 1.35)
    speed_ax.legend(fontsize=8, loc="upper center", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def has_timelines(results: dict[str, Any]) -> bool:
    """Whether every dpkit run of the bench recorded a memory timeline."""
    names = [s.name for s in result_strategies(results)]
    return bool(names) and all(results["runs"][n]["memory"].get("timeline") for n in names)


def timeline_panels(results: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The timelines chart's columns, in order: (run name, title, strategy name): each
    strategy's dpkit run and, after it, its checkpointed twin where the bench ran one
    (``--gradient-checkpointing``: the activation hump is each layer's input only)."""
    runs = results["runs"]
    panels = []
    for strategy in result_strategies(results):
        panels.append((strategy.name, strategy.label, strategy.name))
        twin = checkpointed_run_name(strategy)
        if (runs.get(twin) or {}).get("memory", {}).get("timeline"):
            panels.append((twin, f"{strategy.label}, checkpointed", strategy.name))
    return panels


def write_timelines_chart(results: dict[str, Any], path: Path) -> None:
    """Each strategy's step, its worst rank (the one whose worst moment is largest), side
    by side on one normalised time axis and one memory scale: the categories stacked,
    the ZeRO paper's and ``dpkit plan``'s model states per rank as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dpkit.memory.chart import draw_timeline

    panels = timeline_panels(results)
    runs, comparison = results["runs"], results["comparison"]
    # The step over normalised time above; point by point below, where the optimizer
    # step's copies (short, but often the largest moment) get the width of any point.
    fig, axes = plt.subplots(
        2, len(panels), figsize=(4.6 * len(panels), 8.4), sharey=True, squeeze=False
    )
    for index, (name, title, strategy_name) in enumerate(panels):
        memory = runs[name]["memory"]
        row = comparison[strategy_name]
        lines = [
            (row["predicted_model_states"], "model states, ZeRO paper", "--"),
            (row["plan_model_states"], "model states, dpkit plan", ":"),
        ]
        for axis_row, axis in enumerate(("time", "points")):
            ax = axes[axis_row][index]
            draw_timeline(
                ax,
                memory["timeline"],
                lines=lines,
                runtime_bytes=memory.get("runtime_bytes"),
                legend=index == 0 and axis_row == 0,
                axis=axis,
            )
            if index == 0:
                ax.set_ylabel("MiB on the rank that peaks highest")
        axes[0][index].set_title(f"{title}: rank {memory['timeline_rank']}", fontsize=10)
    fig.suptitle(
        f"One step's memory by category: {results['settings']['nproc']} ranks, "
        f"{results['num_params'] / 1e6:.1f}M params, {results['precision']} "
        "(forward, backward, reduce, optimizer shaded)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
