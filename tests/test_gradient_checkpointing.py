"""``--gradient-checkpointing`` refused where it cannot run, in one line, before anything
starts. (It running under every strategy, losses against one fp32 process, and its
activations planned against measured: tests/test_numerics.py and
tests/test_plan_activations_measured.py.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dpkit
from dpkit import models

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.subprocess_only
def test_a_model_without_checkpointing_support_is_refused_by_the_recipe(tmp_path):
    """transformers' CTRL declares no gradient checkpointing (supports_gradient_checkpointing
    is False in its modeling file): the LM recipe says so in one line, exit 2, writes nothing."""
    from transformers import CTRLConfig

    config_dir = tmp_path / "ctrl"
    CTRLConfig(
        vocab_size=300, n_embd=32, n_layer=1, n_head=2, dff=64, n_positions=256
    ).save_pretrained(config_dir)  # --model-config takes the folder, or its config.json
    output_dir = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable, str(REPO / "recipes" / "train_lm.py"), "--model-config",
            str(config_dir), "--gradient-checkpointing", "--max-steps", "1",
            "--output-dir", str(output_dir),
        ],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    errors = [line for line in output.splitlines() if "error:" in line]
    assert errors == [
        "train_lm.py: error: --gradient-checkpointing=True: CTRLLMHeadModel does not support "
        "gradient checkpointing (transformers' supports_gradient_checkpointing is False)"
    ], output[-3000:]
    assert not output_dir.exists()


def test_a_model_of_ones_own_is_refused_by_setup_naming_what_to_do(capsys):
    """A plain torch module has no transformers switch to turn: dpkit.setup refuses it in
    one line (exit 2) rather than run it uncheckpointed."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    args = dpkit.StrategyConfig(strategy="ddp", gradient_checkpointing=True)
    with pytest.raises(SystemExit) as exit_info:
        dpkit.setup(args, model=model, micro_batch_size=2)
    assert exit_info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].endswith(
        "error: --gradient-checkpointing=True: Sequential is not a transformers model; "
        "checkpoint its blocks with torch.utils.checkpoint in its own forward instead"
    ), lines


def test_a_transformers_model_without_support_is_refused_naming_it():
    """The same refusal as the recipe's, in process: CTRL's class sets
    supports_gradient_checkpointing = False (transformers' modeling_ctrl.py)."""
    from transformers import CTRLConfig, CTRLLMHeadModel

    with torch.device("meta"):
        model = CTRLLMHeadModel(CTRLConfig(vocab_size=300, n_embd=32, n_layer=1, n_head=2, dff=64))
    with pytest.raises(dpkit.UsageError) as refused:
        models.check_gradient_checkpointing(model)
    assert str(refused.value) == (
        "--gradient-checkpointing=True: CTRLLMHeadModel does not support gradient "
        "checkpointing (transformers' supports_gradient_checkpointing is False)"
    )


def test_enabling_recomputes_every_layer_with_the_non_reentrant_checkpoint():
    """What dpkit turns on: every layer wraps torch.utils.checkpoint.checkpoint with
    use_reentrant=False (the variant DDP, ZeRO and FSDP2 all run), and the model says so."""
    from transformers import BertConfig, BertModel

    config = BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        vocab_size=100,
    )  # fmt: skip
    model = BertModel(config)
    assert not models.is_gradient_checkpointing(model)
    assert not models.is_gradient_checkpointing(torch.nn.Linear(2, 2))  # not a transformers model
    models.enable_gradient_checkpointing(model)
    assert models.is_gradient_checkpointing(model)
    layers = model.encoder.layer
    assert len(layers) == 2
    for layer in layers:
        wrapped = layer._gradient_checkpointing_func  # transformers' GradientCheckpointingLayer
        assert wrapped.func is torch.utils.checkpoint.checkpoint
        assert wrapped.keywords == {"use_reentrant": False}
