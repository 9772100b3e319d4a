"""Recipe arguments: validated when built, one line naming the field and the value."""

from __future__ import annotations

import pytest

from dpkit.errors import UsageError
from dpkit.train.config import StrategyConfig
from dpkit.train.finetune_config import (
    DataConfig,
    ModelConfig,
    TrainConfig,
    parse_finetune_args,
)


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (TrainConfig, {"micro_batch_size": 0}, "--micro-batch-size=0: must be > 0"),
        (TrainConfig, {"gradient_accumulation_steps": -1}, "--gradient-accumulation-steps=-1"),
        (TrainConfig, {"learning_rate": 0.0}, "--learning-rate=0.0"),
        (TrainConfig, {"max_steps": 0}, "--max-steps=0"),
        (TrainConfig, {"warmup_ratio": 1.5}, "--warmup-ratio=1.5"),
        (StrategyConfig, {"deepspeed": "missing.json"}, "--deepspeed='missing.json': no such file"),
        (ModelConfig, {"max_seq_length": -5}, "--max-seq-length=-5"),
        (ModelConfig, {"dropout": 1.0}, "--dropout=1.0"),
        (DataConfig, {"dataset": "nope.csv"}, "--dataset='nope.csv': no such file"),
        (DataConfig, {"validation_fraction": 0.0}, "--validation-fraction=0.0"),
    ],
)
def test_bad_values_name_field_and_value(cls, kwargs, message, tmp_path):
    kwargs.setdefault("output_dir", str(tmp_path)) if cls is TrainConfig else None
    with pytest.raises(UsageError) as err:
        cls(**kwargs)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_ddp_with_deepspeed_config_conflicts(tmp_path):
    with pytest.raises(UsageError, match="--strategy=ddp conflicts with --deepspeed"):
        StrategyConfig(strategy="ddp", deepspeed="ds_configs/zero2.json")


def test_output_dir_holding_a_run_is_not_overwritten(tmp_path):
    (tmp_path / "run_config.json").write_text("{}")
    (tmp_path / "run_info.json").write_text("{}")  # a run that started training
    with pytest.raises(UsageError, match="holds another run; pass --overwrite-output-dir"):
        TrainConfig(output_dir=str(tmp_path))
    TrainConfig(output_dir=str(tmp_path), overwrite_output_dir=True)
    assert (tmp_path / "run_config.json").read_text() == "{}"


def test_command_line_exits_2_with_one_line(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        parse_finetune_args(["--micro-batch-size", "0", "--output-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("--micro-batch-size=0: must be > 0")
    assert len(err.splitlines()) == 1


def test_dash_and_underscore_flags_and_deepspeed_local_rank(tmp_path):
    model, data, strategy, train = parse_finetune_args(
        [
            "--micro_batch_size",
            "4",
            "--max-steps",
            "3",
            "--local_rank=1",
            "--output-dir",
            str(tmp_path),
        ]
    )
    assert (train.micro_batch_size, train.max_steps) == (4, 3)


def test_dropout_override_covers_every_dropout_field():
    from transformers import BertConfig

    overrides = ModelConfig(dropout=0.0).dropout_overrides(BertConfig())
    assert overrides == {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    assert ModelConfig().dropout_overrides(BertConfig()) == {}


def test_a_bad_deepspeed_json_is_refused_when_the_flags_are_parsed(capsys, tmp_path):
    """parse_args reads the launch (dpkit.train.resolution.check_launch): a script that
    parses its flags first refuses a broken --deepspeed file before loading its model."""
    bad = tmp_path / "bad.json"
    bad.write_text('{"zero_optimization": {"stage": 2},}')
    with pytest.raises(SystemExit) as exit_info:
        parse_finetune_args(["--deepspeed", str(bad), "--output-dir", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.endswith(f"deepspeed config {str(bad)!r}: not valid JSON (Expecting property "
                        "name enclosed in double quotes: line 1 column 36 (char 35))")  # fmt: skip
