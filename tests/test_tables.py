"""dpkit.core.tables.markdown_table: every expected line is written out here by hand, in
the exact styles results.md of ``dpkit bench`` and ``dpkit tune`` use (a first column
with no colon, numbers right-aligned with ``---:``), never built by the function."""

from __future__ import annotations

import pytest

from dpkit.core.tables import markdown_table


def test_without_alignments_every_separator_cell_is_plain():
    assert markdown_table(
        ["candidate", "status", "note"],
        [["ddp_mb8 **winner**", "ok", "fastest"], ["zero2_mb8", "failed", "- (reused)"]],
    ) == [
        "| candidate | status | note |",
        "|---|---|---|",
        "| ddp_mb8 **winner** | ok | fastest |",
        "| zero2_mb8 | failed | - (reused) |",
    ]


def test_right_aligned_columns_get_a_colon_after_their_dashes():
    # The collectives table of results.md: two text columns, three numbers.
    assert markdown_table(
        ["collective", "used by", "calls", "MiB", "median (ms)"],
        [["allreduce, DDP's buckets", "DDP, during backward", "7", "5.2", "36.3"]],
        align=["", "", "right", "right", "right"],
    ) == [
        "| collective | used by | calls | MiB | median (ms) |",
        "|---|---|---:|---:|---:|",
        "| allreduce, DDP's buckets | DDP, during backward | 7 | 5.2 | 36.3 |",
    ]


def test_each_alignment_has_its_own_marker():
    assert markdown_table(["a", "b", "c", "d"], [], align=["", "left", "center", "right"]) == [
        "| a | b | c | d |",
        "|---|:---|:---:|---:|",
    ]


def test_a_table_without_rows_is_its_header_and_separator():
    assert markdown_table(["run", "wall (s)"], [], align=["", "right"]) == [
        "| run | wall (s) |",
        "|---|---:|",
    ]


def test_a_single_column_table():
    assert markdown_table(["run"], [["floor"]]) == ["| run |", "|---|", "| floor |"]


def test_cells_are_written_as_given_unpadded_and_unescaped():
    # An empty cell keeps both its spaces; a "|" or padding inside a cell is the caller's.
    assert markdown_table(
        ["x", "y", "z"], [["", " 1.0", "a|b"]], align=["right", "right", "right"]
    ) == [
        "| x | y | z |",
        "|---:|---:|---:|",
        "|  |  1.0 | a|b |",
    ]


def test_rows_may_be_any_iterable_of_sequences():
    rows = ((name, f"{t:.3f}") for name, t in [("ddp", 0.25), ("zero2", 0.4567)])
    assert markdown_table(("run", "step"), rows, align=("", "right")) == [
        "| run | step |",
        "|---|---:|",
        "| ddp | 0.250 |",
        "| zero2 | 0.457 |",
    ]


def test_a_row_of_the_wrong_width_is_refused():
    with pytest.raises(ValueError, match="a row of 3 cells in a table of 2 columns"):
        markdown_table(["run", "step"], [["ddp", "0.25"], ["zero2", "0.4", "extra"]])
    with pytest.raises(ValueError, match="a row of 1 cells in a table of 2 columns"):
        markdown_table(["run", "step"], [["ddp"]])


def test_alignments_must_match_the_columns_and_be_known():
    with pytest.raises(ValueError, match="1 alignments for 2 columns"):
        markdown_table(["run", "step"], [], align=["right"])
    with pytest.raises(ValueError, match="alignment 'r' is not one of"):
        markdown_table(["run", "step"], [], align=["", "r"])
