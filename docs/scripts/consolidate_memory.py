"""What ``dpkit consolidate`` holds in memory: the table's lines in docs/checkpoints.md.

Consolidates the sharded checkpoint CHECKPOINT into model folders, once per
``--max-shard-mb`` value given, each in a fresh process, and prints per run the
process's peak RSS above what it held once torch, safetensors and dpkit were imported
(Linux ``VmHWM`` minus ``VmRSS`` before the work), the largest weight and the total
weight bytes (from the checkpoint's own index), and the seconds taken.

    python docs/scripts/consolidate_memory.py CHECKPOINT OUT_DIR --max-shard-mb 100 2048
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` memory field of this process, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)


def one_run(checkpoint: Path, output_dir: Path, max_shard_mb: float) -> dict:
    """Consolidate in this process (a fresh one per run: the peak is the process's)."""
    import safetensors.torch  # noqa: F401  (imported before the baseline is read)
    import torch  # noqa: F401

    from dpkit.core import shards as sharded
    from dpkit.checkpoints.consolidate import consolidate

    index = sharded.TensorIndex.read(checkpoint)
    sizes = [index.nbytes(name) for name in index.shapes]
    before = status_kib("VmRSS")
    start = time.perf_counter()
    consolidate(
        checkpoint,
        output_dir,
        model=None,
        tag=None,
        max_shard_bytes=int(max_shard_mb * 1024**2),
    )
    return {
        "max_shard_mb": max_shard_mb,
        "extra_peak_mb": (status_kib("VmHWM") - before) / 1024,
        "largest_tensor_mb": max(sizes) / 1024**2,
        "weights_mb": sum(sizes) / 1024**2,
        "files": len(list(output_dir.glob("*.safetensors"))),
        "seconds": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--max-shard-mb", type=float, nargs="+", default=[2048.0])
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(args.checkpoint, args.out_dir, args.max_shard_mb[0])))
        return
    for max_shard_mb in args.max_shard_mb:
        out = args.out_dir / f"max-shard-{max_shard_mb:g}"
        shutil.rmtree(out, ignore_errors=True)
        result = subprocess.run(
            [sys.executable, __file__, str(args.checkpoint), str(out), "--one"]
            + ["--max-shard-mb", str(max_shard_mb)],
            check=True,
            capture_output=True,
            text=True,
        )
        print(result.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
