"""The memory timeline as a chart: stacked bytes per category over one step, a panel per rank.

Drawn from ``memory_report.json`` alone (:func:`write_timeline_chart`), at the end of
a run and by ``dpkit report RUN_DIR``; ``dpkit bench`` draws each strategy's worst
rank side by side with :func:`draw_timeline` (:mod:`dpkit.bench.chart`). matplotlib's
Agg backend, as the bench chart.
"""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType
from typing import Any

from dpkit.memory.timeline import TIMELINE_CATEGORIES, timeline_totals

MIB = 1024.0**2
CHART_FILE = "memory_timeline.png"
"""Written next to ``memory_report.json``."""
COLORS = MappingProxyType(
    {
        "params": "#4c72b0",
        "grads": "#dd8452",
        "optimizer": "#55a868",
        "master": "#c44e52",
        "buffers": "#8172b3",
        "activations": "#bbbbbb",
    }
)
PHASE_COLORS = MappingProxyType(
    {
        "forward": "#4c72b0",
        "backward": "#dd8452",
        "reduce": "#8172b3",
        "optimizer": "#55a868",
    }
)


def has_timeline(report: dict[str, Any]) -> bool:
    """Whether any rank of a memory report (as JSON) carries a timeline with points."""
    return any((row.get("timeline") or {}).get("points") for row in report.get("ranks", []))


def normalised_times(points: list[dict[str, Any]]) -> list[float]:
    """Each entry's time as a fraction of the step (0 at its start, 1 at its last point)."""
    last = max((p["t"] for p in points), default=0.0)
    if last <= 0:
        return [i / max(1, len(points) - 1) for i in range(len(points))]
    return [p["t"] / last for p in points]


def _positions(points: list[dict[str, Any]], axis: str) -> list[float]:
    """Where each entry ends on the x axis: its normalised time, or its place in the
    sequence (``points``: every entry one unit wide, so a short optimizer step's copies
    are as visible as a long forward)."""
    if axis == "time":
        return normalised_times(points)
    return [(i + 1) / len(points) for i in range(len(points))]


def draw_timeline(
    ax: Any,
    timeline: dict[str, Any],
    *,
    lines: list[tuple[float, str, str]] | None = None,
    runtime_bytes: float | None = None,
    legend: bool = True,
    axis: str = "time",
) -> None:
    """One rank's step on ``ax``: categories stacked over the step, each entry's bytes
    drawn over the interval that leads up to it (what the step built up by that point),
    the phases shaded, ``lines`` (bytes, label, line style) as horizontal lines, the
    largest moment marked, and the process's memory figure (RSS less ``runtime_bytes``,
    the runtime measured at track(), or CUDA memory allocated) as a line. ``axis``:
    ``time`` (normalised) or ``points`` (one unit per entry)."""
    points = timeline["points"]
    ends = _positions(points, axis)
    xs = [0.0, *ends]
    # The first entry also covers the start (it is at time 0 on the time axis).
    values = [points[0], *points]
    for left, right, point in zip(xs, xs[1:], points, strict=False):
        ax.axvspan(left, right, color=PHASE_COLORS[point["phase"]], alpha=0.12, lw=0)
    stacks = [[(p.get(c) or 0.0) / MIB for p in values] for c in TIMELINE_CATEGORIES]
    ax.stackplot(
        xs,
        *stacks,
        labels=list(TIMELINE_CATEGORIES),
        colors=[COLORS[c] for c in TIMELINE_CATEGORIES],
        step="pre",
        alpha=0.9,
    )
    figure = None
    if timeline.get("memory_figure") == "rss":
        if runtime_bytes is not None:
            figure = ([(p["memory"] - runtime_bytes) / MIB for p in values], "RSS less runtime")
    else:
        figure = ([p["memory"] / MIB for p in values], "CUDA memory allocated")
    if figure is not None:
        ax.plot(xs, figure[0], color="black", lw=1, drawstyle="steps-pre", label=figure[1])
    for value, label, style in lines or []:
        ax.axhline(value / MIB, color="black", linestyle=style, linewidth=1.2, label=label)
    totals = timeline_totals(points)
    top = max(range(len(points)), key=totals.__getitem__)
    ax.annotate(
        f"worst {totals[top] / MIB:,.0f} MiB\n{points[top]['point']}",
        (ends[top], totals[top] / MIB),
        xytext=(-6, 14),
        textcoords="offset points",
        ha="right",
        fontsize=7,
        arrowprops={"arrowstyle": "-", "lw": 0.6},
    )
    stacked = [sum(column) for column in zip(*stacks, strict=True)]
    tops = [max(stacked), *(value / MIB for value, _, _ in lines or [])]
    if figure is not None:
        tops.append(max(figure[0]))
    ax.set_xlim(0, 1)
    ax.set_ylim(0, max(tops) * 1.15)
    if axis == "time":
        ax.set_xlabel("fraction of the step's time")
    else:
        ax.set_xlabel(f"point of the step (1 of {len(points)} each)")
        _phase_ticks(ax, points, xs)
    if legend:
        ax.legend(fontsize=7, loc="upper left", ncol=2)


def _phase_ticks(ax: Any, points: list[dict[str, Any]], xs: list[float]) -> None:
    """A tick where each phase first begins, named by the phase."""
    ticks: list[float] = []
    labels: list[str] = []
    seen: set[str] = set()
    for x, point in zip(xs, points, strict=False):
        if point["phase"] in seen:  # ZeRO-2 interleaves backward and reduce
            continue
        seen.add(point["phase"])
        if ticks and x - ticks[-1] < 2.5 / len(points):  # adjacent: one tick, both names
            labels[-1] += f"+{point['phase']}"
        else:
            ticks.append(x)
            labels.append(point["phase"])
    ax.set_xticks(ticks, labels, fontsize=7, rotation=30, ha="left")


def prediction_lines(
    report: dict[str, Any], plan_total: float | None
) -> list[tuple[float, str, str]]:
    """The horizontal lines of a report's chart: the ZeRO paper's model states per rank
    (the report's prediction) and, when given, ``dpkit plan``'s (its worst rank)."""
    lines = []
    predicted = (report.get("predicted") or {}).get("total")
    if predicted is not None:
        lines.append((float(predicted), "model states, ZeRO paper", "--"))
    if plan_total is not None:
        lines.append((float(plan_total), "model states, dpkit plan", ":"))
    return lines


def write_timeline_chart(
    report: dict[str, Any], path: str | Path, plan_total: float | None = None
) -> Path:
    """The timeline of every rank of ``report`` (a memory report as JSON), one panel per
    rank, saved as a PNG at ``path``. ``plan_total``: ``dpkit plan``'s model states per
    rank, drawn beside the paper's. The report must carry a timeline
    (:func:`has_timeline`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in sorted(report["ranks"], key=lambda r: r["rank"]) if r.get("timeline")]
    # Ranks side by side; the step over time above, point by point below (the optimizer
    # step is short but holds the largest moment of most runs).
    fig, axes = plt.subplots(
        2, len(rows), figsize=(5.2 * len(rows), 7.6), sharey=True, squeeze=False
    )
    lines = prediction_lines(report, plan_total)
    for index, row in enumerate(rows):
        timeline = row["timeline"]
        runtime = (row.get("peak") or {}).get("rss_runtime_at_track")
        for axis_row, axis in enumerate(("time", "points")):
            ax = axes[axis_row][index]
            draw_timeline(
                ax,
                timeline,
                lines=lines,
                runtime_bytes=runtime,
                legend=index == 0 and axis_row == 0,
                axis=axis,
            )
            if index == 0:
                ax.set_ylabel("MiB on this rank")
        worst = row.get("largest_moment") or {}
        axes[0][index].set_title(
            f"rank {row['rank']}, step {timeline.get('step')}: worst moment "
            f"{(worst.get('total') or 0.0) / MIB:,.1f} MiB at {worst.get('point', '-')}",
            fontsize=9,
        )
    fig.suptitle(
        f"Memory over one step: {report.get('strategy')}, {report.get('world_size')} ranks, "
        f"{report.get('precision')}, {int(report.get('num_params', 0)):,} params, "
        f"{report.get('device')}"
    )
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
