"""The flags every dpkit recipe shares (:class:`StrategyConfig`), and the command-line parser.

Every check that can be made before a process group starts is made here, so
bad input costs one line and exit code 2, never a half-started job.
"""

from __future__ import annotations

import difflib
import os
import sys
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from dpkit.engines import RUNNABLE, engine_of, get_strategy
from dpkit.errors import UsageError, check_field

STRATEGY_CHOICES = ("auto", *(strategy.name for strategy in RUNNABLE))
PRECISION_CHOICES = ("no", "bf16", "fp16")


def check_choice(cfg: object, field_name: str, choices: tuple[str, ...]) -> None:
    """The command line checks choices itself; this covers configs built in code."""
    value = getattr(cfg, field_name)
    check_field(value in choices, field_name, value, f"not one of {', '.join(choices)}")


# A collective that does not complete within this time fails the job instead of hanging
# it (torch's and DeepSpeed's default is 30 minutes); --collective-timeout.
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0


@dataclass
class StrategyConfig:
    """How the run is distributed and at what precision: the flags every dpkit recipe shares."""

    strategy: str = field(
        default="auto",
        metadata={
            "help": f"{', '.join(STRATEGY_CHOICES[1:])}; auto takes it from the launcher "
            "(a DeepSpeed or FSDP config) or falls back to ddp.",
            "choices": STRATEGY_CHOICES,
        },
    )
    """Data-parallel strategy; ``auto`` follows the launcher."""
    deepspeed: str | None = field(
        default=None,
        metadata={"help": "DeepSpeed JSON (as `deepspeed ... --deepspeed ds_configs/zero2.json`)."},
    )
    """DeepSpeed JSON config; its ``"auto"`` values are filled from these arguments."""
    mixed_precision: str | None = field(
        default=None,
        metadata={
            "help": "no, bf16 (CPU and GPU) or fp16 (GPU). Default: the launcher's, else no.",
            "choices": PRECISION_CHOICES,
        },
    )
    """Mixed precision; ``None`` takes the launcher's setting."""

    collective_timeout: float = field(
        default=DEFAULT_COLLECTIVE_TIMEOUT_S,
        metadata={
            "help": "Seconds a collective may wait for the other ranks before the job fails "
            "(a hung or stopped rank)."
        },
    )
    """Process-group timeout (torch's and DeepSpeed's default is 30 minutes)."""

    ddp_find_unused_parameters: bool = field(
        default=False,
        metadata={
            "help": "DDP: let the model leave parameters out of the loss (a head of your own "
            "over a backbone whose pooler goes unused); costs one autograd-graph traversal a "
            "step. ZeRO needs no flag (DeepSpeed handles unused parameters itself)."
        },
    )
    """DDP's ``find_unused_parameters`` (the Trainer's ``ddp_find_unused_parameters``).
    Without it DDP stops at the second step with "Expected to have finished reduction in
    the prior iteration" when a parameter gets no gradient."""

    fsdp_layer_classes: str | None = field(
        default=None,
        metadata={
            "help": "FSDP2: the class names (comma-separated) of the blocks each made one "
            "sharding unit, e.g. LlamaDecoderLayer. Default: the model's _no_split_modules, "
            "else its list of repeated blocks."
        },
    )
    """FSDP2's units; None: found in the model (:func:`dpkit.engines.fsdp2.shard.layer_classes`)."""

    gradient_checkpointing: bool = field(
        default=False,
        metadata={
            "aliases": ["--activation-checkpointing"],
            "help": "Recompute each layer's activations in backward instead of keeping them "
            "(transformers' gradient checkpointing, non-reentrant): activations fall to the "
            "layers' inputs plus one layer, for about a third more compute per step.",
        },
    )
    """Activation (gradient) checkpointing of the model's layers, under every strategy
    (:func:`dpkit.models.enable_gradient_checkpointing`); the Trainer's own
    ``gradient_checkpointing=True`` is read from the model."""

    lora_r: int | None = field(
        default=None,
        metadata={
            "help": "Train LoRA adapters of rank N (peft) instead of the whole model: the "
            "pretrained weights are frozen, so only the adapters (and a classifier's head) "
            "have gradients and optimizer states."
        },
    )
    """LoRA rank (:mod:`dpkit.lora`); None: every parameter trains."""
    lora_alpha: float | None = field(
        default=None,
        metadata={"help": "LoRA's scaling numerator (the update is alpha/r x BA). Default: 2 x r."},
    )
    """LoRA alpha; None: twice the rank."""
    lora_dropout: float = field(
        default=0.0,
        metadata={"help": "Dropout on the adapters' input (peft's default, 0)."},
    )
    """Dropout of the LoRA branch."""
    lora_target_modules: str | None = field(
        default=None,
        metadata={
            "help": "The layers that get adapters, by name (comma-separated, e.g. "
            "q_proj,v_proj; all-linear: every linear layer but the output head). Default: "
            "peft's choice for the architecture (BERT query,value; GPT-2 c_attn; Llama "
            "q_proj,v_proj)."
        },
    )
    """Module names (peft's ``target_modules``); None: peft's default for the model type."""

    @property
    def lora_target_module_names(self) -> tuple[str, ...] | None:
        """``lora_target_modules`` as a tuple (None: not given)."""
        if self.lora_target_modules is None:
            return None
        return tuple(n.strip() for n in self.lora_target_modules.split(",") if n.strip())

    @property
    def fsdp_layer_class_names(self) -> tuple[str, ...]:
        """``fsdp_layer_classes`` as a tuple (empty: not given)."""
        return tuple(n.strip() for n in (self.fsdp_layer_classes or "").split(",") if n.strip())

    def __post_init__(self) -> None:
        check_field(
            0 < self.collective_timeout < float("inf"),
            "collective_timeout",
            self.collective_timeout,
            "must be > 0 seconds",
        )
        check_choice(self, "strategy", STRATEGY_CHOICES)
        if self.mixed_precision is not None:
            check_choice(self, "mixed_precision", PRECISION_CHOICES)
        if self.deepspeed is not None:
            from dpkit.config_files import find_config

            find_config(self.deepspeed, "--deepspeed")  # here, or a shipped config's name
        named = None if self.strategy == "auto" else get_strategy(self.strategy)
        if (
            self.deepspeed is not None
            and named is not None
            and not engine_of(named).reads_config_file
        ):
            raise UsageError(
                f"--strategy={self.strategy} conflicts with --deepspeed={self.deepspeed!r}: "
                "drop one of them"
            )
        self._check_lora()
        if self.fsdp_layer_classes is not None:
            check_field(
                bool(self.fsdp_layer_class_names),
                "fsdp_layer_classes",
                self.fsdp_layer_classes,
                "name at least one class",
            )

    def _check_lora(self) -> None:
        if self.lora_r is None:
            given = [
                f"--{name.replace('_', '-')}={getattr(self, name)}"
                for name, default in (
                    ("lora_alpha", None),
                    ("lora_dropout", 0.0),
                    ("lora_target_modules", None),
                )
                if getattr(self, name) != default
            ]
            if given:
                raise UsageError(f"{given[0]}: has no effect without --lora-r (the adapters' rank)")
            return
        check_field(self.lora_r >= 1, "lora_r", self.lora_r, "must be a rank >= 1")
        if self.lora_alpha is not None:
            check_field(self.lora_alpha > 0, "lora_alpha", self.lora_alpha, "must be > 0")
        check_field(
            0.0 <= self.lora_dropout < 1.0, "lora_dropout", self.lora_dropout, "must be in [0, 1)"
        )
        if self.lora_target_modules is not None:
            check_field(
                bool(self.lora_target_module_names),
                "lora_target_modules",
                self.lora_target_modules,
                "name at least one layer",
            )


def config_dict(*configs: object) -> dict:
    """All fields of the given dataclasses, the command line and the launcher's
    environment, for ``run_config.json``. Call it before the run starts: accelerate
    writes ``ACCELERATE_*`` variables of its own into the environment once it runs."""
    merged: dict = {}
    for cfg in configs:
        merged[type(cfg).__name__] = asdict(cfg)
    merged["argv"] = sys.argv
    merged["launcher_env"] = {
        k: v
        for k, v in sorted(os.environ.items())
        if k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        or k.startswith("ACCELERATE_")
    }
    return merged


@dataclass(frozen=True)
class RunOptions:
    """What a run does besides its strategy (:func:`dpkit.setup`'s keywords, as one
    object): the batch layout, the optimizer's settings, the run folder, checkpoints,
    memory probes and accelerate's switches. Checked when built: a bad value is one line
    naming the field."""

    micro_batch_size: int
    """Samples per process per forward."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step."""
    max_grad_norm: float = 0.0
    """The clipping norm the loop uses (0: none); DeepSpeed clips inside its step, so its
    config gets it too."""
    learning_rate: float | None = None
    """The peak lr of one process without accumulation: recorded, scaled by
    :attr:`scale_lr`, and given to a DeepSpeed JSON's own optimizer."""
    scale_lr: str = "none"
    """``none``, ``linear`` or ``sqrt``: scale :attr:`learning_rate` with the global batch."""
    weight_decay: float | None = None
    """For a DeepSpeed JSON with its own ``optimizer`` section."""
    output_dir: str | None = None
    """The run folder (``run_config.json``, ``run_info.json``, checkpoints,
    ``memory_report.json``); None: nothing is written."""
    configs: tuple[Any, ...] = ()
    """The script's other flag dataclasses, recorded in ``run_config.json``."""
    resume: Any = None
    """A checkpoint to continue (:func:`dpkit.checkpoints.resume.find_resume`): its global
    batch, model (as named), labels and parameter shapes must be this run's."""
    seed: int = 0
    """Recorded with each checkpoint; seeds LoRA's adapters."""
    data_seed: int | None = None
    """Seed accelerate's sampler (the same shuffle on every strategy and world size)."""
    tokenizer: Any = None
    """Saved beside each checkpoint and the final model."""
    keep_last: int = 0
    """Keep the newest N checkpoints (0: all)."""
    save_checkpoints: bool = True
    """False: the run writes no checkpoint."""
    checkpoint_format: str = "sharded"
    """``sharded`` (every rank writes its own part; the ranks share a file system) or
    ``full`` (gathered, written by the main process)."""
    async_save: bool = False
    """Sharded checkpoints written in the background: each rank copies its part to CPU
    memory and trains on."""
    memory_probe_steps: int = 1
    """Probe the memory inside the first N optimizer steps (-1: all)."""
    step_scheduler_with_optimizer: bool = True
    """accelerate's switch (dpkit's recipes count optimizer steps and pass False)."""
    log_with: str | None = None
    """accelerate's trackers."""

    def __post_init__(self) -> None:
        if self.checkpoint_format not in ("sharded", "full"):
            raise UsageError(
                f"checkpoint_format={self.checkpoint_format!r}: must be 'sharded' or 'full'"
            )
        if self.async_save and self.checkpoint_format != "sharded":
            raise UsageError(
                f"async_save=True: only with sharded checkpoints (checkpoint_format="
                f"{self.checkpoint_format!r} gathers the state on the main process)"
            )

    @classmethod
    def of(cls, keywords: dict[str, Any]) -> RunOptions:
        """The options named in ``keywords`` (:func:`dpkit.setup`'s); a name that is no
        field is refused in one line naming the closest."""
        names = [f.name for f in fields(cls)]
        unknown = [k for k in keywords if k not in names]
        if unknown:
            close = difflib.get_close_matches(unknown[0], names, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise UsageError(f"setup({unknown[0]}=...): not an option of dpkit.setup{hint}")
        return cls(**keywords)
