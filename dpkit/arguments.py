"""dpkit's one argument parser: every ``dpkit`` command and every recipe refuses bad input
the same way.

:class:`OneLineParser` is an ``argparse.ArgumentParser`` whose refusals are one line,
``PROG: error: MESSAGE``, and exit code 2, never argparse's usage block. An unknown flag
is refused with the closest known one (:func:`unknown_flag_message`)::

    dpkit plan: error: --lora-rr=8: not a flag of this command; did you mean --lora-r?
    finetune.py: error: --lora-rr=8: not a flag of this recipe; did you mean --lora-r?

The ``dpkit`` command and its subcommands use it directly (``add_subparsers`` gives
subcommands their parent's class); the recipes' dataclass flags
(:func:`dpkit.parse_args`) use :func:`dataclass_parser`, the same class joined to
transformers' ``HfArgumentParser``.

Only the standard library and :mod:`dpkit.errors` are imported here (transformers only
inside :func:`dataclass_parser`), so ``dpkit plan --help`` imports neither torch nor
transformers.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import sys
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

from dpkit.errors import EXIT_USAGE, UsageError


class CommandLineError(UsageError):
    """A refusal of the command line itself, with the program whose flags refused it
    (``dpkit plan``, not ``dpkit``, for a bad ``dpkit plan`` flag)."""

    def __init__(self, message: str, prog: str):
        super().__init__(message)
        self.prog = prog


def refusal_line(prog: str, message: object) -> str:
    """The one line every refusal prints: ``PROG: error: MESSAGE``."""
    return f"{prog}: error: {message}"


def refuse(prog: str, message: object) -> NoReturn:
    """Print :func:`refusal_line` on stderr and exit with code 2."""
    print(refusal_line(prog, message), file=sys.stderr, flush=True)
    raise SystemExit(EXIT_USAGE)


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose refusals are one line and exit code 2.

    ``error`` raises :class:`CommandLineError` instead of printing the usage and exiting,
    so a caller that prints refusals its own way (:func:`dpkit.parse_args`: once per
    job) catches it; :meth:`parse_args` prints it as one line and exits 2. Arguments
    that no flag takes are refused (:meth:`refuse_unknown`) rather than listed as
    "unrecognized arguments", naming the closest flag of the (sub)command they were given to.
    """

    kind = "command"
    """What an unknown flag is "not a flag of this ...": ``command`` or ``recipe``."""

    def error(self, message: str) -> NoReturn:
        raise CommandLineError(message, self.prog)

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        """argparse's ``parse_args``; bad input prints one line and exits with code 2."""
        try:
            return self.parse_args_or_raise(args, namespace)
        except CommandLineError as err:
            refuse(err.prog, err)

    def parse_args_or_raise(
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        """:meth:`parse_args` that raises :class:`CommandLineError` instead of exiting."""
        namespace, remaining = self.parse_known_args(args, namespace)
        if remaining:
            chosen_parser(self, namespace).refuse_unknown(remaining)
        return namespace

    def refuse_unknown(self, remaining: list[str]) -> NoReturn:
        """Refuse ``remaining``, what no flag of this parser took, naming the closest flag."""
        self.error(unknown_flag_message(remaining, known_flags(self), self.kind))


def chosen_parser(parser: argparse.ArgumentParser, namespace: argparse.Namespace) -> Any:
    """The innermost (sub)command parser ``namespace`` was parsed by: ``dpkit plan``'s
    for ``dpkit plan --nproc 2``. Subcommands are found by their ``dest`` (a subparsers
    action without one is not followed)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and action.choices:
            name = getattr(namespace, action.dest, None) if action.dest else None
            if isinstance(name, str) and name in action.choices:
                return chosen_parser(action.choices[name], namespace)
    return parser


def known_flags(parser: argparse.ArgumentParser) -> list[str]:
    """``parser``'s long flags, not those hidden from ``--help``."""
    return [
        flag
        for action in parser._actions
        if action.help != argparse.SUPPRESS
        for flag in action.option_strings
        if flag.startswith("--")
    ]


def unknown_flag_message(remaining: list[str], flags: Iterable[str], kind: str) -> str:
    """The refusal of ``remaining`` (what no flag took; its first item is named) given
    the ``flags`` there are: ``--micro-batch-sze=16: not a flag of this recipe; did you
    mean --micro-batch-size?``, or ``'zero2': unexpected argument ...`` for a bare word.

    ``-`` and ``_`` count as the same, and a flag spelled both ways (transformers adds
    ``--max_steps`` beside ``--max-steps``) is suggested with dashes.
    """
    flag, _, value = remaining[0].partition("=")
    if not flag.startswith("-"):
        return f"{flag!r}: unexpected argument (flags take the form --name value)"
    if not value and len(remaining) > 1 and not remaining[1].startswith("-"):
        value = remaining[1]
    spelled: dict[str, str] = {}  # each flag with dashes -> how to suggest it
    for known in flags:
        dashed = known.replace("_", "-")
        if dashed not in spelled or known == dashed:
            spelled[dashed] = known
    close = difflib.get_close_matches(flag.replace("_", "-"), list(spelled), n=1)
    hint = f"; did you mean {spelled[close[0]]}?" if close else ""
    shown = f"{flag}={value}" if value else flag
    return f"{shown}: not a flag of this {kind}{hint}"


@functools.cache
def _dataclass_parser_class() -> type:
    """:class:`OneLineParser` joined to transformers' ``HfArgumentParser`` (built on
    first use: transformers is imported only by the recipes that need it)."""
    from transformers import HfArgumentParser

    class OneLineDataclassParser(OneLineParser, HfArgumentParser):
        """Dataclass flags (``HfArgumentParser``) refused the :class:`OneLineParser` way."""

        kind = "recipe"

    return OneLineDataclassParser


def dataclass_parser(config_classes: Sequence[type], **kwargs: Any) -> Any:
    """An ``HfArgumentParser`` over ``config_classes`` that is a :class:`OneLineParser`:
    its refusals raise :class:`CommandLineError`, an unknown flag's naming the closest."""
    return _dataclass_parser_class()(tuple(config_classes), **kwargs)
