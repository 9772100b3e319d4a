"""Print docs/finetune_lm.md's tables from the runs of docs/scripts/finetune_lm_table.sh.

    python docs/scripts/finetune_lm_table.py OUT_DIR

Per run: the held-out loss and perplexity at steps 20 and 40, the largest per-step loss
difference against DDP (same trainable set), and each memory category as `dpkit plan
--against` predicted it / as the run's memory report measured it (the worst rank, MiB),
with the worst rank's RSS high-water.
"""

import json
import math
import sys
from pathlib import Path

MIB = 2**20
NAMES = {"ddp": "DDP", "zero2": "ZeRO-2", "fsdp2_full_shard": "FSDP2 full-shard"}


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.open()]


def cell(plan: dict, key: str) -> str:
    predicted, measured = plan["predicted_bytes"][key], plan["measured_bytes"][key]
    if key in plan.get("not_checked", {}):  # FSDP2's buffers: planned, not measured on CPU
        return f"{predicted / MIB:,.1f} / -"
    return f"{predicted / MIB:,.1f} / {measured / MIB:,.1f}"


def main(out: Path) -> None:
    start = [m for m in jsonl(out / "as-built" / "metrics.jsonl") if m["split"] == "validation"]
    print(
        f"As built (random init): held-out loss {start[-1]['loss']:.3f}, perplexity "
        f"{start[-1]['perplexity']:,.0f} ({start[-1]['tokens']:,} tokens)\n"
    )
    print(
        "| strategy | trains | held-out ppl, step 20 / 40 | max loss diff vs DDP | "
        "params | grads | optimizer + master | activations | buffers | RSS peak |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for lora in ("", "-lora"):
        reference = out / f"ddp{lora}"
        for strategy in NAMES:
            run = out / f"{strategy}{lora}"
            if not (run / "memory_report.json").is_file():
                print(f"| {NAMES[strategy]} | {'LoRA r=8' if lora else 'all'} | not run |")
                continue
            evals = [m for m in jsonl(run / "metrics.jsonl") if m["split"] == "validation"]
            losses = [r["loss"] for r in jsonl(run / "train_log.jsonl")]
            ddp = [r["loss"] for r in jsonl(reference / "train_log.jsonl")]
            diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ddp, strict=True))
            plan = json.loads((out / f"{run.name}.plan.json").read_text())
            report = json.loads((run / "memory_report.json").read_text())
            rss = max(r["peak"]["rss_high_water"] for r in report["ranks"])
            pred, meas = plan["predicted_bytes"], plan["measured_bytes"]
            states = (
                f"{(pred['optimizer'] + pred['master']) / MIB:,.1f} / "
                f"{(meas['optimizer'] + meas['master']) / MIB:,.1f}"
            )
            ppl = " / ".join(f"{math.exp(m['loss']):,.1f}" for m in evals)
            print(
                f"| {NAMES[strategy]} | {'LoRA r=8' if lora else 'all'} | {ppl} | {diff:.1e} | "
                f"{cell(plan, 'params')} | {cell(plan, 'grads')} | {states} | "
                f"{cell(plan, 'activations')} | {cell(plan, 'buffers')} | {rss / MIB:,.0f} |"
            )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
