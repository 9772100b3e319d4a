"""The flags of ``recipes/finetune_lm.py`` beside the data's (:mod:`dpkit.data.causal`).

The decoder fine-tune shares the classification recipe's training flags
(:class:`~dpkit.train.finetune_config.TrainConfig`: schedule, checkpoints, resume,
``--init-from``, trackers) with defaults of its own, and names its model rather than
defaulting to one: dpkit bundles no pretrained decoder (``docs/finetune_lm.md`` builds
a small one offline).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dpkit.errors import UsageError, check_field
from dpkit.models import max_positions
from dpkit.train.finetune_config import SCHEDULER_CHOICES, ModelConfig, TrainConfig

# Tokens per example when --max-seq-length is not given: the model's position limit, up
# to this (a 32k-position model would otherwise plan 32k-token micro-batches).
DEFAULT_MAX_SEQ_LENGTH = 1024


@dataclass
class DecoderModelConfig(ModelConfig):
    model: str = field(
        default="",
        metadata={
            "help": "The pretrained decoder-only model to fine-tune: a Hub name "
            "(Qwen/Qwen2.5-0.5B, meta-llama/Llama-3.2-1B) or a local folder."
        },
    )
    """Hub name or local folder of a causal LM (``AutoModelForCausalLM``)."""
    max_seq_length: int | None = field(
        default=None,
        metadata={
            "help": "Tokens per example (per packed block with --packing); default: the "
            f"model's position limit, at most {DEFAULT_MAX_SEQ_LENGTH}."
        },
    )
    """Tokens per example or packed block; ``None``: the model's limit, at most
    :data:`DEFAULT_MAX_SEQ_LENGTH` (:meth:`resolve_max_seq_length`)."""

    def __post_init__(self) -> None:
        if not self.model.strip():
            raise UsageError(
                "--model: not given; name the decoder to fine-tune: a Hub name "
                "(Qwen/Qwen2.5-0.5B) or a folder (docs/finetune_lm.md builds one offline)"
            )
        check_field(
            self.max_seq_length is None or self.max_seq_length > 0,
            "max_seq_length",
            self.max_seq_length,
            "must be > 0",
        )
        check_field(
            self.dropout is None or 0 <= self.dropout < 1,
            "dropout",
            self.dropout,
            "must be in [0, 1)",
        )

    def resolve_max_seq_length(self, hf_config: Any) -> tuple[int, str | None]:
        """The tokens per example this run uses, and a line saying so when it was not
        given: the model's position limit, at most :data:`DEFAULT_MAX_SEQ_LENGTH`. A
        given value over the limit is refused (:meth:`check_positions`)."""
        if self.max_seq_length is not None:
            self.check_positions(hf_config)
            return self.max_seq_length, None
        limit = max_positions(hf_config)
        chosen = min(limit or DEFAULT_MAX_SEQ_LENGTH, DEFAULT_MAX_SEQ_LENGTH)
        source = f"the model's {limit} positions" if limit else "the model names no limit"
        if limit and limit > DEFAULT_MAX_SEQ_LENGTH:
            source = f"the model takes {limit:,}; capped at {DEFAULT_MAX_SEQ_LENGTH}"
        self.max_seq_length = chosen
        return chosen, f"--max-seq-length not given: {chosen} tokens ({source})"


@dataclass
class CausalTrainConfig(TrainConfig):
    micro_batch_size: int = field(default=8, metadata={"help": "Examples per process per step."})
    """Examples (or packed blocks) per process per forward/backward."""
    learning_rate: float = field(default=2e-5, metadata={"help": "Peak learning rate."})
    """Peak learning rate for the micro-batch of one process (see ``scale_lr``)."""
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    """AdamW decoupled weight decay (not applied to biases and norm weights); 0, as
    decoder fine-tunes usually run."""
    warmup_ratio: float = field(default=0.03, metadata={"help": "Share of steps spent warming up."})
    """Share of the optimizer steps with linear lr warm-up."""
    lr_scheduler: str = field(
        default="cosine",
        metadata={"help": "Decay after warm-up.", "choices": SCHEDULER_CHOICES},
    )
    """Schedule after warm-up (transformers' get_scheduler names)."""
    output_dir: str = field(default="runs/finetune_lm", metadata={"help": "Run directory."})
    """Run directory: resolved config, metrics, memory report, checkpoints, final model."""
