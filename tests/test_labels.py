"""Label handling: which class id each example gets, the class names' order, and the
id2label/label2id the model is built with.

The class ids are decided from the set of label values over every split, sorted (strings
alphabetically, integers by value), never by the order the values first appear in. Each
case below is written so that first appearance and sorted order differ; the expected
mapping is a literal in the test. A column that mixes numbers and names is refused, and
every run says which label each class id stands for.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from dpkit.data.classification import describe_labels, load_classification_splits
from dpkit.errors import UsageError
from dpkit.models import classifier_labels

FRACTIONS = dict(validation_fraction=0.2, test_fraction=0.2, split_seed=0)


def _write_csv(path: Path, rows: list[tuple[str, object]], header: str = "text,label") -> Path:
    path.write_text("\n".join([header, *(f"{text},{label}" for text, label in rows)]) + "\n")
    return path


def _class_of_every_example(splits) -> dict[str, int]:
    """text -> class id, over every split (every text in these cases is unique)."""
    return {
        text: label
        for split in splits.values()
        for text, label in zip(split["text"], split["label"], strict=True)
    }


@pytest.mark.parametrize(
    ("cycle", "names", "class_of"),
    [
        pytest.param(
            ["pos", "neg", "neutral"],
            ["neg", "neutral", "pos"],
            {"neg": 0, "neutral": 1, "pos": 2},
            id="strings-first-seen-pos-neg-neutral",
        ),
        pytest.param(
            [2, 1],
            ["1", "2"],
            {2: 1, 1: 0},  # 1/2 polarity: two classes, 1 -> 0 and 2 -> 1
            id="ints-1-2-first-seen-2",
        ),
        pytest.param(
            [4, 0, 2],
            ["0", "2", "4"],
            {0: 0, 2: 1, 4: 2},  # 0/2/4 sentiment: three classes by value
            id="ints-0-2-4-first-seen-4",
        ),
        pytest.param(
            [2, 0, 1],
            ["0", "1", "2"],
            {0: 0, 1: 1, 2: 2},  # already 0..K-1: kept as they are
            id="ints-0-1-2-first-seen-2",
        ),
    ],
)
def test_every_example_gets_the_class_of_its_label_in_sorted_order(
    tmp_path, cycle, names, class_of
):
    rows = [(f"review {i}", cycle[i % len(cycle)]) for i in range(60)]
    path = _write_csv(tmp_path / "data.csv", rows)
    splits, label_names = load_classification_splits(
        str(path), text_column="text", label_column="label", **FRACTIONS
    )
    assert label_names == names
    got = _class_of_every_example(splits)
    assert len(got) == 60, "every example is in exactly one split"
    assert got == {text: class_of[label] for text, label in rows}


def test_a_label_seen_first_in_a_later_split_gets_its_sorted_class(tmp_path):
    """A dataset with its own train/validation/test files: the classes come from all three.
    'amber' occurs only in test and 'blue' first in validation; first appearance over the
    splits would give crimson 0, blue 1, amber 2."""
    folder = tmp_path / "three-splits"
    folder.mkdir()
    train = [(f"train {i}", "crimson") for i in range(6)]
    validation = [(f"validation {i}", ("blue", "crimson")[i % 2]) for i in range(4)]
    test = [(f"test {i}", ("amber", "blue", "crimson")[i % 3]) for i in range(6)]
    for name, rows in (("train", train), ("validation", validation), ("test", test)):
        _write_csv(folder / f"{name}.csv", rows)
    splits, label_names = load_classification_splits(
        str(folder), text_column="text", label_column="label", **FRACTIONS
    )
    assert label_names == ["amber", "blue", "crimson"]
    class_of = {"amber": 0, "blue": 1, "crimson": 2}
    for name, rows in (("train", train), ("validation", validation), ("test", test)):
        split = splits[name]  # the dataset's own splits, kept as they are
        assert split["text"] == [text for text, _ in rows]
        assert split["label"] == [class_of[label] for _, label in rows], name


def _logged_loading(tmp_path: Path, rows: list, caplog) -> list[str]:
    """dpkit's log lines while the rows, written as a CSV, are loaded."""
    with caplog.at_level(logging.INFO, logger="dpkit"):
        load_classification_splits(
            str(_write_csv(tmp_path / "d.csv", rows)),
            text_column="text",
            label_column="label",
            **FRACTIONS,
        )
    return [r.getMessage() for r in caplog.records if r.name == "dpkit"]


def test_integer_labels_not_0_to_k_are_mapped_and_the_run_says_so(tmp_path, caplog):
    rows = [(f"review {i}", (4, 0, 2)[i % 3]) for i in range(30)]
    assert _logged_loading(tmp_path, rows, caplog) == [
        "labels [0, 2, 4] are mapped onto classes 0..2 in this order (the model's id2label "
        "keeps the original values)",
        "labels: 3 classes: 0=0, 1=2, 2=4",
    ]
    caplog.clear()
    rows = [(f"review {i}", (2, 0, 1)[i % 3]) for i in range(30)]  # already 0..2: no note
    assert _logged_loading(tmp_path, rows, caplog) == ["labels: 3 classes: 0=0, 1=1, 2=2"]


def _write_jsonl(path: Path, labels: list[object]) -> Path:
    path.write_text("".join(json.dumps({"text": f"review {i}", "label": label}) + "\n"
                            for i, label in enumerate(labels)))  # fmt: skip
    return path


# ---- labels that mix numbers and names: refused, never trained as extra classes ------------


@pytest.mark.parametrize(
    ("write", "message"),
    [
        pytest.param(
            # CSV reads this column as four strings: "0", "1", "pos", "neg" (before: four
            # classes 0, 1, neg, pos, trained without a word).
            lambda t: _write_csv(
                t / "d.csv", [(f"r{i}", ("0", "1", "pos", "neg")[i % 4]) for i in range(40)]
            ),
            "mixes numeric labels ('0') and names ('pos')",
            id="csv-strings-0-1-pos-neg",
        ),
        pytest.param(
            lambda t: _write_csv(
                t / "d.csv", [(f"r{i}", ("neg", "pos", "2", "-1")[i % 4]) for i in range(40)]
            ),
            "mixes numeric labels ('2') and names ('neg')",
            id="csv-names-first",
        ),
        pytest.param(
            lambda t: _write_csv(
                t / "d.csv", [(f"r{i}", ("0.5", "good")[i % 2]) for i in range(40)]
            ),
            "mixes numeric labels ('0.5') and names ('good')",
            id="csv-decimal-and-name",
        ),
        pytest.param(
            lambda t: _write_jsonl(t / "d.jsonl", [(0, 1, "pos", "neg")[i % 4] for i in range(40)]),
            "mixes numeric labels (0) and names ('pos')",
            id="jsonl-int-and-str",
        ),
    ],
)
def test_labels_that_mix_numbers_and_names_are_refused_in_one_line(tmp_path, write, message):
    with pytest.raises(UsageError) as err:
        load_classification_splits(
            str(write(tmp_path)), text_column="text", label_column="label", **FRACTIONS
        )
    assert str(err.value) == f"--label-column='label': {message}; label every class the same way"


def test_int_and_str_labels_from_code_are_refused_naming_one_of_each():
    """A dataset built in code holds Python values as they are: 0 and 1 with 'pos'."""
    from dpkit.data.classification import _labels_from_values

    mixed = {"train": {"label": [1, 0]}, "validation": {"label": ["pos", 1]}}
    with pytest.raises(UsageError) as err:
        _labels_from_values(mixed, "stars")
    assert str(err.value) == (
        "--label-column='stars': mixes numeric labels (1) and names ('pos'); "
        "label every class the same way"
    )


@pytest.mark.parametrize(
    ("labels", "names", "class_of"),
    [
        pytest.param(["2", "0", "1"], ["0", "1", "2"], {"0": 0, "1": 1, "2": 2}, id="text-0-1-2"),
        pytest.param(
            # As integers 1 < 2 < 10, not as text ("10" < "2").
            ["10", "2", "1"],
            ["1", "2", "10"],
            {"1": 0, "2": 1, "10": 2},
            id="text-1-2-10",
        ),
    ],
)
def test_integers_written_as_text_are_those_integers(tmp_path, labels, names, class_of):
    """JSON strings "0", "1", "2" train as the integers 0, 1, 2 would (CSV already reads
    such a column as integers)."""
    written = [labels[i % 3] for i in range(30)]
    splits, label_names = load_classification_splits(
        str(_write_jsonl(tmp_path / "d.jsonl", written)),
        text_column="text",
        label_column="label",
        **FRACTIONS,
    )
    assert label_names == names
    got = _class_of_every_example(splits)
    assert got == {f"review {i}": class_of[label] for i, label in enumerate(written)}


@pytest.mark.parametrize(
    ("labels", "message"),
    [
        pytest.param(["0.5", "1.5"], "labels must be integers or strings, found '0.5', a "
                     "number that is not an integer", id="decimals"),
        pytest.param(["1", "01", "2"], "'01' and '1' are the same number; write each class "
                     "one way", id="two-spellings"),
        pytest.param(["-1", "0", "1"], "negative label -1", id="negative"),
    ],
)  # fmt: skip
def test_numbers_written_as_text_are_refused_as_the_numbers_would_be(tmp_path, labels, message):
    with pytest.raises(UsageError) as err:
        load_classification_splits(
            str(_write_jsonl(tmp_path / "d.jsonl", [labels[i % len(labels)] for i in range(30)])),
            text_column="text",
            label_column="label",
            **FRACTIONS,
        )
    assert str(err.value) == f"--label-column='label': {message}"


# ---- the label set, said once per run --------------------------------------------------------


def test_every_run_says_which_label_each_class_is(tmp_path, caplog):
    rows = [(f"review {i}", ("pos", "neg")[i % 2]) for i in range(20)]
    assert _logged_loading(tmp_path, rows, caplog) == ["labels: 2 classes: 0=neg, 1=pos"]


def test_the_label_line_stops_after_twenty_classes():
    names = [f"c{i:02d}" for i in range(23)]
    assert describe_labels(names) == (
        "23 classes: 0=c00, 1=c01, 2=c02, 3=c03, 4=c04, 5=c05, 6=c06, 7=c07, 8=c08, 9=c09, "
        "10=c10, 11=c11, 12=c12, 13=c13, 14=c14, 15=c15, 16=c16, 17=c17, 18=c18, 19=c19, "
        "... and 3 more"
    )


class _Tokenizer:
    pad_token_id = 7  # any id: classifier_labels passes the tokenizer's own through


def test_the_model_gets_the_names_in_class_order():
    assert classifier_labels(["neg", "neutral", "pos"], _Tokenizer()) == {
        "num_labels": 3,
        "id2label": {0: "neg", 1: "neutral", 2: "pos"},
        "label2id": {"neg": 0, "neutral": 1, "pos": 2},
        "pad_token_id": 7,
    }


def test_a_model_built_for_the_data_names_each_examples_class_by_its_label(tmp_path):
    """The recipe's path: data -> label names -> ``from_pretrained(**classifier_labels)``.
    A tiny BERT classifier (random weights) must name every example's class id by that
    example's own label, and carry the label names in its config for export."""
    from transformers import BertConfig, BertForSequenceClassification

    rows = [(f"review {i}", ("pos", "neg", "neutral")[i % 3]) for i in range(30)]
    splits, label_names = load_classification_splits(
        str(_write_csv(tmp_path / "d.csv", rows)),
        text_column="text",
        label_column="label",
        **FRACTIONS,
    )
    config = BertConfig(
        vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
        intermediate_size=16, pad_token_id=0,
    )  # fmt: skip
    for key, value in classifier_labels(label_names, _Tokenizer()).items():
        setattr(config, key, value)
    model = BertForSequenceClassification(config)
    assert model.classifier.out_features == 3
    assert model.config.id2label == {0: "neg", 1: "neutral", 2: "pos"}
    assert model.config.label2id == {"neg": 0, "neutral": 1, "pos": 2}
    label_of = dict(rows)
    for text, class_id in _class_of_every_example(splits).items():
        assert model.config.id2label[class_id] == label_of[text]
