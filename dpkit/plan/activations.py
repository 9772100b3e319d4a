"""Activation bytes per GPU for ``dpkit plan``: a meta-device trace of the forward, or a formula.

:func:`trace_profile` runs the model's real forward at full size on the meta
device and counts what autograd saves for backward (the memory report's
measure); :func:`formula_layer_bytes` is the Korthikanti et al. 2022 formula it
is checked against and falls back to (:func:`activation_profile`). Kept apart
from :mod:`dpkit.plan.estimate`, which adds them to the other figures; torch
and transformers are imported only inside the functions that trace, so
importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from dpkit.core.spec import ModelSpec
from dpkit.core.units import dtype_bytes
from dpkit.errors import UsageError
from dpkit.models import build_meta_model, quiet_transformers
from dpkit.plan.inputs import first_line


def formula_layer_bytes(
    seq_len: int,
    hidden: int,
    heads: int,
    intermediate: int | None = None,
    act_bytes: int = 2,
    hidden_dropout: bool = True,
    attention_dropout: bool = True,
    eager_attention: bool = True,
    gated_mlp: bool = False,
    kv_heads: int | None = None,
) -> float:
    """Bytes one transformer layer saves for backward, per sample of the micro-batch.

    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models", section 4.1: ``s*b*h*(34 + 5*a*s/h)`` bytes per layer
    with 16-bit activations, 1-byte dropout masks, an MLP of 4h and attention
    scores materialised. That is the default here; the arguments generalise
    the same terms term by term: activation width, dropout present or not, the
    MLP width and gating, grouped K/V heads, and a fused attention kernel
    (``eager_attention=False``), which keeps no ``s*s`` scores (backward
    recomputes them) -- the paper's "selective recomputation" figure, 34sbh.
    """
    s, h, a = seq_len, hidden, act_bytes
    i = intermediate if intermediate is not None else 4 * h
    kv = (kv_heads if kv_heads is not None else heads) / heads
    hidden_mask = 1 if hidden_dropout else 0
    # Attention: QKV input, Q and K (for QK^T), V, output-projection input, dropout mask.
    attention = a * s * h + a * s * h * (1 + kv) + a * s * h * kv + a * s * h + hidden_mask * s * h
    if eager_attention:
        # Per score: softmax output, its dropout mask and dropout output (the
        # matmul input); without dropout the softmax output is that input.
        per_score = a + (1 + a if attention_dropout else 0)
        attention += per_score * heads * s * s
    # MLP: input; 4h pre-activation and 4h post-activation (the paper's 8+8 at 16 bits);
    # gated: gate output, up output, activation output and their product.
    mlp = a * s * h + (4 if gated_mlp else 2) * a * s * i + hidden_mask * s * h
    norms = 2 * a * s * h
    return float(attention + mlp + norms)


@dataclass(frozen=True)
class ActivationProfile:
    """Activation bytes per GPU by micro-batch, by part: exact at 1, a line from 2 on."""

    method: str
    """``trace`` (meta-device forward) or ``formula`` (Korthikanti et al.)."""
    at_one: dict[str, float]
    """Bytes by part at micro-batch 1. The parts: ``layers`` (or ``layer_inputs``
    and ``one_layer`` when checkpointing), ``outside_layers``, ``logits_peak``."""
    fixed: dict[str, float]
    """By part, bytes that do not grow with the micro-batch (position ids, shared masks)."""
    per_sample: dict[str, float]
    """By part, bytes per sample from micro-batch 2 on. Micro-batch 1 is apart:
    there ``reshape`` can return a view (of the fused QKV output, say) where
    larger batches copy, so it is not on the line."""
    note: str = ""
    """Why the formula was used where a trace was asked for."""
    under_autocast: ActivationProfile | None = None
    """The same model under torch autocast over fp32 weights (DDP's mixed precision:
    16-bit matmuls, fp32 residual stream, each weight's 16-bit copy saved), where the
    trace made one; the profile itself is the model with 16-bit weights (DeepSpeed,
    FSDP2). None in fp32 and for the formula."""

    def parts(self, micro_batch: int) -> dict[str, float]:
        """Bytes by part at ``micro_batch``."""
        if micro_batch == 1:
            return dict(self.at_one)
        return {k: self.fixed.get(k, 0.0) + v * micro_batch for k, v in self.per_sample.items()}

    def at(self, micro_batch: int) -> float:
        """All parts at ``micro_batch``."""
        return sum(self.parts(micro_batch).values())


TRANSIENT_PARTS = ("logits_peak", "one_layer")
"""Parts that live in backward only: the loss's gradients at its start, and under
checkpointing the one layer being recomputed."""


def saved_bytes(parts: dict[str, float]) -> float:
    """What the memory report measures of ``parts``: the bytes a training forward saves
    for backward. The transient parts (:data:`TRANSIENT_PARTS`) are not among them."""
    return sum(v for k, v in parts.items() if k not in TRANSIENT_PARTS)


def _logits_peak_per_sample(spec: ModelSpec, seq_len: int, act_bytes: int) -> float:
    # At the start of backward, beside everything saved: the logits the model
    # returned (activation dtype), and cross-entropy's two fp32 gradients (of
    # the log-probabilities, then of the upcast logits). The log-probabilities
    # themselves are saved tensors, counted with the rest. The formula assumes an
    # LM head (the trace measures the head the model has).
    vocab = spec.shape("vocab_size") or 0
    return float(seq_len * vocab * (act_bytes + 4 + 4))


def formula_profile(
    spec: ModelSpec, seq_len: int, precision: str, checkpointing: bool, attention: str
) -> ActivationProfile:
    """Activations from :func:`formula_layer_bytes` and the config's shapes."""
    a = dtype_bytes(precision)
    hidden, layers = spec.hidden_size, spec.shape("num_hidden_layers", "n_layer")
    heads = spec.shape("num_attention_heads", "n_head")
    vocab = spec.shape("vocab_size") or 0
    hidden_p = spec.shape("resid_pdrop", "hidden_dropout_prob", "hidden_dropout", default=0.0)
    attention_p = spec.shape(
        "attn_pdrop", "attention_probs_dropout_prob", "attention_dropout", default=0.0
    )
    embedding_p = spec.shape("embd_pdrop", default=hidden_p)
    one_layer = formula_layer_bytes(
        seq_len,
        hidden,
        heads,
        intermediate=spec.shape("intermediate_size", "n_inner"),
        act_bytes=a,
        hidden_dropout=hidden_p > 0,
        attention_dropout=attention_p > 0,
        eager_attention=attention == "eager",
        gated_mlp=spec.gated_mlp,
        kv_heads=spec.shape("num_key_value_heads"),
    )
    # Outside the layers: embedding dropout mask, final norm input, LM-head
    # input, and the fp32 log-probabilities cross-entropy saves.
    outside = seq_len * ((1 if embedding_p > 0 else 0) * hidden + 2 * a * hidden + 4 * vocab)
    parts = {"outside_layers": float(outside)}
    if checkpointing:
        parts |= {"layer_inputs": float(layers * a * seq_len * hidden), "one_layer": one_layer}
    else:
        parts["layers"] = layers * one_layer
    parts["logits_peak"] = _logits_peak_per_sample(spec, seq_len, a)
    return ActivationProfile("formula", parts, dict.fromkeys(parts, 0.0), parts)


KERNEL_DEVICES = ("cuda", "cpu")
"""Whose kernels the trace imitates: a GPU's (what ``dpkit plan`` plans for) or a CPU's
(``--against`` a run that ran on CPUs)."""


def _kernel_mode(device: str, autocast_dtype: Any = None) -> Any:
    """A torch function mode that makes the meta device save what ``device`` saves.

    On meta PyTorch takes CPU-like code paths: ``scaled_dot_product_attention``
    falls back to the math kernel, which saves the whole score matrix, and dropout
    multiplies by a mask of the input's dtype. On a GPU, SDPA runs a fused kernel
    (FlashAttention, memory-efficient) that keeps q, k, v, the output and the per-row
    log-sum-exp, recomputing the scores in backward (Dao et al. 2022), and dropout is
    ``native_dropout`` with a one-byte mask. On a CPU, SDPA runs the fused flash kernel
    only without attention dropout (measured, torch 2.13: MiniLM saved the same bytes as
    the fused imitation at dropout 0 and as the math kernel at 0.1); dropout is meta's.

    ``autocast_dtype``: imitate ``torch.autocast`` (which does not run on meta) over
    fp32 weights: matmuls in 16 bits, each weight cast once per forward (the copy the
    matmul saves), the ops autocast keeps in fp32 (the loss; on a GPU also norms and
    softmax) in fp32, the rest in whatever dtype their inputs have.
    """
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    class FusedAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, query: Any, key: Any, value: Any) -> Any:
            # The kernels write (batch, seq, heads, dim) and return a transposed
            # view, so the model's transpose(1, 2).contiguous() copies nothing.
            batch, heads, seq = query.shape[:-1]
            output = query.new_empty((batch, seq, heads, value.shape[-1])).transpose(1, 2)
            log_sum_exp = query.new_empty(query.shape[:-1], dtype=torch.float32)
            ctx.save_for_backward(query, key, value, output, log_sum_exp)
            return output

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            # Run by the step's trace (dpkit.plan.step_trace): the kernels' backward returns
            # the gradients of q, k and v and recomputes the scores block by block.
            query, key, value = ctx.saved_tensors[:3]
            return (
                query.new_empty(query.shape),
                key.new_empty(key.shape),
                value.new_empty(value.shape),
            )

    def sdpa(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        dropout_p = kwargs.get("dropout_p", args[1] if len(args) > 1 else 0.0)
        if device == "cpu" and dropout_p:
            return F.scaled_dot_product_attention(query, key, value, *args, **kwargs)
        return FusedAttention.apply(query, key, value)

    # F.dropout hands every argument on to a function mode, by keyword.
    def native_dropout(input: Any, p: float, training: bool, inplace: bool) -> Any:
        if not training or p == 0:
            return input  # PyTorch returns the input itself: nothing saved
        return torch.ops.aten.native_dropout(input, p, True)[0]

    replacements: dict[Any, Any] = {F.scaled_dot_product_attention: sdpa}
    if device == "cuda":
        replacements[F.dropout] = native_dropout
    # torch's autocast lists (aten/src/ATen/autocast_mode.cpp), the ops transformer
    # models call: in 16 bits on both devices; in fp32 on a CPU only the losses.
    lower = {
        F.linear, F.conv1d, F.conv2d, F.scaled_dot_product_attention, torch.addmm,
        torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm,
        torch.baddbmm, torch.mm,
    }  # fmt: skip
    fp32 = {F.cross_entropy, F.nll_loss}
    if device == "cuda":
        fp32 |= {
            F.layer_norm, F.group_norm, F.softmax, F.log_softmax, torch.softmax,
            torch.Tensor.softmax, torch.log_softmax, torch.Tensor.log_softmax, torch.pow,
            torch.Tensor.pow, torch.rsqrt, torch.exp, torch.sum, torch.cumsum, torch.norm,
        }  # fmt: skip
    copies: dict[int, Any] = {}  # autocast's cache: one copy per weight per forward

    def cast(value: Any, dtype: Any) -> Any:
        if not (torch.is_tensor(value) and value.is_floating_point()) or value.dtype == dtype:
            return value
        if value.is_leaf and value.requires_grad:
            if id(value) not in copies:
                copies[id(value)] = value.to(dtype)
            return copies[id(value)]
        return value.to(dtype)

    class Kernels(TorchFunctionMode):
        weight_copies = copies  # what the trace sets apart as a part of its own

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if autocast_dtype is not None and (func in lower or func in fp32):
                dtype = autocast_dtype if func in lower else torch.float32
                args = tuple(cast(a, dtype) for a in args)
                kwargs = {k: cast(v, dtype) for k, v in kwargs.items()}
            return replacements.get(func, func)(*args, **kwargs)

    return Kernels()


def _repeated_layers(model: Any) -> list[Any]:
    """The transformer blocks: modules of the classes transformers never splits,
    else the children of the largest ModuleList."""
    import torch

    block_classes = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in block_classes]
    if blocks:
        return blocks
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        return []
    return list(max(lists, key=lambda m: sum(p.numel() for p in m.parameters())))


def _trace_labels(model: Any, micro_batch: int, seq_len: int) -> Any:
    """Labels of the shape the model's head takes (its loss is part of the forward), or
    None for a head dpkit does not know how to label (no loss traced)."""
    import torch

    name = type(model).__name__
    config = model.config
    if name.endswith("ForSequenceClassification"):
        if getattr(config, "problem_type", None) == "multi_label_classification":
            return torch.zeros((micro_batch, config.num_labels), device="meta")
        if config.num_labels == 1:  # regression: float targets
            return torch.zeros((micro_batch,), device="meta")
        return torch.zeros((micro_batch,), dtype=torch.long, device="meta")
    if name.endswith(("ForCausalLM", "LMHeadModel", "ForMaskedLM", "ForTokenClassification")):
        return torch.zeros((micro_batch, seq_len), dtype=torch.long, device="meta")
    return None


def _trace_once(
    model: Any, micro_batch: int, seq_len: int, device: str, autocast_dtype: Any = None
) -> dict[str, Any]:
    """Saved-for-backward bytes of one forward on the meta device, by layer, and the
    bytes of the logits a loss was computed from (0 without one)."""
    import torch

    param_storages = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: set[int] = set()
    layers = _repeated_layers(model)
    per_layer = [0.0] * len(layers)
    state: dict[str, Any] = {"layer": None, "outside": 0.0}  # layer None: outside them
    where: dict[int, tuple[int | None, float]] = {}  # storage -> (layer, bytes)

    def pack(tensor: Any) -> Any:
        key = tensor.untyped_storage()._cdata
        if (
            key not in seen and key not in param_storages
        ):  # each storage once; weights are model states
            seen.add(key)
            nbytes = float(tensor.untyped_storage().nbytes())
            where[key] = (state["layer"], nbytes)
            if state["layer"] is not None:
                per_layer[state["layer"]] += nbytes
            else:
                state["outside"] += nbytes
        return tensor

    def enter(index: int) -> Any:
        def hook(module: Any, args: Any) -> None:
            state["layer"] = index

        return hook

    def leave(module: Any, args: Any, output: Any) -> None:
        state["layer"] = None

    handles = []
    for index, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(enter(index)))
        handles.append(layer.register_forward_hook(leave))
    # The recipes' batches also carry an attention mask (and BERT's token type ids); a
    # padding mask cannot be built on meta (transformers inspects its values), and on
    # the kernels above it is not saved: the bytes are the same without it.
    kwargs = {"input_ids": torch.zeros((micro_batch, seq_len), dtype=torch.long, device="meta")}
    labels = _trace_labels(model, micro_batch, seq_len)
    if labels is not None:
        kwargs["labels"] = labels
    kernels = _kernel_mode(device, autocast_dtype)
    try:
        with (
            quiet_transformers(),
            _no_token_value_checks(),
            kernels,
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        ):
            output = model(**kwargs)
    finally:
        for handle in handles:
            handle.remove()
    # Autocast's weight copies, a part of their own: they do not grow with the batch.
    weight_copies = 0.0
    for copy in kernels.weight_copies.values():
        saved = where.pop(copy.untyped_storage()._cdata, None)
        if saved is None:
            continue  # cast but not saved (a bias)
        layer, nbytes = saved
        weight_copies += nbytes
        if layer is not None:
            per_layer[layer] -= nbytes
        else:
            state["outside"] -= nbytes
    logits = getattr(output, "logits", None)
    logits_bytes = float(logits.numel() * logits.element_size()) if labels is not None else 0.0
    return {
        "outside": state["outside"],
        "layers": per_layer,
        "logits_elements": float(logits.numel()) if logits_bytes else 0.0,
        "logits_bytes": logits_bytes,
        "weight_copies": weight_copies,
    }


@contextlib.contextmanager
def _no_token_value_checks() -> Iterator[None]:
    """Skip the two checks transformers makes on the token ids' values, which the meta
    device has none of (reading one raises), and which save nothing for backward.

    A decoder without a KV cache (train_lm's, a checkpointed one) reads its position
    ids to find packed sequences: the recipes' batches hold one sequence per row, where
    the search finds none (``None``), which this answers. A model whose config has a
    padding id (GPT-2's sequence classifier: the trace gives it one) looks for it in
    the ids to warn about a missing attention mask: a warning only, skipped.
    """
    from unittest import mock

    from transformers import PreTrainedModel, masking_utils

    with (
        mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda *a, **k: None),
        mock.patch.object(
            PreTrainedModel, "warn_if_padding_and_no_attention_mask", lambda *a, **k: None
        ),
    ):
        yield


def _trace_model(spec: ModelSpec, attention: str) -> Any:
    """The model the run trained, on the meta device, in training mode."""
    import copy

    config = copy.deepcopy(spec.config)
    classifier = spec.task.endswith("ForSequenceClassification")
    if classifier and getattr(config, "pad_token_id", None) is None:
        # Decoder classifiers find each row's last token by the padding id; the recipes
        # set it from the tokenizer (dpkit.models.classifier_labels).
        config.pad_token_id = 0
    model = build_meta_model(config, attn_implementation=attention, task=spec.task)
    if spec.lora is not None:  # frozen weights save less for backward than trained ones
        from dpkit.lora import LoraSettings, apply_lora

        targets = spec.lora["target_modules"]
        model = apply_lora(
            model,
            LoraSettings(
                r=int(spec.lora["r"]),
                alpha=float(spec.lora["alpha"]),
                dropout=float(spec.lora["dropout"]),
                target_modules=(targets,) if isinstance(targets, str) else tuple(targets),
            ),
        )
    return model.train()


@contextlib.contextmanager
def _checkpointed(model: Any, context_fn: Any = None) -> Iterator[None]:
    """The model's layers checkpointed as a run's ``--gradient-checkpointing`` does it
    (:func:`dpkit.models.enable_gradient_checkpointing`: torch's non-reentrant
    checkpoint around each layer's forward), for one trace: the layers' switches only,
    so that the shared meta model is left as it was. ``context_fn``: checkpoint's (the
    contexts of the forward and of the recomputation; a torch function mode is not active
    in backward, where the recomputation runs, unless entered there again)."""
    import functools

    from torch.utils.checkpoint import checkpoint
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no checkpointable layers to trace")
    extra = {} if context_fn is None else {"context_fn": context_fn}
    for layer in layers:
        layer._gradient_checkpointing_func = functools.partial(
            checkpoint, use_reentrant=False, **extra
        )
        layer.gradient_checkpointing = True
    try:
        yield
    finally:
        for layer in layers:
            layer.gradient_checkpointing = False


def _profile_from_traces(
    model: Any, seq_len: int, checkpointing: bool, device: str, autocast_dtype: Any
) -> ActivationProfile:
    def saved(micro_batch: int) -> dict[str, float]:
        trace = _trace_once(model, micro_batch, seq_len, device, autocast_dtype)
        parts = {"outside_layers": trace["outside"]}
        copies = trace["weight_copies"]
        if checkpointing:
            # Traced checkpointed: torch's checkpoint saves each layer's tensor inputs
            # (hidden states, masks: what the layer is recomputed from) and nothing inside
            # it; backward then recomputes one layer at a time, which saves what that
            # layer saves uncheckpointed (a transient: not what the forward keeps).
            with _checkpointed(model):
                kept = _trace_once(model, micro_batch, seq_len, device, autocast_dtype)
            kept_total = kept["outside"] + sum(kept["layers"])
            parts["layer_inputs"] = max(kept_total - trace["outside"], 0.0)
            parts["one_layer"] = max(trace["layers"], default=0.0)
            copies = kept["weight_copies"]
        else:
            parts["layers"] = sum(trace["layers"])
        if autocast_dtype is not None:
            parts["autocast_weight_copies"] = copies
        if trace["logits_bytes"]:
            # At the start of backward, beside everything saved: the logits the model
            # returned, and cross-entropy's two fp32 gradients (of the log-probabilities,
            # then of the upcast logits); a sequence classifier's are a few bytes, an
            # LM's the largest part.
            parts["logits_peak"] = trace["logits_bytes"] + 8 * trace["logits_elements"]
        return parts

    one, two, three = saved(1), saved(2), saved(3)
    per_sample = {k: three[k] - two[k] for k in two}
    fixed = {k: two[k] - 2 * per_sample[k] for k in two}
    return ActivationProfile("trace", one, fixed, per_sample)


def trace_profile(
    spec: ModelSpec,
    seq_len: int,
    precision: str,
    checkpointing: bool,
    attention: str,
    device: str = "cuda",
) -> ActivationProfile:
    """Activations from the model's own forward, run on the meta device at full size.

    The model is built with the head it trains with (``spec.task``: a sequence
    classifier's logits are a few numbers per sample, an LM's a vocabulary per token)
    and its loss is part of the forward. Counts every storage autograd saves for
    backward once, skipping weights (the memory report's measure), with ``device``'s
    kernels (:func:`_kernel_mode`). Traced at micro-batches 1, 2 and 3: from 2 on
    every saved tensor has a batch dimension or none, so 2 and 3 give the line
    exactly; 1 is kept as traced (see :class:`ActivationProfile`). With checkpointing,
    each layer keeps its input and one layer at a time is recomputed in backward. In
    mixed precision the model is traced twice: with 16-bit weights (DeepSpeed, FSDP2),
    and under autocast over fp32 weights (DDP: ``under_autocast``).
    """
    if device not in KERNEL_DEVICES:
        raise UsageError(f"device={device!r}: not one of {', '.join(KERNEL_DEVICES)}")
    return _traced(_TraceKey.of(spec, seq_len, precision, checkpointing, attention, device))


@dataclass(frozen=True)
class _TraceKey:
    """What a trace depends on: the model's config, head and adapters, and the settings.
    The spec rides along uncompared (its config is not hashable)."""

    model: str
    seq_len: int
    precision: str
    checkpointing: bool
    attention: str
    device: str
    spec: ModelSpec = field(compare=False)

    @classmethod
    def of(cls, spec: ModelSpec, seq_len, precision, checkpointing, attention, device):
        model = json.dumps(
            [spec.config.to_json_string(use_diff=False), spec.task, spec.lora],
            sort_keys=True,
            default=str,
        )
        return cls(model, seq_len, precision, checkpointing, attention, device, spec)


# A trace takes seconds (a GPT-2 medium's six: 3 s), and one process asks for the same
# one again: tune per candidate, plan per memory size, a test per assertion.
@functools.lru_cache(maxsize=16)
def _traced(key: _TraceKey) -> ActivationProfile:
    import torch

    spec, seq_len, checkpointing, device = key.spec, key.seq_len, key.checkpointing, key.device
    precision, attention = key.precision, key.attention
    model = _trace_model(spec, attention)
    if precision == "fp32":
        return _profile_from_traces(model, seq_len, checkpointing, device, None)
    half = torch.float16 if precision == "fp16" else torch.bfloat16
    autocast = _profile_from_traces(model, seq_len, checkpointing, device, half)
    weights = _profile_from_traces(model.to(half), seq_len, checkpointing, device, None)
    return replace(weights, under_autocast=autocast)


def activation_profile(
    spec: ModelSpec,
    seq_len: int,
    precision: str,
    checkpointing: bool,
    attention: str = "sdpa",
    method: str = "trace",
    device: str = "cuda",
) -> ActivationProfile | None:
    """Activations per GPU, or None for a bare parameter count (no shapes). ``device``:
    whose kernels the trace imitates (:data:`KERNEL_DEVICES`)."""
    if not spec.has_shapes:
        return None
    if method == "trace":
        try:
            return trace_profile(spec, seq_len, precision, checkpointing, attention, device)
        except Exception as err:  # an unusual model may not run on meta; the formula still applies
            note = f"meta-device trace failed ({first_line(err)})"
            try:
                fallback = formula_profile(spec, seq_len, precision, checkpointing, attention)
            except (TypeError, ValueError, ZeroDivisionError) as formula_err:  # shapes missing
                raise UsageError(
                    f"--model={spec.name!r}: cannot estimate activations ({note}; the formula "
                    f"lacks shapes: {first_line(formula_err)}); --params counts model states only"
                ) from None
            return ActivationProfile(
                "formula", fallback.at_one, fallback.fixed, fallback.per_sample, note
            )
    return formula_profile(spec, seq_len, precision, checkpointing, attention)
