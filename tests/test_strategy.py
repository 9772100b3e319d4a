"""Strategy resolution and DeepSpeed config filling: pure logic, no process group."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest

from dpkit.engines import STRATEGIES, offloaded
from dpkit.engines.deepspeed.config import fill_deepspeed_config
from dpkit.errors import UsageError
from dpkit.models import ModelSizes
from dpkit.train.config import StrategyConfig
from dpkit.train.launcher import read_launch, read_precision
from dpkit.train.resolution import resolve, scaled_learning_rate
from tests.harness import REPO

ZERO1 = str(REPO / "ds_configs" / "zero1.json")
ZERO2 = str(REPO / "ds_configs" / "zero2.json")
ZERO3 = str(REPO / "ds_configs" / "zero3.json")
ACCELERATE_DS = {
    "ACCELERATE_USE_DEEPSPEED": "true",
    "ACCELERATE_DYNAMO_BACKEND": "NO",
    "WORLD_SIZE": "2",
}


def resolve_strategy(flag, deepspeed, env):
    """What ``read_launch`` decides from the raw flags and the launcher's environment (CPU)."""
    args = SimpleNamespace(strategy=flag, deepspeed=deepspeed, mixed_precision=None)
    return read_launch(args, env, on_cuda=False)


def resolve_precision(flag, env):
    """The precision on this CPU box (the suite hides any GPU: tests/conftest.py)."""
    return read_precision(flag, env, on_cuda=False)


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _leaves(node, prefix=""):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, f"{prefix}{key}.")
    else:
        yield prefix.rstrip("."), node


def test_zero_configs_differ_only_in_the_stage():
    zero1 = dict(_leaves(_load(ZERO1)))
    zero2 = dict(_leaves(_load(ZERO2)))
    assert zero1.keys() == zero2.keys()
    differing = {k for k in zero1 if zero1[k] != zero2[k]}
    assert differing == {"zero_optimization.stage"}
    assert (zero1["zero_optimization.stage"], zero2["zero_optimization.stage"]) == (1, 2)


@pytest.mark.parametrize(
    ("flag", "deepspeed", "env", "expected"),
    [
        ("auto", None, {}, "ddp"),
        ("ddp", None, {"WORLD_SIZE": "2"}, "ddp"),
        ("zero1", None, {"WORLD_SIZE": "2"}, "zero1"),  # torchrun + flag
        ("auto", ZERO2, {"WORLD_SIZE": "2"}, "zero2"),  # deepspeed launcher
        ("zero2", ZERO2, {"WORLD_SIZE": "2"}, "zero2"),
        ("auto", None, {**ACCELERATE_DS, "ACCELERATE_DEEPSPEED_CONFIG_FILE": ZERO1}, "zero1"),
        ("auto", None, {**ACCELERATE_DS, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}, "zero2"),
        ("auto", None, {**ACCELERATE_DS, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}, "zero3"),
        ("auto", None, {**ACCELERATE_DS, "ACCELERATE_DEEPSPEED_CONFIG_FILE": ZERO3}, "zero3"),
        ("auto", ZERO3, {"WORLD_SIZE": "2"}, "zero3"),  # deepspeed launcher
        ("zero3", None, {"WORLD_SIZE": "2"}, "zero3"),  # torchrun + flag
        ("auto", None, {"ACCELERATE_DYNAMO_BACKEND": "NO", "WORLD_SIZE": "2"}, "ddp"),
    ],
)
def test_strategy_comes_from_flag_or_launcher(flag, deepspeed, env, expected):
    choice = resolve_strategy(flag, deepspeed, env)
    assert choice.strategy.name == expected
    assert choice.world_size == int(env.get("WORLD_SIZE", "1"))
    assert (choice.config_template is not None) == (expected != "ddp")


@pytest.mark.parametrize(
    ("flag", "deepspeed", "env", "message"),
    [
        (
            "ddp",
            None,
            {**ACCELERATE_DS, "ACCELERATE_DEEPSPEED_CONFIG_FILE": ZERO2},
            "--strategy=ddp conflicts",
        ),
        ("zero1", ZERO2, {}, "--strategy=zero1 conflicts with --deepspeed"),
        (
            "zero2",
            None,
            {"ACCELERATE_DYNAMO_BACKEND": "NO", "WORLD_SIZE": "2"},
            "without DeepSpeed",
        ),
        (
            "auto",
            ZERO1,
            {**ACCELERATE_DS, "ACCELERATE_DEEPSPEED_CONFIG_FILE": ZERO2},
            "is ZeRO-1 but",
        ),
        ("auto", None, {**ACCELERATE_DS, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "4"}, "--zero_stage 4"),
        ("auto", ZERO3, {**ACCELERATE_DS, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}, "is ZeRO-3 but"),
        ("auto", None, {"ACCELERATE_USE_FSDP": "true"}, "fsdp_version=1: dpkit runs FSDP2"),
        (
            "auto",
            None,
            {"ACCELERATE_USE_CPU": "True", "MASTER_PORT": "29500"},
            "starts a single process",
        ),
    ],
)
def test_conflicts_are_one_line_errors(flag, deepspeed, env, message):
    with pytest.raises(UsageError, match=message) as err:
        resolve_strategy(flag, deepspeed, env)
    assert "\n" not in str(err.value)


def test_the_stage_in_a_json_picks_the_strategy_or_is_refused(tmp_path):
    """Stage 3 in a user's JSON resolves to zero3 (resolution only: nothing is launched);
    stages DeepSpeed has but dpkit does not run are refused, naming the stages it does."""
    path = tmp_path / "z3.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    assert resolve_strategy("auto", str(path), {}).strategy.name == "zero3"
    for stage in (0, 4):
        path = tmp_path / f"z{stage}.json"
        path.write_text(json.dumps({"zero_optimization": {"stage": stage}}))
        with pytest.raises(UsageError) as refused:
            resolve_strategy("auto", str(path), {})
        assert str(refused.value) == (
            f"deepspeed config {str(path)!r}: zero_optimization.stage={stage}; "
            "dpkit supports 1, 2 and 3"
        )


def test_malformed_json(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(UsageError, match="not valid JSON"):
        resolve_strategy("auto", str(path), {})


def _fill(template, **overrides):
    kwargs = dict(
        micro_batch_size=8,
        gradient_accumulation_steps=4,
        world_size=2,
        max_grad_norm=1.0,
        precision="no",
        learning_rate=1e-4,
        weight_decay=0.01,
    )
    kwargs.update(overrides)
    return fill_deepspeed_config(template, zero_settings=MINILM_ZERO_SETTINGS, **kwargs)


# The zero_optimization values the run hands the filling for MiniLM (22.7M parameters,
# hidden 384, an 11.7M-element word embedding) at 2 CPU ranks, written out rather than asked
# of dpkit.engines.deepspeed.settings, whose sizing its own tests check (test_memory.py):
# hidden^2 = 147,456 is under the 2^21-element floor; the embedding is larger than the bucket
# and than a quarter of a rank's 11.4M-element partition, so no contiguous gradients; no
# overlap on CPU.
MINILM_ZERO_SETTINGS = {
    "reduce_bucket_size": 2**21,
    "allgather_bucket_size": 2**21,
    "overlap_comm": False,
    "contiguous_gradients": False,
    "round_robin_gradients": False,
    "reduce_scatter": True,
}


@pytest.mark.parametrize("path", [ZERO1, ZERO2])
@pytest.mark.parametrize(("micro", "accum", "world"), [(8, 4, 2), (1, 1, 1), (16, 2, 8)])
def test_auto_values_filled_and_batch_identity_holds(path, micro, accum, world):
    template = _load(path)
    config = _fill(
        template, micro_batch_size=micro, gradient_accumulation_steps=accum, world_size=world
    )
    assert config["train_batch_size"] == micro * accum * world
    assert config["train_micro_batch_size_per_gpu"] == micro
    assert config["gradient_accumulation_steps"] == accum
    assert config["gradient_clipping"] == 1.0
    # Every memory setting the template leaves out or "auto" is the run's; its stage stays.
    stage = 1 if path == ZERO1 else 2
    assert config["zero_optimization"] == {"stage": stage, **MINILM_ZERO_SETTINGS}
    assert config["bf16"] == {"enabled": False} and config["fp16"] == {"enabled": False}
    assert all(value != "auto" for _, value in _leaves(config))
    assert template["train_batch_size"] == "auto", "the template itself is not modified"


def test_precision_fills_the_matching_section():
    config = _fill(_load(ZERO2), precision="bf16")
    assert config["bf16"]["enabled"] is True and config["fp16"]["enabled"] is False


def test_explicit_value_that_disagrees_with_the_recipe_is_refused():
    template = _load(ZERO2)
    template["train_micro_batch_size_per_gpu"] = 4
    with pytest.raises(
        UsageError, match=r"train_micro_batch_size_per_gpu=4 disagrees with the recipe's 8"
    ):
        _fill(template)
    template = _load(ZERO2)
    template["train_batch_size"] = 100
    with pytest.raises(UsageError, match="train_batch_size=100"):
        _fill(template)


def test_the_template_is_not_modified_at_any_depth():
    """The shipped JSON's nested sections ("auto" bf16, zero_optimization) stay as read:
    a template filled for one run is filled again for the next (dpkit tune, the bench)."""
    template = _load(ZERO2)
    before = copy.deepcopy(template)
    _fill(template, precision="bf16")
    assert template == before


# Each refusal in full: the key's dotted path as the user wrote it, both values, and why.
AUTO_HINT = ': set it to "auto" or change the recipe flag'


@pytest.mark.parametrize(
    ("key", "written", "message"),
    [
        ("train_micro_batch_size_per_gpu", 4,
         "train_micro_batch_size_per_gpu=4 disagrees with the recipe's 8"),
        ("gradient_accumulation_steps", 2,
         "gradient_accumulation_steps=2 disagrees with the recipe's 4"),
        # 8 x 4 x 2 = 64, the identity DeepSpeed asserts at start.
        ("train_batch_size", 100,
         "train_batch_size=100 disagrees with the recipe's 64 "
         "(micro_batch 8 x accumulation 4 x world_size 2)"),
        ("gradient_clipping", 0.5, "gradient_clipping=0.5 disagrees with the recipe's 1.0"),
        ("bf16", {"enabled": True}, "bf16.enabled=True disagrees with the recipe's False"),
    ],
)  # fmt: skip
def test_each_written_value_that_disagrees_is_refused_in_full(key, written, message):
    template = _load(ZERO2)
    template[key] = written
    with pytest.raises(UsageError) as refused:
        _fill(template)
    assert str(refused.value) == f"deepspeed config {message}{AUTO_HINT}"


def test_a_json_optimizer_gets_only_the_keys_it_leaves_auto():
    """lr is "auto": the run's; weight_decay is not in the section: it stays out (AdamW's
    own default), not added from the run."""
    template = _load(ZERO2) | {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    config = _fill(template, learning_rate=3e-4, weight_decay=0.05)
    assert config["optimizer"]["params"] == {"lr": 3e-4}


def test_an_auto_dpkit_cannot_fill_is_refused_naming_every_one():
    """No learning rate to fill a JSON optimizer's "auto" lr with, and a scheduler's "auto"
    warm-up (accelerate fills that from its own scheduler, which dpkit's recipes do not use)."""
    template = _load(ZERO2) | {
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}},
    }
    with pytest.raises(UsageError) as refused:
        _fill(template, learning_rate=None)
    assert str(refused.value) == (
        "deepspeed config: dpkit cannot fill "
        'optimizer.params.lr, scheduler.params.warmup_num_steps="auto"'
    )


def test_a_json_without_a_zero_section_gets_the_runs_zero_settings():
    config = _fill({"train_batch_size": "auto"})
    assert config["zero_optimization"] == MINILM_ZERO_SETTINGS
    assert config["train_batch_size"] == 8 * 4 * 2


def test_fp16_needs_cuda_and_launcher_conflicts():
    with pytest.raises(UsageError, match="fp16: needs a CUDA GPU"):
        resolve_precision("fp16", {})
    with pytest.raises(UsageError, match="conflicts with the launcher's mixed_precision=bf16"):
        resolve_precision("no", {"ACCELERATE_MIXED_PRECISION": "bf16"})
    assert resolve_precision(None, {"ACCELERATE_MIXED_PRECISION": "bf16"}) == "bf16"
    assert resolve_precision("bf16", {"ACCELERATE_MIXED_PRECISION": "no"}) == "bf16"
    assert resolve_precision(None, {}) == "no"


def test_lr_scaling_rules():
    assert scaled_learning_rate(1e-4, "none", 8, 2) == 1e-4
    assert scaled_learning_rate(1e-4, "linear", 8, 2) == pytest.approx(1.6e-3)
    assert scaled_learning_rate(1e-4, "sqrt", 8, 2) == pytest.approx(4e-4)


def test_the_offload_variant_of_each_strategy():
    DDP, ZERO1, ZERO2, ZERO2_OFFLOAD = (
        STRATEGIES[n] for n in ("ddp", "zero1", "zero2", "zero2_offload")
    )

    assert offloaded(ZERO2) is ZERO2_OFFLOAD and offloaded(ZERO2_OFFLOAD) is ZERO2_OFFLOAD
    assert offloaded(ZERO1) is ZERO1  # no ZeRO-1 offload row: planned as ZeRO-1
    assert offloaded(DDP) is DDP


# ---- a model that leaves parameters out of the loss ------------------------------------------

_SIZES = ModelSizes(num_params=1000, largest_param_numel=500, hidden_size=16)
_TORCHRUN_2 = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}


def test_find_unused_parameters_reaches_ddp_and_is_a_note_under_zero():
    plain = resolve(
        StrategyConfig(strategy="ddp"), model=_SIZES, micro_batch_size=4, env=_TORCHRUN_2
    )
    assert plain.settings.kwargs["find_unused_parameters"] is False and plain.notes == ()
    asked = StrategyConfig(strategy="ddp", ddp_find_unused_parameters=True)
    ddp = resolve(asked, model=_SIZES, micro_batch_size=4, env=_TORCHRUN_2)
    assert ddp.settings.kwargs["find_unused_parameters"] is True
    assert ddp.settings.kwargs["gradient_as_bucket_view"] is True  # dpkit's own kwargs stay
    assert ddp.notes == ()
    asked = StrategyConfig(strategy="zero2", ddp_find_unused_parameters=True)
    zero = resolve(asked, model=_SIZES, micro_batch_size=4, env=_TORCHRUN_2)
    assert not hasattr(zero.settings, "kwargs")  # ZeRO's settings carry no DDP kwargs
    (note,) = zero.notes  # said once at start, recorded in run_info.json
    assert note.startswith("--ddp-find-unused-parameters: DDP's; zero2 needs none")


def test_ddp_skips_the_per_forward_buffer_broadcast_only_when_every_buffer_is_a_constant():
    """transformers' buffers (position ids, rotary frequencies) are non-persistent
    constants: no broadcast before each forward. BatchNorm's running statistics are
    persistent state that ranks must agree on: DDP's default stays. A config or sizes
    cannot be inspected: DDP's default stays."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    def resolved(model):
        return resolve(
            StrategyConfig(strategy="ddp"), model=model, micro_batch_size=4, env=_TORCHRUN_2
        ).settings.forward_sync_buffers

    llama_config = LlamaConfig(
        num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=64,
    )  # fmt: skip
    llama = LlamaForCausalLM(llama_config)
    assert any(True for _ in llama.buffers())  # rotary inv_freq: there are buffers
    assert resolved(llama) is False
    with_norm = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    assert resolved(with_norm) is True
    assert resolved(llama_config) is True and resolved(_SIZES) is True


# ---- the JSON as read: one-line refusals in full ----------------------------------------------


def _read(tmp_path, text: str) -> tuple[str, dict | None]:
    from dpkit.engines.deepspeed.config import read_ds_config

    path = tmp_path / "ds.json"
    path.write_text(text)
    return str(path), read_ds_config(str(path))


def test_a_missing_json_is_refused_naming_the_path(tmp_path):
    from dpkit.engines.deepspeed.config import read_ds_config

    path = str(tmp_path / "no-such.json")
    with pytest.raises(UsageError) as refused:
        read_ds_config(path)
    assert str(refused.value) == f"deepspeed config {path!r}: no such file"


def test_a_key_given_twice_is_refused_naming_both_values(tmp_path):
    path = str(tmp_path / "ds.json")
    with pytest.raises(UsageError) as refused:
        _read(tmp_path, '{"train_batch_size": 8, "train_batch_size": 16}')
    assert str(refused.value) == (
        f"deepspeed config {path!r}: train_batch_size=8 and train_batch_size=16: "
        "the key is given twice; keep one"
    )


def test_a_json_that_is_not_an_object_or_has_an_unknown_key_is_refused(tmp_path):
    path = str(tmp_path / "ds.json")
    with pytest.raises(UsageError) as refused:
        _read(tmp_path, "[1, 2]")
    assert str(refused.value) == f"deepspeed config {path!r}: must be a JSON object"
    with pytest.raises(UsageError) as refused:
        _read(tmp_path, '{"train_batch_sise": 8}')
    assert str(refused.value).startswith(f"deepspeed config {path!r}: train_batch_sise=8: ")


def test_the_zero_stage_is_read_from_its_section_only():
    from dpkit.engines.deepspeed.config import zero_stage_of

    assert zero_stage_of({"zero_optimization": {"stage": 2}}, "z.json") == 2
    assert zero_stage_of({"zero_optimization": {"stage": 3}}, "z.json") == 3
    refused_configs = (
        {},
        {"zero_optimization": 2},
        {"zero_optimization": {"stage": 0}},
        {"zero_optimization": {"stage": 4}},
        {"zero_optimization": {"stage": True}},
        {"stage": 3},  # the stage outside its section
    )
    for config in refused_configs:
        stage = config.get("zero_optimization", {})
        shown = stage.get("stage") if isinstance(stage, dict) else None
        with pytest.raises(UsageError) as refused:
            zero_stage_of(config, "z.json")
        assert str(refused.value) == (
            f"deepspeed config 'z.json': zero_optimization.stage={shown!r}; "
            "dpkit supports 1, 2 and 3"
        )


@pytest.mark.parametrize("stage", [1, 2])
def test_offload_deepspeed_would_not_run_under_zero_1_or_2_is_refused(stage):
    from dpkit.engines.deepspeed.config import optimizer_offload

    assert optimizer_offload({}, "z.json") is None  # no ZeRO section: nothing offloaded
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
    assert optimizer_offload({"zero_optimization": zero}, "z.json") == "cpu"
    zero = {"stage": stage, "offload_param": {"device": "cpu"}}
    with pytest.raises(UsageError, match=f"parameter offload is ZeRO-3's; under ZeRO-{stage} "):
        optimizer_offload({"zero_optimization": zero}, "z.json")
    zero = {"stage": stage, "offload_optimizer": {"device": "nvme"}}
    with pytest.raises(UsageError, match=f"only under ZeRO-3; under ZeRO-{stage} it would run"):
        optimizer_offload({"zero_optimization": zero}, "z.json")
