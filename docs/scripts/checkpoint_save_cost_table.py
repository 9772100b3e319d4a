"""Print docs/checkpoints.md's save-cost table from checkpoint_save_cost.sh's folder."""

import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
print("| model | strategy | processes | layout | save (s) | MB written, largest rank | MB written, all ranks | main process RSS added (MiB) |")
print("|---|---|---:|---|---:|---:|---:|---:|")
for model in ("minilm", "gpt2", "gpt2-medium"):
    for n in (2, 4):
        for strategy in ("ddp", "zero2", "fsdp2_full_shard"):
            for layout in ("sharded", "full"):
                log = out / f"{model}-{strategy}-n{n}-{layout}" / "checkpoint_log.jsonl"
                if not log.is_file():
                    continue
                first, second = (json.loads(line) for line in log.read_text().splitlines())
                print(
                    f"| {model} | {strategy} | {n} | {layout} | {second['seconds']:.2f} | "
                    f"{max(second['bytes_per_rank']) / 1e6:,.0f} | {second['bytes_total'] / 1e6:,.0f} | "
                    f"{first['main_rss_added_mib']:,.0f} |"
                )
