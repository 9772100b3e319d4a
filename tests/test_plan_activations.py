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


def _gpt2_spec(**config_changes) -> plan_inputs.ModelSpec:
    from transformers import GPT2Config

    config = GPT2Config(
        n_layer=3, n_embd=16, n_head=2, vocab_size=50, n_positions=32, bos_token_id=0,
        eos_token_id=0, **config_changes,
    )  # fmt: skip
    return plan_inputs.ModelSpec(name="gpt2-tiny", source="path", num_params=1, config=config)


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
    spec = plan_inputs.ModelSpec(
        name="llama-tiny", source="path", num_params=1, config=config, gated_mlp=True
    )
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
    # ...unless the config lacks what the formula needs: one line, the model named.
    from transformers import PretrainedConfig

    shapeless = plan_inputs.ModelSpec(
        name="odd", source="path", num_params=1, config=PretrainedConfig()
    )
    with pytest.raises(UsageError) as err:
        activations.activation_profile(shapeless, 8, "bf16", False, "eager")
    assert str(err.value).startswith(
        "--model='odd': cannot estimate activations (meta-device trace failed (this model "
        "does not run on meta); the formula lacks shapes: "
    )
    assert str(err.value).endswith("); --params counts model states only")
    # Asked for the formula, the trace is not tried.
    asked = activations.activation_profile(spec, 8, "bf16", False, "eager", method="formula")
    assert asked.method == "formula" and asked.note == ""
    count = plan_inputs.ModelSpec(name="1B", source="count", num_params=10**9)
    assert activations.activation_profile(count, 8, "bf16", False) is None


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
    spec = plan_inputs.ModelSpec(
        name="ns", source="path", num_params=1, config=SimpleNamespace(**names)
    )
    profile = activations.formula_profile(spec, 8, "bf16", False, "eager")
    sh = 8 * 16
    layer = 16 * sh + 2 * 2 * 8 * 64 + 2 * 64 * 2
    layer += 2 * sh * hidden + 3 * 2 * 64 * attention
    assert profile.per_sample == {
        "outside_layers": 4 * sh + sh * embedding, "layers": 3 * layer, "logits_peak": 0.0,
    }  # fmt: skip
