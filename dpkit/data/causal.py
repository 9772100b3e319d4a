"""Causal-LM fine-tune data: the user's text, prompt/response pairs or conversations,
loaded and checked (:mod:`dpkit.data.causal_tokens` tokenises, masks, packs and collates).

Everything here runs before any process group starts and before the model loads (the
tokenizer is all it needs), so bad data costs one line and exit code 2
(:class:`~dpkit.errors.UsageError`), never a half-started job. Three formats:

* ``text``: whole texts, the loss on every token, EOS appended so the model learns to stop;
* ``prompt_response``: the loss on the response (and its EOS) only;
* ``messages``: conversations rendered with the tokenizer's chat template, the loss on
  the assistant turns only (with the end-of-turn marker the template puts after them).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpkit.data.embedded import rotten_tomatoes_csv, shakespeare_text
from dpkit.errors import UsageError, check_field
from dpkit.train.config import check_choice

if TYPE_CHECKING:
    import datasets

ROTTEN_TOMATOES_TEXT = "rotten-tomatoes-text"
SHAKESPEARE = "shakespeare"
TEXT_SAMPLE_BY_CHOICES = ("line", "paragraph", "document")
FORMATS = ("text", "prompt_response", "messages")
FILE_SUFFIXES = (".txt", ".json", ".jsonl", ".csv")
IGNORE_INDEX = -100  # the label torch's cross-entropy (and every HF model's loss) skips
# Where each example sits in the user's source, kept beside its fields through the split so
# that a refusal after it (a prompt too long) names the line the user can open: a JSON Lines
# file's line, a JSON array's example, a CSV, text or Hub split's row (numbered from 1).
POSITION_COLUMNS = {"line": "_line", "example": "_example", "row": "_row"}


@dataclass
class CausalDataConfig:
    """The data flags of ``recipes/finetune_lm.py``."""

    dataset: str = field(
        default=ROTTEN_TOMATOES_TEXT,
        metadata={
            "help": f"{ROTTEN_TOMATOES_TEXT!r} (the embedded review snippets), {SHAKESPEARE!r} "
            "(the embedded plays), a .txt, .json, .jsonl or .csv file, or a Hub dataset name."
        },
    )
    """Where the examples come from; the two built-ins are read offline."""
    text_field: str = field(
        default="text", metadata={"help": "Field with whole texts (loss on every token)."}
    )
    """The field (column) of whole texts, used when neither prompt/response nor messages apply."""
    prompt_field: str | None = field(
        default=None,
        metadata={"help": "Field with prompts; with --response-field: loss on responses only."},
    )
    """Prompts of prompt/response pairs; their tokens carry no loss."""
    response_field: str | None = field(
        default=None, metadata={"help": "Field with the responses to --prompt-field."}
    )
    """Responses of prompt/response pairs; their tokens (and an EOS) carry the loss."""
    messages_field: str = field(
        default="messages",
        metadata={
            "help": "Field with conversations (lists of role/content dicts), rendered with "
            "the tokenizer's chat template; loss on assistant turns only."
        },
    )
    """Conversations, used when the source has this field and no prompt/response is given."""
    text_sample_by: str = field(
        default="paragraph",
        metadata={
            "help": ".txt files: one example per line, paragraph (blank-line separated) or "
            "document.",
            "choices": TEXT_SAMPLE_BY_CHOICES,
        },
    )
    """How a .txt file (and the Shakespeare built-in) is cut into examples."""
    packing: bool = field(
        default=False,
        metadata={
            "help": "Join the examples (EOS between) and cut them into blocks of exactly "
            "--max-seq-length tokens, instead of one padded example per row."
        },
    )
    """Packed blocks waste no compute on padding; the last partial block is dropped."""
    validation_fraction: float = field(
        default=0.1,
        metadata={"help": "Share held out for validation when the source has no such split."},
    )
    """Share of the examples held out for validation when the source has no validation split."""
    split_seed: int = field(default=42, metadata={"help": "Seed of the train/validation split."})
    """Seed of the split: fixed apart from the training seed so every run sees the same split."""
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Keep only the first N training examples."}
    )
    """Truncate the training split (quick runs and tests)."""
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Keep only the first N validation examples."}
    )
    """Truncate the validation split."""

    def __post_init__(self) -> None:
        check_field(
            0.0 < self.validation_fraction < 0.5,
            "validation_fraction",
            self.validation_fraction,
            "must be in (0, 0.5)",
        )
        for name in ("max_train_samples", "max_eval_samples"):
            value = getattr(self, name)
            check_field(value is None or value > 0, name, value, "must be > 0")
        check_choice(self, "text_sample_by", TEXT_SAMPLE_BY_CHOICES)
        check_field(
            (self.prompt_field is None) == (self.response_field is None),
            "prompt_field" if self.response_field is None else "response_field",
            self.prompt_field if self.response_field is None else self.response_field,
            "give --prompt-field and --response-field together",
        )
        if self.dataset.endswith(FILE_SUFFIXES) and not Path(self.dataset).is_file():
            raise UsageError(f"--dataset={self.dataset!r}: no such file")

    def fields(self, data_format: str) -> dict[str, str]:
        """The source fields ``data_format`` reads, keyed by their flag's name."""
        if data_format == "prompt_response":
            return {"prompt_field": self.prompt_field, "response_field": self.response_field}
        if data_format == "messages":
            return {"messages_field": self.messages_field}
        return {"text_field": self.text_field}


# ---- loading and checking ---------------------------------------------------------------


def load_causal_splits(cfg: CausalDataConfig) -> tuple[datasets.DatasetDict, str]:
    """The raw ``train`` and ``validation`` splits of ``cfg.dataset`` and its format
    (``"text"``, ``"prompt_response"`` or ``"messages"``), every example checked.

    A source with its own validation split keeps it; otherwise ``validation_fraction``
    is held out with ``split_seed`` (the same split on every run, strategy and world
    size). ``max_train_samples`` / ``max_eval_samples`` cut the splits after that. Each
    split holds the format's fields and where each example sits in the source (one of
    :data:`POSITION_COLUMNS`), for refusals after the split to name it.
    """
    import datasets

    with quiet_datasets():
        raw, where = _load_raw(cfg)
        position = POSITION_COLUMNS[where]
        for name, split in raw.items():
            if position not in split.column_names:
                raw[name] = split.add_column(position, list(range(1, len(split) + 1)))
        # The source's own train split (or its only one) and validation split, if any.
        train = raw["train"] if "train" in raw else next(iter(raw.values()))
        source = {"train": train, "validation": raw.get("validation")}
        data_format = _data_format(cfg, set(train.column_names))
        fields = cfg.fields(data_format)
        for split_name, split in source.items():
            if split is not None:
                _check_fields(cfg, split, split_name, fields, where)
        if source["validation"] is None:
            source = _hold_out(cfg, train)
        splits = datasets.DatasetDict(source).select_columns([*fields.values(), position])
        limits = {"train": cfg.max_train_samples, "validation": cfg.max_eval_samples}
        for name, limit in limits.items():
            if limit:
                splits[name] = splits[name].select(range(min(limit, len(splits[name]))))
            if len(splits[name]) == 0:
                raise UsageError(f"--dataset={cfg.dataset!r}: the {name} split is empty")
    return splits, data_format


def _load_raw(cfg: CausalDataConfig) -> tuple[datasets.DatasetDict, str]:
    """The source's splits, and what one of its examples is called in messages (a JSON
    Lines file is checked line by line while it is read; other sources by row later)."""
    import datasets

    dataset = cfg.dataset
    if dataset == ROTTEN_TOMATOES_TEXT:
        raw = datasets.load_dataset("csv", data_files=str(rotten_tomatoes_csv()))
        return raw.select_columns(["text"]), "row"
    if dataset == SHAKESPEARE or dataset.endswith(".txt"):
        path = str(shakespeare_text()) if dataset == SHAKESPEARE else dataset
        _refuse_empty_file(dataset, path)
        raw = datasets.load_dataset("text", data_files=path, sample_by=cfg.text_sample_by)
        raw = raw.filter(lambda ex: bool(ex["text"].strip()), keep_in_memory=True)
        if len(raw["train"]) == 0:
            raise UsageError(f"--dataset={dataset!r}: holds only blank lines")
        return raw, "row"
    if dataset.endswith((".json", ".jsonl")):
        _refuse_empty_file(dataset, dataset)
        records, numbers, where = _read_json_records(dataset)
        fields = cfg.fields(_data_format(cfg, {key for record in records for key in record}))
        for record, number in zip(records, numbers, strict=True):
            for flag, name in fields.items():
                problem = _value_problem(record.get(name), name, flag)
                if problem:
                    raise UsageError(f"--dataset={dataset!r}: {where} {number}{problem}")
        kept = [
            {
                **{name: _plain(record[name], flag) for flag, name in fields.items()},
                POSITION_COLUMNS[where]: number,
            }
            for record, number in zip(records, numbers, strict=True)
        ]
        return datasets.DatasetDict(train=datasets.Dataset.from_list(kept)), where
    if dataset.endswith(".csv"):
        _refuse_empty_file(dataset, dataset)
        try:
            return datasets.load_dataset("csv", data_files=dataset), "row"
        except Exception as err:  # datasets' parsers raise many types; the message says why
            if "corresponds to no data" in str(err):  # a header and no rows
                raise UsageError(f"--dataset={dataset!r}: has no examples") from None
            raise UsageError(
                f"--dataset={dataset!r}: cannot read it as csv ({type(err).__name__}: {err})"
            ) from None
    try:
        raw = datasets.load_dataset(dataset)
    except Exception as err:  # the Hub or a local loader; its message says why
        if "corresponds to no data" in str(err):
            raise UsageError(f"--dataset={dataset!r}: has no examples") from None
        raise UsageError(
            f"--dataset={dataset!r}: cannot load ({type(err).__name__}: {err})"
        ) from None
    return raw, "row"


def _refuse_empty_file(dataset: str, path: str) -> None:
    if Path(path).stat().st_size == 0:
        raise UsageError(f"--dataset={dataset!r}: the file is empty")


def _read_json_records(dataset: str) -> tuple[list[dict], list[int], str]:
    """The objects of a JSON array or of JSON Lines (a .json file that is not one JSON
    value is read as JSON Lines, as datasets does), each one's number as messages name it
    (its line, or its position in the array) and what that number counts."""
    text = Path(dataset).read_text(encoding="utf-8")
    value = None
    if dataset.endswith(".json"):
        with suppress(json.JSONDecodeError):  # else JSON Lines under a .json name
            value = json.loads(text)
    if value is not None:
        if not isinstance(value, list):
            raise UsageError(
                f"--dataset={dataset!r}: holds a JSON {type(value).__name__}; give a list "
                "of examples (objects) or JSON Lines (one object a line)"
            )
        records, numbers, where = value, list(range(1, len(value) + 1)), "example"
    else:
        records, numbers, where = [], [], "line"
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise UsageError(
                    f"--dataset={dataset!r}: line {number} is not JSON ({err.msg})"
                ) from None
            numbers.append(number)
    if not records:
        raise UsageError(f"--dataset={dataset!r}: has no examples")
    for record, number in zip(records, numbers, strict=True):
        if not isinstance(record, dict):
            raise UsageError(
                f"--dataset={dataset!r}: {where} {number} is a JSON {type(record).__name__}, "
                "not an object of fields"
            )
    return records, numbers, where


def _data_format(cfg: CausalDataConfig, columns: set[str]) -> str:
    if cfg.prompt_field is not None:
        return "prompt_response"
    if cfg.messages_field in columns:
        return "messages"
    return "text"


def _check_fields(
    cfg: CausalDataConfig, split: datasets.Dataset, name: str, fields: dict, where: str
) -> None:
    """The split has every field the format reads, and every value is of the right type
    (a missing JSON key or an empty CSV cell reads as None); the first bad row is named."""
    for flag, field_name in fields.items():
        if field_name not in split.column_names:
            names = [c for c in split.column_names if c not in POSITION_COLUMNS.values()]
            raise UsageError(
                f"--{flag.replace('_', '-')}={field_name!r}: not a field of {cfg.dataset!r} "
                f"(fields: {', '.join(names)})"
            )
        if where != "row":  # JSON records were checked while they were read
            continue
        for index, value in enumerate(split[field_name]):
            problem = _value_problem(value, field_name, flag)
            if problem:
                prefix = "" if name == "train" else f"{name} split "
                raise UsageError(f"--dataset={cfg.dataset!r}: {prefix}row {index + 1}{problem}")


def _value_problem(value: Any, name: str, flag: str) -> str | None:
    """What is wrong with one example's ``name`` value, to follow "line 3"; None if fine."""
    if value is None:
        return f" has no {name!r} field"
    if flag == "messages_field":
        if not isinstance(value, list) or not value:
            return f": {name!r} is not a list of role/content messages ({_shown(value)})"
        for turn in value:
            if not (
                isinstance(turn, dict)
                and isinstance(turn.get("role"), str)
                and isinstance(turn.get("content"), str)
            ):
                return (
                    f": {name!r} holds {_shown(turn)}, not a {{'role': ..., 'content': ...}} "
                    "message with text values"
                )
        return None
    if not isinstance(value, str):
        return f": {name!r} is {type(value).__name__} {_shown(value)}, not text"
    return None


def _plain(value: Any, flag: str) -> Any:
    """A checked value as the dataset keeps it: messages reduced to role and content (a
    message's other keys would reach the chat template as None)."""
    if flag == "messages_field":
        return [{"role": turn["role"], "content": turn["content"]} for turn in value]
    return value


def _shown(value: object) -> str:
    shown = repr(value)
    return shown if len(shown) <= 40 else shown[:37] + "..."


def _hold_out(cfg: CausalDataConfig, train: datasets.Dataset) -> dict[str, datasets.Dataset]:
    """``validation_fraction`` of ``train`` held out with ``split_seed``: the same split on
    every run, strategy and world size."""
    held_out = math.ceil(cfg.validation_fraction * len(train))  # as datasets rounds it
    if held_out >= len(train):
        raise UsageError(
            f"--validation-fraction={cfg.validation_fraction}: leaves the train split of "
            f"--dataset={cfg.dataset!r} empty ({len(train)} example(s))"
        )
    split = train.train_test_split(test_size=cfg.validation_fraction, seed=cfg.split_seed)
    return {"train": split["train"], "validation": split["test"]}


@contextmanager
def quiet_datasets() -> Iterator[None]:
    """No progress bars: this runs on every rank, before the recipe quiets the others."""
    import datasets

    bars_were_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if bars_were_on:
            datasets.enable_progress_bars()
