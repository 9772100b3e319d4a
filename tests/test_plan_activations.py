"""The activation arithmetic of ``dpkit plan`` pinned term by term (the formula and the trace).

Whether the figures are right is tests/test_plan_activations_measured.py's job (the trace
against dpkit's probes on real forwards, issue #30); these tests pin the ones the code documents: Korthikanti et al.
2022's per-layer terms, generalised one flag at a time, and a meta-device trace whose
parts add up to what a real forward saves. A change to either shows here first.

The formula's reference figure, section 4.1 with 16-bit activations, s = 10 tokens,
h = 8, a = 2 heads, an MLP of 4h: s*h*(34 + 5*a*s/h) = 80 * 46.5 = 3,720 bytes per layer.
"""

from __future__ import annotations

import pytest

from dpkit.core.spec import ModelSpec
from dpkit.errors import UsageError
from dpkit.plan import activations
from dpkit.plan import inputs as plan_inputs

S, H, HEADS = 10, 8, 2
PAPER = S * H * (34 + 5 * HEADS * S / H)  # 3,720


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({}, PAPER),
        # Without hidden dropout: no 1-byte masks after attention and after the MLP.
        ({"hidden_dropout": False}, PAPER - 2 * S * H),
        # Without attention dropout: per score, no mask (1 B) and no dropout output (2 B).
        ({"attention_dropout": False}, PAPER - 3 * HEADS * S * S),
        # A fused kernel keeps no s x s scores: 34sh, the paper's selective recomputation.
        ({"eager_attention": False}, 34 * S * H),
        # Gated MLP: gate and up outputs, the activation's and the product, 4 x 2 B x s x 4h
        # instead of 2 x.
        ({"gated_mlp": True}, PAPER + 2 * 2 * S * 4 * H),
        # One K/V head of two: K and V are half as wide, 2sh bytes less.
        ({"kv_heads": 1}, PAPER - 2 * S * H * 0.5 * 2),
        # An MLP of 20 instead of 32: 2 x 2 B x s x 12 less.
        ({"intermediate": 20}, PAPER - 2 * 2 * S * 12),
        # fp32 activations: every 2-byte term doubles, the 1-byte masks stay.
        ({"act_bytes": 4}, 2 * PAPER - 2 * S * H - HEADS * S * S),
    ],
)
def test_formula_terms_one_flag_at_a_time(change, expected):
    assert activations.formula_layer_bytes(S, H, HEADS, **change) == pytest.approx(expected)


def _gpt2_spec(**config_changes) -> ModelSpec:
    from transformers import GPT2Config

    config = GPT2Config(
        n_layer=3, n_embd=16, n_head=2, vocab_size=50, n_positions=32, bos_token_id=0,
        eos_token_id=0, **config_changes,
    )  # fmt: skip
    return ModelSpec(name="gpt2-tiny", source="path", num_params=1, config=config)


def test_formula_profile_of_a_small_gpt2():
    """GPT-2, 3 layers of h = 16 (an MLP of 4h), 2 heads, vocabulary 50, dropout 0.1
    everywhere, s = 8, bf16. Per sample:

    * a layer: attention 2sh (QKV input) + 2sh x 2 (Q, K) + 2sh (V) + 2sh (projection
      input) + sh (mask) = 11sh, plus 2 heads x s^2 x (2 + 1 + 2) = 640 for the eager
      scores; MLP 2sh + 2 x 2 x s x 64 + sh; norms 4sh: 11 x 128 + 640 + 3 x 128 + 2048 +
      4 x 128 = 4,992;
    * outside the layers: the embedding's dropout mask (sh), the final norm's and the head's
      16-bit inputs (4sh), cross-entropy's fp32 log-probabilities (4 x s x 50): 2,240;
    * the logits' peak: 16-bit logits and two fp32 gradients, s x 50 x (2 + 4 + 4): 4,000.
    """
    sh = 8 * 16
    layer = 11 * sh + 2 * 64 * 5 + (3 * sh + 4 * 8 * 64) + 4 * sh
    profile = activations.formula_profile(_gpt2_spec(), 8, "bf16", False, "eager")
    assert profile.method == "formula" and profile.note == ""
    expected = {"outside_layers": 5 * sh + 4 * 8 * 50, "layers": 3 * layer, "logits_peak": 4000}
    assert profile.at_one == profile.per_sample == expected
    assert profile.fixed == dict.fromkeys(expected, 0.0)
    assert profile.parts(5) == {k: 5 * v for k, v in expected.items()}
    # Checkpointing keeps each layer's 16-bit input, and one layer at a time.
    checkpointed = activations.formula_profile(_gpt2_spec(), 8, "bf16", True, "eager")
    assert checkpointed.per_sample == {
        "outside_layers": 5 * sh + 4 * 8 * 50, "layer_inputs": 3 * 2 * sh, "one_layer": layer,
        "logits_peak": 4000,
    }  # fmt: skip
    # No dropout anywhere (GPT-2's three probabilities): no masks, and the softmax output
    # is the scores' matmul input. fp32: 4-byte activations, an fp32 logits peak.
    plain = activations.formula_profile(
        _gpt2_spec(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), 8, "fp32", False, "sdpa"
    )
    plain_layer = 4 * 5 * sh + (4 * sh + 2 * 4 * 8 * 64) + 8 * sh  # attention 5 x 4sh
    assert plain.per_sample == {
        "outside_layers": 8 * sh + 4 * 8 * 50, "layers": 3 * plain_layer,
        "logits_peak": 8 * 50 * 12,
    }  # fmt: skip
    # GPT-2's own name for a narrower MLP, n_inner = 40 instead of 4h = 64: each layer's
    # MLP saves two 16-bit s x i tensors, 2 x 2 x 8 x 24 bytes less.
    narrow = activations.formula_profile(_gpt2_spec(n_inner=40), 8, "bf16", False, "eager")
    assert narrow.per_sample["layers"] == 3 * (layer - 2 * 2 * 8 * 24)


def test_formula_profile_reads_the_llama_names_of_the_same_shapes():
    """Llama: hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, K/V
    heads, a gated MLP (the spec's flag), attention_dropout 0 and no hidden dropout (the
    config has no such field): 2 layers, h = 16, 4 heads of which 2 K/V, i = 24, s = 8,
    bf16, sdpa. A layer: 2sh + 2sh x 1.5 + 2sh x 0.5 + 2sh = 8sh; MLP 2sh + 4 x 2 x s x
    24; norms 4sh: 14sh + 1,536. Outside: 4sh + 4 x s x vocab 40."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=24, vocab_size=40, max_position_embeddings=32,
    )  # fmt: skip
    spec = ModelSpec(name="llama-tiny", source="path", num_params=1, config=config, gated_mlp=True)
    profile = activations.formula_profile(spec, 8, "bf16", False, "sdpa")
    sh = 8 * 16
    assert profile.per_sample == {
        "outside_layers": 4 * sh + 4 * 8 * 40, "layers": 2 * (14 * sh + 1536),
        "logits_peak": 8 * 40 * 10,
    }  # fmt: skip


def test_a_model_the_meta_device_cannot_run_falls_back_to_the_formula(monkeypatch):
    def no_meta(*args, **kwargs):
        raise RuntimeError("this model does not run on meta\nsecond line")

    monkeypatch.setattr(activations, "trace_profile", no_meta)
    spec = _gpt2_spec()
    profile = activations.activation_profile(spec, 8, "bf16", False, "eager")
    assert profile.method == "formula"
    assert profile.note == "meta-device trace failed (this model does not run on meta)"
    formula = activations.formula_profile(spec, 8, "bf16", False, "eager")
    assert (profile.at_one, profile.fixed, profile.per_sample) == (
        formula.at_one, formula.fixed, formula.per_sample,
    )  # fmt: skip
    # The fallback keeps the run's checkpointing and attention: test_formula_profile_of_a_
    # small_gpt2's checkpointed figures, eager scores included.
    sh = 8 * 16
    layer = 11 * sh + 2 * 64 * 5 + (3 * sh + 4 * 8 * 64) + 4 * sh
    checkpointed = {
        "outside_layers": 5 * sh + 4 * 8 * 50, "layer_inputs": 3 * 2 * sh, "one_layer": layer,
        "logits_peak": 4000,
    }  # fmt: skip
    fallback = activations.activation_profile(spec, 8, "bf16", True, "eager")
    assert fallback.method == "formula" and fallback.per_sample == checkpointed
    # ...unless the config lacks what the formula needs: one line, the model named.
    from transformers import PretrainedConfig

    shapeless = ModelSpec(name="odd", source="path", num_params=1, config=PretrainedConfig())
    with pytest.raises(UsageError) as err:
        activations.activation_profile(shapeless, 8, "bf16", False, "eager")
    # (The formula's error is Python's, multiplying the missing layer count.)
    assert str(err.value) == (
        "--model='odd': cannot estimate activations (meta-device trace failed (this model "
        "does not run on meta); the formula lacks shapes: unsupported operand type(s) for "
        "*: 'int' and 'NoneType'); --params counts model states only"
    )
    # Asked for the formula, the trace is not tried; checkpointing and attention still count.
    asked = activations.activation_profile(spec, 8, "bf16", True, "eager", method="formula")
    assert asked.method == "formula" and asked.note == ""
    assert asked.per_sample == checkpointed
    fused = activations.activation_profile(spec, 8, "bf16", True, "sdpa", method="formula")
    assert fused.per_sample["one_layer"] == layer - 2 * 64 * 5  # no eager scores
    count = ModelSpec(name="1B", source="count", num_params=10**9)
    assert activations.activation_profile(count, 8, "bf16", False) is None


def test_the_trace_is_of_the_attention_asked_for():
    """Traced, eager attention keeps the s x s scores a fused kernel recomputes in backward:
    more bytes in the layers, the same outside them."""
    spec = _gpt2_spec()
    eager = activations.activation_profile(spec, 8, "bf16", False, "eager").per_sample
    fused = activations.activation_profile(spec, 8, "bf16", False, "sdpa").per_sample
    assert eager["layers"] > fused["layers"]
    assert eager["outside_layers"] == fused["outside_layers"]


def test_the_trace_splits_layers_outside_and_the_logits_peak():
    """The meta-device trace of the small GPT-2 without dropout, fp32, sdpa: its parts
    are the real forward's saved bytes (tests/test_plan.py checks their sum on the CPU);
    here each part's rules: the logits peak is s x vocab x (4 + 4 + 4) per sample, from 2
    on the parts are a line (fixed + per sample x n), and checkpointing keeps each layer's
    fp32 input (4sh) and the largest layer."""
    spec = _gpt2_spec(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    traced = activations.trace_profile(spec, 8, "fp32", checkpointing=False, attention="sdpa")
    assert traced.method == "trace"
    assert set(traced.per_sample) == {"outside_layers", "layers", "logits_peak"}
    assert traced.per_sample["logits_peak"] == 8 * 50 * 12
    assert traced.fixed["logits_peak"] == 0
    for n in (2, 3, 7):
        assert traced.parts(n) == {
            k: traced.fixed[k] + n * traced.per_sample[k] for k in traced.per_sample
        }
    checkpointed = activations.trace_profile(spec, 8, "fp32", checkpointing=True, attention="sdpa")
    assert checkpointed.per_sample["layer_inputs"] == 3 * 4 * 8 * 16
    assert checkpointed.per_sample["one_layer"] == pytest.approx(traced.per_sample["layers"] / 3)
    assert checkpointed.per_sample["outside_layers"] == traced.per_sample["outside_layers"]


@pytest.mark.parametrize(
    ("names", "dropout"),
    [
        # GPT-2's names, read from a config without transformers' aliases.
        ({"n_layer": 3, "n_head": 2, "n_embd": 16, "n_inner": 64, "resid_pdrop": 0.1,
          "attn_pdrop": 0.1, "embd_pdrop": 0.1}, (True, True, True)),
        # BERT's.
        ({"num_hidden_layers": 3, "num_attention_heads": 2, "hidden_size": 16,
          "intermediate_size": 64, "hidden_dropout_prob": 0.1,
          "attention_probs_dropout_prob": 0.1}, (True, True, True)),
        # Other models': hidden_dropout and attention_dropout; the embedding's follows the
        # hidden dropout where the config names none of its own.
        ({"num_hidden_layers": 3, "num_attention_heads": 2, "d_model": 16,
          "intermediate_size": 64, "hidden_dropout": 0.1, "attention_dropout": 0.1},
         (True, True, True)),
        ({"num_hidden_layers": 3, "num_attention_heads": 2, "d_model": 16,
          "intermediate_size": 64, "hidden_dropout": 0.1, "embd_pdrop": 0.0},
         (True, False, False)),
        # No dropout named at all: none.
        ({"num_hidden_layers": 3, "num_attention_heads": 2, "hidden_size": 16,
          "intermediate_size": 64}, (False, False, False)),
    ],
)  # fmt: skip
def test_formula_profile_reads_each_family_of_config_names(names, dropout):
    """The same shapes under each family's names (a plain namespace: no transformers
    aliases between them), s = 8, bf16, eager, no vocabulary (no logits, no
    log-probabilities). Per sample and layer: 16-bit attention tensors 10sh, the MLP's
    input 2sh and its two 4h tensors 2 x 2 x s x 64, norms 4sh, 2 heads x s^2 x 2 B of
    softmax output; with hidden dropout two sh masks, with attention dropout 3 B more per
    score. Outside: the final norm's and the head's inputs 4sh and, with embedding
    dropout, one sh mask."""
    from types import SimpleNamespace

    hidden, attention, embedding = dropout
    spec = ModelSpec(name="ns", source="path", num_params=1, config=SimpleNamespace(**names))
    profile = activations.formula_profile(spec, 8, "bf16", False, "eager")
    sh = 8 * 16
    layer = 16 * sh + 2 * 2 * 8 * 64 + 2 * 64 * 2
    layer += 2 * sh * hidden + 3 * 2 * 64 * attention
    assert profile.per_sample == {
        "outside_layers": 4 * sh + sh * embedding, "layers": 3 * layer, "logits_peak": 0.0,
    }  # fmt: skip


def test_an_encoder_decoders_blocks_are_all_layers():
    """T5's blocks sit in two ModuleLists, the encoder's (2) and the decoder's (3): the
    classes transformers never splits (``_no_split_modules``) find all five, where the
    largest ModuleList alone would miss the encoder's."""
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        d_model=16, d_ff=32, num_layers=2, num_decoder_layers=3, num_heads=2, d_kv=8,
        vocab_size=40,
    )  # fmt: skip
    with torch.device("meta"):
        model = T5ForConditionalGeneration(config)
    blocks = activations._repeated_layers(model)
    assert len(blocks) == 5
    assert {id(b) for b in blocks} == {id(b) for b in (*model.encoder.block, *model.decoder.block)}


@pytest.mark.parametrize(
    ("problem_type", "num_labels"),
    [(None, 3), ("multi_label_classification", 3), (None, 1)],  # 1 label: regression
)
def test_a_classifiers_loss_is_traced_with_the_labels_its_head_takes(problem_type, num_labels):
    """A sequence classifier's loss is part of its forward: class ids, float multi-hot
    targets or, with one label, float regression targets (each the wrong kind fails the
    loss). Its logits peak is per sample num_labels x (2 + 4 + 4) bytes in bf16, as an
    LM's is per token: the 16-bit logits and cross-entropy's two fp32 gradients."""
    from transformers import BertConfig

    config = BertConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        vocab_size=40, max_position_embeddings=32, num_labels=num_labels,
        problem_type=problem_type,
    )  # fmt: skip
    spec = ModelSpec(
        name="bert-tiny", source="path", num_params=1, config=config,
        task="sequence_classification",
    )  # fmt: skip
    profile = activations.trace_profile(spec, 8, "bf16", False, "sdpa")
    assert profile.at_one["logits_peak"] == num_labels * (2 + 4 + 4)
    assert profile.per_sample["logits_peak"] == num_labels * (2 + 4 + 4)


def test_without_blocks_named_the_largest_module_list_is_the_layers():
    """A model that names no unsplittable blocks (no ``_no_split_modules``, or none of its
    classes): the children of its largest ModuleList by parameters; none without one."""
    import torch

    class Plain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.small = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(5)])
            self.large = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(3)])

    model = Plain()
    assert activations._repeated_layers(model) == list(model.large)
    model._no_split_modules = ["NotHere"]
    assert activations._repeated_layers(model) == list(model.large)
    assert activations._repeated_layers(torch.nn.Linear(2, 2)) == []


def _saved_under(mode, call) -> list[tuple[tuple[int, ...], str]]:
    """The (shape, dtype) of each tensor autograd saves while ``call`` runs under ``mode``."""
    import torch

    saved = []

    def pack(tensor):
        saved.append((tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")))
        return tensor

    with mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        call()
    return saved


def test_the_kernels_a_trace_imitates_attention_and_dropout():
    """What ``_kernel_mode`` makes meta save, op by op, on (batch 1, 2 heads, 8 rows, 4)
    queries. A fused SDPA kernel keeps q, k, v, its output and an fp32 log-sum-exp per
    row, never the 8 x 8 scores; a CPU with attention dropout, given by name or by
    position, runs the math kernel, which keeps them. A GPU's dropout keeps a 1-byte
    mask."""
    import torch
    import torch.nn.functional as F

    q = torch.zeros((1, 2, 8, 4), device="meta", requires_grad=True)
    fused = [((1, 2, 8, 4), "float32")] * 4 + [((1, 2, 8), "float32")]

    def attention(*args, **kwargs):
        return lambda: F.scaled_dot_product_attention(q, q, q, *args, **kwargs)

    cpu, gpu = activations._kernel_mode("cpu"), activations._kernel_mode("cuda")
    assert _saved_under(gpu, attention()) == fused
    assert _saved_under(gpu, attention(None, 0.1)) == fused
    assert _saved_under(cpu, attention()) == fused
    assert _saved_under(cpu, attention(None)) == fused
    assert _saved_under(cpu, attention(None, 0.0)) == fused
    math_kernel = _saved_under(cpu, attention(dropout_p=0.1))
    assert ((1, 2, 8, 8), "float32") in math_kernel
    assert _saved_under(cpu, attention(None, 0.1)) == math_kernel
    x = torch.zeros((2, 3), device="meta", requires_grad=True) * 1  # not a leaf
    assert _saved_under(gpu, lambda: F.dropout(x, 0.1)) == [((2, 3), "bool")]
    assert _saved_under(gpu, lambda: F.dropout(x, 0.1, False)) == []  # evaluation


def test_the_kernels_a_trace_imitates_autocast():
    """Autocast over fp32 weights, as ``torch.autocast`` does it: a matmul's inputs in 16
    bits, by position or by keyword, each weight cast once per forward (both matmuls save
    the one copy); on a GPU softmax and norms in fp32, on a CPU in their input's dtype;
    an op on neither list (tanh) left in its input's dtype; losses in fp32 on both."""
    import torch
    import torch.nn.functional as F

    weight = torch.zeros((3, 3), device="meta", requires_grad=True)  # a leaf: a weight
    x = torch.zeros((2, 3), device="meta", requires_grad=True) * 1  # an activation
    bf16 = torch.bfloat16
    gpu, cpu = activations._kernel_mode("cuda", bf16), activations._kernel_mode("cpu", bf16)
    with gpu:
        by_position, by_keyword = F.linear(x, weight), F.linear(input=x, weight=weight)
        twice = F.linear(F.linear(x, weight), weight)
        assert by_position.dtype == by_keyword.dtype == twice.dtype == bf16
        assert F.softmax(x.to(bf16), -1).dtype == torch.float32
        assert F.layer_norm(x.to(bf16), (3,)).dtype == torch.float32
        assert torch.tanh(x.to(bf16)).dtype == bf16
    assert len(gpu.weight_copies) == 1
    target = torch.zeros((2,), dtype=torch.long, device="meta")
    with cpu:
        assert F.softmax(x.to(bf16), -1).dtype == bf16
        assert F.cross_entropy(x.to(bf16), target).dtype == torch.float32
    with activations._kernel_mode("cuda", bf16):
        assert F.cross_entropy(x.to(bf16), target).dtype == torch.float32
    storages = []
    with (
        activations._kernel_mode("cuda", bf16),
        torch.autograd.graph.saved_tensors_hooks(
            lambda t: storages.append((t.untyped_storage()._cdata, t.dtype)) or t, lambda t: t
        ),
    ):
        F.linear(F.linear(x, weight), weight)
    weight_copies = {key for key, dtype in storages if dtype == bf16}
    activations_saved = len(storages) - sum(1 for _, dtype in storages if dtype == bf16)
    assert activations_saved == 0  # every matmul input, the activation too, in 16 bits
    assert len(storages) == 4 and len(weight_copies) == 3  # x, 1 weight copy, 1st output


def _tiny_lm(labelled: bool = True, in_a_list: bool = True):
    """An LM of its own on the meta device, small enough to count by hand: an embedding
    (vocabulary 10, hidden 4), two blocks of Linear(4, 4) + ReLU in a ModuleList (each a
    transformers ``GradientCheckpointingLayer``, as every decoder layer is), a head
    without bias, cross-entropy. Named ``...LMHeadModel`` so that the trace gives it
    token labels; ``labelled=False`` makes it a bare model (no head's loss, no logits);
    ``in_a_list=False`` holds the blocks as plain attributes, where the trace finds no
    layers (no ModuleList, no unsplittable classes named)."""
    from types import SimpleNamespace

    import torch
    import torch.nn.functional as F
    from transformers.modeling_layers import GradientCheckpointingLayer

    class Block(GradientCheckpointingLayer):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.relu(self.linear(x))

    class TinyLMHeadModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = SimpleNamespace()
            self.embed = torch.nn.Embedding(10, 4)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
            self.head = torch.nn.Linear(4, 10, bias=False)

        def forward(self, input_ids, labels):
            x = self.embed(input_ids)
            for block in self.blocks:
                x = block(x)
            logits = self.head(x)
            loss = F.cross_entropy(logits.view(-1, 10), labels.view(-1))
            return SimpleNamespace(loss=loss, logits=logits)

    class TinyModel(TinyLMHeadModel):  # a bare model: its output has no logits
        def forward(self, input_ids):
            x = self.embed(input_ids)
            for block in self.blocks:
                x = block(x)
            return SimpleNamespace(last_hidden_state=x)

    with torch.device("meta"):
        model = (TinyLMHeadModel if labelled else TinyModel)().train()
    if not in_a_list:  # the same blocks as attributes: no layers found
        first, second = model.blocks
        del model.blocks
        model.first, model.second = first, second
        model.blocks = (first, second)  # a plain tuple: not a module, not a ModuleList
    return model


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_one_trace_counts_each_saved_storage_once_by_where_it_was_saved(device):
    """``_trace_once`` on the hand-countable LM, batch 2 x 3 tokens (6 tokens), by torch's
    autograd rules: Linear saves its input (its weight is a model state: not counted),
    ReLU its output, an embedding its int64 indices, log_softmax its output, nll_loss its
    int64 target and a 4-byte total weight. Each storage once: block 2's Linear saves
    block 1's ReLU output and the head block 2's, counted where first saved. The layers
    are the ModuleList's children (the model names no unsplittable blocks)."""
    import torch

    model = _tiny_lm()
    tokens = 2 * 3
    fp32 = activations._trace_once(model, 2, 3, device)
    assert fp32 == {
        # block 1: the embedding's output (Linear) and its ReLU output; block 2: its ReLU.
        "layers": [2 * tokens * 4 * 4.0, tokens * 4 * 4.0],
        # indices, log-probabilities (fp32), target, total weight
        "outside": tokens * 8 + tokens * 10 * 4 + tokens * 8 + 4.0,
        "logits_elements": tokens * 10.0,
        "logits_bytes": tokens * 10 * 4.0,
        "weight_copies": 0.0,
    }
    # Under autocast (bf16): the Linears' inputs and their weights in 16 bits; a weight's
    # copy is saved by the Linear and set apart (2 x 16 + 40 weights x 2 B); the biases are
    # cast but not saved. The loss is in fp32: its log-probabilities stay 4 B.
    bf16 = activations._trace_once(model, 2, 3, device, torch.bfloat16)
    assert bf16 == {
        "layers": [2 * tokens * 4 * 2.0, tokens * 4 * 2.0],
        "outside": tokens * 8 + tokens * 10 * 4 + tokens * 8 + 4.0,
        "logits_elements": tokens * 10.0,
        "logits_bytes": tokens * 10 * 2.0,
        "weight_copies": (2 * 16 + 40) * 2.0,
    }
    # A bare model (no head dpkit knows how to label): no loss traced, no logits counted.
    unlabelled = activations._trace_once(_tiny_lm(labelled=False), 2, 3, device)
    assert unlabelled["outside"] == tokens * 8  # the indices only
    assert unlabelled["logits_bytes"] == unlabelled["logits_elements"] == 0
    assert unlabelled["layers"] == fp32["layers"]


def test_a_profile_is_the_line_through_the_traces_at_two_and_three():
    """``_profile_from_traces`` on the hand-countable LM, 3 tokens a sample: per sample what
    one sample adds (the test above, per 3 tokens), fixed the 4-byte total weight, which
    does not grow with the batch; the logits peak per sample is the logits and
    cross-entropy's two fp32 gradients, 3 x 10 x (4 + 8) in fp32 and 3 x 10 x (2 + 8)
    under autocast, whose weight copies are fixed (2 B x 72 weights)."""
    import torch

    model = _tiny_lm()
    fp32 = activations._profile_from_traces(model, 3, False, "cuda", None)
    per_sample = {
        "outside_layers": 3 * 8 + 3 * 10 * 4 + 3 * 8,
        "layers": 3 * 4 * 4 * 3,
        "logits_peak": 3 * 10 * (4 + 8),
    }
    assert fp32.method == "trace"
    assert fp32.per_sample == per_sample
    assert fp32.fixed == {"outside_layers": 4, "layers": 0, "logits_peak": 0}
    assert fp32.at_one == {k: per_sample[k] + fp32.fixed[k] for k in per_sample}
    mixed = activations._profile_from_traces(model, 3, False, "cuda", torch.bfloat16)
    assert mixed.per_sample == {
        "outside_layers": 3 * 8 + 3 * 10 * 4 + 3 * 8,
        "layers": 3 * 4 * 2 * 3,
        "autocast_weight_copies": 0,
        "logits_peak": 3 * 10 * (2 + 8),
    }
    assert mixed.fixed == {
        "outside_layers": 4, "layers": 0, "autocast_weight_copies": 72 * 2, "logits_peak": 0,
    }  # fmt: skip


def test_a_checkpointed_profile_keeps_what_each_layer_is_recomputed_from():
    """Checkpointed (torch's non-reentrant checkpoint around each block, as a run's
    --gradient-checkpointing), the hand-countable LM keeps per sample of 3 tokens: each
    block's input (3 x 4 floats, twice) and, outside, the last block's output, which the
    head now saves (a plain run counted it in the block, as its ReLU's output): three
    tensors of 48 B in fp32. Backward recomputes one block at a time: the larger one,
    2 x 48 B (its Linear's input and its ReLU's output). Under autocast the first block's
    input is the embedding's fp32, the others bf16 (24 B); only the head's weight copy is
    saved (2 B x 40): the blocks' copies are made again in the recomputation."""
    import torch

    model = _tiny_lm()
    fp32 = activations._profile_from_traces(model, 3, True, "cuda", None)
    assert fp32.per_sample == {
        "outside_layers": 3 * 8 + 3 * 10 * 4 + 3 * 8,
        "layer_inputs": 3 * 48,
        "one_layer": 2 * 48,
        "logits_peak": 3 * 10 * (4 + 8),
    }
    assert fp32.fixed["outside_layers"] == 4 and fp32.fixed["layer_inputs"] == 0
    mixed = activations._profile_from_traces(model, 3, True, "cuda", torch.bfloat16)
    assert mixed.per_sample["layer_inputs"] == 48 + 24 + 24
    assert mixed.per_sample["one_layer"] == 2 * 24
    assert mixed.fixed["autocast_weight_copies"] == 2 * 40
    # The layers' switches are put back: the shared model traces plain again.
    assert not any(block.gradient_checkpointing for block in model.blocks)
    # A model whose layers the trace cannot find: all it saves counts as outside them
    # (the blocks' 3 x 48 B too), and checkpointed, no layer is found to recompute and
    # nothing is added: the checkpointed trace keeps no more than the plain one counted.
    unlisted = _tiny_lm(in_a_list=False)
    plain = activations._profile_from_traces(unlisted, 3, False, "cuda", None)
    assert plain.per_sample["layers"] == 0
    assert plain.per_sample["outside_layers"] == 3 * 8 + 3 * 10 * 4 + 3 * 8 + 3 * 48
    kept = activations._profile_from_traces(unlisted, 3, True, "cuda", None)
    assert kept.per_sample["outside_layers"] == plain.per_sample["outside_layers"]
    for part in ("one_layer", "layer_inputs"):
        assert kept.per_sample[part] == kept.fixed[part] == 0, part


def test_each_head_is_traced_with_the_labels_its_loss_takes():
    """By the model class's name, as transformers names its heads: a token label each
    (int64, batch x sequence) for an LM, a masked LM and a token classifier; per sample a
    class id, a multi-hot row or a regression target for a sequence classifier; none for
    a bare model (its forward computes no loss). On the meta device, as the model is."""
    from types import SimpleNamespace

    import torch

    def labels(class_name, **config):
        model = type(class_name, (), {"config": SimpleNamespace(**config)})()
        found = activations._trace_labels(model, 2, 5)
        return None if found is None else (tuple(found.shape), found.dtype, found.device.type)

    per_token = ((2, 5), torch.long, "meta")
    for head in ("ForCausalLM", "LMHeadModel", "ForMaskedLM", "ForTokenClassification"):
        assert labels(f"Tiny{head}") == per_token, head
    sequence = "TinyForSequenceClassification"
    assert labels(sequence, num_labels=3) == ((2,), torch.long, "meta")
    assert labels(sequence, num_labels=1) == ((2,), torch.float32, "meta")
    multi = labels(sequence, num_labels=3, problem_type="multi_label_classification")
    assert multi == ((2, 3), torch.float32, "meta")
    assert labels("TinyModel") is None


def test_a_decoder_classifier_without_a_padding_id_is_traced_with_one_of_its_own():
    """A decoder's sequence classifier finds each row's last token by the padding id, and
    transformers refuses a batch of more than one without it; GPT-2's config names none
    (the recipes set it from the tokenizer). The trace gives its own copy of the config
    one, so the plan is traced, not the formula's fallback, and the user's config is left
    as it was. Per sample the logits peak is 3 labels x (4 + 4 + 4) bytes in fp32."""
    from transformers import GPT2Config

    config = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=40, n_positions=16)
    config.num_labels = 3
    assert config.pad_token_id is None
    spec = plan_inputs.spec_from_config("gpt2-cls", "config", config, "sequence_classification")
    assert spec.task == "GPT2ForSequenceClassification"
    profile = activations.activation_profile(spec, 8, "fp32", False, "sdpa")
    assert (profile.method, profile.note) == ("trace", "")
    assert profile.per_sample["logits_peak"] == 3 * (4 + 4 + 4)
    assert spec.config.pad_token_id is None


def test_a_trace_imitates_only_the_devices_it_knows():
    """``trace_profile``'s device picks whose kernels the meta device imitates; another is
    refused with the two it knows, before any model is built."""
    with pytest.raises(UsageError) as err:
        activations.trace_profile(_gpt2_spec(), 8, "fp32", False, "sdpa", device="tpu")
    assert str(err.value) == "device='tpu': not one of cuda, cpu"


def test_lora_adapters_are_traced_on_the_modules_and_with_the_dropout_asked_for():
    """A LoRA run's frozen weights save less for backward and its adapters save their own
    inputs: the trace puts the adapters the spec records on its model. Which modules
    carry them changes the bytes (GPT-2's attention projection c_attn, peft's default,
    against the MLP's c_fc), so does the adapters' dropout (its masks and outputs), and a
    target given as one name (as a peft config may hold it) is that module, not the
    name's letters."""
    import dataclasses

    from transformers import GPT2Config

    from dpkit.lora import LoraSettings

    config = GPT2Config(
        n_layer=1, n_embd=8, n_head=2, vocab_size=40, n_positions=16, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip

    def layers(spec):
        profile = activations.activation_profile(spec, 8, "fp32", False, "sdpa")
        assert (profile.method, profile.note) == ("trace", "")
        return profile.per_sample["layers"]

    def adapted(targets, dropout=0.0):
        settings = LoraSettings(r=2, alpha=4, dropout=dropout, target_modules=targets)
        return plan_inputs.spec_from_config("gpt2-lora", "config", config, lora=settings)

    plain = layers(plan_inputs.spec_from_config("gpt2", "config", config))
    on_attention, on_mlp = layers(adapted(("c_attn",))), layers(adapted(("c_fc",)))
    assert plain > on_attention and plain > on_mlp  # frozen weights keep fewer inputs
    assert on_attention != on_mlp
    assert layers(adapted(("c_proj",), dropout=0.1)) > layers(adapted(("c_proj",)))
    one_name = adapted(("c_fc",))
    one_name = dataclasses.replace(one_name, lora={**one_name.lora, "target_modules": "c_fc"})
    assert layers(one_name) == on_mlp
