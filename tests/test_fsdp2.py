"""FSDP2 (torch's ``fully_shard``) beside DDP and ZeRO: the same recipes, one flag or YAML apart.

Classification: tests/checkpoint_runs.py's ``fsdp2_shard_grad_op`` reference (the shipped
accelerate YAML, 2 CPU processes, checkpoints at steps 3 and 6, the model exported) beside
its ``ddp`` reference with the same flags; tests/test_checkpoint.py resumes DDP -> FSDP2
and FSDP2 -> ZeRO-2 from them (the exact optimizer state), this module resumes DDP's as
FSDP2 full-shard and trains on. The LM recipe under both modes (``--strategy``, its bare
``fully_shard`` twin, the plan, the whole parameters each mode holds) is checked on
tests/test_bench.py's tiny bench. Resolution and its refusals are checked in process (no
launch). Both modes in fp32 and bf16 against one fp32 process, and the bf16 gradients
reduced in fp32 (which one rank cannot show), are tests/test_numerics.py's.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from dpkit.engines import STRATEGIES, engine_of
from dpkit.engines.fsdp2.shard import layer_classes
from dpkit.errors import UsageError
from dpkit.train.config import StrategyConfig
from dpkit.train.launcher import read_launch
from dpkit.train.resolution import resolve
from tests.checkpoint_runs import LOGS_ONLY, REFERENCES, launch_ck, step3
from tests.harness import (
    FSDP2_RTOL,
    REPO,
    assert_plan_matches_report,
    max_rel_diff,
    score_model_folder,
)

FSDP2_SHARD_GRAD_OP = STRATEGIES["fsdp2_shard_grad_op"]
FSDP2_FULL_SHARD = STRATEGIES["fsdp2_full_shard"]

# dpkit plan --against, every model-state category and the total. Measured on both modes'
# runs (MiniLM, 2 ranks, fp32): parameters and gradients exact, master 0 predicted 0, the
# optimizer state 420 B under of 86.6 MiB (-0.00046%: AdamW's 4-byte step counters, one
# per tensor, whole on every rank) and the total -0.00023%. 0.01% is 20x that; a state
# counted unsharded, or sharded once too often, is 50-100% off.
PLAN_TOLERANCE_PCT = 0.01


# ---- resolution and refusals, in process ---------------------------------------------------


def launch_of(flag: str, deepspeed: str | None, env: dict[str, str]):
    """What ``read_launch`` decides from the raw flags and the launcher's environment, on a
    CPU box."""
    args = SimpleNamespace(strategy=flag, deepspeed=deepspeed, mixed_precision=None)
    return read_launch(args, env, on_cuda=False)


def _accelerate_fsdp_env(**settings: str) -> dict[str, str]:
    """What ``accelerate launch`` with an FSDP YAML puts in the environment."""
    env = {
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": "2",
        "FSDP_RESHARD_AFTER_FORWARD": "true",
        "ACCELERATE_DYNAMO_BACKEND": "NO",
        "WORLD_SIZE": "2",
    }
    return {**env, **settings}


@pytest.mark.parametrize(
    ("reshard", "expected"),
    [("true", FSDP2_FULL_SHARD), ("false", FSDP2_SHARD_GRAD_OP), ("SHARD_GRAD_OP", FSDP2_SHARD_GRAD_OP)],
)  # fmt: skip
def test_an_accelerate_fsdp2_yaml_picks_the_mode(reshard, expected):
    choice = launch_of("auto", None, _accelerate_fsdp_env(FSDP_RESHARD_AFTER_FORWARD=reshard))
    assert choice.strategy is expected
    assert choice.config_path is None and choice.world_size == 2
    assert engine_of(expected).name == "fsdp2"
    # No fp32 master copy beside the module's own fp32 shards, even under bf16.
    states = engine_of(expected).plan.model_state_bytes(expected, 1000.0, 2, "bf16", "adamw", None)
    assert states.master == 0
    assert expected.reshard_after_forward == (expected is FSDP2_FULL_SHARD)


def test_shipped_fsdp2_yamls_name_their_mode():
    import yaml

    for strategy in (FSDP2_SHARD_GRAD_OP, FSDP2_FULL_SHARD):
        text = (REPO / "ds_configs" / "accelerate" / f"{strategy.name}.yaml").read_text()
        fsdp = yaml.safe_load(text)["fsdp_config"]
        assert fsdp["fsdp_version"] == 2
        assert fsdp["fsdp_reshard_after_forward"] is strategy.reshard_after_forward


@pytest.mark.parametrize(
    ("strategy_flag", "deepspeed", "settings", "message"),
    [
        ("auto", None, {"FSDP_VERSION": "1"}, "accelerate config fsdp_version=1: dpkit runs FSDP2"),
        ("auto", None, {"FSDP_ACTIVATION_CHECKPOINTING": "true"}, "fsdp_activation_checkpointing=true"),
        ("auto", None, {"FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP"}, "fsdp_auto_wrap_policy=SIZE_BASED_WRAP"),
        ("auto", None, {"FSDP_RESHARD_AFTER_FORWARD": "HYBRID_SHARD"}, "fsdp_reshard_after_forward=hybrid_shard"),
        ("zero2", None, {}, "--strategy=zero2 conflicts with accelerate launch (FSDP2, fsdp2_full_shard)"),
        ("auto", "ds_configs/zero2.json", {}, "--deepspeed='ds_configs/zero2.json' conflicts with accelerate launch (FSDP2"),
    ],
    ids=["fsdp1", "activation-checkpointing", "size-wrap", "hybrid", "zero-flag", "deepspeed-json"],
)  # fmt: skip
def test_fsdp_launches_dpkit_cannot_honour_are_refused(strategy_flag, deepspeed, settings, message):
    with pytest.raises(UsageError) as refused:
        launch_of(strategy_flag, deepspeed, _accelerate_fsdp_env(**settings))
    assert message in str(refused.value)
    assert "\n" not in str(refused.value)


def test_fsdp2_flag_runs_under_plain_launchers():
    """dpkit shards the model itself: torchrun or accelerate without a YAML run it."""
    for env in ({"WORLD_SIZE": "2"}, {"WORLD_SIZE": "2", "ACCELERATE_DYNAMO_BACKEND": "NO"}):
        choice = launch_of("fsdp2_shard_grad_op", None, env)
        assert choice.strategy is FSDP2_SHARD_GRAD_OP and choice.config_path is None


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)


class _Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(), _Block(), _Block()])
        self.head = torch.nn.Linear(4, 2)


class _NoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 2)


def test_layer_classes_come_from_the_model_or_the_flag():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64))
    assert layer_classes(gpt2, asked_by="--strategy=fsdp2_full_shard") == (
        "GPT2Block",
    )  # _no_split_modules
    assert layer_classes(_Stack(), asked_by="--strategy=fsdp2_full_shard") == (
        "_Block",
    )  # repeated blocks
    assert layer_classes(_Stack(), ("Linear",), asked_by="--strategy=fsdp2_full_shard") == (
        "Linear",
    )
    with pytest.raises(
        UsageError, match=r"^--fsdp-layer-classes=Conv2d: no Conv2d module in _Stack$"
    ):
        layer_classes(_Stack(), ("Conv2d",), asked_by="--strategy=fsdp2_full_shard")


def test_a_model_without_a_layer_list_is_refused_before_any_process_group():
    message = (
        "--strategy=fsdp2_full_shard: _NoLayers has no recognisable layer list (no "
        "_no_split_modules, no list of repeated blocks); name its block class with "
        "--fsdp-layer-classes"
    )
    with pytest.raises(UsageError) as refused:
        resolve(
            StrategyConfig(strategy="fsdp2_full_shard"),
            model=_NoLayers(),
            micro_batch_size=2,
            env={},
        )
    assert str(refused.value) == message
    assert not torch.distributed.is_initialized()
    # Asked for by an accelerate YAML, the line names the launch.
    with pytest.raises(UsageError) as refused:
        resolve(None, model=_NoLayers(), micro_batch_size=2, env=_accelerate_fsdp_env())
    assert str(refused.value).startswith(
        "accelerate launch (FSDP2, fsdp2_full_shard): _NoLayers has no recognisable layer list"
    )
    # Named by the user, the same model resolves.
    named = StrategyConfig(strategy="fsdp2_full_shard", fsdp_layer_classes="Linear")
    resolution = resolve(named, model=_NoLayers(), micro_batch_size=2, env={})
    assert resolution.settings.layer_classes == ("Linear",)
    # No DeepSpeed config, no DDP kwargs: FSDP2's settings only.
    assert resolution.settings.config is None and not hasattr(resolution.settings, "kwargs")


def test_fsdp2_settings_on_other_strategies_are_refused():
    with pytest.raises(
        UsageError, match=r"^--fsdp-layer-classes=_Block: FSDP2's; ddp shards no layers$"
    ):
        resolve(
            StrategyConfig(strategy="ddp", fsdp_layer_classes="_Block"),
            model=_Stack(),
            micro_batch_size=2,
            env={},
        )
    # Several classes are named back as the user wrote them, comma-separated.
    with pytest.raises(
        UsageError, match=r"^--fsdp-layer-classes=_Block,Linear: FSDP2's; zero2 shards no layers$"
    ):
        resolve(
            StrategyConfig(strategy="zero2", fsdp_layer_classes="_Block,Linear"),
            model=_Stack(),
            micro_batch_size=2,
            env={},
        )
    with pytest.raises(
        UsageError, match=r"^--strategy=fsdp2_shard_grad_op conflicts with --deepspeed="
    ):
        StrategyConfig(strategy="fsdp2_shard_grad_op", deepspeed="ds_configs/zero2.json")


def test_an_ignored_state_dict_type_is_said_and_recorded():
    env = _accelerate_fsdp_env(FSDP_STATE_DICT_TYPE="SHARDED_STATE_DICT")
    resolution = resolve(None, model=_Stack(), micro_batch_size=2, env=env)
    assert resolution.strategy is FSDP2_FULL_SHARD
    assert any("fsdp_state_dict_type=SHARDED_STATE_DICT" in note for note in resolution.notes)


# ---- classification: the checkpointed references -------------------------------------------


@pytest.mark.multiprocess
def test_fsdp2_trains_exactly_as_ddp(reference):
    fsdp2, ddp = reference("fsdp2_shard_grad_op"), reference("ddp")
    info = fsdp2.run_info
    assert info["strategy"] == "fsdp2_shard_grad_op"
    assert info["strategy_source"] == "accelerate launch (FSDP2, fsdp2_shard_grad_op)"
    assert (info["world_size"], info["backend"], info["zero_stage"]) == (2, "gloo", 2)
    # MiniLM's _no_split_modules: its six BertLayers and its embeddings; then the root.
    assert info["wrapper"].startswith("FSDP2 fully_shard (8 units)"), info["wrapper"]
    assert [r["step"] for r in fsdp2.train_log] == [1, 2, 3, 4, 5, 6]
    assert max_rel_diff(fsdp2.losses, ddp.losses) <= FSDP2_RTOL
    assert [r["lr"] for r in fsdp2.train_log] == pytest.approx([r["lr"] for r in ddp.train_log])
    assert max(ddp.losses) - min(ddp.losses) > 100 * FSDP2_RTOL  # the trajectory moves
    assert fsdp2.final("test")["accuracy"] == ddp.final("test")["accuracy"]


@pytest.mark.multiprocess
def test_fsdp2_holds_half_of_ddps_model_states_at_two_ranks(reference):
    def ranks(launch) -> list[dict]:
        return json.loads((launch.output_dir / "memory_report.json").read_text())["ranks"]

    fsdp2, ddp = ranks(reference("fsdp2_shard_grad_op")), ranks(reference("ddp"))
    # Every MiniLM parameter's dim 0 is even: the shards are exactly half, no padding.
    for category in ("params", "grads"):
        assert [r[category] for r in fsdp2] == [ddp[0][category] / 2] * 2, category
    for moment in ("exp_avg", "exp_avg_sq"):
        half = ddp[0]["holders"]["optimizer"][moment] / 2
        assert [r["holders"]["optimizer"][moment] for r in fsdp2] == [half] * 2, moment
    # Adam's step counts (one 4-byte tensor per parameter) are whole on every rank.
    steps = ddp[0]["holders"]["optimizer"]["step"]
    assert [r["holders"]["optimizer"]["step"] for r in fsdp2] == [steps] * 2
    assert all(r["master"] == 0 for r in fsdp2)
    # Shard-grad-op keeps every unit's whole parameters from the forward to the backward:
    # the report counts them as communication buffers (the all-gather output), a full
    # replica's worth.
    for row in fsdp2:
        whole = row["buffers"]["whole parameters (FSDP2 all-gather output)"]
        assert whole == pytest.approx(ddp[0]["params"], rel=1e-6)
    # Activations are the same tensors as under DDP (the whole parameters are not counted twice).
    assert fsdp2[0]["activations"] == pytest.approx(ddp[0]["activations"], rel=1e-6)


@pytest.fixture(scope="module")
def full_shard_resumed(reference, module_tmp):
    """The ``ddp`` reference resumed at step 3 as FSDP2 full-shard (its shipped YAML), to
    step 6: the classification recipe training under full-shard, from DDP's state."""
    _, _, args = REFERENCES["ddp"]
    out = module_tmp / "ddp-to-fsdp2-full-shard"
    resume = str(step3(reference("ddp")))
    return launch_ck("fsdp2_full_shard", 2, out, *args, *LOGS_ONLY, "--resume", resume)


@pytest.mark.multiprocess
def test_a_ddp_run_resumed_as_full_shard_continues_exactly(reference, full_shard_resumed):
    ddp, resumed = reference("ddp"), full_shard_resumed
    assert "written by ddp on 2 process(es)" in resumed.output
    assert "as fsdp2_full_shard on 2 process(es)" in resumed.output
    info = resumed.run_info
    assert info["strategy_source"] == "accelerate launch (FSDP2, fsdp2_full_shard)"
    assert (info["strategy"], info["zero_stage"], info["world_size"]) == ("fsdp2_full_shard", 3, 2)
    assert [r["step"] for r in resumed.train_log] == [4, 5, 6]
    assert max_rel_diff(resumed.losses, ddp.losses[3:]) <= FSDP2_RTOL
    assert [r["lr"] for r in resumed.train_log] == pytest.approx(
        [r["lr"] for r in ddp.train_log][3:]
    )
    assert resumed.final("test")["accuracy"] == ddp.final("test")["accuracy"]
    # Full-shard keeps (almost) no whole parameters once a unit's forward is done.
    report = json.loads((resumed.output_dir / "memory_report.json").read_text())
    replica = json.loads((ddp.output_dir / "memory_report.json").read_text())["ranks"][0]["params"]
    for row in report["ranks"]:
        assert row["params"] == replica / 2
        assert (
            row["buffers"].get("whole parameters (FSDP2 all-gather output)", 0.0) < 0.05 * replica
        )


@pytest.mark.multiprocess
def test_gradient_accumulation_under_fsdp2_continues_ddps(reference, tmp_path):
    """DDP's accumulation reference (micro-batch 8 x 2) resumed at step 3 as shard-grad-op
    with the same accumulation: FSDP2 reduce-scatters each micro-batch into the sharded
    gradients (accelerate's no_sync has no FSDP2 form here), so the sum is the same and
    the gradients stay half of DDP's between micro-batches."""
    ddp = reference("ddp_accumulation")
    _, _, args = REFERENCES["ddp_accumulation"]
    resumed = launch_ck(
        "fsdp2_shard_grad_op", 2, tmp_path, *args, *LOGS_ONLY, "--resume", str(step3(ddp))
    )
    assert resumed.run_info["gradient_accumulation_steps"] == 2
    assert [r["step"] for r in resumed.train_log] == [4, 5, 6]
    assert max_rel_diff(resumed.losses, ddp.losses[3:]) <= FSDP2_RTOL
    grads = [r["grads"] for r in json.loads((tmp_path / "memory_report.json").read_text())["ranks"]]
    ddp_grads = json.loads((ddp.output_dir / "memory_report.json").read_text())["ranks"][0]["grads"]
    assert grads == [ddp_grads / 2] * 2


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["shard_grad_op", "full_shard"])
def test_dpkit_plan_against_fsdp2_runs(reference, full_shard_resumed, mode):
    run = reference("fsdp2_shard_grad_op") if mode == "shard_grad_op" else full_shard_resumed
    check = assert_plan_matches_report(run.output_dir, PLAN_TOLERANCE_PCT, PLAN_TOLERANCE_PCT)
    assert (check.strategy, check.world_size) == (f"fsdp2_{mode}", 2)
    # By hand, fp32 AdamW sharded over 2 ranks: parameters and gradients 4 bytes x Psi / 2,
    # both moments 8 x Psi / 2, no master copy (the shards are fp32 already).
    psi = json.loads((run.output_dir / "memory_report.json").read_text())["num_params"]
    expected = {"params": 2 * psi, "grads": 2 * psi, "optimizer": 4 * psi, "master": 0}
    assert {c: check.predicted[c] for c in expected} == expected
    # Its buffers (whole parameters and gradients of the unit computed) are planned but
    # live between the report's probe points: said so, with no error figure.
    assert set(check.not_checked) == {"buffers"} and check.error_pct["buffers"] is None
    assert check.predicted["buffers"] > 0


@pytest.mark.multiprocess
def test_fsdp2s_export_loads_with_from_pretrained_and_scores_the_same(reference):
    ref = reference("fsdp2_shard_grad_op")
    config = (ref.output_dir / "model" / "config.json").read_text()
    assert '"BertForSequenceClassification"' in config  # not the FSDP wrapper class
    scored = score_model_folder(ref.output_dir / "model", samples=48, max_length=32)
    assert scored["dtype"] == "torch.float32"
    final = ref.final("test")
    assert scored["accuracy"] == pytest.approx(final["accuracy"], abs=1e-6)
    assert scored["loss"] == pytest.approx(final["loss"], rel=1e-5)


# ---- one process, a one-rank mesh: what run.prepare shards, and what its checks refuse ------

_ONE_RANK_SCRIPT = """
import json, torch
from transformers import GPT2Config, GPT2LMHeadModel
import dpkit
from dpkit.core.walk import walk

def model():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))

found = {}
args = dpkit.StrategyConfig(strategy="fsdp2_shard_grad_op", mixed_precision="bf16")
gpt2 = model()
run = dpkit.setup(args, model=gpt2, micro_batch_size=2)
whole_params = list(gpt2.parameters())  # what fully_shard replaces by shards
# Built over the whole parameters, as a plain script builds it: prepare moves it onto the shards.
optimizer = torch.optim.AdamW(gpt2.parameters())
model_, optimizer = run.prepare(gpt2, optimizer)
found["wrapper"] = run.info.wrapper
found["optimizer_on_shards"] = [id(p) for g in optimizer.param_groups for p in g["params"]] == [
    id(p) for p in model_.parameters()
]
# The checks prepare runs after wrapping (engine.after_prepare), on the two mistakes they
# turn into errors: an optimizer over the model's unsharded parameters, a model not sharded.
try:
    run.engine.after_prepare(run, model_, torch.optim.AdamW(whole_params))
except RuntimeError as err:
    found["optimizer_first"] = str(err)
try:
    run.engine.after_prepare(run, model(), torch.optim.AdamW(model().parameters()))
except RuntimeError as err:
    found["not_sharded"] = str(err)
ids = torch.randint(0, 64, (2, 8))
dtypes = []
handle = model_.transformer.h[0].mlp.c_fc.register_forward_hook(
    lambda m, a, out: dtypes.append(str(out.dtype)))
loss = model_(input_ids=ids, labels=ids).loss
loss.backward()
handle.remove()
params = list(model_.parameters())
found["compute_dtype"] = dtypes[0]
found["param_dtypes"] = sorted({str(p.dtype) for p in params})
found["grad_dtypes"] = sorted({str(p.grad.dtype) for p in params})
found["sharded"] = all(type(p).__name__ == "DTensor" for p in params)
optimizer.step()
optimizer.zero_grad()
model_.eval()
with torch.no_grad():
    model_(input_ids=ids)
def whole():
    buffers = walk(run.engine, model_, optimizer)["holders"].get("buffers", {})
    return buffers.get("whole parameters (FSDP2 all-gather output)", 0.0)

found["whole_after_eval"] = whole()
run.evaluation_done(model_)
found["whole_after_reshard"] = whole()
run.accelerator.end_training()
print(json.dumps(found))
"""


def test_one_rank_fsdp2_in_bf16_and_what_check_refuses():
    """``python script.py --strategy fsdp2_*``: a one-rank mesh (dpkit's rendezvous), bf16
    through FSDP2's MixedPrecisionPolicy (bf16 compute, fp32 shards and gradients; the fp32
    reduction needs two ranks to be seen: tests/test_numerics.py), run.prepare moving an
    optimizer built over the whole parameters onto the shards, the two mistakes its
    post-wrap checks turn into errors, and the whole parameters an evaluation leaves
    under shard-grad-op, given back by run.evaluation_done."""
    import sys

    from tests.harness import run_captured

    done = run_captured([sys.executable, "-c", _ONE_RANK_SCRIPT])
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["optimizer_on_shards"] is True
    assert found["optimizer_first"] == (
        "the optimizer holds the model's unsharded parameters: build it after "
        "the model is sharded (run.prepare does both in order)"
    )
    assert found["not_sharded"].startswith("FSDP2 was asked for but the model is not sharded")
    assert found["wrapper"] == "FSDP2 fully_shard (3 units)+AdamW"  # two GPT2Blocks, the root
    assert found["compute_dtype"] == "torch.bfloat16"
    assert found["param_dtypes"] == found["grad_dtypes"] == ["torch.float32"]
    assert found["sharded"] is True
    assert found["whole_after_eval"] > 0  # bf16 copies of every unit's parameters
    assert found["whole_after_reshard"] == 0
