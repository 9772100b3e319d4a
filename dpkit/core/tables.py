"""Markdown tables: the one place dpkit joins cells into ``| a | b |`` lines.

The ground floor (:mod:`dpkit.core`): standard library only, nothing of dpkit's above it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

SEPARATORS = {"": "---", "left": ":---", "center": ":---:", "right": "---:"}
"""Each column alignment and its separator cell; ``""`` writes no colon (the renderer's
default, left)."""


def markdown_table(
    header: Sequence[str],
    rows: Iterable[Sequence[str]],
    align: Sequence[str] | None = None,
) -> list[str]:
    """The lines of a markdown table: the header, the separator, then one line per row.

    A line is ``"| " + " | ".join(cells) + " |"``, with no padding; the separator is
    ``|`` then one ``---`` per column, each followed by ``|``: ``---:`` for a column
    aligned ``"right"``, ``:---`` for ``"left"``, ``:---:`` for ``"center"``, plain
    ``---`` for ``""`` (every column when ``align`` is None). Cells are written as given:
    a ``|`` inside one is not escaped.

    >>> markdown_table(["run", "s"], [["ddp", "0.25"]], align=["", "right"])
    ['| run | s |', '|---|---:|', '| ddp | 0.25 |']

    Raises ValueError for a row or an ``align`` whose length is not the header's, or an
    alignment not in :data:`SEPARATORS`.
    """
    width = len(header)
    if align is None:
        align = [""] * width
    if len(align) != width:
        raise ValueError(f"{len(align)} alignments for {width} columns: {list(align)}")
    unknown = [a for a in align if a not in SEPARATORS]
    if unknown:
        raise ValueError(f"alignment {unknown[0]!r} is not one of {sorted(SEPARATORS)}")
    lines = [_line(header), "|" + "".join(SEPARATORS[a] + "|" for a in align)]
    for row in rows:
        if len(row) != width:
            raise ValueError(f"a row of {len(row)} cells in a table of {width} columns: {row}")
        lines.append(_line(row))
    return lines


def _line(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"
