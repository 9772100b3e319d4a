"""Small checkpoints of other architectures, built here with random weights (no download).

What users bring: a decoder-only model whose tokenizer and config have no padding token
(GPT-2 and Llama checkpoints ship so), and an encoder with one (RoBERTa). Each folder is
what ``save_pretrained`` writes (config, weights, tokenizer files), with a byte-level BPE
tokenizer trained on the embedded Rotten Tomatoes text.
"""

from __future__ import annotations

import csv
from pathlib import Path

VOCAB = 512
SPECIAL = {
    "gpt2": {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"},
    "llama": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    "roberta": {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "cls_token": "<s>",
        "sep_token": "</s>",
        "mask_token": "<mask>",
    },
}


def _texts(limit: int = 2000) -> list[str]:
    from dpkit.data.embedded import rotten_tomatoes_csv

    with open(rotten_tomatoes_csv()) as f:
        return [row["text"] for _, row in zip(range(limit), csv.DictReader(f), strict=False)]


def _tokenizer(kind: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = list(dict.fromkeys(SPECIAL[kind].values()))
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(
        _texts(), trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=special)
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, **SPECIAL[kind])


def build(kind: str, folder: Path, odd_width: bool = False) -> Path:
    """A tiny ``kind`` (gpt2, llama, roberta) checkpoint saved in ``folder``.

    ``odd_width`` (roberta): hidden size 63, so that the classifier built on it has an
    odd parameter count (DeepSpeed asserts its bucket sizes are even)."""
    import torch
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        RobertaConfig,
        RobertaModel,
    )

    tokenizer = _tokenizer(kind)
    size = len(tokenizer)
    torch.manual_seed(0)
    if kind == "gpt2":
        # As GPT-2 ships: no pad_token_id in the config, none in the tokenizer.
        config = GPT2Config(
            vocab_size=size, n_positions=128, n_embd=64, n_layer=2, n_head=2,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
        model = GPT2LMHeadModel(config)
    elif kind == "llama":
        config = LlamaConfig(
            vocab_size=size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
        model = LlamaForCausalLM(config)
    else:
        width, heads = (63, 3) if odd_width else (64, 2)
        config = RobertaConfig(
            vocab_size=size, hidden_size=width, intermediate_size=2 * width,
            num_hidden_layers=2, num_attention_heads=heads, max_position_embeddings=130,
            type_vocab_size=1,
            pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
        model = RobertaModel(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def reviews_csv(path: Path, rows: int = 400) -> Path:
    """Rotten Tomatoes snippets with string labels under other column names."""
    from dpkit.data.embedded import rotten_tomatoes_csv

    with open(rotten_tomatoes_csv()) as source, open(path, "w", newline="") as target:
        writer = csv.writer(target)
        writer.writerow(["review", "verdict"])
        for _, row in zip(range(rows), csv.DictReader(source), strict=False):
            writer.writerow([row["text"], "fresh" if row["label"] == "1" else "rotten"])
    return path
