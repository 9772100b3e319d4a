"""dpkit's train_lm.py, except that it fails at one micro-batch size (FAIL_AT_MICRO_BATCH):
the trial ``dpkit tune`` must record as failed, with its error line, and go on from.

The failure is the recipe's own one-line error at start-up, before any process group,
as a bad setting of a user's script would be."""

import runpy
import sys
from pathlib import Path

FAIL_AT_MICRO_BATCH = "1"

if __name__ == "__main__":
    args = sys.argv[1:]
    flag = "--micro-batch-size"
    if flag in args and args[args.index(flag) + 1] == FAIL_AT_MICRO_BATCH:
        sys.exit(f"failing_recipe.py: error: refusing micro-batch {FAIL_AT_MICRO_BATCH} (forced)")
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "train_lm.py"
    runpy.run_path(str(recipe), run_name="__main__")
