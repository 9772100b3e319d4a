"""What ``dpkit tune`` writes: ``results.json`` (every raw number, the machine, the
versions), ``results.md`` (the table, also printed), ``chart.png`` (throughput against
measured memory per candidate, the budget line, the winner marked) and ``winner/``:
the winner's accelerate YAML (a ZeRO winner's names its resolved DeepSpeed JSON, copied
beside it; an FSDP2 winner's sets the mode) and the launch command (``command.sh``)."""

from __future__ import annotations

import json
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

from dpkit.bench import launch
from dpkit.core.tables import markdown_table
from dpkit.engines import RUNNABLE, engine_of, get_strategy
from dpkit.tune import space
from dpkit.tune.config import TuneSettings
from dpkit.tune.decide import Decision
from dpkit.tune.trials import OK, Trial, recipe_command, trial_dir

MIB = 2**20
OUTPUTS = ("results.json", "results.md", "chart.png")
WINNER_DIR = "winner"
# One colour per strategy on the chart (seaborn's "deep" palette, DDP's blue first); more
# strategies than colours reuse them in turn rather than fail.
CHART_COLORS = (
    "#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3",
    "#937860", "#da8bc3", "#8c8c8c", "#ccb974", "#64b5cd",
)  # fmt: skip


def clear_outputs(out: Path) -> None:
    """Remove an earlier tune's report and winner files (its trials stay, for reuse)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUTS:
        (out / name).unlink(missing_ok=True)
    shutil.rmtree(out / WINNER_DIR, ignore_errors=True)


def build_results(
    settings: TuneSettings,
    trials: list[Trial],
    decision: Decision,
    *,
    plan_note: str,
    machine: dict[str, Any],
    command: str,
    wall_s: float,
    stopped: str | None,
) -> dict[str, Any]:
    """Everything the tune measured and decided, as ``results.json`` holds it."""
    config = settings.config
    winner = decision.winner
    baseline_name = space.baseline(settings).name
    return {
        "command": command,
        "recipe": str(settings.recipe.path),
        "recipe_args": list(config.recipe_args),
        "nproc": settings.nproc,
        "device": settings.device,
        "precision": settings.precision,
        "global_batch_size": settings.global_batch_size,
        "warmup_steps": config.warmup_steps,
        "timed_steps": config.steps,
        "memory_budget_bytes": settings.memory_budget,
        "tie_tolerance": config.tie_tolerance,
        "loss_rtol": decision.loss_rtol,
        "threads_per_process": settings.threads_per_process,
        "plan": plan_note,
        "trials": [{**t.as_dict(), "verdict": decision.verdicts[t.name].as_dict()} for t in trials],
        "baseline": None if decision.baseline is None else decision.baseline.name,
        "baseline_name": baseline_name,
        "baseline_why_not": decision.verdicts[baseline_name].why_not
        if baseline_name in decision.verdicts
        else "was not measured",
        "winner": None if winner is None else winner.name,
        "winner_reason": decision.reason,
        "tie": decision.tie,
        "speedup_over_baseline": decision.speedup,
        "stopped": stopped,
        "wall_s": wall_s,
        "machine": machine,
    }


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / MIB:.1f}"


def format_markdown(results: dict[str, Any]) -> str:
    """The trials as a table, then the decision."""
    budget = results["memory_budget_bytes"]
    lines = [
        f"# dpkit tune: {Path(results['recipe']).name}, {results['nproc']} processes "
        f"({results['device']}), global batch {results['global_batch_size']}, "
        f"{results['precision']}",
        "",
        f"`{results['command']}`",
        "",
        f"Budget per rank: {'none' if budget is None else f'{budget / MIB:.1f} MiB'}; "
        f"{results['plan']}. Step time: median of {results['timed_steps']} steps after "
        f"{results['warmup_steps']} warm-up; losses against DDP at the same micro-batch, "
        f"tolerance {results['loss_rtol']:g}.",
        "",
    ]
    rows = []
    for trial in results["trials"]:
        figures, verdict = trial["figures"], trial["verdict"]
        name = trial["name"] + (" **winner**" if trial["name"] == results["winner"] else "")
        name += " (current)" if trial["name"] == results["baseline_name"] else ""
        if trial["status"] == OK:
            step = (
                f"{figures['median_step_time_s']:.3f} ({figures['min_step_time_s']:.3f}-"
                f"{figures['max_step_time_s']:.3f})"
            )
            samples, tokens = f"{figures['samples_per_s']:.1f}", f"{figures['tokens_per_s']:.0f}"
            memory = f"{_mib(figures['memory_bytes'])}"
            states = _mib(figures["model_states_per_rank"])
        else:
            step, samples, tokens, memory, states = "-", "-", "-", "-", "-"
        deviation = verdict.get("loss_deviation")
        loss = "-" if deviation is None else f"{deviation:.1e}"
        note = verdict.get("why_not") or trial["reason"]
        note += " (reused)" if trial["reused"] else ""
        rows.append(
            [
                name,
                trial["status"],
                step,
                samples,
                tokens,
                memory,
                _mib(trial["predicted_bytes"]),
                states,
                loss,
                note,
            ]
        )
    header = [
        "candidate",
        "status",
        "step s (min-max)",
        "samples/s",
        "tokens/s",
        "peak MiB/rank",
        "plan MiB",
        "model states MiB",
        "loss dev. vs DDP",
        "note",
    ]
    lines += [*markdown_table(header, rows), ""]
    if results["winner"] is None:
        lines.append(f"No winner: {results['winner_reason']}.")
    else:
        speedup = results["speedup_over_baseline"]
        against = (
            f"{speedup:.2f}x the throughput of the current configuration ({results['baseline']})"
            if speedup is not None
            else f"no speedup figure: the current configuration ({results['baseline_name']}) "
            f"{results['baseline_why_not'] or 'was not measured'}"
        )
        lines += [
            f"Winner: **{results['winner']}**: {results['winner_reason']}; {against}.",
            "",
            f"Launch it: `bash {WINNER_DIR}/command.sh` (files in `{WINNER_DIR}/`).",
        ]
    if results["stopped"]:
        lines += ["", f"Stopped early: {results['stopped']}."]
    return "\n".join(lines)


def write_chart(results: dict[str, Any], path: Path) -> None:
    """Throughput against measured peak memory per rank, one point per measured
    candidate, the budget as a vertical line, the winner marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {s.name: CHART_COLORS[i % len(CHART_COLORS)] for i, s in enumerate(RUNNABLE)}
    shown = {trial["strategy"] for trial in results["trials"] if trial["status"] == OK}
    fig, ax = plt.subplots(figsize=(8, 5))
    for trial in results["trials"]:
        if trial["status"] != OK:
            continue
        figures = trial["figures"]
        x, y = figures["memory_bytes"] / MIB, figures["samples_per_s"]
        winner = trial["name"] == results["winner"]
        current = trial["name"] == results["baseline_name"]
        ax.scatter(
            x,
            y,
            s=220 if winner else 50,
            marker="*" if winner else ("s" if current else "o"),
            color=colors.get(trial["strategy"], "grey"),
            edgecolors="black" if winner else "none",
            zorder=3,
        )
        ax.annotate(trial["name"], (x, y), fontsize=7, xytext=(4, 4), textcoords="offset points")
    for name, color in colors.items():
        if name in shown:  # the legend names the strategies tried, not all five
            ax.scatter([], [], color=color, label=get_strategy(name).label)
    if results["memory_budget_bytes"] is not None:
        ax.axvline(results["memory_budget_bytes"] / MIB, color="red", linestyle="--")
        ax.plot([], [], color="red", linestyle="--", label="budget")
    ax.set_xlabel("measured peak per rank (MiB)")
    ax.set_ylabel("samples/s (all ranks)")
    ax.set_title(
        f"dpkit tune: {Path(results['recipe']).name}, {results['nproc']} processes, "
        f"global batch {results['global_batch_size']} (winner: star, current: square)"
    )
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_winner(settings: TuneSettings, decision: Decision, out: Path) -> Path | None:
    """``winner/``: the accelerate YAML of the winner's strategy (for ZeRO naming the
    resolved DeepSpeed JSON the winner ran with, copied here; for FSDP2 dpkit's FSDP2
    YAML, which sets the mode), and ``command.sh`` launching the recipe with the
    winner's settings."""
    trial = decision.winner
    if trial is None:
        return None
    where = out / WINNER_DIR
    where.mkdir(parents=True, exist_ok=True)
    strategy = get_strategy(trial.candidate.strategy)
    config = None
    if engine_of(strategy).config_file:  # the backend's config as the winner ran with it
        config = where / engine_of(strategy).config_file
        ran_with = trial_dir(settings, trial.candidate) / "run" / engine_of(strategy).config_file
        shutil.copyfile(ran_with, config)
    yaml = launch.accelerate_config(strategy, {}, where, backend_config=config)
    final = where / "accelerate.yaml"
    yaml.replace(final)
    shutil.rmtree(where / "configs", ignore_errors=True)
    cmd = [
        # This interpreter's accelerate, by absolute path: a bare `accelerate` exits 127
        # where the virtualenv is not on PATH.
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(final),
        "--num_processes", str(settings.nproc),
        *recipe_command(settings, trial.candidate),
    ]  # fmt: skip
    (where / "command.sh").write_text(
        f"#!/usr/bin/env bash\n# dpkit tune's winner: {trial.name} "
        f'({trial.step_time:.3f} s per step measured)\n{shlex.join(cmd)} "$@"\n'
    )
    return where


def write_all(settings: TuneSettings, results: dict[str, Any], decision: Decision) -> None:
    """results.json, results.md, chart.png and the winner's files; the table printed."""
    out = settings.output_dir
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    table = format_markdown(results)
    (out / "results.md").write_text(table + "\n")
    write_chart(results, out / "chart.png")
    write_winner(settings, decision, out)
    print(table)
    print(f"\nresults: {', '.join(str(out / name) for name in OUTPUTS)}")
