"""Print docs/offload.md's every-strategy GPT-2 table from docs/scripts/offload_gpt2_table.sh's runs.

    python docs/scripts/offload_gpt2_table.py OUT_DIR

Per run (model, processes, strategy), from its memory_report.json, train_log.jsonl and
`dpkit plan --against` JSON (OUT_DIR/NAME.plan.json):

- device MiB per rank: the report's model states + buffers (`model_state_total` +
  `buffers_total`), the largest rank;
- host MiB per rank: the report's `host_total` (what offload places in host memory), the
  largest rank. On a CPU run host and device are one RAM; the two columns say where the
  backend places each tensor, not two memories;
- the step's peak of live tensors: measured (`peak_live`, the largest rank) and the plan's
  prediction for the same step and batch (`predicted_bytes["peak"]`), with the error;
- the last step's wall time (train_log.jsonl `step_time_s`, main process);
- the loss against DDP at the same model and process count: the largest relative
  difference over the steps (the same seed, weights and batches in every run).

Runs that did not finish print as "failed"; notes under the table give the plan's
reasons where it predicts or checks nothing (a device figure marked * leaves out buffers
the run could not measure).
"""

import json
import sys
from pathlib import Path

MIB = 2**20
MODELS = {"gpt2": "GPT-2 124M", "gpt2-medium": "GPT-2 355M"}
PROCESSES = (2, 4)
STRATEGIES = {
    "ddp": "DDP",
    "zero2": "ZeRO-2",
    "zero2_offload": "ZeRO-2 offload",
    "zero3": "ZeRO-3",
    "zero3_offload": "ZeRO-3 offload",
    "fsdp2_full_shard": "FSDP2 full-shard",
    "fsdp2_full_shard_offload": "FSDP2 full-shard offload",
}


def losses(run: Path) -> list[float]:
    """The run's per-step losses (averaged over ranks by the recipe), in step order."""
    with (run / "train_log.jsonl").open() as lines:
        return [json.loads(line)["loss"] for line in lines if line.strip()]


def loss_cell(run: Path, reference: Path) -> str:
    """The largest relative difference of ``run``'s losses from ``reference``'s (DDP's)."""
    if run == reference:
        return "reference"
    if not (reference / "train_log.jsonl").is_file():  # no DDP run to compare with
        return "-"
    ours, ref = losses(run), losses(reference)
    if len(ours) != len(ref):  # a run cut short: the steps do not pair
        return f"{len(ours)} vs {len(ref)} steps"
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours, ref, strict=True))
    return "0 (bitwise)" if worst == 0 else f"{worst:.1e}"


def peak_cells(plan: dict, measured: float) -> tuple[str, str]:
    """The measured peak and the plan's prediction with its error, in MiB; the plan's
    own measured figure is the same largest rank's ``peak_live``."""
    predicted = plan["predicted_bytes"].get("peak")
    if predicted is None:  # the plan says why in not_predicted, printed under the table
        return f"{measured / MIB:,.1f}", "-"
    error = 100.0 * (predicted - measured) / measured
    return f"{measured / MIB:,.1f}", f"{predicted / MIB:,.1f} ({error:+.1f}%)"


def row(model: str, n: int, strategy: str, out: Path, notes: list[str]) -> str | None:
    """One table row, or None where the combination was not launched at all."""
    name = f"{model}-n{n}-{strategy}"
    run = out / name
    head = f"| {MODELS[model]} | {n} | {STRATEGIES[strategy]} |"
    if not run.is_dir():
        return None
    if not (run / "memory_report.json").is_file():  # failed: its log says why
        return f"{head} failed (see {name}.log) |" + " - |" * 6
    report = json.loads((run / "memory_report.json").read_text())
    plan_file = out / f"{name}.plan.json"
    try:
        plan = json.loads(plan_file.read_text())
    except (OSError, json.JSONDecodeError):  # the plan refused the run: its log says why
        notes.append(f"{name}: no plan JSON (dpkit plan's error is in {name}.log)")
        plan = {"predicted_bytes": {}}
    ranks = report["ranks"]
    device = max(r["model_state_total"] + r["buffers_total"] for r in ranks)
    host = max(r.get("host_total", 0.0) for r in ranks)
    peak = max(float(r["peak_live"]["bytes"]) for r in ranks if r.get("peak_live"))
    measured, predicted = peak_cells(plan, peak)
    step_time = json.loads((run / "train_log.jsonl").read_text().splitlines()[-1])["step_time_s"]
    reference = out / f"{model}-n{n}-ddp"
    for key, why in {**plan.get("not_predicted", {}), **plan.get("not_checked", {})}.items():
        notes.append(f"{MODELS[model]}, {n} processes, {STRATEGIES[strategy]}: {key}: {why}")
    # FSDP2's unit buffers live between the report's probe points: planned, not measured.
    unmeasured = " *" if "buffers" in plan.get("not_checked", {}) else ""
    return (
        f"{head} {device / MIB:,.1f}{unmeasured} | {host / MIB:,.1f} | {measured} | {predicted} | "
        f"{step_time:.1f} s | {loss_cell(run, reference)} |"
    )


def main(out: Path) -> None:
    """Print the table of every run found under ``out``, then the plan's caveats."""
    print(
        "| model | processes | strategy | device MiB/rank | host MiB/rank | "
        "step peak, measured MiB | step peak, planned MiB | last step | "
        "loss vs DDP (max rel.) |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    notes: list[str] = []
    for model in MODELS:
        for n in PROCESSES:
            for strategy in STRATEGIES:
                line = row(model, n, strategy, out, notes)
                if line is not None:
                    print(line)
    if notes:
        print()
        for note in notes:
            print(f"- {note}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
