"""Causal-LM fine-tune data, part two: the loaded examples tokenised with the model's
tokenizer, the loss masked, packed or padded, and collated (:mod:`dpkit.data.causal`
loads and checks them).

Needs only the tokenizer, so it runs before the model loads and before any process
group starts: a prompt with no room for its response or conversations without a chat
template cost one line and exit code 2 (:class:`~dpkit.errors.UsageError`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dpkit.data.causal import (
    FORMATS,
    IGNORE_INDEX,
    POSITION_COLUMNS,
    CausalDataConfig,
    quiet_datasets,
)
from dpkit.errors import UsageError

if TYPE_CHECKING:
    import datasets
    import torch

# ---- tokenisation -----------------------------------------------------------------------

_FORMAT_NAMES = {"text": "text", "prompt_response": "prompt/response", "messages": "conversations"}
_LOSS_ON = {
    "text": "every token",
    "prompt_response": "response only",
    "messages": "assistant turns only",
}
_TRUNCATED = {"text": "texts", "prompt_response": "responses", "messages": "conversations"}
COLUMNS = ("input_ids", "attention_mask", "labels")


@dataclass(frozen=True)
class SplitCounts:
    """One split after tokenisation: ``examples`` before packing, ``rows`` after it (the
    same without packing); ``tokens`` and ``loss_tokens`` (labels not -100) in the rows."""

    examples: int
    rows: int
    tokens: int
    loss_tokens: int
    truncated: int
    """Examples cut to ``max_seq_length`` (never with packing)."""
    dropped_tokens: int
    """Tokens of the last partial block, left out by packing."""


@dataclass(frozen=True)
class TokenCounts:
    """What :func:`tokenize_causal` made of the data, for the run's log."""

    data_format: str
    max_seq_length: int
    packing: bool
    train: SplitCounts
    validation: SplitCounts

    def describe(self) -> str:
        """One log line: examples, tokens, where the loss is, truncation or packing."""
        train, validation = self.train, self.validation
        line = (
            f"data: {_FORMAT_NAMES[self.data_format]}, {train.examples:,} train / "
            f"{validation.examples:,} validation examples, {train.tokens:,} train tokens of "
            f"which {train.loss_tokens:,} carry the loss ({_LOSS_ON[self.data_format]})"
        )
        if self.packing:
            line += (
                f"; packed into {train.rows:,} train / {validation.rows:,} validation blocks "
                f"of {self.max_seq_length} tokens ({train.dropped_tokens:,} train / "
                f"{validation.dropped_tokens:,} validation tokens of a last partial block "
                "dropped)"
            )
        elif train.truncated or validation.truncated:
            line += (
                f"; {train.truncated:,} train / {validation.truncated:,} validation "
                f"{_TRUNCATED[self.data_format]} truncated to "
                f"--max-seq-length={self.max_seq_length}"
            )
        return line


def tokenize_causal(
    splits: datasets.DatasetDict,
    tokenizer: Any,
    cfg: CausalDataConfig,
    data_format: str,
    max_seq_length: int,
) -> tuple[datasets.DatasetDict, TokenCounts]:
    """The splits of :func:`load_causal_splits` as ``input_ids``, ``attention_mask`` and
    ``labels`` (-100 where no loss), packed into blocks of ``max_seq_length`` with
    ``cfg.packing``, else one example a row cut to ``max_seq_length``; and their counts.

    Needs only the tokenizer: call it before the model loads, so that a prompt longer
    than ``max_seq_length`` or conversations without a chat template cost one line.
    """
    import datasets

    if data_format not in FORMATS:
        raise ValueError(f"data_format {data_format!r}: not one of {', '.join(FORMATS)}")
    model = tokenizer.name_or_path
    if tokenizer.eos_token_id is None:
        raise UsageError(
            f"--model={model!r}: its tokenizer has no end-of-sequence token to end examples with"
        )
    if data_format == "messages" and not tokenizer.chat_template:
        raise UsageError(
            f"--dataset={cfg.dataset!r}: conversations (a {cfg.messages_field!r} field) need a "
            f"tokenizer with a chat template; {model} has none: give "
            "--prompt-field/--response-field, or --text-field"
        )
    encoder = _Encoder(tokenizer, cfg, data_format, max_seq_length)
    tokenized, counts, crowded = {}, {}, []
    with quiet_datasets():
        for name in ("train", "validation"):
            split = splits[name]
            encoded = split.map(
                encoder,
                batched=True,
                with_indices=True,
                fn_kwargs={"split_name": name},
                remove_columns=split.column_names,
                keep_in_memory=True,
            )
            crowded += _crowded_prompts(split, encoded["crowded_prompt"], name)
            truncated = sum(encoded["truncated"])
            encoded = encoded.remove_columns(["truncated", "crowded_prompt"])
            dropped = 0
            if cfg.packing:
                total = _tokens(encoded)
                if total < max_seq_length:
                    raise UsageError(
                        f"--max-seq-length={max_seq_length}: the {name} split has {total:,} "
                        "tokens, fewer than one packed block (--packing)"
                    )
                dropped = total % max_seq_length
                encoded = encoded.map(
                    _pack,
                    batched=True,
                    batch_size=None,  # the whole split: one stream, one partial block
                    fn_kwargs={"block": max_seq_length},
                    remove_columns=encoded.column_names,
                    keep_in_memory=True,
                )
            tokenized[name] = encoded.select_columns(list(COLUMNS))
            counts[name] = SplitCounts(
                examples=len(split),
                rows=len(encoded),
                tokens=_tokens(encoded),
                loss_tokens=_loss_tokens(encoded),
                truncated=truncated,
                dropped_tokens=dropped,
            )
    if crowded:
        first = min(crowded)
        prompts = len(splits["train"]) + len(splits["validation"])
        raise UsageError(
            f"--max-seq-length={max_seq_length}: {len(crowded):,} of the {prompts:,} prompts "
            f"leave no room for their response; the first, {first[1]}, is {first[2]} tokens "
            f"(it needs at least {first[2] + 1}), the longest {max(c[2] for c in crowded)}"
        )
    if counts["train"].loss_tokens == 0:
        raise UsageError(
            f"--dataset={cfg.dataset!r}: no token of the train split carries the loss "
            f"({_LOSS_ON[data_format]}, within --max-seq-length={max_seq_length})"
        )
    token_counts = TokenCounts(
        data_format=data_format,
        max_seq_length=max_seq_length,
        packing=cfg.packing,
        train=counts["train"],
        validation=counts["validation"],
    )
    return datasets.DatasetDict(tokenized), token_counts


class _Encoder:
    """Batches of raw examples to token ids and labels (a ``Dataset.map`` function)."""

    def __init__(self, tokenizer: Any, cfg: CausalDataConfig, data_format: str, length: int):
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.data_format = data_format
        self.length = length
        self.eos = tokenizer.eos_token_id

    def __call__(self, batch: dict[str, list], indices: list[int], split_name: str) -> dict:
        places = _places(batch, indices, split_name)
        crowded = [0] * len(indices)  # prompt tokens where a prompt leaves no room, else 0
        if self.data_format == "text":
            pairs = self._texts(batch[self.cfg.text_field])
        elif self.data_format == "prompt_response":
            pairs, crowded = self._prompt_responses(batch)
        else:
            pairs = [
                self._conversation(conversation, place)
                for conversation, place in zip(batch[self.cfg.messages_field], places, strict=True)
            ]
        out: dict[str, list] = {name: [] for name in (*COLUMNS, "truncated")}
        out["crowded_prompt"] = crowded
        for ids, labels in pairs:
            # Packing keeps every token; one example a row is cut (and counted).
            cut = not self.cfg.packing and len(ids) > self.length
            if cut:
                ids, labels = ids[: self.length], labels[: self.length]
            out["input_ids"].append(ids)
            out["attention_mask"].append([1] * len(ids))
            out["labels"].append(labels)
            out["truncated"].append(cut)
        return out

    def _ids(self, texts: list[str], special: bool) -> list[list[int]]:
        # verbose=False: no "longer than the maximum sequence length" warning per rank;
        # this module truncates (or packs) itself.
        encoded = self.tokenizer(texts, add_special_tokens=special, verbose=False)
        return [list(ids) for ids in encoded["input_ids"]]

    def _texts(self, texts: list[str]) -> list[tuple[list[int], list[int]]]:
        pairs = []
        for ids in self._ids(texts, special=True):
            if not ids or ids[-1] != self.eos:  # a tokenizer set to add EOS itself has
                ids.append(self.eos)
            pairs.append((ids, list(ids)))
        return pairs

    def _prompt_responses(
        self, batch: dict[str, list]
    ) -> tuple[list[tuple[list[int], list[int]]], list[int]]:
        prompts = self._ids(batch[self.cfg.prompt_field], special=True)
        responses = self._ids(batch[self.cfg.response_field], special=False)
        pairs, crowded = [], []
        for prompt, response in zip(prompts, responses, strict=True):
            # A prompt that leaves no room for one response token (one example a row):
            # counted here, refused with the count once both splits are read.
            no_room = not self.cfg.packing and len(prompt) >= self.length
            crowded.append(len(prompt) if no_room else 0)
            response = response + [self.eos]
            pairs.append((prompt + response, [IGNORE_INDEX] * len(prompt) + response))
        return pairs, crowded

    def _conversation(self, conversation: list[dict], place: str) -> tuple[list[int], list[int]]:
        """The rendered conversation's ids, and labels on the assistant turns only.

        A turn's tokens are found by rendering prefixes: the conversation up to the turn
        with the generation prompt ends where the turn starts, the conversation through
        the turn ends where it ends (its end-of-turn marker included). Token counts of
        those prefixes are the turn's span in the whole rendering.
        """
        messages = [{"role": m["role"], "content": m["content"]} for m in conversation]
        full = self._render(messages, False, place)
        ids = self._ids([full], special=False)[0]  # templates carry their own BOS
        labels = [IGNORE_INDEX] * len(ids)
        for turn, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self._render(messages[:turn], True, place) if turn else ""
            through = self._render(messages[: turn + 1], False, place)
            if not (full.startswith(through) and through.startswith(before)):
                raise UsageError(
                    f"--dataset={self.cfg.dataset!r}: the chat template of "
                    f"{self.tokenizer.name_or_path} renders {place} "
                    "differently turn by turn, so its assistant turns cannot be found: give "
                    "--prompt-field/--response-field, or --text-field"
                )
            start, end = (len(self._ids([text], special=False)[0]) for text in (before, through))
            labels[start:end] = ids[start:end]
        return ids, labels

    def _render(self, messages: list[dict], prompt: bool, place: str) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=prompt
            )
        except Exception as err:  # jinja's raise_exception: the template's own words
            raise UsageError(
                f"--dataset={self.cfg.dataset!r}: the chat template of "
                f"{self.tokenizer.name_or_path} refuses {place} "
                f"({type(err).__name__}: {err})"
            ) from None


def _crowded_prompts(
    split: datasets.Dataset, lengths: list[int], split_name: str
) -> list[tuple[int, str, int]]:
    """(position, where, prompt tokens) of each example of ``split`` whose prompt leaves no
    room for its response (``lengths``: the encoder's count, 0 where it fits)."""
    rows = [i for i, length in enumerate(lengths) if length]
    if not rows:
        return []
    columns = [c for c in POSITION_COLUMNS.values() if c in split.column_names]
    batch = {columns[0]: split.select(rows)[columns[0]]} if columns else {}
    places = _places(batch, rows, split_name)
    numbers = batch[columns[0]] if columns else [i + 1 for i in rows]
    return [(n, p, lengths[i]) for n, p, i in zip(numbers, places, rows, strict=True)]


def _places(batch: dict[str, list], indices: list[int], split_name: str) -> list[str]:
    """Where each example of ``batch`` sits, for a refusal: its line, example or row in the
    user's source (:data:`~dpkit.data.causal.POSITION_COLUMNS`, kept by
    :func:`~dpkit.data.causal.load_causal_splits`) and its split; else its place in the split."""
    for where, column in POSITION_COLUMNS.items():
        if column in batch:
            return [f"{where} {number} ({split_name} split)" for number in batch[column]]
    return [f"{split_name} example {index + 1}" for index in indices]


def _pack(batch: dict[str, list], block: int) -> dict[str, list]:
    """The examples joined in order (each already ends in EOS or the template's end of turn)
    and cut into blocks of ``block`` tokens; the last partial block is dropped."""
    ids = [token for row in batch["input_ids"] for token in row]
    labels = [label for row in batch["labels"] for label in row]
    starts = range(0, len(ids) - block + 1, block)
    return {
        "input_ids": [ids[i : i + block] for i in starts],
        "attention_mask": [[1] * block for _ in starts],
        "labels": [labels[i : i + block] for i in starts],
    }


def _tokens(split: datasets.Dataset) -> int:
    import pyarrow.compute as pc

    lengths = pc.list_value_length(split.with_format("arrow")[:]["input_ids"])
    return int(pc.sum(lengths).as_py() or 0)


def _loss_tokens(split: datasets.Dataset) -> int:
    import pyarrow.compute as pc

    labels = pc.list_flatten(split.with_format("arrow")[:]["labels"])
    return int(pc.sum(pc.not_equal(labels, IGNORE_INDEX)).as_py() or 0)


# ---- batches ----------------------------------------------------------------------------


class CausalCollator:
    """``DataLoader(collate_fn=...)`` for :func:`tokenize_causal`'s rows: right-pads
    ``input_ids`` with ``pad_token_id``, ``attention_mask`` with 0 and ``labels`` with -100
    to the batch's longest row, rounded up to ``pad_to_multiple_of`` (tensor cores like
    multiples of 8) but never past ``max_length`` (a model with learned positions, GPT-2's,
    has none beyond its limit); long tensors."""

    def __init__(
        self,
        pad_token_id: int,
        pad_to_multiple_of: int | None = 8,
        max_length: int | None = None,
    ):
        if not isinstance(pad_token_id, int):
            raise TypeError(f"pad_token_id must be a token id, not {pad_token_id!r}")
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.max_length = max_length

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        import torch

        longest = max(len(feature["input_ids"]) for feature in features)
        if self.pad_to_multiple_of:
            rounded = math.ceil(longest / self.pad_to_multiple_of) * self.pad_to_multiple_of
            longest = max(longest, min(rounded, self.max_length or rounded))
        pads = {"input_ids": self.pad_token_id, "attention_mask": 0, "labels": IGNORE_INDEX}
        batch = {}
        for name, pad in pads.items():
            rows = [_as_list(feature[name]) for feature in features]
            padded = [row + [pad] * (longest - len(row)) for row in rows]
            batch[name] = torch.tensor(padded, dtype=torch.long)
        return batch


def _as_list(values: Any) -> list[int]:
    return values.tolist() if hasattr(values, "tolist") else list(values)
