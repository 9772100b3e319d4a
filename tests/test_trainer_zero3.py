"""The Transformers ``Trainer`` with dpkit's callback under DeepSpeed ZeRO-3, ZeRO-2 offload
and ZeRO-3 offload.

Three launches of the real example (``recipes/trainer_finetune.py``: MiniLM, the embedded
Rotten Tomatoes, ``MemoryReportCallback``) on 2 CPU processes by the ``deepspeed``
launcher, with the shipped ``ds_configs/zero3.json``, ``ds_configs/zero2_offload.json``
and ``ds_configs/zero3_offload.json`` and tests/test_trainer.py's short flags (3 steps),
each checked many ways: the model loaded partitioned under ZeRO-3 (DeepSpeed's own line)
and counted whole, the runs' per-step losses equal, every model-state category (device and host) within 2% of
``dpkit plan --against``, and against the bytes worked by hand, and the optimizer that
ran under offload (the Trainer's torch AdamW: decoupled weight decay). In one process:
the refusals (a ZeRO-3 model built before ``TrainingArguments``; accelerate's CPU Adam in
L2 mode) and what ``deepspeed_config`` writes for offload.

tests/test_trainer.py's ZeRO-2 run is a module-scoped launch of that file: reusing it here
would launch it again, so the two runs here are compared with each other (each is
numerically ZeRO-2: docs/zero3.md, docs/offload.md).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.harness import Launch, deepspeed_cmd, max_rel_diff, run
from tests.test_trainer import MIB, PSI, RECIPE, SHORT, plan_against

# The per-step losses come from TensorBoard (float32; the printed log lines round to 4
# digits), one per step.
LOGGED = ["--logging_steps", "1", "--report_to", "tensorboard"]
CONFIG = {
    "zero3": "ds_configs/zero3.json",
    "zero2_offload": "ds_configs/zero2_offload.json",
    "zero3_offload": "ds_configs/zero3_offload.json",
}
MODEL_STATES = ("params", "grads", "optimizer", "master")
# ZeRO-3 against ZeRO-2 offload, the same Trainer flags, fp32 (dropout on, the same seed):
# each run is ZeRO-2's arithmetic but for the order of fp32 reductions and the
# optimizer's host step. Measured here: equal to the last float32 bit at all 3 steps
# (1.3820567, 1.3827039, 1.3763478). 1e-5 is tests/test_zero3.py's and
# tests/test_offload.py's tolerance for the same pairs; a gradient averaged wrongly, or
# ranks holding different weights, moves a loss by 1e-3 or more.
RTOL = 1e-5


@pytest.fixture(scope="module")
def runs(module_tmp):
    """Each run launched once, on first use."""
    launched: dict[str, Launch] = {}

    def get(name: str) -> Launch:
        if name not in launched:
            out = module_tmp / name
            args = [*SHORT, *LOGGED, "--output_dir", str(out), "--deepspeed", CONFIG[name]]
            launched[name] = run(deepspeed_cmd(2, *args, recipe=RECIPE), output_dir=out)
        return launched[name]

    return get


def _report(launch: Launch) -> dict:
    return json.loads((launch.check().output_dir / "memory_report.json").read_text())


def _losses(launch: Launch) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = {p.parent for p in Path(launch.output_dir).rglob("events.out.tfevents.*")}
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    by_step = {event.step: event.value for event in accumulator.Scalars("train/loss")}
    assert sorted(by_step) == [1, 2, 3], by_step
    return [by_step[step] for step in (1, 2, 3)]


@pytest.mark.multiprocess
def test_zero3_trainer_loads_the_model_partitioned_and_counts_it_whole(runs):
    """The example builds TrainingArguments before from_pretrained, so the model loads
    under deepspeed.zero.Init; a model loaded whole would have been refused at the
    Trainer's init (the refusal: test_a_zero3_model_built_before_the_arguments_is_refused)
    and the run would exit 2. Every count reads whole sizes."""
    launch = runs("zero3").check()
    report = _report(launch)
    assert (report["strategy"], report["world_size"]) == ("zero3", 2)
    # Whole sizes, not ZeRO-3's empty placeholders: MiniLM with the 2-label head,
    # 22,713,986 parameters (tests/test_trainer.py's PSI, as transformers counts it).
    assert report["num_params"] == PSI == 22_713_986
    assert sum(sum(group) for group in report["model"]["param_groups"]) == PSI
    assert report["model"]["class"] == "BertForSequenceClassification"
    assert [row["rank"] for row in report["ranks"]] == [0, 1]
    for row in report["ranks"]:
        # Each rank holds its slice of every parameter: half the fp32 model (plus
        # DeepSpeed's alignment padding of its flat partitions, a few hundred bytes).
        assert row["params"] == pytest.approx(4 * PSI / 2, rel=1e-3), row["params"]
        assert row["optimizer"] == pytest.approx(8 * PSI / 2, rel=1e-3)  # exp_avg + exp_avg_sq
        assert row["master"] == pytest.approx(4 * PSI / 2, rel=1e-3)
    assert report["grads_measured"] is True


@pytest.mark.multiprocess
def test_the_trainer_runs_train_and_give_the_same_losses(runs):
    zero3, offload = _losses(runs("zero3").check()), _losses(runs("zero2_offload").check())
    both = _losses(runs("zero3_offload").check())
    assert all(math.isfinite(loss) for loss in zero3 + offload + both), (zero3, offload, both)
    assert max_rel_diff(zero3, offload) <= RTOL, (zero3, offload)
    # ZeRO-3 offload: the Trainer's torch AdamW steps the host partitions (as ZeRO-2
    # offload's): ZeRO-3's arithmetic.
    assert max_rel_diff(zero3, both) <= RTOL, (zero3, both)
    # The trajectory moves more than the tolerance (other batches each step).
    assert max(zero3) - min(zero3) > 10 * RTOL * max(zero3), zero3


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["zero3", "zero2_offload", "zero3_offload"])
def test_each_model_state_is_within_2pct_of_dpkit_plan_against_the_trainer_run(runs, name):
    runs(name).check()
    check = plan_against(runs(name).output_dir)
    assert (check["strategy"], check["world_size"]) == (name, 2), check
    predicted, measured = check["predicted_bytes"], check["measured_bytes"]
    for category in (*MODEL_STATES, "total"):
        assert abs(predicted[category] - measured[category]) <= 0.02 * measured[category] or (
            predicted[category] == measured[category] == 0
        ), (category, check)
    # docs/plan.md's tolerance for buffers: 10% or 1 MiB.
    assert abs(predicted["buffers"] - measured["buffers"]) <= max(0.10 * measured["buffers"], MIB)
    if name.endswith("_offload"):
        hosted = ("params", "grads", "optimizer", "master")[name == "zero2_offload" :]
        for category in hosted:
            host = f"host {category}"
            assert abs(predicted[host] - measured[host]) <= 0.02 * measured[host], (host, check)
        # On a CPU host and device are one RAM: the step's peak predicted with both in it.
        assert abs(predicted["peak"] - measured["peak"]) <= 0.05 * measured["peak"], check


@pytest.mark.multiprocess
def test_zero3_gathers_the_whole_model_for_the_step(runs):
    """At DeepSpeed's defaults (reuse distance 1e9 elements) every parameter stays gathered
    from the end of the forward into the backward from step 2 (docs/zero3.md): the whole
    fp32 model, 4 bytes x PSI, beside each rank's slice."""
    for row in _report(runs("zero3"))["ranks"]:
        gathered = row["buffers"]["zero3_gathered_params (whole until released)"]
        assert gathered == pytest.approx(4 * PSI, rel=1e-2), row["buffers"]


@pytest.mark.multiprocess
def test_zero3_offload_keeps_no_model_state_on_the_device(runs):
    """ZeRO-3 offload under the Trainer: each rank's fp32 parameter partition, both AdamW
    moments and the fp32 master in host memory (4, 8 and 4 bytes x PSI / 2), nothing of
    them on the device; the Trainer's torch AdamW steps them."""
    report = _report(runs("zero3_offload"))
    assert (report["strategy"], report["offload_optimizer"]) == ("zero3_offload", "cpu")
    assert report["optimizer_class"] == "AdamW", report["optimizer_class"]
    for row in report["ranks"]:
        assert row["params"] == row["grads"] == row["optimizer"] == row["master"] == 0
        assert row["host"]["params"] == pytest.approx(4 * PSI / 2, rel=1e-3)
        assert row["host"]["optimizer"] == pytest.approx(8 * PSI / 2, rel=1e-3)
        assert row["host"]["master"] == pytest.approx(4 * PSI / 2, rel=1e-3)


@pytest.mark.multiprocess
def test_offload_keeps_the_trainers_adamw_and_its_states_in_host_memory(runs):
    report = _report(runs("zero2_offload"))
    assert (report["strategy"], report["offload_optimizer"]) == ("zero2_offload", "cpu")
    # The Trainer's own torch AdamW (decoupled weight decay) steps the host partitions:
    # the shipped JSON says zero_force_ds_cpu_optimizer false, so accelerate does not
    # swap in DeepSpeed's CPU Adam.
    assert report["optimizer_class"] == "AdamW", report["optimizer_class"]
    for row in report["ranks"]:
        # The device: the whole fp32 module, no optimizer state, no master.
        assert row["params"] == pytest.approx(4 * PSI, rel=1e-3)
        assert row["optimizer"] == row["master"] == 0
        # Host memory: AdamW's two fp32 moments and the fp32 master of half the model.
        assert row["host"]["optimizer"] == pytest.approx(8 * PSI / 2, rel=1e-3)
        assert row["host"]["master"] == pytest.approx(4 * PSI / 2, rel=1e-3)


# --- in one process ---------------------------------------------------------------------


def _tiny_bert():
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32,
    )  # fmt: skip
    return BertForSequenceClassification(config)


def test_a_zero3_model_built_before_the_arguments_is_refused():
    """Under ZeRO-3 (transformers' HfDeepSpeedConfig alive, as TrainingArguments(deepspeed=
    ...) makes it), a model with a parameter DeepSpeed has not partitioned (no ``ds_id``)
    was loaded whole on every rank."""
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    from dpkit.engines import ENGINES

    engine = next(engine for engine in ENGINES if engine.reads_config_file)
    model = _tiny_bert()
    assert engine.trainer_refusal(model=model) is None  # no ZeRO-3: nothing to say
    zero3 = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}})  # held: the weak ref lives
    try:
        message = engine.trainer_refusal(model=model)
    finally:
        unset_hf_deepspeed_config()
    del zero3
    assert message.startswith("ZeRO-3: the Trainer's model was loaded whole on every rank ("), (
        message
    )
    assert "create TrainingArguments(deepspeed=...) before from_pretrained" in message


def test_deepspeed_config_keeps_the_trainers_optimizer_under_offload():
    """``zero_force_ds_cpu_optimizer`` left out of an offload config: written false (the
    Trainer's optimizer runs as built); written true: kept (the callback then checks what
    accelerate built)."""
    from dpkit.integrations.transformers import deepspeed_config
    from tests.test_trainer import _minilm_config

    shipped = json.loads(Path("ds_configs/zero2_offload.json").read_text())
    del shipped["zero_force_ds_cpu_optimizer"]
    assert (
        deepspeed_config(_minilm_config(), shipped, world_size=2)["zero_force_ds_cpu_optimizer"]
        is False
    )
    forced = {**shipped, "zero_force_ds_cpu_optimizer": True}
    assert (
        deepspeed_config(_minilm_config(), forced, world_size=2)["zero_force_ds_cpu_optimizer"]
        is True
    )
    zero2 = deepspeed_config(_minilm_config(), "zero2", world_size=2)
    assert "zero_force_ds_cpu_optimizer" not in zero2  # no offload: nothing written
    zero3 = deepspeed_config(_minilm_config(), "zero3", world_size=2)
    assert zero3["zero_optimization"]["stage"] == 3
    assert zero3["zero_optimization"]["reduce_bucket_size"] == 2**21  # dpkit's MiniLM bucket


def test_accelerates_cpu_adam_in_l2_mode_is_refused(monkeypatch, tmp_path, one_rank_group):
    """What accelerate builds under offload with ``zero_force_ds_cpu_optimizer`` true from a
    Trainer optimizer that is not a torch AdamW (here torch Adam with weight decay:
    ``map_pytorch_optim_to_deepspeed``), prepared by DeepSpeed in one process, is refused
    in one line; the same swap from a torch AdamW (AdamW mode) is not."""
    import deepspeed
    import deepspeed.ops
    import torch
    from accelerate.utils.deepspeed import map_pytorch_optim_to_deepspeed
    from deepspeed.accelerator import get_accelerator
    from transformers import TrainingArguments

    from dpkit.engines import ENGINES
    from dpkit.engines.deepspeed.config import skip_deepspeed_cpu_shm_op

    # As tests/test_trainer_callbacks.py's DeepSpeed run in one process: accelerate's
    # state made first, DeepSpeed's launcher check, no shared-memory op.
    TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    monkeypatch.setenv("LOCAL_RANK", "0")
    shm_op = get_accelerator().create_op_builder("ShareMemCommBuilder").NAME
    compatible = deepspeed.ops.__compatible_ops__
    monkeypatch.setitem(compatible, shm_op, compatible[shm_op])
    skip_deepspeed_cpu_shm_op()
    engine = next(engine for engine in ENGINES if engine.reads_config_file)
    messages = {}
    for torch_class in (torch.optim.Adam, torch.optim.AdamW):
        model = _tiny_bert()
        swapped = map_pytorch_optim_to_deepspeed(
            torch_class(model.parameters(), lr=1e-3, weight_decay=0.01)
        )
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        }
        _, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=swapped, config=config)
        messages[torch_class.__name__] = engine.trainer_refusal(optimizer=optimizer)
    assert messages["AdamW"] is None
    assert messages["Adam"].startswith(
        "offload_optimizer: the Trainer's optimizer runs as DeepSpeedCPUAdam in L2 mode "
        "(adamw_mode=False) with weight_decay=0.01"
    ), messages
