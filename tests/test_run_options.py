"""``dpkit.setup``'s options as one object (:class:`dpkit.train.config.RunOptions`), and the
keywords a script gives it: one line for a name that is no option, none started."""

from __future__ import annotations

import pytest

import dpkit
from dpkit.errors import UsageError
from dpkit.models import ModelSizes
from dpkit.train.config import RunOptions, StrategyConfig

SIZES = ModelSizes(num_params=1000, hidden_size=8, largest_param_numel=64)


def _refused(capsys, **keywords) -> str:
    with pytest.raises(SystemExit) as stopped:
        dpkit.setup(StrategyConfig(), model=SIZES, **keywords)
    assert stopped.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_a_misspelled_option_is_one_line_with_the_closest(capsys):
    line = _refused(capsys, micro_batch_size=2, keep_lst=3)
    assert line.endswith(
        "setup(keep_lst=...): not an option of dpkit.setup; did you mean keep_last?"
    )


def test_options_and_keywords_together_are_refused(capsys):
    line = _refused(capsys, options=RunOptions(micro_batch_size=2), seed=1)
    assert line.endswith("setup(seed=...): give the options as RunOptions or as keywords, not both")


def test_the_options_object_is_checked_when_built():
    with pytest.raises(UsageError) as err:
        RunOptions(micro_batch_size=2, checkpoint_format="full", async_save=True)
    assert str(err.value) == (
        "async_save=True: only with sharded checkpoints (checkpoint_format='full' gathers the "
        "state on the main process)"
    )


def test_keywords_and_the_object_build_the_same_run(tmp_path):
    """Nothing starts: the run is resolved, its options are what was given either way."""
    given = {"micro_batch_size": 3, "gradient_accumulation_steps": 2, "keep_last": 4}
    by_keywords = dpkit.setup(StrategyConfig(), model=SIZES, **given)
    by_object = dpkit.setup(StrategyConfig(), model=SIZES, options=RunOptions(**given))
    assert by_keywords.options == by_object.options == RunOptions(**given)
    assert by_keywords.resolution.micro_batch_size == 3
    assert by_object.resolution.gradient_accumulation_steps == 2
