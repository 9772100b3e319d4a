"""LoRA (``--lora-r``, peft): the flags, the memory arithmetic and plan, and the recipe under
two strategies with a checkpoint resumed across them, ``dpkit plan --against`` and
``dpkit consolidate`` (the adapter folder and the merged model).

The numerics of every strategy against one plain peft process are in tests/test_numerics.py.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from dpkit.errors import UsageError
from tests.harness import (
    BIN,
    REPO,
    Launch,
    assert_refused,
    max_rel_diff,
    python_cmd,
    run,
    saved_moments,
    torchrun_cmd,
)

# ---- flags, before anything starts -------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"lora_r": 0}, "--lora-r=0: must be a rank >= 1"),
        ({"lora_r": -4}, "--lora-r=-4: must be a rank >= 1"),
        ({"lora_r": 8, "lora_alpha": 0.0}, "--lora-alpha=0.0: must be > 0"),
        ({"lora_r": 8, "lora_dropout": 1.0}, "--lora-dropout=1.0: must be in [0, 1)"),
        ({"lora_r": 8, "lora_target_modules": " , "}, "--lora-target-modules=' , ': name at least"),
        ({"lora_alpha": 32.0}, "--lora-alpha=32.0: has no effect without --lora-r"),
        ({"lora_target_modules": "query"}, "--lora-target-modules=query: has no effect without"),
    ],
)
def test_lora_flags_are_checked_when_built(fields, message):
    import dpkit

    with pytest.raises(UsageError) as err:
        dpkit.StrategyConfig(**fields)
    assert message in str(err.value)


def _meta_bert():
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    with torch.device("meta"):
        return BertForSequenceClassification(config)


def test_a_target_that_matches_no_layer_is_refused_naming_the_layers():
    from dpkit.lora import LoraSettings, apply_lora

    settings = LoraSettings(r=8, alpha=16.0, target_modules=("query", "qkv"))
    with pytest.raises(UsageError) as err:
        apply_lora(_meta_bert(), settings)
    message = str(err.value)
    assert message.startswith("--lora-target-modules=query,qkv: qkv matches no layer"), message
    for layer in ("query", "key", "value", "dense"):  # what BERT has, said in the line
        assert layer in message


def test_a_model_peft_has_no_default_for_must_name_its_layers():
    from dpkit.lora import LoraSettings, apply_lora

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with pytest.raises(UsageError) as err:
        apply_lora(model, LoraSettings(r=2, alpha=4.0))
    assert "name them with --lora-target-modules" in str(err.value)


def test_the_defaults_follow_the_architecture_and_train_a_classifiers_head():
    from dpkit.lora import LoraSettings, apply_lora

    model = apply_lora(_meta_bert(), LoraSettings(r=4, alpha=8.0))
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    # peft's default for BERT: query and value; the new head trains whole (SEQ_CLS).
    layers = {n.split(".attention.self.")[1].split(".")[0] for n in trainable if "lora_" in n}
    assert layers == {"query", "value"}
    assert [n for n in trainable if "classifier" in n] == [
        "base_model.model.classifier.modules_to_save.default.bias",
        "base_model.model.classifier.modules_to_save.default.weight",
    ]
    # 2 layers x 2 targets x (A 4 x 32 + B 32 x 4), plus the head's 32 x 2 + 2.
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 2 * 2 * 256 + 66


def test_prepare_refuses_a_lora_run_whose_model_or_optimizer_skipped_the_adapters():
    from accelerate.utils import DummyOptim

    from dpkit.lora import LoraSettings, apply_lora
    from dpkit.train.run import _check_lora  # what Run.prepare runs first

    settings = LoraSettings(r=2, alpha=4.0, target_modules=("query",))
    base = _meta_bert().to_empty(device="cpu")
    with pytest.raises(UsageError, match="the model has no LoRA adapters; call run.apply_lora"):
        _check_lora(settings, [base, torch.optim.AdamW(base.parameters())])
    # The optimizer built before the adapters holds the (now frozen) base weights only.
    early = torch.optim.AdamW(list(base.parameters()))
    model = apply_lora(base, settings)
    with pytest.raises(UsageError, match="the optimizer does not hold 6 trainable parameter"):
        _check_lora(settings, [model, early])  # 2 layers x A, B; the head's weight and bias
    trainable = [p for p in model.parameters() if p.requires_grad]
    _check_lora(settings, [model, torch.optim.AdamW(trainable)])
    _check_lora(settings, [model, DummyOptim(trainable)])  # a DeepSpeed JSON's optimizer
    with pytest.raises(UsageError, match="the optimizer does not hold"):
        _check_lora(settings, [model, DummyOptim(trainable[1:])])


def test_the_recipes_optimizer_groups_leave_out_an_empty_one():
    """GPT-2's adapters are all matrices: no bias trains, so the recipes' no-decay group
    would be empty; DeepSpeed drops an empty group, and a scheduler built over two then
    failed at its first step (seen: recipes/train_lm.py --lora-r 8 under ZeRO-2)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from dpkit.lora import LoraSettings, apply_lora
    from dpkit.models import adamw_param_groups

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64))
    model = apply_lora(model, LoraSettings(r=4, alpha=8.0))
    groups = adamw_param_groups(model, weight_decay=0.1)
    assert [(len(g["params"]), g["weight_decay"]) for g in groups] == [(4, 0.1)]  # 2 x (A, B)


# ---- the arithmetic ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("strategy", "world_size", "precision", "expected"),
    [
        # DDP fp32: every weight 4 bytes; gradients 4 and Adam 8 bytes for the 1,000 that train.
        ("ddp", 4, "fp32", {"params": 4 * 10_000, "grads": 4 * 1_000, "optimizer": 8 * 1_000}),
        # ZeRO-2 bf16 on 4: DeepSpeed casts the whole module to bf16 (frozen weights too);
        # moments and the fp32 master only for what trains, over 4 ranks.
        (
            "zero2",
            4,
            "bf16",
            {"params": 2 * 10_000, "optimizer": 8 * 1_000 / 4, "master": 4 * 1_000 / 4},
        ),
    ],
)
def test_frozen_weights_are_parameters_and_nothing_else(strategy, world_size, precision, expected):
    from dpkit.memory.analytic import model_state_bytes

    states = model_state_bytes(
        1_000, strategy, world_size, precision, frozen_params=9_000
    ).as_dict()
    for category, value in expected.items():
        assert states[category] == pytest.approx(value), (category, states)


def test_fsdp2_shards_frozen_weights_padded_like_trained_ones():
    from dpkit.memory.analytic import model_state_bytes

    # Trained [4, 2] and frozen [3, 4] + [5]: on 2 ranks each dim 0 pads to even, the
    # worst rank holds rows 2 x 2 + 2 x 4 + 3 fp32 elements of parameters.
    states = model_state_bytes(
        8, "fsdp2_full_shard", 2, "fp32", param_shapes=[[4, 2]],
        frozen_params=17, frozen_param_shapes=[[3, 4], [5]],
    )  # fmt: skip
    assert states.params == 4 * (2 * 2 + 2 * 4 + 3)
    assert states.optimizer == 8 * (2 * 2)  # the trained parameter's rows only


def test_plan_counts_gpt2_with_lora_adapters():
    out = subprocess.run(
        [str(BIN / "dpkit"), "plan", "--model", "gpt2", "--lora-r", "8", "--gpus-per-node", "2",
         "--precision", "fp32", "--json"],
        capture_output=True, text=True, check=True, cwd=REPO,
    )  # fmt: skip
    plan = json.loads(out.stdout)
    # peft's default for GPT-2: c_attn (768 -> 2304) in each of 12 blocks: A 8 x 768, B 2304 x 8.
    trainable = 12 * (8 * 768 + 2304 * 8)
    frozen = 124_439_808  # GPT-2 small, tied embedding once (the "124M")
    assert (plan["model"]["num_params"], plan["model"]["frozen_params"]) == (trainable, frozen)
    ddp = next(row for row in plan["strategies"] if row["strategy"] == "ddp")["bytes_per_gpu"]
    assert ddp["params"] == 4 * (trainable + frozen)
    assert (ddp["grads"], ddp["optimizer"]) == (4 * trainable, 8 * trainable)


def test_plan_refuses_lora_on_a_bare_count():
    out = subprocess.run(
        [str(BIN / "dpkit"), "plan", "--params", "124M", "--lora-r", "8"],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "dpkit plan: error: --lora-r=8: needs --model (the adapters' layers and sizes come from its "
        "config), not a bare --params"
    ], out.stderr


def test_the_recipe_refuses_a_target_that_matches_nothing_before_starting(tmp_path):
    out = tmp_path / "run"
    result = run(python_cmd("--lora-r", "8", "--lora-target-modules", "c_attn",
                            "--output-dir", str(out)), None)  # fmt: skip
    assert_refused(result, "--lora-target-modules=c_attn: c_attn matches no layer", out, 2)


# ---- the recipe: ZeRO-2, resumed under FSDP2 -----------------------------------------------------

LORA_RUN = [
    "--lora-r", "8",
    "--max-steps", "4",
    "--save-steps", "2",
    "--max-train-samples", "128",
    "--max-eval-samples", "16",
    "--eval-steps", "0",
    "--micro-batch-size", "8",
    "--max-seq-length", "32",
    "--learning-rate", "1e-3",
    "--warmup-ratio", "0",
    "--dropout", "0",
    "--logging-steps", "1",
]  # fmt: skip
# all-MiniLM-L6-v2: 22,713,216 parameters (its model card). peft's default for BERT puts
# rank-8 adapters on query and value (384 -> 384) in each of 6 layers, and trains a copy
# of the 2-label head, keeping the original frozen.
MINILM = 22_713_216
HEAD = 384 * 2 + 2
TRAINABLE = 6 * 2 * (8 * 384 + 384 * 8) + HEAD
# Resumed across strategies: the same arithmetic on the same weights; measured equal to
# 8 digits. fp32 rounding of a reduction in another order is about 1e-7 a step.
RESUME_RTOL = 1e-6


@dataclass
class LoraRuns:
    trained: Launch
    resumed: Launch

    def checkpoint(self, step: int) -> Path:
        return self.trained.output_dir / "checkpoints" / f"step-{step:06d}"


@pytest.fixture(scope="module")
def lora_runs(module_tmp) -> LoraRuns:
    """ZeRO-2 on 2 processes with a checkpoint at step 2, then FSDP2 full-shard on 2
    resuming from it (two launches, about 30 s each)."""
    trained_dir, resumed_dir = module_tmp / "zero2", module_tmp / "fsdp2"
    trained = run(
        torchrun_cmd(2, *LORA_RUN, "--strategy", "zero2", "--output-dir", str(trained_dir)),
        trained_dir,
    ).check()
    checkpoint = trained_dir / "checkpoints" / "step-000002"
    resumed = run(
        torchrun_cmd(2, *LORA_RUN, "--strategy", "fsdp2_full_shard", "--no-save-model",
                     "--resume", str(checkpoint), "--output-dir", str(resumed_dir)),
        resumed_dir,
    ).check()  # fmt: skip
    return LoraRuns(trained, resumed)


@pytest.mark.multiprocess
def test_a_lora_run_trains_the_adapters_only(lora_runs):
    info = lora_runs.trained.run_info
    assert (info["strategy"], info["world_size"], info["zero_stage"]) == ("zero2", 2, 2)
    assert info["lora"]["r"] == 8 and info["lora"]["target_modules"] == ["query", "value"]
    assert (info["num_params"], info["frozen_params"]) == (TRAINABLE, MINILM + HEAD)
    # The saved moments are the adapters' and the head's, every element once.
    moments = saved_moments(lora_runs.checkpoint(4))
    assert all(".lora_" in name or "modules_to_save" in name for name in moments), list(moments)
    assert sum(m["exp_avg"].numel() for m in moments.values()) == TRAINABLE
    report = json.loads((lora_runs.trained.output_dir / "memory_report.json").read_text())
    # ZeRO-2 on 2: Adam's 8 bytes over the ranks, and the whole fp32 module on each.
    worst = {k: max(r[k] for r in report["ranks"]) for k in ("params", "optimizer")}
    assert worst["optimizer"] == pytest.approx(8 * TRAINABLE / 2, rel=0.01)
    assert worst["params"] == pytest.approx(4 * (MINILM + HEAD + TRAINABLE), rel=0.001)


@pytest.mark.multiprocess
def test_a_lora_checkpoint_resumes_exactly_under_another_strategy(lora_runs):
    trained, resumed = lora_runs.trained.losses, lora_runs.resumed.losses
    assert len(trained) == 4 and len(resumed) == 2
    assert max_rel_diff(resumed, trained[2:]) <= RESUME_RTOL, (resumed, trained)
    # The control: the adapters moved the loss between the two steps compared.
    assert abs(trained[3] - trained[2]) / trained[2] > 100 * RESUME_RTOL, trained
    info = lora_runs.resumed.run_info
    assert (info["strategy"], info["lora"]["r"]) == ("fsdp2_full_shard", 8)


@pytest.mark.multiprocess
def test_plan_against_a_lora_run_predicts_what_it_measured(lora_runs):
    from dpkit.plan.check import check_run

    check = check_run(lora_runs.trained.output_dir)
    for category in ("params", "optimizer", "master", "total"):
        assert abs(check.error_pct[category]) <= 1.0, check.error_pct
    assert abs(check.error_pct["activations"]) <= 15, check.error_pct  # docs/plan.md


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "the checkpoint trained LoRA r=8 on query, value, this run the whole model"),
        (["--lora-r", "4"], "the checkpoint trained LoRA r=8 on query, value, this run LoRA r=4"),
    ],
)
def test_a_lora_checkpoint_resumes_only_into_the_same_adapters(lora_runs, tmp_path, extra, message):
    assert LORA_RUN[:2] == ["--lora-r", "8"]
    args = LORA_RUN[2:]
    args[args.index("--micro-batch-size") + 1] = "16"  # the global batch of 2 x 8, on one
    out = tmp_path / "run"
    result = run(python_cmd(*args, *extra, "--resume", str(lora_runs.checkpoint(2)),
                            "--output-dir", str(out)), None)  # fmt: skip
    assert_refused(result, message, out, 2)


def _logits(model, texts: list[str], tokenizer) -> torch.Tensor:
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        return model.eval()(**batch).logits


@pytest.mark.multiprocess
def test_consolidate_writes_the_adapters_or_the_merged_model(lora_runs, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    checkpoint = lora_runs.checkpoint(4)
    adapters, merged = tmp_path / "adapters", tmp_path / "merged"
    for out, extra in ((adapters, []), (merged, ["--merge-lora"])):
        subprocess.run(
            [str(BIN / "dpkit"), "consolidate", str(checkpoint), "--output-dir", str(out), *extra],
            check=True, cwd=REPO, capture_output=True,
        )  # fmt: skip
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {
        p.name for p in adapters.iterdir()
    }
    assert not (adapters / "model.safetensors").exists()
    assert not (merged / "adapter_config.json").exists()
    # The final model folder the run wrote is peft's too.
    assert (lora_runs.trained.output_dir / "model" / "adapter_config.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(merged)
    texts = ["a quiet, lovely film", "two hours I will not get back"]
    merged_model = AutoModelForSequenceClassification.from_pretrained(merged)
    base_path = json.loads((adapters / "adapter_config.json").read_text())[
        "base_model_name_or_path"
    ]
    base = AutoModelForSequenceClassification.from_pretrained(base_path, num_labels=2)
    with_adapters = PeftModel.from_pretrained(base, adapters)
    expected = _logits(with_adapters, texts, tokenizer)
    # Merging adds B A x alpha/r into each weight: fp32 rounding of the sums.
    assert torch.allclose(_logits(merged_model, texts, tokenizer), expected, atol=1e-5)
    # The control: the adapters changed what the pretrained model (its trained head) says.
    plain = AutoModelForSequenceClassification.from_pretrained(base_path, num_labels=2)
    plain.classifier.load_state_dict(
        with_adapters.base_model.model.classifier.modules_to_save.default.state_dict()
    )
    assert not torch.allclose(_logits(plain, texts, tokenizer), expected, atol=1e-4)


@pytest.mark.multiprocess
def test_merge_lora_refuses_a_checkpoint_that_trained_the_whole_model(reference, tmp_path):
    from tests.checkpoint_runs import step3

    checkpoint = step3(reference("zero2"))  # shared with the resume tests
    out = tmp_path / "out"
    result = subprocess.run(
        [str(BIN / "dpkit"), "consolidate", str(checkpoint), "--output-dir", str(out),
         "--merge-lora"],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "--merge-lora: checkpoint=" in result.stderr
    assert "trained the whole model (no adapter_config.json)" in result.stderr
    assert not out.exists()
