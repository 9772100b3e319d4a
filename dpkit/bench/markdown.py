"""``results.md`` of ``dpkit bench``: the tables and notes made from a results dict.

Everything here reads only the dict :func:`dpkit.bench.results.build_results` returns
(or a results.json read back), so a table can be remade without rerunning a bench.
"""

from __future__ import annotations

from typing import Any

from dpkit.bench.launch import FLOOR_RUN, trainer_run_name
from dpkit.bench.results import REFERENCE, max_relative_deviation, result_strategies
from dpkit.core.categories import MODEL_STATES
from dpkit.core.tables import markdown_table
from dpkit.engines import engine_of, get_strategy
from dpkit.train.phases import PHASES

MIB = 1024.0**2
COLLECTIVE_ROWS = (
    ("ddp_allreduce", "allreduce, DDP's buckets issued together", "DDP, during backward"),
    ("zero_reduce", "allreduce, ZeRO buckets one at a time", "ZeRO-1/2 gradient reduction"),
    ("zero_allgather", "all-gather of the parameter partitions", "ZeRO-1/2, after the step"),
)
"""The collectives phase's patterns: key in collectives.json, what it is, who uses it."""
_COLLECTIVE_NAMES = {
    "ddp_allreduce": "allreduce",
    "zero_reduce": "reduction",
    "zero_allgather": "all-gather",
}


def mib(value: float | None) -> str:
    """Bytes as MiB with one decimal, ``-`` for none."""
    return "-" if value is None else f"{value / MIB:,.1f}"


def _saved(saved: float | None, ratio: float | None) -> str:
    if saved is None or ratio is None:
        return "-"
    return f"{saved / MIB:,.1f} ({100 * (1 - ratio):.0f}%)"


def _with_cpu(wall: float | None, cpu: float | None) -> str:
    """A wall-time ratio, with the CPU-time ratio beside it when there is one."""
    if wall is None:
        return "-"
    return f"{wall:.2f}x" + ("" if cpu is None else f" (CPU {cpu:.2f}x)")


def _deviation(value: float | None, of_reference: bool) -> str:
    """A loss deviation from the reference; ``-`` for the reference run itself."""
    return "-" if value is None or of_reference else f"{value:.1e}"


def _classification(results: dict[str, Any]) -> bool:
    return results["settings"].get("workload") == "classification"


def _baseline_label(results: dict[str, Any]) -> str:
    """``trainer`` or ``bare``: the key part of the comparison's ``dpkit_over_*`` figures."""
    return "trainer" if _classification(results) else "bare"


def _workload_line(results: dict[str, Any]) -> str:
    settings = results["settings"]
    repeats = settings.get("repeats", 1)
    timing = (
        f"{settings['warmup_steps']} warm-up + {settings['timed_steps']} timed steps (median)"
        + (f", dpkit and baseline interleaved {repeats} times" if repeats > 1 else "")
    )
    if _classification(results):
        return (
            "Workload: recipes/finetune.py against the plain Transformers Trainer "
            "(dpkit.bench.trainer_baseline), both under torchrun: MiniLM on the embedded "
            f"Rotten Tomatoes, micro-batch {settings['micro_batch_size']} per rank, dynamic "
            f"padding up to {settings['seq_len']} tokens, {results['precision']}, dpkit's "
            f"fine-tuning defaults on both sides; {timing}."
        )
    return (
        f"Workload: {'synthetic tokens' if settings['synthetic'] else 'Shakespeare bytes'}, "
        f"micro-batch {settings['micro_batch_size']} x {settings['seq_len']} tokens per rank, "
        f"{results['precision']}, torch AdamW (fused), {timing}."
    )


def _header(results: dict[str, Any]) -> list[str]:
    settings, machine = results["settings"], results["machine"]
    model = settings["model_config"] or settings["size"] or "MiniLM (classification)"
    versions = ", ".join(f"{k} {v}" for k, v in machine["versions"].items() if v)
    device = ", ".join(machine["gpus"]) if machine["gpus"] else f"{machine['cpu_model']} CPU"
    load = ", ".join(f"{x:.1f}" for x in machine["load_average_at_start"] or [])
    return [
        f"# dpkit bench: {model} ({results['num_params'] / 1e6:.1f}M params), "
        f"{settings['nproc']} processes",
        "",
        f"`{results['command']}`, {results['bench_wall_s'] / 60:.1f} min in all.",
        f"Machine: {device}, {machine['cpu_cores_usable']} cores usable, load average "
        f"{load} at start; OMP_NUM_THREADS={machine['omp_num_threads'] or 'unset'}. {versions}.",
        _workload_line(results),
    ]


def _strategy_table(results: dict[str, Any]) -> list[str]:
    """Memory per rank, savings, throughput and losses: one row per dpkit strategy."""
    runs, comparison = results["runs"], results["comparison"]
    first = runs[results["strategies"][0]]
    label = _baseline_label(results)
    baseline = "Trainer" if label == "trainer" else "bare"
    lines = [
        "",
        "Memory per rank in MiB (the rank holding the most), measured by dpkit.memory; "
        "states = params + grads + optimizer + master, the model states that paper and plan "
        "predict; total adds the communication buffers. paper = the ZeRO paper's accounting "
        "(dpkit.memory.analytic; in mixed precision with the fp32 gradient partition "
        "DeepSpeed's step casts); plan = `dpkit plan` for this run, with gradients as "
        "DeepSpeed's layout holds them (dpkit.engines.deepspeed.layout).",
        "",
    ]
    header = [
        "strategy",
        *MODEL_STATES,
        "states",
        "buffers",
        "total",
        "paper",
        "plan",
        f"peak ({first['memory']['peak_kind']})",
        "saved vs DDP, measured",
        "saved vs DDP, paper",
        "tokens/s",
        "vs DDP",
        f"dpkit/{baseline} step",
        "loss dev. vs DDP",
    ]
    rows = []
    for strategy in result_strategies(results):
        run, row = runs[strategy.name], comparison[strategy.name]
        per_rank = run["memory"]["per_rank"]
        rows.append(
            [
                strategy.label,
                *(mib(per_rank[c]) for c in MODEL_STATES),
                mib(sum(per_rank[c] for c in MODEL_STATES)),
                mib(per_rank["buffers"]),
                mib(per_rank["total"]),
                mib(row["predicted_model_states"]),
                mib(row["plan_model_states"]),
                mib(run["memory"]["peak_bytes"]),
                _saved(row.get("saved_vs_ddp_measured"), row.get("ratio_vs_ddp_measured")),
                _saved(row["saved_vs_ddp_predicted"], row["ratio_vs_ddp_predicted"]),
                f"{run['tokens_per_s']:,.0f}",
                _with_cpu(row.get("throughput_vs_ddp"), row.get("throughput_vs_ddp_cpu")),
                _with_cpu(
                    row.get(f"dpkit_over_{label}_step_time"),
                    row.get(f"dpkit_over_{label}_step_cpu"),
                ),
                _deviation(row.get("loss_max_rel_dev_vs_ddp"), strategy == REFERENCE),
            ]
        )
    return lines + markdown_table(header, rows, align=["", *["right"] * (len(header) - 1)])


def _gradient_lines(results: dict[str, Any]) -> list[str]:
    """Where a gradient-sharding strategy's gradient bytes go, against DDP/N."""
    runs, nproc = results["runs"], results["settings"]["nproc"]
    reference = runs.get(REFERENCE.name)
    lines = []
    for strategy in result_strategies(results):
        memory, plan = runs[strategy.name]["memory"], runs[strategy.name]["plan"]
        # A layout the plan worked out per rank (DeepSpeed's partitions), gradients sharded.
        if not strategy.shards_gradients or not plan.get("grads_where") or reference is None:
            continue
        share = max((r["grads_partition"] or 0.0) for r in memory["ranks"])
        lines += [
            "",
            f"{strategy.label} gradients: each rank's own partition is {mib(share)} MiB "
            f"(DDP/{nproc} = {mib(reference['memory']['per_rank']['grads'] / nproc)}); the "
            f"high-water is {mib(memory['per_rank']['grads'])} MiB, because DeepSpeed also "
            "holds the whole gradient of every parameter touching the partition and the "
            f"step's flat copy of it: dpkit plan predicts {mib(plan['predicted_bytes']['grads'])} "
            f"MiB ({plan['grads_where']}).",
        ]
    return lines


def _host_lines(results: dict[str, Any]) -> list[str]:
    """What each offloading strategy keeps in host memory (its largest rank): the
    strategy table's bytes are the device's."""
    runs = results["runs"]
    held = [
        f"{s.label} {mib(runs[s.name]['memory'].get('host_bytes') or 0.0)} MiB"
        for s in result_strategies(results)
        if s.offload
    ]
    if not held:
        return []
    return ["", f"Host memory per rank (offload, largest rank): {', '.join(held)}."]


def _checkpointing_lines(results: dict[str, Any]) -> list[str]:
    """``--gradient-checkpointing``: each strategy's run against its checkpointed twin."""
    rows = results.get("checkpointing")
    if not rows:
        return []
    lines = [
        "",
        "Gradient checkpointing (each strategy's dpkit run again with "
        "`--gradient-checkpointing`, launched next to it): activations of the worst rank, "
        "planned and measured; step time against the plain run (median of the repeats' "
        "ratios; CPU time beside it); the largest relative loss difference.",
        "",
    ]
    header = [
        "strategy",
        "activations (MiB)",
        "checkpointed (MiB)",
        "plan error",
        "step time",
        "loss dev.",
    ]
    table_rows = []
    for strategy in result_strategies(results):
        row = rows.get(strategy.name)
        if row is None:
            continue
        error = row["plan_activations_error_pct"]
        table_rows.append(
            [
                strategy.label,
                mib(row["activations_bytes"]),
                mib(row["checkpointed_activations_bytes"]),
                "-" if error is None else f"{error:+.1f}%",
                _with_cpu(row["step_time_ratio"], row["step_cpu_ratio"]),
                f"{row['loss_max_rel_dev']:.1e}",
            ]
        )
    return lines + markdown_table(header, table_rows, align=["", *["right"] * 5])


def _run_table(results: dict[str, Any]) -> list[str]:
    """Every run, dpkit's and bare: step times, rates, loss deviation, wall time."""
    runs, nproc = results["runs"], results["settings"]["nproc"]
    lines = [
        "",
        "Every run: median step time after the warm-up (wall; and the main process's CPU "
        "time, which other work on a shared machine disturbs far less), rates per rank and "
        f"in total ({nproc} ranks); floor/step is the compute floor's step time (one "
        "rank alone, the same per-rank batch, forward, backward and optimizer, no "
        "communication: the `floor` run) over the run's, so 1 - floor/step is the share of "
        "a step that parallelism costs; loss deviation is the largest relative difference "
        "from dpkit DDP.",
        "",
    ]
    header = [
        "run",
        "launcher",
        "median step (s)",
        "min-max (s)",
        "CPU per step (s)",
        "tokens/s per rank",
        "tokens/s",
        "samples/s per rank",
        "samples/s",
        "floor/step",
        "loss dev. vs DDP",
        "wall (s)",
    ]
    rows = []
    reference = runs.get(REFERENCE.name)
    floor = runs.get(FLOOR_RUN)
    for name, run in runs.items():
        # The floor is one rank on its own data, the Trainer logs no per-step loss.
        dev = (
            max_relative_deviation(run["losses"], reference["losses"])
            if reference and name != FLOOR_RUN and run["losses"]
            else None
        )
        efficiency = (
            "-"
            if floor is None or name == FLOOR_RUN
            else f"{floor['median_step_time_s'] / run['median_step_time_s']:.2f}"
        )
        rows.append(
            [
                name,
                run["launcher"],
                f"{run['median_step_time_s']:.3f}",
                f"{run['min_step_time_s']:.2f}-{run['max_step_time_s']:.2f}",
                "-" if run["median_step_cpu_s"] is None else f"{run['median_step_cpu_s']:.3f}",
                f"{run['tokens_per_s_per_rank']:,.0f}",
                f"{run['tokens_per_s']:,.0f}",
                f"{run['samples_per_s_per_rank']:.2f}",
                f"{run['samples_per_s']:.2f}",
                efficiency,
                _deviation(dev, name in (REFERENCE.name, FLOOR_RUN)),
                f"{run['wall_s']:.0f}",
            ]
        )
    return lines + markdown_table(header, rows, align=["", "", *["right"] * 10])


PHASE_LABELS = {
    "data_s": "data",
    "forward_s": "forward",
    "backward_s": "backward",
    "grad_sync_s": "grad sync",
    "optimizer_s": "optimizer",
    "other_s": "other",
}


def _phase_table(results: dict[str, Any]) -> list[str]:
    """Where a step's time goes, per run (dpkit.StepPhases; medians over the repeats)."""
    profile = results.get("phase_profile") or {}
    if not profile:
        return []
    lines = [
        "",
        "Where a step's time goes on the main process (seconds; dpkit.StepPhases: hooks on "
        "the prepared model, its loss and the optimizer; each phase's median over the timed "
        "steps, then over the repeats, so a row need not add up to the median step). "
        "backward is the autograd pass (DeepSpeed's bucket reduces run inside it, DDP's "
        "allreduce overlaps it); grad sync runs from its end to the update: the wait for "
        "reduction still in flight, and clipping; other is everything after the update "
        "(zero_grad, the scheduler, the loss all-reduce, the log; under ZeRO the all-gather "
        "of the updated parameters). backward + sync - floor's: what those two cost beyond "
        "one rank alone with no communication. DDP exposed allreduce: DDP's own timing of "
        "the allreduce time not overlapped with backward compute (its first 10 iterations).",
        "",
    ]
    header = [
        "run",
        *(PHASE_LABELS[phase] for phase in PHASES),
        "backward + sync - floor's",
        "DDP exposed allreduce",
    ]
    rows = []
    for name, row in profile.items():
        medians = row["phases_s"]
        excess = row["backward_and_sync_over_floor_s"]
        exposed = row["ddp_exposed_allreduce_s"]
        cells = [name, *(f"{medians[phase]:.3f}" for phase in PHASES)]
        cells += ["-" if excess is None else f"{excess:+.3f}"]
        cells += ["-" if exposed is None else f"{exposed:.3f}"]
        rows.append(cells)
    return lines + markdown_table(header, rows, align=["", *["right"] * (len(header) - 1)])


def _collectives_lines(results: dict[str, Any]) -> list[str]:
    """The collectives phase: each strategy's communication timed alone, beside the
    step-time difference it explains."""
    comm = results.get("collectives")
    if not comm:
        return []
    patterns = comm["patterns"]
    lines = [
        "",
        f"Communication of one step, each pattern timed alone (dpkit.bench.collectives: "
        f"{comm['backend']}, {comm['world_size']} ranks, the model's "
        f"{comm['num_params'] / 1e6:.1f}M {comm['dtype']} elements, median of "
        f"{comm['repeats']} rounds, the slowest rank's; ZeRO bucket "
        f"{comm['zero_bucket_elements']:,} elements):",
        "",
        *markdown_table(
            ["collective", "used by", "calls", "MiB", "median (ms)"],
            (
                [
                    what,
                    who,
                    str(patterns[key]["calls"]),
                    mib(patterns[key]["bytes"]),
                    f"{patterns[key]['median_s'] * 1e3:.1f}",
                ]
                for key, what, who in COLLECTIVE_ROWS
            ),
            align=["", "", "right", "right", "right"],
        ),
    ]
    runs = results["runs"]
    reference = runs.get(REFERENCE.name)
    # Strategies whose collectives the phase timed, beside the reference's.
    timed = [
        s for s in result_strategies(results) if s is not REFERENCE and engine_of(s).collectives
    ]
    if reference is None or not timed:
        return lines
    reference_step = reference["median_step_time_s"]
    over = ", ".join(
        f"{s.label} {1e3 * (runs[s.name]['median_step_time_s'] - reference_step):+.0f} ms"
        for s in timed
    )
    reference_comm = sum(patterns[k]["median_s"] for k in engine_of(REFERENCE).collectives)
    sentences = [
        f"{engine.label}'s {' and '.join(_COLLECTIVE_NAMES[k] for k in engine.collectives)} "
        f"take {1e3 * sum(patterns[k]['median_s'] for k in engine.collectives):.0f} ms together "
        f"against DDP's allreduce {reference_comm * 1e3:.0f} ms, which DDP also overlaps with "
        f"backward{engine.collectives_note}."
        for engine in dict.fromkeys(engine_of(s) for s in timed)
    ]
    return [*lines, "", f"Step time over DDP's: {over}. " + " ".join(sentences)]


def _trainer_lines(results: dict[str, Any]) -> list[str]:
    """dpkit against the plain Trainer: every repeat's ratio, and what the Trainer chose."""
    if not _classification(results):
        return []
    runs, lines = results["runs"], []
    for strategy in result_strategies(results):
        row = results["comparison"][strategy.name]
        ratios = row.get("dpkit_over_trainer_step_time_repeats") or []
        if not ratios:
            continue
        cpu = row.get("dpkit_over_trainer_step_cpu_repeats") or []
        info = runs[trainer_run_name(strategy)].get("run_info", {})
        chose = []
        if "ddp_find_unused_parameters" in info:
            chose.append(f"DDP find_unused_parameters={info['ddp_find_unused_parameters']}")
        if "ddp_forward_sync_buffers" in info:
            dpkit_sync = runs.get(strategy.name, {}).get("run_info", {})
            chose.append(
                f"forward_sync_buffers={info['ddp_forward_sync_buffers']} (dpkit's: "
                f"{dpkit_sync.get('ddp_forward_sync_buffers')})"
            )
        zero = info.get("zero_optimization")
        if zero:
            chose.append(f"reduce_bucket_size={zero.get('reduce_bucket_size')}")
        lines += [
            "",
            f"{strategy.label}, dpkit/Trainer step time per repeat: "
            + ", ".join(f"{r:.3f}" for r in ratios)
            + f" (median {row['dpkit_over_trainer_step_time']:.3f}); CPU time: "
            + ", ".join(f"{r:.3f}" for r in cpu)
            + f". The Trainer ran {info.get('strategy')} over {info.get('world_size')} "
            f"processes ({info.get('wrapper')})"
            + (f"; its choices: {', '.join(chose)}" if chose else "")
            + ".",
        ]
    return lines


def _check_lines(results: dict[str, Any]) -> list[str]:
    if not results["checks"]:
        return []
    lines = ["", "Checks:"]
    for check in results["checks"]:
        text = f"{check['value']:.4g} ({'ok' if check['ok'] else 'MISSED'})"
        if check.get("value_cpu") is not None:
            text = f"wall {text}, CPU time {check['value_cpu']:.4g} " + (
                "(ok)" if check["ok_cpu"] else "(MISSED)"
            )
        lines.append(f"- {get_strategy(check['strategy']).label}: {check['check']}: {text}")
    return lines


def _zero_settings_lines(results: dict[str, Any]) -> list[str]:
    """The resolved zero_optimization section of each dpkit ZeRO run (its ds_config.json)."""
    parts = []
    for strategy in result_strategies(results):
        run = results["runs"][strategy.name]
        if "ds_config" not in run:  # the runs of a backend configured by a DeepSpeed JSON
            continue
        zero = {k: v for k, v in run["ds_config"]["zero_optimization"].items() if k != "stage"}
        parts.append(f"{strategy.label} " + ", ".join(f"{k}={v}" for k, v in zero.items()))
    if not parts:
        return []
    overrides = results["settings"]["zero_overrides"]
    return [
        "",
        "dpkit's ZeRO settings"
        + (f" (with --zero-override {overrides})" if overrides else "")
        + ": "
        + "; ".join(parts)
        + (
            ". The Trainer's: its ZeRO JSON as written, 'auto' filled by the Trainer."
            if _classification(results)
            else ". Bare runs: DeepSpeed's defaults (buckets 5e8 elements, contiguous_gradients "
            "true, overlap_comm false, reduce_scatter true)."
        ),
    ]


def format_markdown(results: dict[str, Any]) -> str:
    """results.md: the header, the strategy table, the run table, communication, checks."""
    return "\n".join(
        [
            *_header(results),
            *_strategy_table(results),
            *_gradient_lines(results),
            *_host_lines(results),
            *_checkpointing_lines(results),
            *_run_table(results),
            *_phase_table(results),
            *_trainer_lines(results),
            *_collectives_lines(results),
            *_check_lines(results),
            *_zero_settings_lines(results),
        ]
    )
