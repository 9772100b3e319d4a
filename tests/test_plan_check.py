"""``dpkit plan --against RUN_DIR`` in process, on run folders written by hand.

The multi-process modules check the plan against real runs; these pin what ``--against``
reads and how: which recipe's section names the model, the run's own DeepSpeed settings
and accumulation, accelerate's name for fp32, offload on a GPU, the largest rank per
category, the refusals, and the table and JSON it prints. Every expected figure is worked
out by hand from torch's count of the model (a Linear(8, 3): a 24-element weight and a
3-element bias) or from the report written here.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from dpkit.core.spec import ModelSpec, PlanInputs
from dpkit.errors import UsageError
from dpkit.plan import inputs as plan_inputs
from dpkit.plan.check import PlanCheck, check_dict, check_run, format_check

MIB = 2**20


def _linear_record(**extra) -> dict:
    """A Trainer run's record of its live model: one Linear(8, 3), no transformers config."""
    import torch

    model = torch.nn.Linear(8, 3)
    assert sum(p.numel() for p in model.parameters()) == 27  # torch's count
    record = plan_inputs.spec_record(plan_inputs.spec_from_model("linear", "live model", model))
    return record | extra


def _ranks(*rows: dict) -> list[dict]:
    """Report rows: the categories given, model_state_total their sum unless given."""
    out = []
    for rank, row in enumerate(rows):
        full = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "master": 0.0, **row}
        total = sum(full[c] for c in ("params", "grads", "optimizer", "master"))
        out.append({"rank": rank, "model_state_total": total, **full})
    return out


def _write(run_dir: Path, report: dict, **others: dict) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "memory_report.json").write_text(json.dumps(report))
    for name, data in others.items():
        (run_dir / f"{name}.json").write_text(json.dumps(data))
    return run_dir


def _trainer_report(strategy="zero2", precision="fp32", settings=None, record=None, **extra):
    return {
        "strategy": strategy,
        "world_size": 2,
        "precision": precision,
        "optimizer": "adamw",
        "device": "cpu",
        "model": record or _linear_record(micro_batch_size=4),
        "ranks": _ranks({"params": 1.0}, {"params": 1.0}),
        "settings": settings or {},
    } | extra


# --- ZeRO-2's gradient layout follows the run's own settings -----------------------------------
#
# Linear(8, 3) as the recipes' AdamW groups: [weight 24], [bias 3]; N=2, fp32. Group 0 pads
# to 24 (a multiple of 2N): partitions of 12, the weight touches both ranks. Group 1 pads 3
# to 4: partitions of 2, the bias touches both. Each rank holds 27 whole gradients.
# * Step (rank 1, the last rank, whose flatten pads: a copy): 27 + the flat 12 = 39
#   elements, 156 B. Rank 0's partitions lie inside one tensor each: views, 27 (108 B).
# * Contiguous gradients with a 10-element bucket: backward yields the bias (3), then the
#   weight (24) overflows the bucket, so the bucket holding the bias is reduced while the
#   weight's gradient is alive: the partition buffer (27) + the weight (24) = 51, 204 B, on
#   both ranks (rank 0 named: the first of equals).
# * Without contiguous gradients, 2 micro-batches a step: the accumulated whole gradients
#   (27) beside a later backward's own (27): 54, 216 B.


@pytest.mark.parametrize(
    ("settings", "accumulation", "grads", "where"),
    [
        ({}, 1, 156, "rank 1, step, group 0 (flat copy of the partition)"),
        ({"zero.reduce_bucket_size": 10}, 1, 204,
         "rank 0, backward (partition buffer + gradients being reduced)"),
        ({"zero.reduce_bucket_size": 10, "zero.contiguous_gradients": False}, 1, 156,
         "rank 1, step, group 0 (flat copy of the partition)"),
        ({"zero.reduce_bucket_size": 10, "zero.contiguous_gradients": False}, 2, 216,
         "rank 0, backward of a later micro-batch (accumulated whole gradients + its own)"),
        # Keys of other engines, and DDP's bucket view, change no DeepSpeed layout.
        ({"ddp.gradient_as_bucket_view": False, "reduce_bucket_size": 10}, 1, 156,
         "rank 1, step, group 0 (flat copy of the partition)"),
    ],
)  # fmt: skip
def test_zero2_gradients_are_laid_out_with_the_runs_settings(
    tmp_path, settings, accumulation, grads, where
):
    record = _linear_record(micro_batch_size=4, gradient_accumulation_steps=accumulation)
    check = check_run(_write(tmp_path, _trainer_report(settings=settings, record=record)))
    assert _states(check.predicted) == {
        "params": 4 * 27, "grads": grads, "optimizer": 8 * 27 / 2, "master": 4 * 27 / 2,
        "total": 4 * 27 + grads + 8 * 27 / 2 + 4 * 27 / 2,
    }  # fmt: skip
    assert check.grads_where == where
    assert check.grads_paper == 4 * 27 / 2


def test_zero1_bf16_holds_the_16_bit_gradients_and_the_fp32_cast(tmp_path):
    """bf16 ZeRO-1, the same layout in 2-byte gradients: every full gradient (27 x 2 B) in
    backward; at the step rank 1 holds 27 whole + the flat 12 (2 B) + its fp32 cast (12 x
    4 B) = 126 B. The module is bf16 (2 x 27), master and moments fp32, sharded."""
    report = _trainer_report(strategy="zero1", precision="bf16")
    check = check_run(_write(tmp_path, report))
    assert _states(check.predicted) == {
        "params": 2 * 27, "grads": 2 * 39 + 4 * 12, "optimizer": 8 * 27 / 2,
        "master": 4 * 27 / 2, "total": 54 + 126 + 108 + 54,
    }  # fmt: skip
    assert check.grads_paper == 2 * 27 and check.precision == "bf16"


@pytest.mark.parametrize("device", ["cuda:0", "cpu"])
def test_offload_is_planned_on_device_and_host_wherever_it_ran(tmp_path, device):
    """A ZeRO-2 offload run keeps Adam's moments, the master, the fp32 gradient partition
    and two staging buffers in host memory, on a GPU and on a CPU alike (there the same
    RAM, split by where DeepSpeed places them). Linear(8, 3), 27 parameters, bf16, 2
    ranks: on the device the bf16 module (2 x 27 B) and no gradient (none is larger than
    the bucket, so each passes through it to host memory); in host memory 8 x 27 / 2 B
    of moments, 4 x 27 / 2 of master, 4 x 27 / 2 of fp32 gradients, and the buffers: the
    partition's bf16 copy (2 x 27 / 2) and the largest parameter's staging (2 x 24)."""
    report = _trainer_report(
        strategy="zero2_offload", precision="bf16", device=device, offload_optimizer="cpu"
    )
    report["ranks"] = _ranks(
        {"host": {"grads": 54.0, "optimizer": 108.0, "master": 54.0, "buffers": 75.0}},
        {"host": {"grads": 54.0, "optimizer": 108.0, "master": 54.0, "buffers": 75.0}},
    )
    for row in report["ranks"]:
        row["host_total"] = sum(row["host"].values())
    check = check_run(_write(tmp_path, report))
    assert _states(check.predicted) == {
        "params": 54, "grads": 0, "optimizer": 0, "master": 0, "total": 54,
    }  # fmt: skip
    host = {k: v for k, v in check.predicted.items() if k.startswith("host ")}
    assert host == {
        "host grads": 54, "host optimizer": 108, "host master": 54, "host buffers": 27 + 48,
        "host total": 54 + 108 + 54 + 75,
    }  # fmt: skip
    assert all(check.error_pct[k] == 0 for k in host)
    assert check.strategy == "zero2_offload"


def test_measured_is_the_largest_rank_per_category_and_the_error_is_against_it(tmp_path):
    report = _trainer_report(strategy="ddp", device="cuda:0")
    # DDP fp32, Linear(8, 3) by hand: 108 B of parameters and of gradients, 216 of moments.
    report["ranks"] = _ranks(
        {"params": 108, "grads": 120, "optimizer": 200, "master": 0},
        {"params": 100, "grads": 135, "optimizer": 216, "master": 0},
    )
    report["ranks"][0]["model_state_total"] = 470  # the report's own sum, read as written
    check = check_run(_write(tmp_path, report))
    assert _states(check.predicted) == {"params": 108, "grads": 108, "optimizer": 216, "master": 0,
                               "total": 432}  # fmt: skip
    assert _states(check.measured) == {"params": 108, "grads": 135, "optimizer": 216, "master": 0,
                              "total": 470}  # fmt: skip
    assert _states(check.error_pct) == {
        "params": 0.0, "grads": 100 * (108 - 135) / 135, "optimizer": 0.0, "master": None,
        "total": 100 * (432 - 470) / 470,
    }  # fmt: skip
    assert (check.grads_where, check.grads_paper, check.world_size) == ("", 108, 2)


@pytest.mark.parametrize(("written", "read"), [("no", "fp32"), ("fp16", "fp16")])
def test_accelerates_name_for_fp32_is_read_as_fp32(tmp_path, written, read):
    check = check_run(_write(tmp_path, _trainer_report(strategy="ddp", precision=written)))
    assert check.precision == read
    assert check.predicted["params"] == 4 * 27  # DDP keeps fp32 parameters either way


def test_a_trainer_record_plans_at_most_128_tokens_within_the_models_positions(tmp_path):
    """Model states do not depend on the sequence length; the plan still checks it against
    the model's positions, so a record of a 64-position model must plan at 64, not 128."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40, n_positions=64)
    spec = plan_inputs.spec_from_model("gpt2-64", "live model", GPT2LMHeadModel(config))
    record = plan_inputs.spec_record(spec)  # no micro_batch_size: one
    check = check_run(_write(tmp_path, _trainer_report(strategy="ddp", record=record)))
    # wte 40x16, wpe 64x16, one block (12 x 16^2 + 13 x 16), ln_f 2 x 16.
    psi = 640 + 1024 + 12 * 256 + 13 * 16 + 32
    assert check.predicted["params"] == 4 * psi and check.model == "gpt2-64"


# --- the recipes' own run folders -------------------------------------------------------------


def _tiny_bert_folder(path: Path) -> tuple[Path, int]:
    """A BERT config folder, and torch's count of its 2-label classifier."""
    import torch
    from transformers import AutoModelForSequenceClassification, BertConfig

    config = BertConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        vocab_size=50, max_position_embeddings=40, num_labels=2,
    )  # fmt: skip
    config.save_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config)
    return path, sum(p.numel() for p in model.parameters())


def _recipe_report(strategy: str, precision: str = "fp32") -> dict:
    return {
        "strategy": strategy, "world_size": 4, "precision": precision, "optimizer": "sgd",
        "device": "cpu", "ranks": _ranks({"params": 1.0}),
    }  # fmt: skip


def test_a_finetune_run_names_its_model_in_its_model_config(tmp_path):
    folder, psi = _tiny_bert_folder(tmp_path / "bert")
    config = {
        "ModelConfig": {"model": str(folder), "max_seq_length": 32},
        "TrainConfig": {"micro_batch_size": 3},
    }
    run_dir = _write(tmp_path / "run", _recipe_report("ddp"), run_config=config)
    check = check_run(run_dir)
    assert check.model == str(folder)
    # fp32 DDP, plain SGD (no state): parameters and gradients, 4 bytes each.
    assert _states(check.predicted) == {
        "params": 4 * psi, "grads": 4 * psi, "optimizer": 0, "master": 0, "total": 8 * psi,
    }  # fmt: skip


def test_a_finetune_config_needs_both_sections_and_not_its_sequence_length(tmp_path):
    """Its model and its micro-batch come from two sections: one alone is not a finetune
    run. max_seq_length is optional (runs before it was recorded): the figures stand."""
    folder, psi = _tiny_bert_folder(tmp_path / "bert")
    config = {"ModelConfig": {"model": str(folder)}}
    run_dir = _write(tmp_path / "half", _recipe_report("ddp"), run_config=config)
    with pytest.raises(UsageError) as err:
        check_run(run_dir)
    assert str(err.value) == (
        f"--against={str(run_dir)!r}: run_config.json: not from recipes/finetune.py, "
        "recipes/finetune_lm.py or recipes/train_lm.py"
    )
    config["TrainConfig"] = {"micro_batch_size": 3}
    check = check_run(_write(tmp_path / "whole", _recipe_report("ddp"), run_config=config))
    assert check.predicted["total"] == 8 * psi


def test_a_train_lm_run_names_its_size_or_its_config(tmp_path):
    """The LM recipe's section: the named size (tiny: 4 blocks of 256, 8192 tokens, 128
    positions) or a config file. ZeRO-1 bf16 SGD at N=4: the bf16 module (2 bytes) and the
    fp32 master (4 / N), no optimizer state."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    shape = {"n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 8192, "n_positions": 128}
    with torch.device("meta"):
        tiny = GPT2LMHeadModel(GPT2Config(**shape))
    psi = sum(p.numel() for p in tiny.parameters())  # the tied head once
    workload = {"size": "tiny", "synthetic": True, "seq_len": 64, "micro_batch_size": 2,
                "not_a_field": 1}  # fmt: skip
    run_dir = _write(tmp_path / "a", _recipe_report("zero1", "bf16"), run_config={
        "LMWorkload": workload})  # fmt: skip
    check = check_run(run_dir)
    assert check.model == "train_lm --size tiny"
    assert (check.predicted["params"], check.predicted["optimizer"]) == (2 * psi, 0)
    assert check.predicted["master"] == 4 * psi / 4
    config_file = tmp_path / "lm" / "config.json"
    GPT2Config(**(shape | {"n_layer": 1})).save_pretrained(config_file.parent)
    workload |= {"model_config": str(config_file)}
    run_dir = _write(tmp_path / "b", _recipe_report("ddp"), run_config={"LMWorkload": workload})
    check = check_run(run_dir)
    assert check.model == str(config_file)
    one_block = 12 * 256**2 + 13 * 256
    assert check.predicted["params"] == 4 * (psi - 3 * one_block)


def test_accumulation_comes_from_the_runs_info_or_the_trainers_record(tmp_path):
    """ZeRO-2 without contiguous gradients at 2 micro-batches a step holds the accumulated
    whole gradients beside a later backward. A recipe's run_info.json says how many; at one
    rank every gradient is whole: Psi, twice over at 2 micro-batches (8 Psi bytes), and at
    one the step's flat copy of the padded decay group beside them. A Trainer's record
    says it itself, and its folder's run_info.json is not read."""
    import torch
    from transformers import AutoModelForSequenceClassification, BertConfig

    folder, psi = _tiny_bert_folder(tmp_path / "bert")
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(BertConfig.from_pretrained(folder))
    decay = sum(p.numel() for p in model.parameters() if p.ndim >= 2)
    config = {
        "ModelConfig": {"model": str(folder), "max_seq_length": 32},
        "TrainConfig": {"micro_batch_size": 3},
    }
    report = _recipe_report("zero2") | {"world_size": 1, "optimizer": "adamw"}
    report["settings"] = {"zero.reduce_bucket_size": 10**6, "zero.contiguous_gradients": False}
    one = check_run(_write(tmp_path / "one", report, run_config=config))
    assert one.predicted["grads"] == 4 * (psi + 2 * -(-decay // 2))
    two = check_run(
        _write(tmp_path / "two", report, run_config=config,
               run_info={"gradient_accumulation_steps": 2})
    )  # fmt: skip
    assert two.predicted["grads"] == 8 * psi
    # A run_info.json that does not say (written before it recorded accumulation): one.
    unsaid = check_run(_write(tmp_path / "unsaid", report, run_config=config, run_info={}))
    assert unsaid.predicted["grads"] == one.predicted["grads"]
    trainer = _trainer_report(settings=report["settings"])  # its record: no accumulation
    run_dir = _write(tmp_path / "t", trainer, run_info={"gradient_accumulation_steps": 2})
    assert check_run(run_dir).predicted["grads"] == 156  # as at one micro-batch, above


# --- refusals: one line naming the flag --------------------------------------------------------


def test_refusals_name_what_is_missing_or_wrong(tmp_path):
    with pytest.raises(UsageError) as err:
        check_run(tmp_path / "nope")
    assert str(err.value) == f"--against={str(tmp_path / 'nope')!r}: no such run folder"
    with pytest.raises(UsageError) as err:
        check_run(tmp_path)
    assert str(err.value) == (
        f"--against={str(tmp_path)!r}: no memory_report.json (written at the end of every run)"
    )
    (tmp_path / "memory_report.json").write_text("{")
    with pytest.raises(UsageError) as err:
        check_run(tmp_path)
    assert str(err.value) == (
        f"--against: {tmp_path / 'memory_report.json'} is not valid JSON "
        "(Expecting property name enclosed in double quotes, line 1)"
    )
    _write(tmp_path, _recipe_report("ddp"))
    with pytest.raises(UsageError) as err:
        check_run(tmp_path)
    assert str(err.value) == (
        f"--against={str(tmp_path)!r}: no run_config.json (written at the start of every run)"
    )
    _write(tmp_path, _recipe_report("ddp"), run_config={"Other": {}})
    with pytest.raises(UsageError) as err:
        check_run(tmp_path)
    assert str(err.value) == (
        f"--against={str(tmp_path)!r}: run_config.json: not from recipes/finetune.py, "
        "recipes/finetune_lm.py or recipes/train_lm.py"
    )
    _write(tmp_path, _trainer_report(precision="fp8"))
    with pytest.raises(UsageError) as err:
        check_run(tmp_path)
    assert str(err.value) == "--against: unknown precision 'fp8' in the report"


def _states(figures: dict) -> dict:
    """The model-state rows of a check (since issue #30 it also has buffers and activations,
    checked in tests/test_plan_activations_measured.py)."""
    return {
        k: v for k, v in figures.items() if k in ("params", "grads", "optimizer", "master", "total")
    }


# --- what it prints ------------------------------------------------------------------------------


def _check(grads_where: str = "rank 1, step, group 0 (flat copy of the partition)") -> PlanCheck:
    return PlanCheck(
        run_dir=Path("runs/z2"), model="m", strategy="zero2", world_size=2, precision="bf16",
        predicted={"params": 3 * MIB, "grads": 1.5 * MIB, "optimizer": 8 * MIB, "master": 0.0,
                   "total": 12.5 * MIB},
        measured={"params": 3 * MIB, "grads": 2 * MIB, "optimizer": 7.5 * MIB, "master": 0.0,
                  "total": 12.5 * MIB},
        grads_paper=0.5 * MIB + 0.4, grads_where=grads_where,
    )  # fmt: skip


def test_the_table_gives_mib_and_signed_errors_per_category():
    assert format_check(_check()).splitlines() == [
        "dpkit plan --against runs/z2",
        "  m: zero2 on 2 ranks, bf16; per GPU (plan: its worst rank; measured: the largest rank)",
        "",
        "MiB per GPU     predicted   measured    error",
        "params                3.0        3.0    +0.0%",
        "grads                 1.5        2.0   -25.0%",
        "optimizer             8.0        7.5    +6.7%",
        "master                0.0        0.0        -",
        "total                12.5       12.5    +0.0%",
        "total: the model states; activations: bytes saved for backward in one forward (the "
        "report's measure)",
        "",
        "grads: rank 1, step, group 0 (flat copy of the partition); the ZeRO paper's figure "
        "would be 0.5 MiB (see dpkit.engines.deepspeed.layout)",
    ]
    assert format_check(_check(grads_where="")).splitlines()[-1].startswith("total: the model")


def test_the_json_gives_whole_bytes():
    assert check_dict(_check()) == {
        "run_dir": "runs/z2", "model": "m", "strategy": "zero2", "world_size": 2,
        "precision": "bf16",
        "predicted_bytes": {"params": 3 * MIB, "grads": 3 * MIB // 2, "optimizer": 8 * MIB,
                            "master": 0, "total": 25 * MIB // 2},
        "measured_bytes": {"params": 3 * MIB, "grads": 2 * MIB, "optimizer": 15 * MIB // 2,
                           "master": 0, "total": 25 * MIB // 2},
        "error_pct": {"params": 0.0, "grads": -25.0, "optimizer": 100 / 15, "master": None,
                      "total": 0.0},
        "grads_paper_bytes": MIB // 2,
        "grads_where": "rank 1, step, group 0 (flat copy of the partition)",
        "planned_batch": "", "not_predicted": {}, "not_checked": {}, "logits_peak_bytes": 0,
        "gradient_checkpointing": False, "recomputed_layer_bytes": 0, "activation_method": "",
        "peak": None, "peak_measured": None,
    }  # fmt: skip


def test_an_error_beyond_the_column_is_bounded_and_an_unchecked_row_says_why():
    """Measured on MiniLM bf16 at 2 ranks (full-shard): buffers planned 94.9 MiB, measured
    8 KiB (the module's own buffers), an error of +1,214,503% that overflowed the column.
    FSDP2's buffers are not measurable by the report: shown planned, with the reason."""
    from dpkit.plan.check import PlanCheck, format_check

    mib = 2**20
    fields = dict(
        run_dir=Path("run"), model="m", world_size=2, precision="bf16",
        predicted={"params": mib, "total": mib, "buffers": 94.9 * mib},
        measured={"params": mib, "total": mib, "buffers": 8192.0},
        grads_paper=0.0, grads_where="",
    )  # fmt: skip
    text = format_check(PlanCheck(strategy="ddp", **fields))
    (row,) = [line for line in text.splitlines() if line.startswith("buffers ")]
    assert row == f"{'buffers':<14}{'94.9':>11}{'0.0':>11}{'>+999%':>9}"
    check = PlanCheck(strategy="fsdp2_full_shard", not_checked={"buffers": "why"}, **fields)
    (row,) = [line for line in format_check(check).splitlines() if line.startswith("buffers ")]
    assert row == f"{'buffers':<14}{'94.9':>11}{'-':>11}{'-':>9}  why"
    assert check.error_pct["buffers"] is None and check.error_pct["params"] == 0.0


def test_the_table_shows_every_row_and_note_a_checkpointed_run_can_have():
    """Every optional part at once: the checkpointing mark and its note, the planned batch,
    a row the plan gives no number for (a CPU run's peak), buffers and activations, the
    logits' and the formula's notes, and an error of exactly +1000% (planned 11 MiB,
    measured 1: (11 - 1) / 1), the first one the column bounds."""
    check = PlanCheck(
        run_dir=Path("runs/gc"), model="gpt2", strategy="ddp", world_size=2, precision="fp32",
        predicted={"params": 4 * MIB, "grads": 4 * MIB, "optimizer": 8 * MIB, "master": 0.0,
                   "total": 16 * MIB, "buffers": 11 * MIB, "activations": 2 * MIB},
        measured={"params": 4 * MIB, "grads": 4 * MIB, "optimizer": 8 * MIB, "master": 0.0,
                  "total": 16 * MIB, "buffers": 1 * MIB, "activations": 2.5 * MIB},
        grads_paper=0.0, grads_where="", planned_batch="micro-batch 8 x 128 tokens",
        not_predicted={"peak": "why not"}, logits_peak=3 * MIB, gradient_checkpointing=True,
        recomputed_layer=1.5 * MIB, activation_method="formula: no trace",
    )  # fmt: skip
    assert format_check(check).splitlines() == [
        "dpkit plan --against runs/gc",
        "  gpt2: ddp on 2 ranks, fp32, gradient checkpointing; per GPU (plan: its worst "
        "rank; measured: the largest rank)",
        "  activations planned for micro-batch 8 x 128 tokens",
        "",
        "MiB per GPU     predicted   measured    error",
        "params                4.0        4.0    +0.0%",
        "grads                 4.0        4.0    +0.0%",
        "optimizer             8.0        8.0    +0.0%",
        "master                0.0        0.0        -",
        "total                16.0       16.0    +0.0%",
        "buffers              11.0        1.0   >+999%",
        "activations           2.0        2.5   -20.0%",
        "peak                    -          -        -  why not",
        "total: the model states; activations: bytes saved for backward in one forward (the "
        "report's measure)",
        "not in activations above: the loss's logits peak at the start of backward, 3.0 MiB "
        "planned (transient, not a saved tensor; the report does not measure it)",
        "activations planned by the formula, not a trace (formula: no trace)",
        "gradient checkpointing: activations are each layer's inputs (what the forward keeps); "
        "the layer recomputed in backward adds 1.5 MiB planned at a time (transient, not "
        "measured)",
    ]
    # Just under the bound, the error is written out; a classifier's logits get no line.
    predicted = {**check.predicted, "buffers": 10.99 * MIB}
    lines = format_check(replace(check, predicted=predicted, logits_peak=0.04 * MIB)).splitlines()
    assert f"{'buffers':<14}{'11.0':>11}{'1.0':>11}{'+999.0%':>9}" in lines
    assert not any(line.startswith("not in activations") for line in lines)
    # From 0.05 MiB of logits on, the line is there.
    lines = format_check(replace(check, logits_peak=0.05 * MIB)).splitlines()
    assert any(line.startswith("not in activations") for line in lines)
    # A row with no number, not planned or not measurable is a row less or a row without
    # its measure, not the end of the table.
    predicted = {k: v for k, v in check.predicted.items() if k != "grads"}
    measured = {k: v for k, v in check.measured.items() if k != "grads"}
    early = replace(
        check, predicted=predicted, measured=measured, not_predicted={"params": "why not"},
        not_checked={"buffers": "not measurable"},
    )  # fmt: skip
    rows = [line.split()[0] for line in format_check(early).splitlines()[5:12]]
    assert rows == ["params", "optimizer", "master", "total", "buffers", "activations", "total:"]


# --- the run's own inputs, read back from its run_config.json ----------------------------------

MINILM = "sentence-transformers/all-MiniLM-L6-v2"  # the embedded model: 6 layers, hidden 384


def test_a_finetune_runs_config_gives_its_model_dropout_batch_length_and_adapters():
    from dpkit.plan.check import recipe_model

    config = {
        "ModelConfig": {"model": MINILM, "dropout": 0.0, "max_seq_length": 64},
        "TrainConfig": {"micro_batch_size": 16},
        "StrategyConfig": {"lora_r": 8, "lora_target_modules": "query, value"},
    }
    name, spec, micro_batch, seq_len = recipe_model(config, "run_config.json")
    assert (name, micro_batch, seq_len) == (MINILM, 16, 64)
    assert spec.task.endswith("ForSequenceClassification")
    # --dropout 0 reached every dropout probability of the model the activations trace.
    dropouts = {k: v for k, v in spec.config.to_dict().items() if "dropout" in k}
    assert dropouts and all(v in (0.0, None) for v in dropouts.values()), dropouts
    assert spec.config.hidden_dropout_prob == 0.0 == spec.config.attention_probs_dropout_prob
    assert spec.config.layer_norm_eps == 1e-12  # a float, but no dropout: left as it is
    # LoRA r=8 on query and value (alpha 2r by default): A (8 x 384) and B (384 x 8) per
    # projection, 2 projections x 6 layers = 73,728 adapter parameters, trained with the
    # classifier head (384 x 2 + 2), which peft copies to train; frozen: the whole
    # classifier as loaded, 22,713,986 parameters (tests/test_memory_timeline_multiprocess.py
    # counts them), the head's original included.
    assert spec.lora == {
        "r": 8,
        "alpha": 16.0,
        "dropout": 0.0,
        "target_modules": ["query", "value"],
    }
    assert spec.num_params == 2 * 8 * 384 * 2 * 6 + 384 * 2 + 2
    assert spec.frozen_params == 22_713_986


def test_a_finetune_config_without_dropout_or_length_keeps_the_models_and_the_default():
    """A run recorded before max_seq_length was: the recipe's default 128 (MiniLM allows
    512 positions); no --dropout: the checkpoint's own 0.1; no LoRA: everything trains."""
    from dpkit.plan.check import recipe_model

    config = {"ModelConfig": {"model": MINILM}, "TrainConfig": {"micro_batch_size": 8}}
    name, spec, micro_batch, seq_len = recipe_model(config, "run_config.json")
    assert (micro_batch, seq_len) == (8, 128)
    assert spec.config.hidden_dropout_prob == 0.1  # all-MiniLM-L6-v2's config.json
    assert spec.lora is None and spec.frozen_params == 0


def test_an_lm_runs_config_gives_its_workload_and_ignores_unknown_fields():
    from dpkit.plan.check import recipe_model

    config = {
        "LMWorkload": {"size": "tiny", "micro_batch_size": 4, "seq_len": 32, "from_a_newer": 1},
        "StrategyConfig": {"lora_r": 4, "lora_alpha": 4},
    }
    name, spec, micro_batch, seq_len = recipe_model(config, "run_config.json")
    assert (name, micro_batch, seq_len) == ("train_lm --size tiny", 4, 32)
    assert spec.name == "train_lm --size tiny"
    assert spec.source == "recipe" and spec.lora["r"] == 4 and spec.lora["alpha"] == 4.0
    with pytest.raises(UsageError) as err:
        recipe_model({"TrainConfig": {}}, "the/run_config.json")
    assert (
        str(err.value)
        == "the/run_config.json: not from recipes/finetune.py, recipes/finetune_lm.py or recipes/train_lm.py"
    )


def test_the_peak_is_compared_where_the_run_measured_peak_live():
    """The largest rank's ``peak_live`` (the first step's live-tensor high-water, on CPUs
    and GPUs alike) is what the predicted peak is set against; a report without one, or a
    model without shapes, gets no peak and the reason."""
    from dpkit.plan.check import _peak
    from dpkit.plan.recommend import make_plan

    spec = ModelSpec(name="1B", source="count", num_params=10**9)
    inputs = PlanInputs(model=spec, gpu_memory=80 * 10**9)
    row = make_plan(inputs).row("ddp")
    none = {"ranks": [{"peak": {"max_allocated": 3.0e9}}, {"peak_live": None}]}
    assert _peak(none, inputs, row, {}, True) == (
        None,
        None,
        "the run measured no peak_live (--memory-probe-steps 0, or a report from before it)",
    )
    measured = {
        "ranks": [
            {"rank": 0, "peak_live": {"bytes": 3.0e9}},
            {"rank": 1, "peak_live": {"bytes": 5.0e9}},
        ]
    }
    peak, largest, why = _peak(measured, inputs, row, {}, True)
    assert peak is None and largest == {"bytes": 5.0e9, "rank": 1}
    assert why == "the run's model has no shapes to trace"


def test_a_report_without_batch_shapes_plans_the_runs_longest_batch_and_says_so():
    from dpkit.plan.check import _measured_batch

    report = {"ranks": [{"rank": 0, "activations": 2.0e6}, {"rank": 1, "activations": None}]}
    assert _measured_batch(report, 16, 64) == (
        16,
        64,
        "micro-batch 16 x 64 tokens: the run's longest allowed (the report records no batch "
        "shapes), a worst case",
    )


# --- what check_run passes on to the plan, and what it reads back -------------------------------


def _finetune_run(
    tmp_path: Path, name: str, strategy: str = "ddp", peaks: tuple = (), **report_extra
) -> PlanCheck:
    """A finetune run of the tiny BERT (dropout 0.1, 16 tokens, micro-batch 2) whose two
    ranks counted 1,000 and 3,000 activation bytes and 5 and 7 buffer bytes (and, given
    ``peaks``, reported those allocator high-waters)."""
    folder, _ = _tiny_bert_folder(tmp_path / "bert")
    config = {
        "ModelConfig": {"model": str(folder), "max_seq_length": 16},
        "TrainConfig": {"micro_batch_size": 2},
    }
    report = _recipe_report(strategy) | {"world_size": 2}
    report["ranks"] = _ranks({"params": 1.0}, {"params": 1.0})
    for rank, (counted, buffers) in enumerate([(1000.0, 5.0), (3000.0, 7.0)]):
        report["ranks"][rank] |= {"activations": counted, "buffers_total": buffers}
    for rank, peak in enumerate(peaks):
        report["ranks"][rank]["peak_live"] = {"bytes": peak, "point": "backward"}
    report |= report_extra
    return check_run(_write(tmp_path / name, report, run_config=config))


def test_the_activations_are_planned_with_the_runs_checkpointing_and_device(tmp_path):
    """The run's recorded checkpointing and device reach the trace: with checkpointing the
    plan keeps one recomputed layer (and names it); without the record, none. On a GPU
    the dropout masks are 1 byte, on a CPU (and a report without a device, older runs)
    4 bytes in fp32: the CPU's prediction is the larger. Measured: the largest rank's
    counts, 3,000 activation bytes and 7 buffer bytes."""
    plain = _finetune_run(tmp_path, "plain")
    checkpointed = _finetune_run(tmp_path, "checkpointed", gradient_checkpointing=True)
    on_gpu = _finetune_run(tmp_path, "gpu", peaks=(100.0, 200.0), device="cuda:0")
    no_device = _finetune_run(tmp_path, "no-device", device="unknown")
    # No batch shapes in these reports: the plan says which batch it assumed.
    assert plain.planned_batch == (
        "micro-batch 2 x 16 tokens: the run's longest allowed (the report records no batch "
        "shapes), a worst case"
    )
    assert plain.gradient_checkpointing is False and plain.recomputed_layer == 0
    assert checkpointed.gradient_checkpointing is True and checkpointed.recomputed_layer > 0
    assert checkpointed.predicted["activations"] < plain.predicted["activations"]
    assert on_gpu.predicted["activations"] < plain.predicted["activations"]
    assert no_device.predicted["activations"] == plain.predicted["activations"]
    # The largest rank's peak_live against the first step's predicted peak, which holds at
    # least the parameters and DDP's gradient buckets; a run without one is not compared.
    assert on_gpu.measured["peak"] == 200.0 and "peak" not in on_gpu.not_predicted
    assert on_gpu.predicted["peak"] > on_gpu.predicted["params"] + on_gpu.predicted["grads"]
    assert plain.not_predicted["peak"].startswith("the run measured no peak_live")
    assert "peak" not in plain.predicted and "peak" not in plain.measured
    for check in (plain, checkpointed, on_gpu):
        assert check.measured["activations"] == 3000.0
        assert check.measured["buffers"] == 7.0
        assert check.activation_method == "trace"
        # Micro-batch 2 x 2 labels x (the fp32 logits and cross-entropy's 2 fp32 gradients).
        assert check.logits_peak == 2 * 2 * (4 + 4 + 4)
        assert "activations" not in check.not_predicted


def test_what_check_run_cannot_plan_or_measure_is_said_per_category(tmp_path):
    """No activation counts (count_activations off), no buffers recorded, a model without
    shapes (a Trainer's bare Linear), and FSDP2's buffers that live between the probes."""
    report = _recipe_report("ddp") | {"world_size": 2, "ranks": _ranks({"params": 1.0})}
    folder, _ = _tiny_bert_folder(tmp_path / "bert")
    config = {"ModelConfig": {"model": str(folder)}, "TrainConfig": {"micro_batch_size": 2}}
    uncounted = check_run(_write(tmp_path / "uncounted", report, run_config=config))
    assert uncounted.not_predicted["activations"] == (
        "the run did not count them (count_activations off)"
    )
    assert uncounted.measured["buffers"] == 0.0
    assert uncounted.activation_method == ""  # nothing measured to hold the plan against
    shapeless = check_run(_write(tmp_path / "linear", _trainer_report(strategy="ddp")))
    assert shapeless.not_predicted["activations"] == "the run's model has no shapes to trace"
    assert shapeless.activation_method == ""
    assert shapeless.logits_peak == shapeless.recomputed_layer == 0.0
    fsdp2 = _finetune_run(tmp_path, "fsdp2", strategy="fsdp2_full_shard")
    assert fsdp2.not_checked == {
        "buffers": "not measured: fsdp2_root_whole_grads, fsdp2_reduce_scatter, "
        "fsdp2_whole_params live between the report's probe points"
    }
    assert _finetune_run(tmp_path, "ddp").not_checked == {}


def test_a_trainer_run_with_another_scripts_config_is_read_from_its_report(tmp_path):
    """A Trainer run's folder may hold a run_config.json of the user's own: only both of
    finetune's sections (or train_lm's) make it a recipe run, planned from that config
    even where the report also records its model; otherwise the report's record plans it."""
    for name, config in {
        "model-only": {"ModelConfig": {"model": "x"}},
        "train-only": {"TrainConfig": {"micro_batch_size": 2}},
    }.items():
        run_dir = _write(tmp_path / name, _trainer_report(), run_config=config)
        check = check_run(run_dir)
        assert check.model == "linear" and check.world_size == 2
    folder, _ = _tiny_bert_folder(tmp_path / "bert")
    finetune = {"ModelConfig": {"model": str(folder)}, "TrainConfig": {"micro_batch_size": 2}}
    run_dir = _write(tmp_path / "recipe", _trainer_report(), run_config=finetune)
    assert check_run(run_dir).model == str(folder)


def test_a_trace_that_fails_is_planned_by_the_formula_and_says_why(tmp_path, monkeypatch):
    from dpkit.plan import activations

    def no_meta(*args, **kwargs):
        raise RuntimeError("this model does not run on meta")

    monkeypatch.setattr(activations, "trace_profile", no_meta)
    check = _finetune_run(tmp_path, "formula")
    assert check.activation_method == (
        "formula: meta-device trace failed (this model does not run on meta)"
    )


def test_ddps_bucket_view_recorded_by_the_run_reaches_the_buffers_plan(tmp_path):
    """DDP's reducer keeps a bucket copy of every gradient unless the run used
    gradient_as_bucket_view, which the report records: the buffers planned differ by the
    whole fp32 gradients, 4 bytes x the classifier's parameters (torch's count)."""
    _, psi = _tiny_bert_folder(tmp_path / "bert")
    copied = _finetune_run(tmp_path, "copied", settings={"ddp.gradient_as_bucket_view": False})
    viewed = _finetune_run(tmp_path, "viewed", settings={"ddp.gradient_as_bucket_view": True})
    assert copied.predicted["buffers"] - viewed.predicted["buffers"] == 4 * psi
