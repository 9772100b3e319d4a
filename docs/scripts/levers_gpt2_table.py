"""Print docs/levers.md's GPT-2 124M table from the runs of docs/scripts/levers_gpt2_table.sh.

    python docs/scripts/levers_gpt2_table.py OUT_DIR

Per run: each category as `dpkit plan --against` predicted it / as the run's memory report
measured it (the worst rank, MiB), the worst rank's RSS high-water and step 2's time.
"""

import json
import sys
from pathlib import Path

MIB = 2**20
NAMES = {"ddp": "DDP", "zero2": "ZeRO-2", "fsdp2_full_shard": "FSDP2 full-shard"}


def cell(plan: dict, key: str) -> str:
    predicted, measured = plan["predicted_bytes"][key], plan["measured_bytes"][key]
    if key in plan.get("not_checked", {}):  # FSDP2's buffers: planned, not measured on CPU
        return f"{predicted / MIB:,.0f} / -"
    return f"{predicted / MIB:,.0f} / {measured / MIB:,.0f}"


def main(out: Path) -> None:
    print(
        "| strategy | trains | checkpointing | params | grads | optimizer + master | "
        "activations | buffers | RSS peak | step 2 |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for strategy in NAMES:
        for lora in ("", "-lora"):
            for ckpt in ("", "-ckpt"):
                run = out / f"{strategy}{lora}{ckpt}"
                if not (run / "memory_report.json").is_file():  # failed or not run yet
                    print(f"| {NAMES[strategy]} | {lora or 'all'} | {ckpt or 'no'} | not run |")
                    continue
                plan = json.loads((run.parent / f"{run.name}.plan.json").read_text())
                report = json.loads((run / "memory_report.json").read_text())
                steps = [json.loads(line) for line in (run / "train_log.jsonl").open()]
                rss = max(r["peak"]["rss_high_water"] for r in report["ranks"])
                pred, meas = plan["predicted_bytes"], plan["measured_bytes"]
                states = (
                    f"{(pred['optimizer'] + pred['master']) / MIB:,.0f} / "
                    f"{(meas['optimizer'] + meas['master']) / MIB:,.0f}"
                )
                print(
                    f"| {NAMES[strategy]} | {'LoRA r=8' if lora else 'all'} | "
                    f"{'yes' if ckpt else 'no'} | {cell(plan, 'params')} | {cell(plan, 'grads')} | "
                    f"{states} | {cell(plan, 'activations')} | {cell(plan, 'buffers')} | "
                    f"{rss / MIB:,.0f} | {steps[1]['step_time_s']:.1f} s |"
                )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
