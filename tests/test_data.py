"""Data loading: the embedded Rotten Tomatoes split, user files, validation errors, metrics."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpkit.data.classification import load_classification_splits
from dpkit.data.embedded import rotten_tomatoes_csv
from dpkit.errors import UsageError

SPLIT = dict(
    text_column="text",
    label_column="label",
    validation_fraction=0.1,
    test_fraction=0.1,
    split_seed=42,
)


def test_embedded_rotten_tomatoes_is_real_and_split_deterministically():
    splits, labels = load_classification_splits("rotten-tomatoes-snippets", **SPLIT)
    assert labels == ["rotten", "fresh"]
    sizes = {name: len(split) for name, split in splits.items()}
    # 12,808 review snippets once the plot summaries are dropped.
    assert sum(sizes.values()) == 12808
    assert sizes["validation"] == pytest.approx(1281, abs=2)
    again, _ = load_classification_splits("rotten-tomatoes-snippets", **SPLIT)
    assert splits["test"]["text"][:20] == again["test"]["text"][:20]
    assert set(splits["train"]["label"]) == {0, 1}
    assert not set(splits["train"]["text"]) & set(splits["test"]["text"][:200]) - {""}


def test_csv_with_string_labels_and_other_columns(tmp_path):
    path = tmp_path / "reviews.csv"
    rows = ["sentence,stars"] + [f"text number {i},{'good' if i % 2 else 'bad'}" for i in range(50)]
    path.write_text("\n".join(rows))
    splits, labels = load_classification_splits(
        str(path),
        text_column="sentence",
        label_column="stars",
        validation_fraction=0.2,
        test_fraction=0.2,
        split_seed=0,
    )
    assert labels == ["bad", "good"]
    assert set(splits["train"].column_names) == {"text", "label"}
    assert set(splits["train"]["label"]) <= {0, 1}


def test_missing_column_names_the_flag_and_the_columns(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("review,label\nnice,1\nbad,0\n")
    with pytest.raises(
        UsageError, match=r"--text-column='text': not a column .*columns: review, label"
    ):
        load_classification_splits(str(path), **SPLIT)


def test_empty_dataset_is_refused(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    with pytest.raises(UsageError, match="--dataset="):
        load_classification_splits(str(path), **SPLIT)


def test_shipped_metric_modules_load_offline():
    import evaluate

    metrics = Path(__file__).resolve().parents[1] / "dpkit" / "metrics"
    accuracy = evaluate.load(str(metrics / "accuracy"))
    f1 = evaluate.load(str(metrics / "f1"))
    assert accuracy.compute(predictions=[1, 0, 1, 1], references=[1, 0, 0, 1])["accuracy"] == 0.75
    assert f1.compute(predictions=[1, 0, 1, 1], references=[1, 0, 0, 1])["f1"] == pytest.approx(0.8)


def test_cache_file_is_plain_csv():
    header = rotten_tomatoes_csv().read_text().splitlines()[0]
    assert header == "text,label"
