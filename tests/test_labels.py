"""Label handling: which class id each example gets, the class names' order, and the
id2label/label2id the model is built with.

The class ids are decided from the set of label values over every split, sorted (strings
alphabetically, integers by value), never by the order the values first appear in. Each
case below is written so that first appearance and sorted order differ; the expected
mapping is a literal in the test.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from dpkit.data.classification import load_classification_splits
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


def test_integer_labels_not_0_to_k_are_mapped_and_the_run_says_so(tmp_path, caplog):
    rows = [(f"review {i}", (4, 0, 2)[i % 3]) for i in range(30)]
    with caplog.at_level(logging.INFO, logger="dpkit"):
        load_classification_splits(
            str(_write_csv(tmp_path / "d.csv", rows)),
            text_column="text",
            label_column="label",
            **FRACTIONS,
        )
    assert [r.getMessage() for r in caplog.records if r.name == "dpkit"] == [
        "labels [0, 2, 4] are mapped onto classes 0..2 in this order (the model's id2label "
        "keeps the original values)"
    ]
    caplog.clear()
    rows = [(f"review {i}", (2, 0, 1)[i % 3]) for i in range(30)]  # already 0..2: no note
    with caplog.at_level(logging.INFO, logger="dpkit"):
        load_classification_splits(
            str(_write_csv(tmp_path / "e.csv", rows)),
            text_column="text",
            label_column="label",
            **FRACTIONS,
        )
    assert [r.getMessage() for r in caplog.records if r.name == "dpkit"] == []


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
