"""A sharded checkpoint read by one process: ``--init-from`` (a new run from a checkpoint's
weights, a new head), the resume checks on its index, and ``dpkit consolidate``'s stream.

The checkpoint is a real one: a tiny BERT classifier trained one AdamW step by accelerate
in this process (no process group) and saved by dpkit's Checkpointer, sharded (the
default). The expectations are the trained model's own tensors, kept before the save.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification

from dpkit.checkpoints.checkpointer import Checkpointer, Position
from dpkit.checkpoints.consolidate import stream_to_model_folder
from dpkit.checkpoints.folder import verify_checkpoint
from dpkit.checkpoints.resume import check_same_model
from dpkit.checkpoints.warm_start import check_init_from, init_from
from dpkit.engines import STRATEGIES, engine_of
from dpkit.errors import UsageError
from dpkit.train.output import RunOutput, read_jsonl
from dpkit.train.run import RunInfo

TWO = {0: "rotten", 1: "fresh"}
THREE = {0: "mid", 1: "neg", 2: "pos"}


def bert(labels: dict[int, str], hidden: int = 32, seed: int = 0) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=100, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=2 * hidden, max_position_embeddings=64,
        id2label=labels, label2id={v: k for k, v in labels.items()},
    )  # fmt: skip
    return BertForSequenceClassification(config)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(checkpoint folder, the trained model's tensors by name, cloned before the save)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    out = tmp_path_factory.mktemp("run")
    accelerator = Accelerator(cpu=True)
    try:
        model = bert(TWO)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer = accelerator.prepare(model, optimizer)
        tokens = torch.arange(16).reshape(2, 8)
        accelerator.backward(model(input_ids=tokens, labels=torch.tensor([0, 1])).loss)
        optimizer.step()
        expected = {n: p.detach().clone() for n, p in model.named_parameters()}
        moments = {
            n: {k: v.clone() for k, v in optimizer.optimizer.state[p].items() if k != "step"}
            for n, p in model.named_parameters()
        }
        strategy = STRATEGIES["ddp"]
        info = RunInfo(
            strategy="ddp", strategy_source="test", distributed_type="NO", world_size=1,
            backend=None, device="cpu", wrapper="BertForSequenceClassification",
            zero_stage=0, precision="no", micro_batch_size=2, gradient_accumulation_steps=1,
            global_batch_size=2, learning_rate=1e-2, num_params=0,
        )  # fmt: skip
        run = SimpleNamespace(
            accelerator=accelerator, output=RunOutput(str(out), True), info=info,
            strategy=strategy, engine=engine_of(strategy),
        )  # fmt: skip
        path = Checkpointer(run, out, seed=0, model_name="org/tiny-bert").save(
            model, optimizer, None, Position(step=1)
        )
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    return path, expected, out, moments


def test_the_save_is_sharded_and_logged(trained):
    path, expected, out, _ = trained
    assert (path / "shards" / "__0_0.distcp").is_file() and not (
        path / "model.safetensors"
    ).exists()
    assert verify_checkpoint(path).step == 1
    (record,) = read_jsonl(out / "checkpoint_log.jsonl")
    assert record["step"] == 1 and record["checkpoint_format"] == "sharded"
    # One process wrote all: fp32 weight + exp_avg + exp_avg_sq, 12 bytes per parameter,
    # plus DCP's torch.save header per item (41 parameters x 3 items; measured 1.6 KB each).
    params = sum(t.numel() for t in expected.values())
    assert 12 * params < record["bytes_per_rank"][0] < 12 * params + 2_000 * 41 * 3
    assert record["seconds"] > 0


def test_init_from_copies_the_backbone_and_leaves_a_new_head_as_built(trained):
    path, expected, _, _ = trained
    fresh = bert(THREE, seed=1)
    head_before = fresh.classifier.weight.detach().clone()
    line = init_from(fresh, path)
    for name, param in fresh.named_parameters():
        if name.startswith("bert."):
            assert torch.equal(param, expected[name]), name
    assert torch.equal(fresh.classifier.weight, head_before)
    assert line.startswith(f"init from {path}: ")
    # 2 layers of 16 tensors, embeddings 5, pooler 2: 39 backbone tensors copied; the
    # head's weight and bias left as built.
    assert f"{39} of 41 weights copied" in line
    assert "classifier.weight [2, 32] -> [3, 32]" in line


def test_init_from_is_refused_with_resume_or_for_no_checkpoint(trained, tmp_path):
    path, _, _, _ = trained
    with pytest.raises(UsageError, match=r"--init-from=.*: not with --resume='latest'"):
        check_init_from(str(path), "latest")
    with pytest.raises(UsageError, match=r"--init-from=.*: no such checkpoint folder"):
        check_init_from(str(tmp_path / "nope"), None)
    assert check_init_from(str(path), None) == path
    other = BertForSequenceClassification(
        BertConfig(vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                   intermediate_size=8)
    )  # fmt: skip
    renamed = torch.nn.Sequential(other)  # every name prefixed "0.": nothing in common
    with pytest.raises(UsageError, match=r"no weight of the checkpoint has this model's names"):
        init_from(renamed, path)


def test_a_resume_into_other_shapes_is_refused_from_the_index(trained):
    path, _, _, _ = trained
    state = verify_checkpoint(path)
    with pytest.raises(UsageError) as refused:
        check_same_model(state, path, model=bert(TWO, hidden=48), model_name="org/tiny-bert")
    assert (
        "bert.embeddings.word_embeddings.weight is [100, 32] in the checkpoint, [100, 48]"
        in str(refused.value)
    )
    check_same_model(state, path, model=bert(TWO), model_name="org/tiny-bert")  # its own model


def test_consolidate_streams_into_several_files_that_from_pretrained_reads(trained, tmp_path):
    path, expected, _, _ = trained
    # The word embeddings are 100 x 32 x 4 = 12,800 bytes; 16 KB files split the model.
    files = stream_to_model_folder(path, tmp_path, max_shard_bytes=16_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert files == len(set(index["weight_map"].values())) > 1
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    loaded = BertForSequenceClassification.from_pretrained(tmp_path)
    for name, param in loaded.named_parameters():
        assert torch.equal(param, expected[name]), name


def test_consolidate_writes_one_file_below_the_limit(trained, tmp_path: Path):
    path, _, _, _ = trained
    assert stream_to_model_folder(path, tmp_path) == 1
    assert (tmp_path / "model.safetensors").is_file()
    assert not (tmp_path / "model.safetensors.index.json").exists()


def consolidate_cli(*args: str) -> int:
    import argparse

    from dpkit.checkpoints import consolidate

    parser = argparse.ArgumentParser()
    consolidate.add_arguments(parser)
    return consolidate.main(parser.parse_args(list(args)))


def test_consolidate_with_optimizer_writes_the_full_layout_a_resume_loads(trained, tmp_path):
    """The sharded checkpoint rewritten as ``--checkpoint-format full`` writes it; a fresh
    model and AdamW (another seed) loaded from it by the resume's own loader hold the
    trained weights and the Adam moments of step 1, bit for bit."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from dpkit.checkpoints.checkpointer import load_checkpoint
    from dpkit.core.shards import is_sharded

    path, expected, _, moments = trained
    out = tmp_path / "full"
    assert consolidate_cli(str(path), "--output-dir", str(out), "--with-optimizer") == 0
    assert not is_sharded(out) and verify_checkpoint(out).step == 1
    saved = torch.load(out / "optimizer.pt", weights_only=True)
    assert saved["step"] == 1 and saved["param_group_lrs"] == [1e-2]
    assert sorted(saved["moments"]) == sorted(expected)  # every parameter trains here
    accelerator = Accelerator(cpu=True)
    try:
        model = bert(TWO, seed=5)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        model, optimizer = accelerator.prepare(model, optimizer)
        state = load_checkpoint(engine_of("ddp"), accelerator, model, optimizer, None, out)
        assert state.step == 1
        for name, param in model.named_parameters():
            assert torch.equal(param, expected[name]), name
            loaded = optimizer.optimizer.state[param]
            for moment in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(loaded[moment], moments[name][moment]), (name, moment)
            assert float(loaded["step"]) == 1.0
        assert optimizer.optimizer.param_groups[0]["lr"] == 1e-2  # the saved lr, not 3e-4
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def test_consolidate_with_optimizer_refuses_what_it_would_ignore(trained, tmp_path):
    path, _, _, _ = trained
    with pytest.raises(UsageError, match=r"^--max-shard-mb=16.0: not with --with-optimizer"):
        consolidate_cli(
            str(path), "--output-dir", str(tmp_path), "--with-optimizer", "--max-shard-mb", "16"
        )
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_replicated_tensors_are_split_into_ranges_that_cover_them_once():
    """DDP's share of a replicated tensor per rank: 10 elements over 4 ranks, by hand
    (floor(10 r / 4) to floor(10 (r + 1) / 4)). Every MiniLM tensor has an even size, so
    the 2-process runs cannot see a split that drops a remainder."""
    from dpkit.core.shards import even_range, replicated_shard

    assert [even_range(10, r, 4) for r in range(4)] == [(0, 2), (2, 3), (5, 2), (7, 3)]
    tensor = torch.arange(7.0)
    parts = [replicated_shard(tensor, r, 3) for r in range(3)]
    assert torch.equal(torch.cat([p.local for p in parts]), tensor)
    assert [p.offset for p in parts] == [0, 2, 4]
    assert replicated_shard(torch.arange(1.0), 0, 2) is None  # an empty share writes nothing
