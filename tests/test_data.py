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
    # 'good' comes first in the file; the classes are sorted: bad 0, good 1.
    rows = ["sentence,stars"] + [f"text number {i},{'bad' if i % 2 else 'good'}" for i in range(50)]
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
    got = {t: y for s in splits.values() for t, y in zip(s["text"], s["label"], strict=True)}
    assert got == {f"text number {i}": 0 if i % 2 else 1 for i in range(50)}


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


# ---- user files: columns, missing values, label types, splits ------------------------------


def _csv(folder: Path, name: str, lines: list[str]) -> str:
    path = folder / name
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _load(dataset: str, text="text", label="label", validation=0.1, test=0.1):
    return load_classification_splits(
        dataset,
        text_column=text,
        label_column=label,
        validation_fraction=validation,
        test_fraction=test,
        split_seed=0,
    )


def _refusal(dataset: str, **kwargs) -> str:
    with pytest.raises(UsageError) as err:
        _load(dataset, **kwargs)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_columns_named_the_other_way_round_are_swapped_not_merged(tmp_path):
    """The file's 'label' column holds the text and its 'text' column the labels."""
    rows = [f"review number {i},{'ab'[i % 2]}" for i in range(40)]
    path = _csv(tmp_path, "swapped.csv", ["label,text", *rows])
    splits, names = _load(path, text="label", label="text")
    assert names == ["a", "b"]
    got = {t: y for s in splits.values() for t, y in zip(s["text"], s["label"], strict=True)}
    assert got == {f"review number {i}": i % 2 for i in range(40)}


def test_examples_without_a_text_or_a_label_are_left_out(tmp_path):
    rows = [f"r{i},{'ab'[i % 2]}" for i in range(40)] + [",a", "no label,", ",b"]
    splits, names = _load(_csv(tmp_path, "gaps.csv", ["text,label", *rows]))
    assert sum(len(split) for split in splits.values()) == 40 and names == ["a", "b"]
    none = _csv(tmp_path, "none.csv", ["text,label", ",1", "x,", ",0"])
    assert _refusal(none) == f"--dataset={none!r}: no example has both a text and a label"


def test_a_dataset_with_its_own_class_names_keeps_their_order(tmp_path):
    """A ClassLabel feature (Hub datasets carry one) names the classes in its own order,
    which is not sorted here: the ids are kept as they are."""
    import datasets

    features = datasets.Features(
        {"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["pos", "neg"])}
    )
    rows = {"text": [f"r{i}" for i in range(40)], "label": [i % 2 for i in range(40)]}
    folder = tmp_path / "hub-like"
    folder.mkdir()
    datasets.Dataset.from_dict(rows, features=features).to_parquet(str(folder / "train.parquet"))
    splits, names = _load(str(folder))
    assert names == ["pos", "neg"]
    got = {t: y for s in splits.values() for t, y in zip(s["text"], s["label"], strict=True)}
    assert got == {f"r{i}": i % 2 for i in range(40)}


def test_splits_carved_from_one_file_have_the_asked_sizes(tmp_path):
    """64 examples, 1/8 validation and 1/4 test: 3/8 held out (24), of which 2/3 test (16)
    and the rest validation (8); 40 train."""
    path = _csv(tmp_path, "one.csv", ["text,label", *(f"r{i},{i % 2}" for i in range(64))])
    splits, _ = _load(path, validation=0.125, test=0.25)
    sizes = {name: len(split) for name, split in splits.items()}
    assert sizes == {"train": 40, "validation": 8, "test": 16}
    texts = [t for split in splits.values() for t in split["text"]]
    assert sorted(texts) == sorted(f"r{i}" for i in range(64))  # each example once


def test_a_dataset_with_train_and_test_files_keeps_its_test_split(tmp_path):
    """Validation is carved from train (1/5 of 40 = 8), with the run's seed; the dataset's own
    test is kept."""
    folder = tmp_path / "two-files"
    folder.mkdir()
    _csv(folder, "train.csv", ["text,label", *(f"train {i},{i % 2}" for i in range(40))])
    _csv(folder, "test.csv", ["text,label", *(f"test {i},{i % 2}" for i in range(6))])
    splits, _ = _load(str(folder), validation=0.2, test=0.5)
    assert {name: len(split) for name, split in splits.items()} == {
        "train": 32,
        "validation": 8,
        "test": 6,
    }
    assert splits["test"]["text"] == [f"test {i}" for i in range(6)]
    assert all(t.startswith("train ") for t in splits["validation"]["text"])
    again, _ = _load(str(folder), validation=0.2, test=0.5)
    assert again["validation"]["text"] == splits["validation"]["text"]


def test_train_is_the_split_carved_whatever_the_order():
    """A dataset built in code may list its splits in any order: validation and test are
    carved from train, not from the first split."""
    import datasets

    from dpkit.data.classification import _ensure_splits

    def split(prefix, n):
        return datasets.Dataset.from_dict({"text": [f"{prefix}{i}" for i in range(n)]})

    raw = datasets.DatasetDict(validation=split("v", 4), train=split("t", 40))
    splits = _ensure_splits(raw, 0.25, 0.25, seed=0)
    assert {name: len(s) for name, s in splits.items()} == {
        "train": 20,
        "validation": 10,
        "test": 10,
    }
    assert all(t.startswith("t") for s in splits.values() for t in s["text"])


def test_a_dataset_without_a_train_split_is_split_from_its_first(tmp_path):
    folder = tmp_path / "test-only"
    folder.mkdir()
    _csv(folder, "test.csv", ["text,label", *(f"t{i},{i % 2}" for i in range(64))])
    splits, _ = _load(str(folder), validation=0.125, test=0.25)
    assert {name: len(split) for name, split in splits.items()} == {
        "train": 40,
        "validation": 8,
        "test": 16,
    }


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        pytest.param(
            ["text,label", *(f"r{i},{'True' if i % 2 else 'False'}" for i in range(20))],
            "--label-column='label': labels must be integers or strings, found bool False",
            id="bool",
        ),
        pytest.param(
            ["text,label", *(f"r{i},{i % 3 - 1}" for i in range(20))],
            "--label-column='label': negative label -1",
            id="negative",
        ),
        pytest.param(
            ["text,label", *(f"r{i},a" for i in range(20))],
            "--dataset={path!r}: needs at least 2 classes, found ['a']",
            id="one-class",
        ),
        pytest.param(
            ["text,label", *(f"r{i},{i % 2}" for i in range(3))],
            "--dataset={path!r}: 3 examples are too few for train, validation (0.1) and test "
            "(0.1) splits",
            id="too-few-to-split",
        ),
        pytest.param(
            ["text,label"],
            "--dataset={path!r}: has no examples",
            id="header-only",
        ),
        pytest.param(
            ["text,label", "one,1"],
            "--dataset={path!r}: needs at least 2 classes, found ['1']",
            id="one-example",
        ),
    ],
)
def test_labels_and_sizes_that_cannot_train_are_refused_in_full(tmp_path, lines, message):
    path = _csv(tmp_path, "d.csv", lines)
    assert _refusal(path) == message.format(path=path)


def test_a_long_label_value_is_shown_cut(tmp_path):
    path = tmp_path / "lists.jsonl"
    path.write_text("".join(f'{{"text": "r{i}", "label": {list(range(30))}}}\n' for i in range(4)))
    shown = repr(list(range(30)))[:37] + "..."  # 40 characters at most
    assert _refusal(str(path)) == (
        f"--label-column='label': labels must be integers or strings, found list {shown}"
    )
    short = tmp_path / "short.jsonl"
    short.write_text("".join(f'{{"text": "r{i}", "label": [{i}, 1]}}\n' for i in range(4)))
    assert _refusal(str(short)).endswith("found list [0, 1]")


@pytest.mark.parametrize(
    ("classes", "examples", "refused"),
    [
        (21, 41, True),  # over 20 classes and under 2 examples each: the text column?
        (21, 42, False),  # 2 examples a class: a labelling
        (20, 20, False),  # 20 classes is a labelling whatever the examples
    ],
)
def test_many_classes_for_few_examples_look_like_the_text_column(
    tmp_path, classes, examples, refused
):
    lines = ["text,label", *(f"r{i},c{i % classes:02d}" for i in range(examples))]
    path = _csv(tmp_path, "many.csv", lines)
    if refused:
        assert _refusal(path, validation=0.25, test=0.25) == (
            f"--label-column='label': {classes} classes for {examples} examples (fewer than 2 "
            "examples a class); is it the text column (--text-column='text')?"
        )
    else:
        _, names = _load(path, validation=0.25, test=0.25)
        assert names == [f"c{i:02d}" for i in range(classes)]


def test_files_that_cannot_be_read_are_refused_in_one_line(tmp_path):
    missing = str(tmp_path / "missing.jsonl")
    assert _refusal(missing) == f"--dataset={missing!r}: no such file"
    empty = _csv(tmp_path, "empty.json", [])
    (tmp_path / "empty.json").write_text("")
    assert _refusal(empty) == f"--dataset={empty!r}: the file is empty"
    import datasets

    # What datasets itself raises, named by its type in the line.
    broken = _csv(tmp_path, "broken.json", ['{"text": "a", "label": 1', "not json"])
    with pytest.raises(Exception) as raw:
        datasets.load_dataset("json", data_files=broken)
    assert _refusal(broken) == (
        f"--dataset={broken!r}: cannot read it as json ({type(raw.value).__name__}: {raw.value})"
    )
    folder = str(tmp_path / "nothing-here")
    Path(folder).mkdir()
    with pytest.raises(Exception) as raw:
        datasets.load_dataset(folder)
    assert _refusal(folder) == (
        f"--dataset={folder!r}: cannot load ({type(raw.value).__name__}: {raw.value})"
    )


def test_a_dataset_of_columns_without_rows_is_refused(tmp_path):
    import datasets

    folder = tmp_path / "no-rows"
    folder.mkdir()
    empty = datasets.Dataset.from_dict({"text": [], "label": []})
    empty.to_parquet(str(folder / "train.parquet"))
    assert _refusal(str(folder)) == f"--dataset={str(folder)!r}: has no examples"


def test_a_missing_label_column_names_the_flag_and_the_columns(tmp_path):
    path = _csv(tmp_path, "d.csv", ["text,stars", "good,1", "bad,0"])
    assert _refusal(path) == (
        f"--label-column='label': not a column of {path!r} (columns: text, stars)"
    )


# ---- the data against the model and the run ----------------------------------------------


def _in_memory(train: int, classes: int):
    """Splits as load_data_splits returns them, built in memory: ``train`` examples."""
    import datasets

    def split(n):
        return datasets.Dataset.from_dict({"text": ["x"] * n, "label": [0] * n})

    return datasets.DatasetDict(train=split(train), validation=split(2), test=split(2)), [
        str(i) for i in range(classes)
    ]


def _bert(**kwargs):
    from transformers import BertConfig

    return BertConfig(**kwargs)


def _check(tmp_path, loaded, model_config, **train):
    from dpkit.data.classification import check_classification_data
    from dpkit.train.finetune_config import DataConfig, ModelConfig, TrainConfig

    data_cfg = DataConfig(max_train_samples=train.pop("max_train_samples", None))
    train_cfg = TrainConfig(output_dir=str(tmp_path / "run"), **train)
    return check_classification_data(ModelConfig(), data_cfg, train_cfg, model_config, loaded)


def test_a_sequence_classifier_takes_exactly_its_own_classes(tmp_path):
    head_3 = _bert(architectures=["BertForSequenceClassification"], num_labels=3)
    assert _check(tmp_path, _in_memory(40, 3), head_3, micro_batch_size=8) == ["0", "1", "2"]
    with pytest.raises(UsageError) as err:
        _check(tmp_path, _in_memory(40, 5), head_3, micro_batch_size=8)
    assert str(err.value) == (
        "--dataset='rotten-tomatoes-snippets': label 4 is outside the classes 0..2 of "
        "--model='sentence-transformers/all-MiniLM-L6-v2' (a sequence classifier); use data "
        "with 3 classes or a model without a classification head"
    )
    with pytest.raises(UsageError) as err:
        _check(tmp_path, _in_memory(40, 2), head_3, micro_batch_size=8)
    assert "2 classes do not fit the 3 labels of --model=" in str(err.value)
    named = _in_memory(40, 0)[0], ["a", "b", "c", "d"]  # more classes, but not numbered
    with pytest.raises(UsageError) as err:
        _check(tmp_path, named, head_3, micro_batch_size=8)
    assert "4 classes do not fit the 3 labels of --model=" in str(err.value)
    # A model without a head (or whose architectures are unknown) takes any classes.
    assert _check(tmp_path, _in_memory(40, 5), _bert(num_labels=2), micro_batch_size=8)
    assert _check(tmp_path, _in_memory(40, 5), _bert(architectures=None), micro_batch_size=8)


def test_training_needs_one_full_micro_batch(tmp_path):
    bert = _bert()
    _check(tmp_path, _in_memory(8, 2), bert, micro_batch_size=8)  # exactly one batch
    with pytest.raises(UsageError) as err:
        _check(tmp_path, _in_memory(7, 2), bert, micro_batch_size=8)
    assert str(err.value) == (
        "--micro-batch-size=8: more than the 7 training examples; the incomplete batch is "
        "dropped, so nothing would train"
    )
    with pytest.raises(UsageError, match="more than the 5 training examples"):
        _check(tmp_path, _in_memory(40, 2), bert, micro_batch_size=8, max_train_samples=5)
    _check(tmp_path, _in_memory(40, 2), bert, micro_batch_size=8, max_train_samples=8)
    _check(tmp_path, _in_memory(7, 2), bert, micro_batch_size=8, eval_only=True)


def test_loading_leaves_the_progress_bars_as_they_were(tmp_path):
    import datasets

    from dpkit.data.classification import load_data_splits
    from dpkit.train.finetune_config import DataConfig

    path = _csv(tmp_path, "d.csv", ["text,label", *(f"r{i},{i % 2}" for i in range(20))])
    config = DataConfig(dataset=path)
    was = datasets.is_progress_bar_enabled()
    try:
        datasets.enable_progress_bars()
        splits, names = load_data_splits(config)
        assert datasets.is_progress_bar_enabled() and names == ["0", "1"]
        assert sum(len(split) for split in splits.values()) == 20
        datasets.disable_progress_bars()
        load_data_splits(config)
        assert not datasets.is_progress_bar_enabled()
    finally:
        (datasets.enable_progress_bars if was else datasets.disable_progress_bars)()


def test_integer_and_string_labels_together_are_refused():
    """An Arrow column holds one type, so no file reaches this; a dataset built in code can."""
    from dpkit.data.classification import _labels_from_values

    mixed = {"train": {"label": [0, 1]}, "validation": {"label": ["1"]}}
    with pytest.raises(UsageError) as err:
        _labels_from_values(mixed, "stars")
    assert str(err.value) == "--label-column='stars': mixes integer and string labels; use one type"


def test_the_run_splits_with_its_own_seed(tmp_path):
    from dpkit.data.classification import load_data_splits
    from dpkit.train.finetune_config import DataConfig

    path = _csv(tmp_path, "d.csv", ["text,label", *(f"r{i},{i % 2}" for i in range(60))])
    fractions = dict(text_column="text", label_column="label", validation_fraction=0.1)
    seeded, _ = load_data_splits(DataConfig(dataset=path, split_seed=3, **fractions))
    same, _ = load_classification_splits(path, **fractions, test_fraction=0.1, split_seed=3)
    other, _ = load_classification_splits(path, **fractions, test_fraction=0.1, split_seed=4)
    assert seeded["test"]["text"] == same["test"]["text"]
    assert seeded["test"]["text"] != other["test"]["text"]  # the seed does pick the split


def test_the_check_loads_the_data_itself_when_not_given_it(tmp_path):
    from dpkit.data.classification import check_classification_data
    from dpkit.train.finetune_config import DataConfig, ModelConfig, TrainConfig

    path = _csv(tmp_path, "d.csv", ["text,label", *(f"r{i},{'yn'[i % 2]}" for i in range(40))])
    train_cfg = TrainConfig(output_dir=str(tmp_path / "run"), micro_batch_size=4)
    names = check_classification_data(ModelConfig(), DataConfig(dataset=path), train_cfg, _bert())
    assert names == ["n", "y"]


def test_only_a_sequence_classification_architecture_has_a_head():
    from types import SimpleNamespace

    from dpkit.data.classification import is_sequence_classifier

    assert is_sequence_classifier(_bert(architectures=["BertForSequenceClassification"]))
    assert not is_sequence_classifier(_bert(architectures=["BertForMaskedLM"]))
    assert not is_sequence_classifier(SimpleNamespace())  # a config without the field


@pytest.mark.parametrize(
    ("label", "shown"),
    [
        # A repr of 40 characters (1 + 4 x 9 + 2 + 1) is shown whole.
        ([10**6] * 4 + [12], "[1000000, 1000000, 1000000, 1000000, 12]"),
        # 41: its first 37 characters and "...".
        ([10**6] * 4 + [123], "[1000000, 1000000, 1000000, 1000000, ..."),
    ],
)
def test_an_odd_label_is_shown_whole_up_to_40_characters(label, shown):
    from dpkit.data.classification import _labels_from_values

    with pytest.raises(UsageError) as err:
        _labels_from_values({"train": {"label": [label]}}, "y")
    assert str(err.value) == (
        f"--label-column='y': labels must be integers or strings, found list {shown}"
    )
