"""Build a small Llama-style decoder folder offline, for trying recipes/finetune_lm.py without the Hub.

    python docs/scripts/small_decoder.py OUT_DIR [--layers 4 --hidden 256 --vocab 4096]

What ``save_pretrained`` writes for a Llama checkpoint: config, weights (random: the
model's own init, seeded) and a byte-level BPE tokenizer trained on the embedded
Shakespeare text (``dpkit data fetch``), with no padding token and a chat template, as
Llama checkpoints ship. Not a pretrained model: a fine-tune of it shows the recipe,
the strategies and the memory, not what pretraining learnt.
"""

from __future__ import annotations

import argparse
from pathlib import Path

# A chat template in the style of the Llama/Qwen instruct checkpoints: one marker per role,
# each turn closed by the end-of-sequence token; the generation prompt opens the
# assistant's turn.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build(out: Path, layers: int, hidden: int, vocab: int, positions: int) -> Path:
    """The decoder folder ``out``: config, seeded random weights, tokenizer."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from dpkit.data.embedded import shakespeare_text

    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    text = shakespeare_text().read_text().split("\n\n")
    backend.train_from_iterator(
        text, trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(special.values()))
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **special)
    tokenizer.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers, num_attention_heads=max(hidden // 64, 1),
        num_key_value_heads=max(hidden // 128, 1), max_position_embeddings=positions,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--positions", type=int, default=512)
    args = parser.parse_args()
    print(build(args.out, args.layers, args.hidden, args.vocab, args.positions))


if __name__ == "__main__":
    main()
