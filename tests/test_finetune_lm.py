"""recipes/finetune_lm.py: a pretrained decoder fine-tuned on prompt/response pairs, through the real launchers.

The decoder is a tiny Llama-style checkpoint with a byte-level BPE tokenizer and no
padding token, as Llama checkpoints ship (tests/local_models.py, random weights, no
download); the data are Rotten Tomatoes snippets written as a JSONL of
``{"prompt": "Review: ...\\nVerdict:", "response": " fresh"}``. Five launches on 2 CPU
processes (each once, checked many ways): DDP under torchrun (saving at step 2),
ZeRO-2 under the deepspeed launcher, FSDP2 under accelerate launch, a resume of the
DDP run's step-2 checkpoint under ZeRO-2 at world size 1, and LoRA with packing and
gradient checkpointing under ZeRO-3 (the model loaded partitioned; docs/zero3.md), whose
adapters ``dpkit consolidate --merge-lora`` merges. The data's masking and packing are tested by hand-counted examples in
tests/test_causal_data.py; the refusals here are the recipe's own, before any model loads.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests import local_models
from tests.harness import (
    BIN,
    accelerate_cmd,
    assert_refused,
    deepspeed_cmd,
    max_rel_diff,
    python_cmd,
    run,
    torchrun_cmd,
)

RECIPE = "recipes/finetune_lm.py"
TRAIN_PAIRS = 96
EVAL_PAIRS = 13  # odd on purpose: 2 ranks of micro-batch 4 see an uneven last batch
# fp32, dropout 0, the same batches: the strategies differ only in how a sum is reduced
# (ZeRO's bucketed reduce-scatter, FSDP2's reduce-scatter against DDP's all-reduce), so
# per-step losses agree to float32 rounding accumulated over 4 Adam steps; 1e-5 relative
# is the bound and 100x the differences measured (docs/finetune_lm.md).
STRATEGY_RTOL = 1e-5


def _pairs_jsonl(path: Path, rows: int) -> Path:
    """Reviews as prompt/response pairs: the verdict is the response."""
    import csv

    from dpkit.data.embedded import rotten_tomatoes_csv

    with open(rotten_tomatoes_csv()) as source, open(path, "w") as target:
        for _, row in zip(range(rows), csv.DictReader(source), strict=False):
            verdict = " fresh" if row["label"] == "1" else " rotten"
            prompt = f"Review: {row['text'][:80]}\nVerdict:"
            target.write(json.dumps({"prompt": prompt, "response": verdict}) + "\n")
    return path


@pytest.fixture(scope="module")
def inputs(module_tmp):
    model = local_models.build("llama", module_tmp / "llama")
    # 109 rows: --validation-fraction 0.15 holds out 16 or 17 of them (however the split
    # rounds), --max-eval-samples keeps 13 of those.
    data = _pairs_jsonl(module_tmp / "pairs.jsonl", TRAIN_PAIRS + EVAL_PAIRS)
    return model, data


def _args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--model", str(model), "--dataset", str(data),
        "--prompt-field", "prompt", "--response-field", "response",
        "--validation-fraction", "0.15", "--max-eval-samples", str(EVAL_PAIRS),
        "--max-steps", "4", "--micro-batch-size", "4", "--max-seq-length", "64",
        "--learning-rate", "1e-3", "--warmup-ratio", "0", "--lr-scheduler", "linear",
        "--dropout", "0", "--logging-steps", "1", "--save-steps", "2",
        "--output-dir", str(out), "--overwrite-output-dir", *extra,
    ]  # fmt: skip


_launches: dict[str, object] = {}


@pytest.fixture(scope="module")
def launched(inputs, module_tmp):
    """Each named launch run once, on first use."""
    model, data = inputs

    def commands(name: str, out: Path) -> list[str]:
        if name == "ddp":
            return torchrun_cmd(2, *_args(model, data, out), recipe=RECIPE)
        if name == "zero2":
            return deepspeed_cmd(
                2, *_args(model, data, out, "--deepspeed", "ds_configs/zero2.json"), recipe=RECIPE
            )
        if name == "fsdp2":
            config = ["--config_file", "ds_configs/accelerate/fsdp2_full_shard.yaml"]
            return accelerate_cmd(config, *_args(model, data, out), recipe=RECIPE)
        if name == "resumed":  # the DDP run's step 2, continued by one ZeRO-2 process
            checkpoint = get("ddp").output_dir / "checkpoints" / "step-000002"
            extra = ("--strategy", "zero2", "--micro-batch-size", "4",
                     "--gradient-accumulation-steps", "2", "--resume", str(checkpoint))  # fmt: skip
            return python_cmd(*_args(model, data, out), *extra, recipe=RECIPE)
        if name == "lora":
            extra = ("--lora-r", "4", "--packing", "--gradient-checkpointing",
                     "--deepspeed", "ds_configs/zero3.json")  # fmt: skip
            return deepspeed_cmd(2, *_args(model, data, out, *extra), recipe=RECIPE)
        raise KeyError(name)

    def get(name: str):
        if name not in _launches:
            out = module_tmp / f"run-{name}"
            _launches[name] = run(commands(name, out), out).check()
        return _launches[name]

    yield get
    _launches.clear()


@pytest.mark.multiprocess
def test_ddp_trains_evaluates_and_saves_a_model_that_reloads(launched, inputs):
    result = launched("ddp")
    info = result.run_info
    assert (info["strategy"], info["world_size"]) == ("ddp", 2)
    assert [r["step"] for r in result.train_log] == [1, 2, 3, 4]
    # The held-out split, every example once at 2 ranks (no duplicate of the uneven batch).
    final = result.final("validation")
    assert final["samples"] == EVAL_PAIRS
    assert math.isclose(final["perplexity"], math.exp(final["loss"]), rel_tol=1e-9)
    # Each response is " fresh" or " rotten" plus </s>: at least 2 loss tokens an example.
    assert final["tokens"] >= 2 * EVAL_PAIRS
    # The loss fell: the verdict is learnt from the first steps (lr 1e-3 on 96 pairs).
    evaluations = [m["loss"] for m in result.metrics]
    assert evaluations[-1] < evaluations[0] or result.losses[-1] < result.losses[0]
    # The model saved reloads without dpkit and scores the split as the run did.
    model_dir = result.output_dir / "model"
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["pad_token_id"] == config["eos_token_id"]  # no pad token: EOS pads, said once
    assert result.output.count("has no padding token") == 1, result.output[-3000:]
    rescored = _score(model_dir, result.output_dir)
    assert math.isclose(rescored, final["loss"], rel_tol=1e-5), (rescored, final["loss"])
    # The data line says what trains: response tokens only.
    assert "carry the loss" in result.output


def _score(model_dir: Path, run_dir: Path) -> float:
    """The loss per loss-carrying token of the run's validation rows (examples, or packed
    blocks), recomputed one row at a time with transformers from the run's own data
    settings (run_config.json), in a fresh process."""
    script = r"""
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from dpkit.data.causal import CausalDataConfig, load_causal_splits
from dpkit.data.causal_tokens import tokenize_causal
model_dir, run_dir = sys.argv[1], sys.argv[2]
tok = AutoTokenizer.from_pretrained(model_dir)
cfg = json.loads(open(f"{run_dir}/run_config.json").read())
data = CausalDataConfig(**cfg["CausalDataConfig"])
splits, fmt = load_causal_splits(data)
tokenized, _ = tokenize_causal(splits, tok, data, fmt, 64)
model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
total, count = 0.0, 0
for row in tokenized["validation"]:
    ids = torch.tensor([row["input_ids"]]); labels = torch.tensor([row["labels"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1]
    target = labels[0, 1:]
    keep = target != -100
    total += torch.nn.functional.cross_entropy(logits[keep], target[keep], reduction="sum").item()
    count += int(keep.sum())
print(total / count)
"""
    done = subprocess.run(
        [sys.executable, "-c", script, str(model_dir), str(run_dir)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return float(done.stdout.strip().splitlines()[-1])


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["zero2", "fsdp2"])
def test_every_strategy_trains_the_losses_of_ddp(launched, strategy):
    ddp, other = launched("ddp"), launched(strategy)
    # Both sides real 2-process jobs of the strategy asked for (run_info.json, read back).
    assert (ddp.run_info["strategy"], ddp.run_info["world_size"]) == ("ddp", 2)
    expected = {"zero2": "zero2", "fsdp2": "fsdp2_full_shard"}[strategy]
    assert (other.run_info["strategy"], other.run_info["world_size"]) == (expected, 2)
    assert len(other.losses) == 4
    assert max_rel_diff(other.losses, ddp.losses) < STRATEGY_RTOL, (other.losses, ddp.losses)
    assert math.isclose(
        other.final("validation")["loss"], ddp.final("validation")["loss"], rel_tol=STRATEGY_RTOL
    )
    assert other.final("validation")["tokens"] == ddp.final("validation")["tokens"]


@pytest.mark.multiprocess
def test_a_resume_under_another_strategy_and_world_size_continues_the_same_losses(launched):
    ddp, resumed = launched("ddp"), launched("resumed")
    assert (resumed.run_info["strategy"], resumed.run_info["world_size"]) == ("zero2", 1)
    steps = [r["step"] for r in resumed.train_log]
    assert steps == [3, 4]
    assert max_rel_diff(resumed.losses, ddp.losses[2:]) < STRATEGY_RTOL, (
        resumed.losses,
        ddp.losses,
    )


@pytest.mark.multiprocess
def test_lora_packed_checkpointed_adapters_merge_into_the_model_the_run_evaluated(
    launched, module_tmp
):
    result = launched("lora")
    info = result.run_info
    assert (info["strategy"], info["zero_stage"]) == ("zero3", 3)
    assert info["lora"]["r"] == 4
    assert info["gradient_checkpointing"] is True
    # Packed: 92 training examples became whole 64-token blocks, the remainder dropped.
    data = info["data"]
    assert data["packing"] is True
    train = data["train"]
    assert train["rows"] * 64 == train["tokens"]  # the tokens trained on, in whole blocks
    assert 0 <= train["dropped_tokens"] < 64
    checkpoint = result.output_dir / "checkpoints" / "step-000004"
    merged = module_tmp / "merged"
    done = subprocess.run(
        [str(BIN / "dpkit"), "consolidate", str(checkpoint), "--output-dir", str(merged),
         "--merge-lora"], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    config = json.loads((merged / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert not (merged / "adapter_config.json").exists()  # merged: a plain model
    # The merged weights score the held-out blocks as the adapters did at the end of the run.
    final = result.final("validation")
    rescored = _score(merged, result.output_dir)
    assert math.isclose(rescored, final["loss"], rel_tol=1e-5), (rescored, final["loss"])


@pytest.mark.subprocess_only
def test_no_model_is_refused_in_one_line_naming_the_flag(module_tmp):
    out = module_tmp / "no-model"
    result = run(python_cmd("--output-dir", str(out), recipe=RECIPE))
    assert_refused(result, "--model: not given", out, exit_code=2, prog="finetune_lm.py")


@pytest.mark.subprocess_only
def test_a_prompt_with_no_room_for_its_response_is_refused_before_the_model_loads(
    inputs, module_tmp
):
    model, data = inputs
    out = module_tmp / "too-long"
    args = _args(model, data, out)
    args[args.index("--max-seq-length") + 1] = "8"
    result = run(python_cmd(*args, recipe=RECIPE))
    # Every prompt of the file ("Review: ...\nVerdict:") is longer than 8 tokens. Of its 109
    # rows, ceil(0.15 * 109) = 17 are held out (92 train) and --max-eval-samples keeps 13.
    total = (TRAIN_PAIRS + EVAL_PAIRS - 17) + EVAL_PAIRS
    assert_refused(result, f"--max-seq-length=8: {total} of the {total} prompts leave no room "
                   "for their response; the first, line 1 (", out, exit_code=2,
                   prog="finetune_lm.py")  # fmt: skip
