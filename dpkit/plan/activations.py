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

from dataclasses import dataclass
from typing import Any

from dpkit.errors import UsageError
from dpkit.memory.analytic import dtype_bytes
from dpkit.models import build_meta_model, quiet_transformers
from dpkit.plan.inputs import ModelSpec, first_line


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

    def parts(self, micro_batch: int) -> dict[str, float]:
        if micro_batch == 1:
            return dict(self.at_one)
        return {k: self.fixed.get(k, 0.0) + v * micro_batch for k, v in self.per_sample.items()}

    def at(self, micro_batch: int) -> float:
        return sum(self.parts(micro_batch).values())


def _logits_peak_per_sample(spec: ModelSpec, seq_len: int, act_bytes: int) -> float:
    # At the start of backward, beside everything saved: the logits the model
    # returned (activation dtype), and cross-entropy's two fp32 gradients (of
    # the log-probabilities, then of the upcast logits). The log-probabilities
    # themselves are saved tensors, counted with the rest.
    vocab = spec.shape("vocab_size", default=0) or 0
    return float(seq_len * vocab * (act_bytes + 4 + 4))


def formula_profile(
    spec: ModelSpec, seq_len: int, precision: str, checkpointing: bool, attention: str
) -> ActivationProfile:
    """Activations from :func:`formula_layer_bytes` and the config's shapes."""
    a = dtype_bytes(precision)
    hidden, layers = spec.hidden_size, spec.shape("num_hidden_layers", "n_layer")
    heads = spec.shape("num_attention_heads", "n_head")
    vocab = spec.shape("vocab_size", default=0) or 0
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


def _fused_kernel_mode() -> Any:
    """A torch function mode that makes the meta device save what a GPU saves.

    On meta (as on CPU) PyTorch takes other code paths than on CUDA:
    ``scaled_dot_product_attention`` falls back to the math kernel, which
    saves the whole fp32 score matrix, and dropout multiplies by a mask of the
    input's dtype. On a GPU, SDPA runs a fused kernel (FlashAttention,
    memory-efficient) that keeps q, k, v, the output and the per-row
    log-sum-exp, recomputing the scores in backward (Dao et al. 2022), and
    dropout is ``native_dropout`` with a one-byte mask.
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
        def backward(ctx: Any, grad: Any) -> Any:  # never run: the trace only goes forward
            raise NotImplementedError

    def sdpa(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        return FusedAttention.apply(query, key, value)

    def dropout(input: Any, p: float = 0.5, training: bool = True, inplace: bool = False) -> Any:
        if not training or p == 0:
            return input  # PyTorch returns the input itself: nothing saved
        return torch.ops.aten.native_dropout(input, p, True)[0]

    replacements = {F.scaled_dot_product_attention: sdpa, F.dropout: dropout}

    class FusedKernels(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return replacements.get(func, func)(*args, **(kwargs or {}))

    return FusedKernels()


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


def _trace_once(model: Any, micro_batch: int, seq_len: int, with_labels: bool) -> dict[str, Any]:
    """Saved-for-backward bytes of one forward on the meta device, by layer."""
    import torch

    param_storages = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: set[int] = set()
    layers = _repeated_layers(model)
    per_layer = [0.0] * len(layers)
    layer_inputs = [0.0] * len(layers)
    state = {"layer": -1, "outside": 0.0}

    def pack(tensor: Any) -> Any:
        key = tensor.untyped_storage()._cdata
        if (
            key not in seen and key not in param_storages
        ):  # each storage once; weights are model states
            seen.add(key)
            nbytes = float(tensor.untyped_storage().nbytes())
            if state["layer"] >= 0:
                per_layer[state["layer"]] += nbytes
            else:
                state["outside"] += nbytes
        return tensor

    def enter(index: int) -> Any:
        def hook(module: Any, args: Any, kwargs: Any) -> None:
            state["layer"] = index
            hidden = args[0] if args else kwargs.get("hidden_states")
            if torch.is_tensor(hidden):
                layer_inputs[index] = float(hidden.untyped_storage().nbytes())

        return hook

    def leave(module: Any, args: Any, output: Any) -> None:
        state["layer"] = -1

    handles = []
    for index, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(enter(index), with_kwargs=True))
        handles.append(layer.register_forward_hook(leave))
    ids = torch.zeros((micro_batch, seq_len), dtype=torch.long, device="meta")
    kwargs = {"input_ids": ids, "labels": ids} if with_labels else {"input_ids": ids}
    try:
        with (
            quiet_transformers(),
            _fused_kernel_mode(),
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        ):
            model(**kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return {"outside": state["outside"], "layers": per_layer, "layer_inputs": layer_inputs}


def trace_profile(
    spec: ModelSpec, seq_len: int, precision: str, checkpointing: bool, attention: str
) -> ActivationProfile:
    """Activations from the model's own forward, run on the meta device at full size.

    Counts every storage autograd saves for backward once, skipping weights
    (the memory report's measure). Traced at micro-batches 1, 2 and 3: from 2
    on every saved tensor has a batch dimension or none, so 2 and 3 give the
    line exactly; 1 is kept as traced (see :class:`ActivationProfile`). With
    checkpointing, each layer keeps its input and one layer at a time is
    recomputed in backward.
    """
    import torch

    model = build_meta_model(spec.config, attn_implementation=attention)
    model = model.to(torch.float32 if precision == "fp32" else torch.bfloat16).train()
    has_lm_head = model.get_output_embeddings() is not None
    logits_peak = _logits_peak_per_sample(spec, seq_len, dtype_bytes(precision))

    def saved(micro_batch: int) -> dict[str, float]:
        trace = _trace_once(model, micro_batch, seq_len, has_lm_head)
        parts = {"outside_layers": trace["outside"]}
        if checkpointing:
            parts["layer_inputs"] = sum(trace["layer_inputs"])
            parts["one_layer"] = max(trace["layers"], default=0.0)
        else:
            parts["layers"] = sum(trace["layers"])
        if has_lm_head:
            parts["logits_peak"] = logits_peak * micro_batch
        return parts

    one, two, three = saved(1), saved(2), saved(3)
    per_sample = {k: three[k] - two[k] for k in two}
    fixed = {k: two[k] - 2 * per_sample[k] for k in two}
    return ActivationProfile("trace", one, fixed, per_sample)


def activation_profile(
    spec: ModelSpec,
    seq_len: int,
    precision: str,
    checkpointing: bool,
    attention: str = "sdpa",
    method: str = "trace",
) -> ActivationProfile | None:
    """Activations per GPU, or None for a bare parameter count (no shapes)."""
    if not spec.has_shapes:
        return None
    if method == "trace":
        try:
            return trace_profile(spec, seq_len, precision, checkpointing, attention)
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
