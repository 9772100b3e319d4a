"""``dpkit report RUN_DIR``: the memory timeline of a finished run, drawn from its report.

    dpkit report runs/finetune                  # -> runs/finetune/memory_timeline.png
    dpkit report runs/finetune --output t.png --no-plan

Reads only ``RUN_DIR/memory_report.json`` (a recipe's, a script's on ``dpkit.setup`` /
``run.finish``, or the Trainer callback's), so it works for any run that wrote one.
``dpkit plan``'s model states are drawn beside the paper's when the plan can be made
for the run (``dpkit plan --against``'s inputs); a run it cannot plan is drawn
without that line, and the command says why. Bad input is one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dpkit.errors import UsageError
from dpkit.memory.chart import CHART_FILE, MIB, has_timeline, write_timeline_chart
from dpkit.memory.timeline import timeline_totals

REPORT_FILE = "memory_report.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``dpkit report``."""
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run's output folder")
    parser.add_argument(
        "--output", default=None, help=f"the PNG to write (default: RUN_DIR/{CHART_FILE})"
    )
    parser.add_argument(
        "--no-plan", action="store_true", help="do not draw dpkit plan's model states"
    )


def read_report(run_dir: str | Path) -> dict[str, Any]:
    """``RUN_DIR/memory_report.json`` with a timeline; bad input raises
    :class:`~dpkit.errors.UsageError` naming the problem."""
    folder = Path(run_dir)
    if not folder.is_dir():
        raise UsageError(f"RUN_DIR={str(run_dir)!r}: no such folder")
    path = folder / REPORT_FILE
    if not path.is_file():
        raise UsageError(
            f"RUN_DIR={str(run_dir)!r}: no {REPORT_FILE} (a run writes it when it finishes)"
        )
    try:
        report = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UsageError(f"{path}: not valid JSON ({err.msg}, line {err.lineno})") from None
    if not isinstance(report, dict) or not isinstance(report.get("ranks"), list):
        raise UsageError(f"{path}: not a dpkit memory report (no per-rank rows)")
    if not has_timeline(report):
        raise UsageError(
            f"{path}: no memory timeline (report schema {report.get('schema', '?')}, written "
            "before dpkit recorded one, or with --memory-probe-steps 0); run the job again"
        )
    return report


def _plan_total(run_dir: Path) -> tuple[float | None, str | None]:
    """dpkit plan's model states per rank for the run, or None and why not."""
    from dpkit.plan.check import check_run

    try:
        return float(check_run(run_dir).predicted["total"]), None
    except UsageError as err:
        return None, str(err)


def summary_lines(report: dict[str, Any]) -> list[str]:
    """Per rank: the points recorded, the step's length, where the counted tensors and
    the activations peaked."""
    lines = []
    for row in sorted(report["ranks"], key=lambda r: r["rank"]):
        points = (row.get("timeline") or {}).get("points") or []
        if not points:
            continue
        totals = timeline_totals(points)
        top = max(range(len(points)), key=totals.__getitem__)
        held = [p.get("activations") or 0.0 for p in points]
        most = max(range(len(points)), key=held.__getitem__)
        lines.append(
            f"rank {row['rank']}: {len(points)} points over {points[-1]['t']:.3f} s; counted "
            f"tensors peak {totals[top] / MIB:,.1f} MiB at {points[top]['point']} "
            f"({points[top]['phase']}); activations peak {held[most] / MIB:,.1f} MiB at "
            f"{points[most]['point']}"
        )
    return lines


def main(args: argparse.Namespace) -> int:
    """Draw the chart; 0 when written, 2 on bad input (raised as UsageError)."""
    report = read_report(args.run_dir)
    run_dir = Path(args.run_dir)
    output = Path(args.output) if args.output else run_dir / CHART_FILE
    if not output.parent.is_dir():
        raise UsageError(f"--output={args.output!r}: no folder {str(output.parent)!r}")
    plan_total = None
    if not args.no_plan:
        plan_total, why = _plan_total(run_dir)
        if why is not None:
            print(f"dpkit report: drawn without dpkit plan's line ({why})", file=sys.stderr)
    write_timeline_chart(report, output, plan_total=plan_total)
    for line in summary_lines(report):
        print(line)
    print(f"wrote {output}")
    return 0
