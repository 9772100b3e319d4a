"""Causal-LM fine-tune data: loading and refusing the user's data, masks counted by hand,
packing, conversations through a chat template, and the collator.

The tokenizer is the tiny Llama's from tests/local_models.py (byte-level BPE, bos <s>,
eos </s>, no pad token, no chat template; it adds no BOS by itself). Expected ids come
from the tokenizer's own ``encode``, never from the code under test.
"""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import pytest

from dpkit.data.causal import CausalDataConfig, load_causal_splits
from dpkit.data.causal_tokens import CausalCollator, tokenize_causal
from dpkit.data.embedded import rotten_tomatoes_csv
from dpkit.errors import UsageError
from tests import local_models

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> Path:
    return local_models.build("llama", tmp_path_factory.mktemp("causal") / "llama")


@pytest.fixture(scope="module")
def tokenizer(llama_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama_folder)


def splits_of(train: list[dict], validation: list[dict] | None = None):
    import datasets

    return datasets.DatasetDict(
        train=datasets.Dataset.from_list(train),
        validation=datasets.Dataset.from_list(validation or train),
    )


def write_jsonl(path: Path, lines: list[dict | None]) -> Path:
    """One JSON object a line; None writes a blank line."""
    path.write_text("\n".join("" if line is None else json.dumps(line) for line in lines) + "\n")
    return path


PAIRS = CausalDataConfig(prompt_field="prompt", response_field="response")


# ---- masks and packing, counted by hand -------------------------------------------------


def test_prompt_response_masks_the_prompt(tokenizer):
    prompt_ids = tokenizer.encode("Hi")  # with the special tokens the tokenizer adds
    response_ids = tokenizer.encode("there", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    data = splits_of([{"prompt": "Hi", "response": "there"}])
    tokenized, counts = tokenize_causal(data, tokenizer, PAIRS, "prompt_response", 64)
    row = tokenized["train"][0]
    assert set(tokenized["train"].column_names) == {"input_ids", "attention_mask", "labels"}
    assert row["input_ids"] == prompt_ids + response_ids + [eos]
    assert row["labels"] == [-100] * len(prompt_ids) + response_ids + [eos]
    assert row["attention_mask"] == [1] * (len(prompt_ids) + len(response_ids) + 1)
    # "Hi" is 2 tokens, "there" 3, plus EOS: 6 tokens, 4 of them carry the loss.
    assert (len(prompt_ids), len(response_ids)) == (2, 3)
    assert (counts.train.tokens, counts.train.loss_tokens, counts.train.truncated) == (6, 4, 0)
    assert counts.describe() == (
        "data: prompt/response, 1 train / 1 validation examples, 6 train tokens of which 4 "
        "carry the loss (response only)"
    )


def test_a_response_that_does_not_fit_is_cut_and_counted(tokenizer):
    prompt_ids = tokenizer.encode("What is it?")
    response_ids = tokenizer.encode("Fine, thanks", add_special_tokens=False)
    assert len(prompt_ids) == 6  # so max_seq_length 7 leaves room for one response token
    data = splits_of([{"prompt": "What is it?", "response": "Fine, thanks"}])
    tokenized, counts = tokenize_causal(data, tokenizer, PAIRS, "prompt_response", 7)
    row = tokenized["train"][0]
    assert row["input_ids"] == prompt_ids + response_ids[:1]
    assert row["labels"] == [-100] * 6 + response_ids[:1]
    assert (counts.train.truncated, counts.validation.truncated) == (1, 1)
    assert counts.describe().endswith(
        "; 1 train / 1 validation responses truncated to --max-seq-length=7"
    )


def test_text_ends_in_eos_and_carries_the_loss_everywhere(tokenizer):
    eos = tokenizer.eos_token_id
    data = splits_of([{"text": "a good film"}, {"text": "the plot is thin"}])
    tokenized, counts = tokenize_causal(data, tokenizer, CausalDataConfig(), "text", 5)
    first, second = tokenized["train"]
    assert first["input_ids"] == tokenizer.encode("a good film") + [eos]  # 3 + 1 tokens
    assert first["labels"] == first["input_ids"]
    # "the plot is thin" is 6 tokens + EOS = 7: cut to 5, EOS gone with the cut.
    assert second["input_ids"] == tokenizer.encode("the plot is thin")[:5]
    assert (counts.train.tokens, counts.train.loss_tokens, counts.train.truncated) == (9, 9, 1)


def test_packing_joins_examples_and_drops_the_last_partial_block(tokenizer):
    eos = tokenizer.eos_token_id
    texts = ["a good film", "the plot is thin", "bad"]
    # 3 + 6 + 2 tokens, each with an EOS: 4 + 7 + 3 = 14 tokens; blocks of 5: 2 blocks,
    # 14 - 2 * 5 = 4 tokens dropped.
    assert [len(tokenizer.encode(t)) for t in texts] == [3, 6, 2]
    stream = [token for t in texts for token in tokenizer.encode(t) + [eos]]
    data = splits_of([{"text": t} for t in texts])
    cfg = CausalDataConfig(packing=True)
    tokenized, counts = tokenize_causal(data, tokenizer, cfg, "text", 5)
    assert tokenized["train"]["input_ids"] == [stream[0:5], stream[5:10]]
    assert tokenized["train"]["labels"] == [stream[0:5], stream[5:10]]
    assert tokenized["train"]["attention_mask"] == [[1] * 5] * 2
    assert counts.train == counts.validation
    assert (counts.train.examples, counts.train.rows) == (3, 2)
    assert (counts.train.tokens, counts.train.dropped_tokens) == (10, 4)
    assert "packed into 2 train / 2 validation blocks of 5 tokens" in counts.describe()


def test_packing_keeps_prompt_masks_inside_blocks(tokenizer):
    eos = tokenizer.eos_token_id
    there = tokenizer.encode("there", add_special_tokens=False)  # 3 ids
    # Each example: "Hi" (2 prompt tokens, masked) + "there" (3) + EOS = 6 tokens; two
    # examples are 12 tokens: 3 blocks of 4, nothing dropped. A long prompt is not refused
    # with packing: nothing is cut.
    data = splits_of([{"prompt": "Hi", "response": "there"}] * 2)
    cfg = CausalDataConfig(prompt_field="prompt", response_field="response", packing=True)
    tokenized, counts = tokenize_causal(data, tokenizer, cfg, "prompt_response", 4)
    labels = [-100, -100, *there, eos] * 2
    assert tokenized["train"]["labels"] == [labels[0:4], labels[4:8], labels[8:12]]
    assert (counts.train.rows, counts.train.dropped_tokens, counts.train.loss_tokens) == (3, 0, 8)


def test_conversations_carry_the_loss_on_assistant_turns_only(llama_folder):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(llama_folder)  # not the shared one: changed here
    tokenizer.chat_template = CHAT_TEMPLATE
    conversation = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "What is it?"},
        {"role": "assistant", "content": "Fine, thanks"},
    ]
    data = splits_of([{"messages": conversation}])
    tokenized, counts = tokenize_causal(data, tokenizer, CausalDataConfig(), "messages", 128)
    row = tokenized["train"][0]
    rendered = (
        "<|user|>Hi</s><|assistant|>Hello</s><|user|>What is it?</s><|assistant|>Fine, thanks</s>"
    )
    assert row["input_ids"] == tokenizer.encode(rendered, add_special_tokens=False)
    runs, run = [], []  # the stretches of tokens that carry the loss
    for token, label in zip(row["input_ids"], row["labels"], strict=True):
        if label == -100:
            runs, run = (runs + [run] if run else runs), []
        else:
            assert label == token
            run.append(token)
    runs += [run] if run else []
    assert [tokenizer.decode(r) for r in runs] == ["Hello</s>", "Fine, thanks</s>"]
    # "Hello" is 3 tokens, "Fine, thanks" 6, each with its </s>: 4 + 7 = 11.
    assert counts.train.loss_tokens == 11


# ---- loading ----------------------------------------------------------------------------


def test_builtin_rotten_tomatoes_text_loads_offline_and_splits_the_same_way():
    with open(rotten_tomatoes_csv()) as f:
        examples = sum(1 for _ in csv.DictReader(f))
    splits, data_format = load_causal_splits(CausalDataConfig())
    assert data_format == "text"
    assert splits["train"].column_names == ["text", "_row"]  # and where each came from
    # datasets holds out ceil(0.1 * N): 12,808 snippets -> 1,281 validation, 11,527 train.
    held_out = math.ceil(0.1 * examples)
    assert (len(splits["train"]), len(splits["validation"])) == (examples - held_out, held_out)
    cut, _ = load_causal_splits(CausalDataConfig(max_train_samples=10, max_eval_samples=3))
    assert cut["train"]["text"] == splits["train"]["text"][:10]  # the same split, then cut
    assert cut["validation"]["text"] == splits["validation"]["text"][:3]


def test_builtin_shakespeare_is_cut_into_paragraphs():
    splits, data_format = load_causal_splits(CausalDataConfig(dataset="shakespeare"))
    total = len(splits["train"]) + len(splits["validation"])
    assert data_format == "text" and total > 10_000
    assert len(splits["validation"]) == math.ceil(0.1 * total)
    assert all(text.strip() for text in splits["validation"]["text"])  # no blank paragraphs


def test_txt_files_are_cut_by_line_or_paragraph(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("a\nb\n\nc\n\n\n\nd\n")
    for sample_by, expected in (("paragraph", 3), ("line", 4), ("document", None)):
        cfg = CausalDataConfig(dataset=str(path), text_sample_by=sample_by)
        if expected is None:  # one document cannot be split in two
            with pytest.raises(UsageError, match="leaves the train split .* empty"):
                load_causal_splits(cfg)
            continue
        splits, data_format = load_causal_splits(cfg)
        texts = [*splits["train"]["text"], *splits["validation"]["text"]]
        assert data_format == "text" and len(texts) == expected
        # ceil(0.1 * 3) = ceil(0.1 * 4) = 1 held out
        assert len(splits["validation"]) == 1


def test_formats_and_a_folders_own_validation_split(tmp_path):
    pair = {"prompt": "Hi", "response": "there", "messages": [{"role": "user", "content": "x"}]}
    folder = tmp_path / "data"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [pair] * 5)
    write_jsonl(folder / "validation.jsonl", [pair] * 2)
    splits, data_format = load_causal_splits(CausalDataConfig(dataset=str(folder)))
    assert data_format == "messages"  # the field exists and no prompt/response is asked for
    assert (len(splits["train"]), len(splits["validation"])) == (5, 2)  # nothing held out
    cfg = CausalDataConfig(dataset=str(folder), prompt_field="prompt", response_field="response")
    splits, data_format = load_causal_splits(cfg)
    assert data_format == "prompt_response"
    assert splits["train"].column_names == ["prompt", "response", "_row"]


def test_jsonl_pairs_load_and_split_the_same_way_every_run(tmp_path):
    path = write_jsonl(
        tmp_path / "pairs.jsonl",
        [{"prompt": f"q{i}", "response": f"a{i}", "extra": i if i % 2 else "x"} for i in range(20)],
    )
    cfg = CausalDataConfig(dataset=str(path), prompt_field="prompt", response_field="response")
    first, data_format = load_causal_splits(cfg)
    again, _ = load_causal_splits(cfg)
    assert data_format == "prompt_response"
    assert (len(first["train"]), len(first["validation"])) == (18, 2)  # ceil(0.1 * 20) = 2
    assert first["validation"]["prompt"] == again["validation"]["prompt"]


# ---- refusals: one line naming the flag and value ---------------------------------------


def test_config_refusals(tmp_path):
    with pytest.raises(UsageError, match=r"--dataset='.*missing\.jsonl': no such file"):
        CausalDataConfig(dataset=str(tmp_path / "missing.jsonl"))
    with pytest.raises(UsageError, match="--prompt-field='q': give --prompt-field and"):
        CausalDataConfig(prompt_field="q")
    with pytest.raises(UsageError, match="--response-field='a': give --prompt-field and"):
        CausalDataConfig(response_field="a")
    with pytest.raises(UsageError, match="--text-sample-by='sentence': not one of"):
        CausalDataConfig(text_sample_by="sentence")
    with pytest.raises(UsageError, match=r"--validation-fraction=0\.5: must be in \(0, 0\.5\)"):
        CausalDataConfig(validation_fraction=0.5)
    with pytest.raises(UsageError, match="--max-train-samples=0: must be > 0"):
        CausalDataConfig(max_train_samples=0)


def test_jsonl_refusals_name_the_line(tmp_path):
    # Line 2 is blank: the line number counts lines of the file, not examples.
    path = write_jsonl(
        tmp_path / "pairs.jsonl",
        [{"prompt": "a", "response": "b"}, None, {"prompt": "c"}, {"prompt": "d", "response": 1}],
    )
    cfg = CausalDataConfig(dataset=str(path), prompt_field="prompt", response_field="response")
    with pytest.raises(UsageError) as refused:
        load_causal_splits(cfg)
    assert str(refused.value) == f"--dataset={str(path)!r}: line 3 has no 'response' field"
    write_jsonl(path, [{"prompt": "a", "response": "b"}, {"prompt": "d", "response": 1}])
    with pytest.raises(UsageError, match="line 2: 'response' is int 1, not text"):
        load_causal_splits(cfg)
    write_jsonl(path, [{"messages": [{"role": "user", "content": "x"}]}, {"messages": "hi"}])
    with pytest.raises(UsageError, match="line 2: 'messages' is not a list of role/content"):
        load_causal_splits(CausalDataConfig(dataset=str(path)))
    write_jsonl(path, [{"messages": [{"role": "user"}]}])
    with pytest.raises(UsageError, match=r"line 1: 'messages' holds \{'role': 'user'\}, not a"):
        load_causal_splits(CausalDataConfig(dataset=str(path)))
    path.write_text('{"text": "a"}\n{"text": \n')
    with pytest.raises(UsageError, match="line 2 is not JSON"):
        load_causal_splits(CausalDataConfig(dataset=str(path)))
    path.write_text("")
    with pytest.raises(UsageError, match="the file is empty"):
        load_causal_splits(CausalDataConfig(dataset=str(path)))


def test_csv_refusals_name_the_field_or_row(tmp_path):
    path = tmp_path / "texts.csv"
    path.write_text("body\nfirst\nsecond\n")
    with pytest.raises(UsageError) as refused:
        load_causal_splits(CausalDataConfig(dataset=str(path)))
    where = repr(str(path))
    assert str(refused.value) == f"--text-field='text': not a field of {where} (fields: body)"
    path.write_text('text\nfirst\n""\nthird\n')  # an empty cell reads as None
    with pytest.raises(UsageError, match="row 2 has no 'text' field"):
        load_causal_splits(CausalDataConfig(dataset=str(path)))


def test_too_few_examples_to_hold_out_a_validation_split(tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("only one paragraph\n")
    with pytest.raises(UsageError) as refused:
        load_causal_splits(CausalDataConfig(dataset=str(path)))
    # ceil(0.1 * 1) = 1 held out leaves 0 to train on.
    assert str(refused.value) == (
        f"--validation-fraction=0.1: leaves the train split of --dataset={str(path)!r} "
        "empty (1 example(s))"
    )


def test_a_prompt_with_no_room_for_its_response_is_refused(tokenizer):
    assert len(tokenizer.encode("What is it?")) == 6
    data = splits_of(
        [{"prompt": "Hi", "response": "there"}, {"prompt": "What is it?", "response": "x"}]
    )
    with pytest.raises(UsageError) as refused:
        tokenize_causal(data, tokenizer, PAIRS, "prompt_response", 6)
    # The same two pairs in train and validation: 2 of the 4 prompts are 6 tokens.
    assert str(refused.value) == (
        "--max-seq-length=6: 2 of the 4 prompts leave no room for their response; the "
        "first, train example 2, is 6 tokens (it needs at least 7), the longest 6"
    )


def test_prompts_too_long_are_counted_and_the_first_named_by_its_line(tokenizer, tmp_path):
    # 10 pairs; the prompts of lines 7 and 9 (after a blank line 4) are 6 and 9 tokens.
    assert [len(tokenizer.encode(p)) for p in ("What is it?", "What is it? What")] == [6, 9]
    pair = {"prompt": "Hi", "response": "there"}
    lines = [pair] * 3 + [None] + [pair] * 2
    lines += [{"prompt": "What is it?", "response": "x"}, pair]
    lines += [{"prompt": "What is it? What", "response": "x"}, pair, pair]
    cfg = CausalDataConfig(
        dataset=str(write_jsonl(tmp_path / "pairs.jsonl", lines)),
        prompt_field="prompt",
        response_field="response",
    )
    splits, data_format = load_causal_splits(cfg)
    with pytest.raises(UsageError) as refused:
        tokenize_causal(splits, tokenizer, cfg, data_format, 6)
    # Whichever split the seeded hold-out put it in, the line is the file's.
    assert re.fullmatch(
        r"--max-seq-length=6: 2 of the 10 prompts leave no room for their response; the "
        r"first, line 7 \((train|validation) split\), is 6 tokens \(it needs at least 7\), "
        r"the longest 9",
        str(refused.value),
    ), str(refused.value)


def test_conversations_need_a_chat_template(tokenizer, llama_folder):
    assert tokenizer.chat_template is None
    data = splits_of([{"messages": [{"role": "user", "content": "Hi"}]}])
    with pytest.raises(UsageError) as refused:
        tokenize_causal(data, tokenizer, CausalDataConfig(dataset="someone/chats"), "messages", 64)
    assert str(refused.value) == (
        "--dataset='someone/chats': conversations (a 'messages' field) need a tokenizer with a "
        f"chat template; {llama_folder} has none: give --prompt-field/--response-field, or "
        "--text-field"
    )


def test_packing_refuses_a_split_smaller_than_one_block(tokenizer):
    data = splits_of([{"text": "a good film"}])  # 3 tokens + EOS
    with pytest.raises(UsageError) as refused:
        tokenize_causal(data, tokenizer, CausalDataConfig(packing=True), "text", 64)
    assert str(refused.value) == (
        "--max-seq-length=64: the train split has 4 tokens, fewer than one packed block (--packing)"
    )


# ---- batches ----------------------------------------------------------------------------


def test_collator_right_pads_to_a_multiple_of_8():
    import torch

    features = [
        {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": [-100, 6, 7]},
        {"input_ids": [1, 2, 3, 4, 5], "attention_mask": [1] * 5, "labels": [1, 2, 3, 4, 5]},
    ]
    batch = CausalCollator(pad_token_id=0)(features)
    assert batch["input_ids"].tolist() == [[5, 6, 7] + [0] * 5, [1, 2, 3, 4, 5] + [0] * 3]
    assert batch["attention_mask"].tolist() == [[1] * 3 + [0] * 5, [1] * 5 + [0] * 3]
    assert batch["labels"].tolist() == [[-100, 6, 7] + [-100] * 5, [1, 2, 3, 4, 5] + [-100] * 3]
    assert all(t.dtype == torch.long for t in batch.values())
    unrounded = CausalCollator(pad_token_id=0, pad_to_multiple_of=None)(features)
    assert unrounded["input_ids"].shape == (2, 5)
