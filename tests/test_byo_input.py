"""What users bring that no recipe of ours ships: label conventions, column mix-ups, model
folders, DeepSpeed offload, launcher settings. In process, no process group: each case is
refused with one line naming the flag and its value, or handled and said.

(Whole launches of the same refusals, asserting the exit code and that nothing was
written, are in tests/test_bad_input.py.)
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from dpkit.data.classification import load_classification_splits
from dpkit.engines.deepspeed.config import optimizer_offload
from dpkit.errors import UsageError
from dpkit.memory.report import MemoryReport
from dpkit.models import load_tokenizer, local_model_path, max_positions
from dpkit.train.evaluation import ClassifierMetrics
from dpkit.train.finetune_config import TrainConfig
from dpkit.train.launcher import check_accelerate_settings, read_launch
from dpkit.train.output import check_output_dir
from tests.harness import REPO

MINILM = "sentence-transformers/all-MiniLM-L6-v2"


def _splits(tmp: Path, header: str, rows: list[str], text="text", label="label"):
    path = tmp / "data.csv"
    path.write_text("\n".join([header, *rows]) + "\n")
    return load_classification_splits(
        str(path),
        text_column=text,
        label_column=label,
        validation_fraction=0.1,
        test_fraction=0.1,
        split_seed=0,
    )


# ---- labels: decided from the label set ----------------------------------------------------


def test_labels_1_and_2_are_two_classes_not_three(tmp_path, caplog):
    rows = [f"review {i},{1 + i % 2}" for i in range(60)]
    with caplog.at_level(logging.INFO, logger="dpkit"):
        splits, names = _splits(tmp_path, "text,label", rows)
    assert names == ["1", "2"]
    assert {label for split in splits.values() for label in split["label"]} == {0, 1}
    assert [r.message for r in caplog.records if "mapped onto classes" in r.message] == [
        "labels [1, 2] are mapped onto classes 0..1 in this order (the model's id2label keeps "
        "the original values)"
    ]


@pytest.mark.parametrize(
    ("header", "rows", "columns", "message"),
    [
        pytest.param(
            "text,label",
            [f"review number {i},{i % 2}" for i in range(300)],
            ("label", "text"),
            "--text-column='label': holds int values (0), not text",
            id="swapped-columns",
        ),
        pytest.param(
            "text,label",
            [f"r{i},verdict {i}" for i in range(300)],
            ("text", "label"),
            "--label-column='label': 300 classes for 300 examples (fewer than 2 examples a class)",
            id="one-class-per-example",
        ),
        pytest.param(
            "text,label",
            [f"r{i},{0.5 + i % 2}" for i in range(40)],
            ("text", "label"),
            "--label-column='label': labels must be integers or strings, found float 0.5",
            id="float-labels",
        ),
        pytest.param(
            "text,label",
            [f"r{i},x" for i in range(40)],
            ("text", "text"),
            "--label-column='text': the same column as --text-column",
            id="same-column",
        ),
    ],
)
def test_label_and_text_columns_that_cannot_be_right(tmp_path, header, rows, columns, message):
    with pytest.raises(UsageError) as err:
        _splits(tmp_path, header, rows, *columns)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_f1_averaging_follows_the_label_set_and_is_named():
    """A 3-class model on a split where only classes 0 and 1 occur: macro F1 (named so),
    not the binary F1 of class 1 that the values alone would suggest."""
    three = ClassifierMetrics(num_labels=3)
    result = three.score(predictions=[0, 1, 1, 0, 1], references=[0, 1, 0, 0, 1])
    assert set(result) == {"samples", "accuracy", "f1_macro"}
    assert result["f1_macro"] == pytest.approx((0.8 + 0.8) / 2)
    two = ClassifierMetrics(num_labels=2).score(predictions=[0, 1, 1, 0], references=[0, 1, 0, 0])
    assert two["f1_binary"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("num_labels", [2, 3, 5, 11])
def test_scores_are_scikit_learns_bit_for_bit(num_labels):
    """The run counts accuracy and F1 itself (no sklearn import on every rank); scikit-learn
    is the reference, exactly: 100 random splits of 1 to 40 samples, including ones where a
    class (binary: the positive one) never occurs or is never predicted, where scikit-learn
    gives 0.0 with a warning, and macro F1 over more than 8 classes (numpy's pairwise sum)."""
    import random
    import warnings

    from sklearn.metrics import accuracy_score, f1_score

    metrics = ClassifierMetrics(num_labels=num_labels)
    rng = random.Random(num_labels)
    cases = [([0, 0, 0], [0, 0, 0]), ([1, 0], [0, 0]), ([0, 0], [1, 1])]
    for _ in range(100):
        size = rng.randint(1, 40)
        classes = rng.sample(range(num_labels), rng.randint(1, num_labels))
        cases.append(([rng.choice(classes) for _ in range(size)],
                      [rng.choice(range(num_labels)) for _ in range(size)]))  # fmt: skip
    for predictions, references in cases:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = {
                "samples": len(references),
                "accuracy": float(accuracy_score(references, predictions)),
                metrics.f1_key: float(f1_score(references, predictions, average=metrics.average)),
            }
        assert metrics.score(predictions, references) == expected, (predictions, references)


# ---- schedules that would train other steps than asked --------------------------------------


@pytest.mark.parametrize(
    ("train", "examples", "world", "message"),
    [
        (
            {"micro_batch_size": 8, "gradient_accumulation_steps": 8},
            100,
            2,
            "--gradient-accumulation-steps=8: more than the 6 micro-batches each of the 2 "
            "processes gets per epoch (100 examples / micro-batch 8)",
        ),
        (
            {"micro_batch_size": 16},
            40,
            4,
            "--micro-batch-size=16: x 4 processes is more than the 40 training examples",
        ),
    ],
)
def test_a_step_that_would_accumulate_fewer_micro_batches_is_refused(
    tmp_path, train, examples, world, message
):
    config = TrainConfig(output_dir=str(tmp_path / "run"), **train)
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config.schedule(examples, world)


def test_every_step_accumulates_whole():
    """10 micro-batches per process and accumulation 4: two steps of 4 an epoch, the last
    2 micro-batches left out (not a third step of 2 divided by 4)."""
    schedule = TrainConfig(
        output_dir="unused", micro_batch_size=1, gradient_accumulation_steps=4, num_epochs=3
    ).schedule(train_examples=20, world_size=2)
    assert (schedule.steps_per_epoch, schedule.micro_batches_per_epoch) == (2, 8)
    assert (schedule.total_steps, schedule.num_epochs) == (6, 3)


# ---- output folders ------------------------------------------------------------------------


def test_an_output_dir_that_cannot_be_created_is_refused_and_nothing_is_left(tmp_path):
    with pytest.raises(UsageError, match=r"--output-dir='/proc/dpkit-run/out': cannot be created"):
        check_output_dir("/proc/dpkit-run/out", overwrite=False)
    afile = tmp_path / "a-file"
    afile.write_text("")
    with pytest.raises(UsageError, match="is not a directory"):
        check_output_dir(str(afile / "run"), overwrite=False)
    check_output_dir(str(tmp_path / "new" / "deeper"), overwrite=False)
    assert not (tmp_path / "new").exists(), "the probe leaves nothing behind"


def test_a_folder_holding_only_a_failed_start_is_reusable(tmp_path):
    (tmp_path / "run_config.json").write_text("{}")  # a start that failed before training
    check_output_dir(str(tmp_path), overwrite=False)
    (tmp_path / "train_log.jsonl").write_text("{}\n")
    with pytest.raises(UsageError, match="holds another run"):
        check_output_dir(str(tmp_path), overwrite=False)


# ---- model folders -------------------------------------------------------------------------


def test_a_model_folder_without_tokenizer_files_is_refused(tmp_path):
    folder = tmp_path / "weights-only"
    shutil.copytree(local_model_path(MINILM), folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    from transformers import AutoConfig

    # transformers builds an empty BertTokenizer here (5 special tokens), without a word.
    config = AutoConfig.from_pretrained(folder)
    with pytest.raises(UsageError, match=r"--model='weights-only': its tokenizer has 5 tokens"):
        load_tokenizer(str(folder), "weights-only", config)


def test_a_tokenizer_with_neither_pad_nor_eos_is_refused(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(tmp_path)
    with pytest.raises(UsageError, match="no padding token and no end-of-sequence token"):
        load_tokenizer(str(tmp_path), "bare")


def test_roberta_positions_start_after_the_padding_index():
    from transformers import RobertaConfig

    assert max_positions(RobertaConfig(max_position_embeddings=514, pad_token_id=1)) == 512


# ---- DeepSpeed JSON and launcher settings --------------------------------------------------


def _zero2(**zero) -> dict:
    config = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    config["zero_optimization"].update(zero)
    return config


@pytest.mark.parametrize(
    ("zero", "message"),
    [
        (
            {"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}},
            "offload_optimizer.device='nvme': DeepSpeed offloads to NVMe only under ZeRO-3",
        ),
        (
            {"offload_param": {"device": "cpu"}},
            "offload_param.device='cpu': parameter offload is ZeRO-3's; under ZeRO-2",
        ),
    ],
)
def test_offload_deepspeed_would_not_run_as_written_is_refused(zero, message):
    with pytest.raises(UsageError, match=message):
        optimizer_offload(_zero2(**zero), "z.json")


def test_cpu_offload_is_recorded_where_the_run_says_what_it_is():
    assert optimizer_offload(_zero2(offload_optimizer={"device": "cpu"}), "z.json") == "cpu"
    assert optimizer_offload(_zero2(cpu_offload=True), "z.json") == "cpu"  # older spelling
    assert optimizer_offload(_zero2(), "z.json") is None
    report = MemoryReport(
        strategy="zero2",
        precision="fp32",
        world_size=2,
        num_params=100,
        ranks=[
            {"rank": r, "params": 400.0, "grads": 200.0, "optimizer": 400.0, "master": 200.0,
             "model_state_total": 1200.0, "buffers_total": 0.0, "buffers": {}}
            for r in range(2)
        ],
        offload_optimizer="cpu",
    )  # fmt: skip
    assert report.format_table().startswith("memory: zero2 (optimizer offloaded to cpu), 2 ranks")
    assert report.to_dict()["offload_optimizer"] == "cpu"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"},
            "accelerate config gradient_accumulation_steps=4 disagrees with the run's 1",
        ),
        (
            {"ACCELERATE_GRADIENT_CLIPPING": "0.5"},
            "accelerate config gradient_clipping=0.5 disagrees with the run's 1",
        ),
        # Offload in accelerate's settings is the DeepSpeed engine's to refuse:
        # tests/test_resolve_launch.py checks it, alone and through resolve().
    ],
)
def test_accelerate_settings_that_would_be_dropped_are_refused(env, message):
    with pytest.raises(UsageError, match=message):
        check_accelerate_settings(env, gradient_accumulation_steps=1, max_grad_norm=1.0)
    check_accelerate_settings(
        {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "1", "ACCELERATE_GRADIENT_CLIPPING": "1.0"},
        gradient_accumulation_steps=1,
        max_grad_norm=1.0,
    )


def test_a_deepspeed_file_under_accelerate_without_deepspeed_is_refused():
    env = {"ACCELERATE_DYNAMO_BACKEND": "NO", "WORLD_SIZE": "2"}
    with pytest.raises(UsageError, match="--deepspeed='z.json' conflicts with accelerate launch"):
        # The raw flags: the file is never read (StrategyConfig would first look for it).
        flags = SimpleNamespace(strategy="auto", deepspeed="z.json", mixed_precision=None)
        read_launch(flags, env, on_cuda=False)
