"""Classification data: the embedded Rotten Tomatoes snippets, CSV/JSON(L) files or Hub datasets, split and validated.

Everything here runs before any process group starts, so bad data costs one line
and exit code 2 (:class:`~dpkit.errors.UsageError`), never a half-started job.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from dpkit.data.embedded import ROTTEN_TOMATOES, rotten_tomatoes_csv
from dpkit.errors import UsageError

logger = logging.getLogger("dpkit")
# Over this many classes, fewer than two examples a class means the label column is
# probably the text (swapped --text-column/--label-column), not a labelling.
MANY_CLASSES = 20
# A label that reads as a number: "0", "-1", "2.5", "1e3". CSV keeps such labels as text
# when another label in the column is not a number; JSON strings always do.
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
_INTEGER = re.compile(r"[+-]?\d+")


def load_classification_splits(
    dataset: str,
    *,
    text_column: str,
    label_column: str,
    validation_fraction: float,
    test_fraction: float,
    split_seed: int,
):
    """A ``DatasetDict`` with train/validation/test and integer labels 0..K-1.

    Returns ``(splits, label_names)``. A single-split source is split with a fixed
    seed (a random split, not stratified) so every run, strategy and world size sees the
    same examples.
    """
    import datasets

    if dataset == ROTTEN_TOMATOES:
        raw = datasets.load_dataset("csv", data_files=str(rotten_tomatoes_csv()))
        label_names = ["rotten", "fresh"]
    elif dataset.endswith((".csv", ".json", ".jsonl")):
        if not Path(dataset).is_file():
            raise UsageError(f"--dataset={dataset!r}: no such file")
        kind = "csv" if dataset.endswith(".csv") else "json"
        if Path(dataset).stat().st_size == 0:
            raise UsageError(f"--dataset={dataset!r}: the file is empty")
        try:
            raw = datasets.load_dataset(kind, data_files=dataset)
        except Exception as err:  # datasets' parsers raise many types; the message says why
            if "corresponds to no data" in str(err):  # a header and no rows
                raise UsageError(f"--dataset={dataset!r}: has no examples") from None
            raise UsageError(
                f"--dataset={dataset!r}: cannot read it as {kind} ({type(err).__name__}: {err})"
            ) from None
        label_names = None
    else:
        try:
            raw = datasets.load_dataset(dataset)
        except Exception as err:  # the Hub or a local loader; its message says why
            if "corresponds to no data" in str(err):  # a folder of files without rows
                raise UsageError(f"--dataset={dataset!r}: has no examples") from None
            raise UsageError(
                f"--dataset={dataset!r}: cannot load ({type(err).__name__}: {err})"
            ) from None
        label_names = None

    first = next(iter(raw.values()))
    for flag, column in (("text_column", text_column), ("label_column", label_column)):
        if column not in first.column_names:
            raise UsageError(
                f"--{flag.replace('_', '-')}={column!r}: not a column of {dataset!r} "
                f"(columns: {', '.join(first.column_names)})"
            )
    # No split is empty here: datasets refuses to load a split without rows (both
    # branches above turn that into "has no examples").

    if text_column == label_column:
        raise UsageError(
            f"--label-column={label_column!r}: the same column as --text-column; name the labels"
        )
    raw = raw.select_columns([text_column, label_column])
    renames = {
        old: new for old, new in ((text_column, "text"), (label_column, "label")) if old != new
    }
    if renames:  # at once: the two may swap names
        raw = raw.rename_columns(renames)
    raw = raw.filter(lambda ex: ex["text"] is not None and ex["label"] is not None)
    if sum(len(split) for split in raw.values()) == 0:
        raise UsageError(f"--dataset={dataset!r}: no example has both a text and a label")

    texts = [v for split in raw.values() for v in split["text"][:1000]]
    not_text = next((v for v in texts if not isinstance(v, str)), None)
    if not_text is not None:
        raise UsageError(
            f"--text-column={text_column!r}: holds {type(not_text).__name__} values "
            f"({not_text!r}), not text; is --label-column={label_column!r} the text?"
        )
    feature = first.features.get(label_column)
    if label_names is None and isinstance(feature, datasets.ClassLabel):
        label_names = list(feature.names)
    if label_names is None:
        label_names, raw = _labels_from_values(raw, label_column)
    examples = sum(len(split) for split in raw.values())
    if len(label_names) > MANY_CLASSES and len(label_names) > examples / 2:
        raise UsageError(
            f"--label-column={label_column!r}: {len(label_names)} classes for {examples} "
            f"examples (fewer than 2 examples a class); is it the text column "
            f"(--text-column={text_column!r})?"
        )
    if len(label_names) < 2:
        raise UsageError(f"--dataset={dataset!r}: needs at least 2 classes, found {label_names}")

    try:
        splits = _ensure_splits(raw, validation_fraction, test_fraction, split_seed)
    except ValueError:  # datasets: a split would be empty
        examples = sum(len(split) for split in raw.values())
        raise UsageError(
            f"--dataset={dataset!r}: {examples} examples are too few for train, validation "
            f"({validation_fraction}) and test ({test_fraction}) splits"
        ) from None
    # Said on every run (the main process's log): which class id stands for which label.
    logger.info("labels: %s", describe_labels(label_names))
    return splits, label_names


def _labels_from_values(raw, label_column: str):
    """Class names and the splits with labels 0..K-1, decided from the set of label values
    over every split (never from what one batch or split holds).

    Integer labels keep their order; a set that is not 0..K-1 (1/2 polarity, 0/2/4
    sentiment) is mapped onto 0..K-1 in order rather than building a head with empty
    classes, and the run says so. Integers written as text (JSON strings: "1", "2", "10")
    are those integers, in numeric order, as the same values unquoted would be. Other
    strings are sorted. Refused: negative integers (often "no label"), floats, labels
    that mix numbers and names (CSV reads a column of 0, 1, pos, neg as four strings), and
    integers beside strings (1 and "1").
    """
    seen = [v for split in raw.values() for v in split["label"]]
    odd = next((v for v in seen if isinstance(v, bool) or not isinstance(v, (int, str))), None)
    if odd is not None:
        raise UsageError(
            f"--label-column={label_column!r}: labels must be integers or strings, found "
            f"{type(odd).__name__} {_shown(odd)}"
        )
    number = next((v for v in seen if _is_number(v)), None)
    name = next((v for v in seen if not _is_number(v)), None)
    if number is not None and name is not None:
        raise UsageError(
            f"--label-column={label_column!r}: mixes numeric labels ({_shown(number)}) and "
            f"names ({_shown(name)}); label every class the same way"
        )
    values = set(seen)
    if len({type(v) for v in values}) > 1:
        raise UsageError(
            f"--label-column={label_column!r}: mixes integer and string labels; use one type"
        )
    if isinstance(number, str):  # every label is a number written as text
        value_of = _integers_from_text(values, label_column)
    else:
        value_of = {v: v for v in values}
    ordered = sorted(set(value_of.values()))
    if isinstance(ordered[0], int):
        if ordered[0] < 0:
            raise UsageError(f"--label-column={label_column!r}: negative label {ordered[0]}")
        if ordered != list(range(len(ordered))):
            logger.info(
                "labels %s are mapped onto classes 0..%d in this order (the model's id2label "
                "keeps the original values)",
                ordered,
                len(ordered) - 1,
            )
    position = {value: i for i, value in enumerate(ordered)}
    class_of = {v: position[value_of[v]] for v in values}
    names = [str(v) for v in ordered]
    if all(class_of[v] == v for v in values):  # integers 0..K-1: already the class ids
        return names, raw
    raw = raw.map(lambda ex: {"label_id": class_of[ex["label"]]}, remove_columns=["label"])
    return names, raw.rename_column("label_id", "label")


def _is_number(value: int | str) -> bool:
    return isinstance(value, int) or bool(_NUMBER.fullmatch(value.strip()))


def _shown(value: object) -> str:
    """``repr`` of a label for a one-line message, cut at 40 characters."""
    shown = repr(value)
    return shown if len(shown) <= 40 else shown[:37] + "..."


def _integers_from_text(values: set[str], label_column: str) -> dict[str, int]:
    """Each label written as a number, read as the integer it is. A decimal is refused as
    a float label would be; two spellings of one number ("1", "01") would silently merge
    two classes, so they are refused too."""
    decimal = next((v for v in sorted(values) if not _INTEGER.fullmatch(v.strip())), None)
    if decimal is not None:
        raise UsageError(
            f"--label-column={label_column!r}: labels must be integers or strings, found "
            f"{_shown(decimal)}, a number that is not an integer"
        )
    value_of = {v: int(v) for v in values}
    spelled: dict[int, str] = {}
    for text in sorted(values):
        other = spelled.setdefault(value_of[text], text)
        if other != text:
            raise UsageError(
                f"--label-column={label_column!r}: {other!r} and {text!r} are the same "
                "number; write each class one way"
            )
    return value_of


def describe_labels(label_names: list[str], shown: int = 20) -> str:
    """The classes and the label each class id stands for, for one log line:
    ``"2 classes: 0=neg, 1=pos"``; past ``shown`` classes, how many more."""
    pairs = ", ".join(f"{i}={name}" for i, name in enumerate(label_names[:shown]))
    more = len(label_names) - shown
    return f"{len(label_names)} classes: {pairs}" + (f", ... and {more} more" if more > 0 else "")


def is_sequence_classifier(model_config) -> bool:
    """Whether the model already has a classification head (its labels are then fixed)."""
    return any(
        name.endswith("ForSequenceClassification")
        for name in getattr(model_config, "architectures", None) or []
    )


def load_data_splits(data_cfg):
    """``load_classification_splits`` for a :class:`~dpkit.train.finetune_config.DataConfig`, without
    progress bars (it runs on every rank, before the recipe quiets the others)."""
    import datasets

    bars_were_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        return load_classification_splits(
            data_cfg.dataset,
            text_column=data_cfg.text_column,
            label_column=data_cfg.label_column,
            validation_fraction=data_cfg.validation_fraction,
            test_fraction=data_cfg.test_fraction,
            split_seed=data_cfg.split_seed,
        )
    finally:
        if bars_were_on:
            datasets.enable_progress_bars()


def check_classification_data(
    model_cfg, data_cfg, train_cfg, model_config, loaded=None
) -> list[str]:
    """Check the data (``loaded`` by :func:`load_data_splits`, else loaded here) before
    any process group starts.

    Beyond what :func:`load_classification_splits` refuses (a missing column, no
    examples, negative labels, too few examples to split), the data must fit the
    model: a model that already has a classification head takes exactly its own
    number of classes. Training needs one full micro-batch (the last incomplete
    batch is dropped). Returns the label names.
    """
    splits, label_names = loaded if loaded is not None else load_data_splits(data_cfg)

    classes = model_config.num_labels
    if is_sequence_classifier(model_config) and len(label_names) != classes:
        # The recipe builds the head for the data's classes; a trained head has its own.
        numbered = label_names == [str(i) for i in range(len(label_names))]
        if numbered and len(label_names) > classes:
            found = f"label {len(label_names) - 1} is outside the classes 0..{classes - 1} of"
        else:
            found = f"{len(label_names)} classes do not fit the {classes} labels of"
        raise UsageError(
            f"--dataset={data_cfg.dataset!r}: {found} --model={model_cfg.model!r} (a sequence "
            f"classifier); use data with {classes} classes or a model without a classification head"
        )

    train_examples = len(splits["train"])
    if data_cfg.max_train_samples:
        train_examples = min(train_examples, data_cfg.max_train_samples)
    if not train_cfg.eval_only and train_cfg.micro_batch_size > train_examples:
        raise UsageError(
            f"--micro-batch-size={train_cfg.micro_batch_size}: more than the {train_examples} "
            "training examples; the incomplete batch is dropped, so nothing would train"
        )
    return label_names


def _ensure_splits(raw, validation_fraction: float, test_fraction: float, seed: int):
    import datasets

    names = set(raw.keys())
    if {"train", "validation", "test"} <= names:
        return datasets.DatasetDict({k: raw[k] for k in ("train", "validation", "test")})
    base = raw["train"] if "train" in names else next(iter(raw.values()))
    if "test" in names and "train" in names:
        test, rest = raw["test"], base
        split = rest.train_test_split(test_size=validation_fraction, seed=seed)
        return datasets.DatasetDict(train=split["train"], validation=split["test"], test=test)
    held_out = validation_fraction + test_fraction
    first = base.train_test_split(test_size=held_out, seed=seed)
    second = first["test"].train_test_split(test_size=test_fraction / held_out, seed=seed)
    return datasets.DatasetDict(
        train=first["train"], validation=second["train"], test=second["test"]
    )
