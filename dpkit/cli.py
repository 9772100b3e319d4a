"""The ``dpkit`` command: ``dpkit data fetch``, ``plan``, ``bench``, ``tune``, ``configs``, ``report``, ``consolidate``.

Each subcommand lives in its own module that provides ``add_arguments(parser)``
and ``main(args) -> int``; modules are imported only when their command runs,
so ``dpkit plan`` starts without importing DeepSpeed. Every parser here is a
:class:`dpkit.arguments.OneLineParser` (``add_subparsers`` gives subcommands their
parent's class): bad input is one line, ``dpkit plan: error: ...``, and exit code 2,
as a recipe's is.
"""

from __future__ import annotations

import importlib
import sys

from dpkit.arguments import OneLineParser, refusal_line
from dpkit.errors import EXIT_USAGE, UsageError

# command name -> (module, one-line help)
COMMANDS = {
    "data": (
        "dpkit.data.embedded",
        "fetch the embedded datasets (Rotten Tomatoes, Shakespeare) into the cache",
    ),
    "plan": ("dpkit.plan.cli", "predict per-GPU memory for DDP and ZeRO before launching"),
    "bench": (
        "dpkit.bench.cli",
        "DDP vs ZeRO-1 vs ZeRO-2 side by side: memory, throughput, losses",
    ),
    "tune": (
        "dpkit.tune.cli",
        "the fastest strategy, micro-batch and ZeRO buckets that fit, by measuring",
    ),
    "configs": (
        "dpkit.config_files",
        "export the shipped DeepSpeed JSONs and accelerate YAMLs into a folder, to edit",
    ),
    "report": (
        "dpkit.memory.report_cli",
        "draw a finished run's memory timeline (memory_timeline.png) from its memory_report.json",
    ),
    "consolidate": (
        "dpkit.checkpoints.consolidate",
        "a dpkit or DeepSpeed ZeRO checkpoint to a Hugging Face model folder (fp32)",
    ),
}


def build_parser(command: str | None = None) -> OneLineParser:
    """The parser; only ``command``'s module is imported (so a missing optional
    dependency of one command does not break the others)."""
    parser = OneLineParser(prog="dpkit", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(_module=module_name)
        if name == command:
            importlib.import_module(module_name).add_arguments(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if a in COMMANDS), None)
    args = build_parser(command).parse_args(argv)  # bad flags: one line, SystemExit(2)
    module = importlib.import_module(args._module)
    try:
        return int(module.main(args) or 0)
    except UsageError as err:
        print(refusal_line(f"dpkit {args.command}", err), file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
