"""The command line parsed into dpkit's flag dataclasses, with one-line refusals.

Every check that can be made before a process group starts is made here or in the
dataclasses themselves, so bad input costs one line and exit code 2, never a
half-started job.
"""

from __future__ import annotations

import sys

from dpkit.arguments import dataclass_parser
from dpkit.errors import EXIT_USAGE, UsageError
from dpkit.train.config import StrategyConfig
from dpkit.train.guards import print_usage_error
from dpkit.train.logs import log_once_per_job
from dpkit.train.resolution import check_launch


def parse_args(*config_classes: type, argv: list[str] | None = None) -> tuple:
    """Parse a command line into ``config_classes`` (dataclasses, validated when built) with
    transformers' ``HfArgumentParser`` made dpkit's one parser
    (:func:`dpkit.arguments.dataclass_parser`).

    A run starts here: dpkit's log lines and library warnings are set to appear once per
    job (:func:`dpkit.train.logs.log_once_per_job`). Bad input (argparse's own errors, a
    misspelled flag, named with the closest one as every dpkit command does, a value a
    dataclass refuses) prints one line naming the flag and its value, once for the job
    (:func:`dpkit.train.guards.print_usage_error`: rank 0's; every rank parses the same
    line), and exits with code 2, before anything starts. ``--local_rank=N``,
    which the ``deepspeed`` launcher appends, is dropped (``LOCAL_RANK`` carries it).
    """
    log_once_per_job()  # a run starts here: dpkit's lines and library warnings once per job
    parser = dataclass_parser(config_classes)
    argv = _without_local_rank(sys.argv[1:] if argv is None else argv)
    try:
        parser.parse_args_or_raise(argv)  # argparse's errors and unknown flags, one line each
        configs = tuple(parser.parse_args_into_dataclasses(args=argv))
        for cfg in configs:
            if isinstance(cfg, StrategyConfig):
                check_launch(cfg)  # a bad DeepSpeed JSON before the script loads its model
        return configs
    except UsageError as err:
        # One line for the job: rank 0's. Another rank waits for the launcher to end it
        # first; leaving at once let the launcher kill rank 0 before it printed (seen).
        print_usage_error(err)
        raise SystemExit(EXIT_USAGE) from None


def _without_local_rank(argv: list[str]) -> list[str]:
    """``argv`` without the deepspeed launcher's ``--local_rank=N`` / ``--local_rank N``."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg.replace("-", "_") == "__local_rank":
            skip = True
        elif not arg.replace("-", "_").startswith("__local_rank="):
            kept.append(arg)
    return kept
