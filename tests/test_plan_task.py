"""``dpkit plan --task``: the head the model is planned with (issue 54, item 3).

In process and fast: the CLI's flags parsed by its own parser, models on the meta device.
MiniLM is the bundled all-MiniLM-L6-v2 (``minilm``); its config.json names ``BertModel``,
a vocabulary of 30,522 tokens and 384 hidden units, which the expectations below use.
"""

from __future__ import annotations

import argparse
import json

import pytest

from dpkit.cli import main
from dpkit.engines import get_strategy
from dpkit.plan import check, cli, estimate
from dpkit.plan.activations import activation_profile, saved_bytes
from dpkit.plan.inputs import choose_task, load_planned_model
from dpkit.plan.recommend import make_plan

MIB = 2**20
MINILM_VOCAB = 30_522  # all-MiniLM-L6-v2's config.json, "vocab_size"
MICRO_BATCH, SEQ_LEN = 16, 128  # the recipe's --micro-batch-size 16 --max-seq-length 128
# An LM head's fp32 logits for one micro-batch: 16 x 128 x 30,522 x 4 bytes = 250,036,224.
LM_LOGITS_FP32 = MICRO_BATCH * SEQ_LEN * MINILM_VOCAB * 4


def _request(*flags: str):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli.request_from_args(parser.parse_args(list(flags)))


def _minilm_plan(task: str):
    flags = ["--model", "minilm", "--task", task, "--precision", "fp32"]
    return make_plan(*_request(*flags, "--micro-batch", "16", "--seq-len", "128"))


def test_the_minilm_classifier_is_charged_no_vocabulary_logits():
    """fp32, micro-batch 16 x 128 tokens. The classifier's logits are 16 x 2, so its
    logits peak (the logits and cross-entropy's two fp32 gradients) is 16 x 2 x (4 + 4 + 4)
    = 384 bytes, and what it saves outside its six layers (embeddings, pooler, head, loss)
    is a few hidden-state tensors of 16 x 128 x 384 x 4 = 3,145,728 bytes: under four of
    them, nowhere near one LM logits tensor of 16 x 128 x 30,522 x 4 = 250,036,224 bytes.
    The causal LM's peak is 16 x 128 x 30,522 x 12 = 750,108,672 bytes, and it also saves
    fp32 log-probabilities of the same 250,036,224 bytes: the classifier is charged at
    least 16 x 128 x 30,522 x 16 = 1,000,144,896 bytes less (its layers save the same)."""
    classifier, causal_lm = _minilm_plan("classification"), _minilm_plan("causal_lm")
    assert (classifier.task.task, classifier.task.num_labels) == ("classification", 2)
    assert classifier.inputs.model.task == "BertForSequenceClassification"
    assert causal_lm.inputs.model.task == "BertLMHeadModel"
    for strategy in ("ddp", "zero2", "fsdp2_full_shard"):
        parts = classifier.row(strategy).activation_parts
        assert parts["logits_peak"] == 16 * 2 * (4 + 4 + 4)
        assert parts["outside_layers"] < 4 * 16 * 128 * 384 * 4 < LM_LOGITS_FP32, parts
        lm_row = causal_lm.row(strategy)
        assert lm_row.activation_parts["logits_peak"] == 16 * 128 * 30_522 * 12
        assert lm_row.activations - classifier.row(strategy).activations >= 16 * 128 * 30_522 * 16


def test_auto_plans_minilm_as_the_classifier_and_says_so(capsys):
    """MiniLM names ``BertModel`` (an encoder with no head): ``auto`` puts the recipe's
    2-label classifier on it, and the plan's one task line says why and how to change it."""
    assert main(["plan", "--model", "minilm", "--precision", "fp32", "--micro-batch", "16",
                 "--seq-len", "128"]) == 0  # fmt: skip
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    task_lines = [line for line in lines if line.startswith("task:")]
    assert task_lines == [
        "task: sequence classification, 2 labels (BertForSequenceClassification); --task auto: "
        "the config names BertModel, a bert encoder without a head: planned with the sequence "
        "classifier recipes/finetune.py trains on one; to change it: --task causal_lm, or "
        "--num-labels N"
    ]
    assert main(["plan", "--model", "minilm", "--task", "causal_lm", "--precision", "fp32",
                 "--micro-batch", "16", "--seq-len", "128", "--json"]) == 0  # fmt: skip
    planned = json.loads(capsys.readouterr().out)["task"]
    assert planned == {
        "task": "causal_lm",
        "num_labels": None,
        "model_class": "BertLMHeadModel",
        "chosen_by": "--task",
        "why": None,
    }


def _configs():
    from transformers import BertConfig, GPT2Config, LlamaConfig, RobertaConfig

    small = {"hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}
    llama = small | {"num_hidden_layers": 1, "num_key_value_heads": 2, "vocab_size": 100}
    return {
        # Built here: no architectures at all.
        "gpt2-local": (GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=100),
                       "causal_lm", None, "GPT2LMHeadModel"),
        "llama-local": (LlamaConfig(**llama), "causal_lm", None, "LlamaForCausalLM"),
        "llama-named-lm": (LlamaConfig(**llama, architectures=["LlamaForCausalLM"]),
                           "causal_lm", None, "LlamaForCausalLM"),
        "bert-local": (BertConfig(**small, num_hidden_layers=1, vocab_size=100),
                       "classification", 2, "BertForSequenceClassification"),
        # A classifier's own config, 5 labels: its head and its labels.
        "roberta-classifier": (
            RobertaConfig(**small, num_hidden_layers=1, vocab_size=100, num_labels=5,
                          architectures=["RobertaForSequenceClassification"]),
            "classification", 5, "RobertaForSequenceClassification"),
        "llama-classifier": (
            LlamaConfig(**llama, num_labels=3, architectures=["LlamaForSequenceClassification"]),
            "classification", 3, "LlamaForSequenceClassification"),
        "bert-masked-lm": (BertConfig(**small, num_hidden_layers=1, vocab_size=100,
                                      architectures=["BertForMaskedLM"]),
                           "BertForMaskedLM", None, "BertForMaskedLM"),
    }  # fmt: skip


@pytest.mark.parametrize("name", sorted(_configs()))
def test_auto_follows_the_configs_architectures(name, tmp_path):
    config, task, num_labels, built_as = _configs()[name]
    config.save_pretrained(tmp_path)  # a local config.json, as --model reads one
    spec, planned = load_planned_model(str(tmp_path))
    assert (planned.task, planned.num_labels, planned.chosen_by) == (task, num_labels, "auto")
    assert spec.task == built_as
    if num_labels is not None:
        assert spec.config.num_labels == num_labels


def test_num_labels_sizes_the_head():
    """--task classification --num-labels 7 on MiniLM: the head is 384 x 7 weights and 7
    biases, so the model has (384 + 1) x (7 - 2) = 1,925 parameters more than with 2."""
    two, _ = load_planned_model("minilm", "classification")
    seven, planned = load_planned_model("minilm", "classification", num_labels=7)
    assert (planned.num_labels, seven.config.num_labels) == (7, 7)
    assert seven.num_params - two.num_params == (384 + 1) * (7 - 2)


def test_an_explicit_task_overrides_the_configs_head():
    from transformers import LlamaConfig

    classifier = LlamaConfig(architectures=["LlamaForSequenceClassification"], num_labels=4)
    assert choose_task(classifier, "causal_lm").task == "causal_lm"
    assert choose_task(classifier, "classification").num_labels == 4
    assert choose_task(classifier, "classification", 9).num_labels == 9
    line = choose_task(classifier, "classification").line("LlamaForSequenceClassification")
    assert line == (
        "sequence classification, 4 labels (LlamaForSequenceClassification), "
        "as --task classification asks"
    )


def test_the_classifier_plan_is_the_one_against_plans_for_the_recipes_run():
    """``--against`` plans a recipes/finetune.py run of MiniLM from its run_config.json
    (dpkit.plan.check.recipe_model); ``--task classification`` must build the same model
    (same class, parameters, layout and config) and so trace the same activations. The
    figure: the recipe's 2-process DDP run at the measured batch of 16 x 56 tokens, fp32,
    recipe defaults, CPU kernels, is 187.2 MiB planned and measured (docs/plan.md,
    "Activations and buffers, checked")."""
    run_config = {"ModelConfig": {"model": "minilm"}, "TrainConfig": {"micro_batch_size": 16}}
    _, against, _, _ = check.recipe_model(run_config, "run_config.json")
    inputs, _ = _request("--model", "minilm", "--task", "classification", "--precision", "fp32",
                         "--gpus-per-node", "2", "--micro-batch", "16", "--seq-len", "56")  # fmt: skip
    spec = inputs.model
    assert spec == against
    assert spec.config.to_dict() == against.config.to_dict()
    profile = activation_profile(spec, 56, "fp32", False, "sdpa", device="cpu")
    row = estimate.estimate(
        inputs, get_strategy("ddp"), 16, profile, estimate.buffer_settings(spec, 2)
    )
    assert round(saved_bytes(row.activation_parts) / MIB, 1) == 187.2
