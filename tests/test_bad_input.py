"""Bad input, before anything starts: one line naming the field and the value, exit code 2,
no process group, nothing written or overwritten.

The issue's cases and where each is tested (E2E: the real recipe in its own process, as
``python recipes/finetune.py``, forked from a process that has done the imports once
(tests/harness.py ``WarmRecipe``), or under a launcher; cases marked * were tested before
this file, elsewhere):

==========================================  ===================================================
malformed JSON (DeepSpeed config)           E2E ``malformed-json``; * test_strategy
duplicate key in the JSON                   test_ds_config_refused[duplicate-key]
malformed / unknown-key accelerate YAML     test_malformed_accelerate_yaml, ..._unknown_key
misspelled top-level DeepSpeed key          E2E ``misspelled-top-level-key``
unknown key in a nested section             E2E deepspeed launcher; test_ds_config_refused
key DeepSpeed removed (``amp``)             test_ds_config_refused[removed-key]
batch identity broken by the JSON           E2E ``batch-identity``; * test_launch_errors
zero / negative sizes, steps, lr            E2E ``zero-accumulation``, ``negative-lr``;
                                            test_command_line_refused; * test_config
unknown strategy                            E2E ``unknown-strategy``
ZeRO stage 0 (stages 1-3 run)               E2E ``zero-stage-0``; test_ds_config_refused
ZeRO-3 with zero3_init_flag off             E2E accelerate launcher; test_resolve_launch
FSDP2 with a DeepSpeed JSON, bad layers     E2E ``fsdp2-with-deepspeed-json``,
                                            ``fsdp2-unknown-layer-class``; test_fsdp2
fp16 on CPU                                 E2E ``fp16-on-cpu``; test_fp16_from_the_launcher
model folder that does not exist            * test_launch_errors (E2E)
dataset file that does not exist            E2E ``missing-dataset-file``
no text / no label column                   E2E ``no-text-column``; test_data_refused
empty dataset                               E2E ``empty-dataset``; test_data_refused
labels outside a classifier's classes       E2E ``labels-outside-classifier``; test_data_refused
negative labels                             E2E ``negative-labels``
sequence length over the model's limit      * test_launch_errors (E2E)
output dir holding another run              E2E test_output_dir_holding_a_run_is_untouched
misspelled command-line flag                E2E ``misspelled-flag``
==========================================  ===================================================
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from dpkit.data.classification import check_classification_data
from dpkit.errors import UsageError
from dpkit.train.config import StrategyConfig
from dpkit.train.finetune_config import (
    DataConfig,
    ModelConfig,
    TrainConfig,
    parse_finetune_args,
)
from dpkit.train.launcher import read_launch, read_precision
from tests.harness import REPO, accelerate_cmd, assert_refused, deepspeed_cmd, run

# Small and quick: every case here is refused before any of it matters.
ARGS = ["--max-steps", "2", "--micro-batch-size", "16", "--max-seq-length", "64"]


def _write(tmp: Path, name: str, text: str) -> Path:
    path = tmp / name
    path.write_text(text)
    return path


def _ds_config(tmp: Path, name: str, **sections) -> str:
    """The shipped zero2.json with top-level keys replaced or added (sections merged)."""
    config = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    path = tmp / name
    path.write_text(json.dumps(config))
    return str(path)


def _csv(tmp: Path, name: str, header: str, rows: list[str]) -> str:
    path = tmp / name
    path.write_text("\n".join([header, *rows]) + "\n")
    return str(path)


def _labelled(tmp: Path, name: str, labels) -> str:
    return _csv(
        tmp, name, "text,label", [f"review number {i},{label}" for i, label in enumerate(labels)]
    )


def _classifier(tmp: Path, num_labels: int = 2) -> str:
    """A folder whose config is a BERT sequence classifier (a head with ``num_labels``)."""
    from transformers import BertConfig

    folder = tmp / "classifier"
    BertConfig(
        architectures=["BertForSequenceClassification"],
        num_labels=num_labels,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
    ).save_pretrained(folder)
    return str(folder)


# (id, command-line arguments given tmp_path, what the one error line must contain)
RECIPE_CASES = [
    (
        "malformed-json",
        lambda t: ["--deepspeed", str(_write(t, "bad.json", '{"train_batch_size": "auto",}'))],
        "bad.json': not valid JSON",
    ),
    (
        "misspelled-top-level-key",
        lambda t: ["--deepspeed", _ds_config(t, "typo.json", train_batch_sze=16)],
        "typo.json': train_batch_sze=16: not a DeepSpeed key (DeepSpeed would silently ignore it); "
        "did you mean train_batch_size?",
    ),
    (
        "zero-stage-0",
        lambda t: ["--deepspeed", _ds_config(t, "z0.json", zero_optimization={"stage": 0})],
        "z0.json': zero_optimization.stage=0; dpkit supports 1, 2 and 3",
    ),
    (
        "batch-identity",
        lambda t: ["--deepspeed", _ds_config(t, "batch.json", train_batch_size=48)],
        "train_batch_size=48 disagrees with the recipe's 16 "
        "(micro_batch 16 x accumulation 1 x world_size 1)",
    ),
    (
        "unknown-strategy",
        lambda t: ["--strategy", "zero4"],
        "--strategy: invalid choice: 'zero4' (choose from 'auto', 'ddp', 'zero1', 'zero2', "
        "'zero2_offload', 'zero3', 'zero3_offload', 'fsdp2_shard_grad_op', 'fsdp2_full_shard', "
        "'fsdp2_full_shard_offload')",
    ),
    (
        "fsdp2-with-deepspeed-json",
        lambda t: ["--strategy", "fsdp2_full_shard", "--deepspeed", "ds_configs/zero2.json"],
        "--strategy=fsdp2_full_shard conflicts with --deepspeed='ds_configs/zero2.json'",
    ),
    (
        "fsdp2-unknown-layer-class",
        lambda t: [
            "--strategy",
            "fsdp2_shard_grad_op",
            "--fsdp-layer-classes",
            "LlamaDecoderLayer",
        ],
        "--fsdp-layer-classes=LlamaDecoderLayer: no LlamaDecoderLayer module in "
        "BertForSequenceClassification",
    ),
    (
        "zero-accumulation",
        lambda t: ["--gradient-accumulation-steps", "0"],
        "--gradient-accumulation-steps=0: must be > 0",
    ),
    ("negative-lr", lambda t: ["--learning-rate", "-0.001"], "--learning-rate=-0.001: must be > 0"),
    (
        "fp16-on-cpu",
        lambda t: ["--mixed-precision", "fp16"],
        "--mixed-precision=fp16: needs a CUDA GPU; use bf16 on CPU",
    ),
    (
        "missing-dataset-file",
        lambda t: ["--dataset", str(t / "no_such.csv")],
        "no_such.csv': no such file",
    ),
    (
        "no-text-column",
        lambda t: ["--dataset", _csv(t, "cols.csv", "review,label", ["good,1", "bad,0"])],
        "--text-column='text': not a column of",
    ),
    (
        "empty-dataset",
        lambda t: ["--dataset", _csv(t, "header_only.csv", "text,label", [])],
        "header_only.csv': has no examples",
    ),
    (
        "negative-labels",
        lambda t: ["--dataset", _labelled(t, "neg.csv", [i % 2 - 1 for i in range(40)])],
        "--label-column='label': negative label -1",
    ),
    (
        "labels-outside-classifier",
        lambda t: [
            "--model",
            _classifier(t, num_labels=2),
            "--dataset",
            _labelled(t, "six.csv", [i % 6 for i in range(60)]),
        ],
        "six.csv': label 5 is outside the classes 0..1 of --model=",
    ),
    (
        "misspelled-flag",
        lambda t: ["--micro-batch-sze", "16"],
        "--micro-batch-sze=16: not a flag of this recipe; did you mean --micro-batch-size?",
    ),
    (
        "accumulation-longer-than-an-epoch",
        lambda t: ["--gradient-accumulation-steps", "64", "--max-train-samples", "256"],
        "--gradient-accumulation-steps=64: more than the 16 micro-batches each of the 1 "
        "processes gets per epoch",
    ),
    (
        "model-folder-without-tokenizer",
        lambda t: ["--model", _weights_only(t)],
        "its tokenizer has 5 tokens for the model's 30,522-token vocabulary",
    ),
    (
        "nvme-offload-under-zero2",
        lambda t: [
            "--deepspeed",
            _ds_config(t, "nvme.json", zero_optimization={"offload_optimizer": {"device": "nvme"}}),
        ],
        "offload_optimizer.device='nvme': DeepSpeed offloads to NVMe only under ZeRO-3",
    ),
]


def _weights_only(tmp: Path) -> str:
    """MiniLM's folder without its tokenizer files (transformers would build an empty one)."""
    import shutil

    from dpkit.models import local_model_path

    folder = tmp / "weights-only"
    shutil.copytree(local_model_path("sentence-transformers/all-MiniLM-L6-v2"), folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        (folder / name).unlink()
    return str(folder)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.parametrize(
    ("make_args", "message"),
    [pytest.param(make, message, id=case_id) for case_id, make, message in RECIPE_CASES],
)
def test_recipe_refuses(make_args, message, tmp_path, request, warm_recipe):
    if "fp16" in request.node.callspec.id and _cuda():
        pytest.skip("fp16 is valid with a GPU")
    out = tmp_path / "run"
    result = warm_recipe.run(*ARGS, *make_args(tmp_path), "--output-dir", str(out))
    assert_refused(result, message, out, exit_code=2)


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_output_dir_holding_a_run_is_untouched(tmp_path, warm_recipe):
    previous = tmp_path / "previous_run"
    (previous / "model").mkdir(parents=True)
    (previous / "run_config.json").write_text('{"argv": ["earlier run"]}')
    (previous / "train_log.jsonl").write_text('{"step": 1, "loss": 0.69}\n')
    (previous / "model" / "model.safetensors").write_bytes(b"weights of the earlier run")
    before = _snapshot(previous)
    result = warm_recipe.run(*ARGS, "--output-dir", str(previous))
    assert_refused(
        result,
        f"--output-dir={str(previous)!r}: holds another run; pass --overwrite-output-dir",
        None,
        exit_code=2,
    )
    assert _snapshot(previous) == before, "a refused run must not touch the earlier run"


@pytest.mark.multiprocess
def test_an_output_dir_that_cannot_be_created_is_one_line(tmp_path, warm_recipe):
    result = warm_recipe.run(*ARGS, "--output-dir", "/proc/dpkit-refused/run")
    assert_refused(result, "--output-dir='/proc/dpkit-refused/run': cannot be created", None, 2)


def test_a_deepspeed_file_under_accelerate_ddp_is_refused(tmp_path):
    """ddp.yaml with --deepspeed zero2.json ran ZeRO-2, though --strategy zero2 under the
    same YAML was refused: now both are."""
    out = tmp_path / "run"
    launch = ["--config_file", "ds_configs/accelerate/ddp.yaml", "--num_processes", "2"]
    args = [*ARGS, "--deepspeed", "ds_configs/zero2.json", "--output-dir", str(out)]
    result = run(accelerate_cmd(launch, *args))
    message = "--deepspeed='ds_configs/zero2.json' conflicts with accelerate launch"
    assert_refused(result, message, out)
    # The launcher exits 1 for any failed child; the rank's own code is the usage code.
    assert re.search(r"exitcode\s*: 2 ", result.output), result.output[-3000:]


def test_deepspeed_launcher_refuses_an_unknown_nested_key(tmp_path):
    path = _ds_config(tmp_path, "nested.json", zero_optimization={"overlap_com": True})
    out = tmp_path / "run"
    result = run(deepspeed_cmd(2, *ARGS, "--deepspeed", path, "--output-dir", str(out)))
    assert_refused(
        result,
        "nested.json': zero_optimization.overlap_com=true: not a key of zero_optimization; "
        "did you mean zero_optimization.overlap_comm?",
        out,
    )
    assert "exits with return code = 2" in result.output  # the launcher itself says 1


@pytest.mark.multiprocess
def test_accelerate_launcher_refuses_zero3_without_zero_init(tmp_path):
    """The shipped ZeRO-3 YAML with zero3_init_flag turned off: every rank would load the
    whole model before DeepSpeed partitions it. Refused when the run resolves, before the
    process group (it used to fail only once the group was up, while building the model)."""
    shipped = (REPO / "ds_configs" / "accelerate" / "zero3.yaml").read_text()
    assert "  zero3_init_flag: true\n" in shipped
    config = _write(
        tmp_path,
        "zero3_no_init.yaml",
        shipped.replace("  zero3_init_flag: true\n", "  zero3_init_flag: false\n").replace(
            "ds_configs/zero3.json", str(REPO / "ds_configs" / "zero3.json")
        ),
    )
    out = tmp_path / "run"
    launch = ["--config_file", str(config), "--num_processes", "2"]
    result = run(accelerate_cmd(launch, *ARGS, "--output-dir", str(out)))
    assert_refused(
        result,
        "accelerate config zero3_init_flag=false: ZeRO-3 needs zero.Init (dpkit builds the "
        "model partitioned under it; without it every rank would load the whole model); set "
        "zero3_init_flag: true (--zero3_init_flag true) or leave it out",
        out,
    )
    assert "exitcode  : 2" in result.output  # accelerate (torchrun) itself exits 1


# accelerate parses its YAML before starting anything: it fails with its own traceback,
# whose last lines name the file and what is wrong; the recipe never runs.
@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        pytest.param(
            "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 2\n   offload: none\n",
            "mapping values are not allowed here",
            id="malformed",
        ),
        pytest.param(
            "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_processez: 2\n",
            "had unknown keys (['num_processez'])",
            id="unknown-key",
        ),
    ],
)
def test_malformed_accelerate_yaml(yaml_text, message, tmp_path):
    config = _write(tmp_path, "accelerate.yaml", yaml_text)
    out = tmp_path / "run"
    result = run(accelerate_cmd(["--config_file", str(config)], *ARGS, "--output-dir", str(out)))
    assert result.returncode != 0
    ending = "\n".join(result.output.strip().splitlines()[-2:])  # error, then where
    assert message in ending and str(config) in ending, result.output[-2000:]
    assert "finetune.py" not in result.output.replace(" recipes/finetune.py", "")
    assert not out.exists()


# ---- the same checks in-process: DeepSpeed JSON ----------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param(
            '{"train_batch_size": 8, "train_batch_size": 16}',
            "train_batch_size=8 and train_batch_size=16: the key is given twice",
            id="duplicate-key",
        ),
        pytest.param(
            '{"zero_optimization": {"stage": 2, "offload_optimizer": {"pin_memry": true}}}',
            "zero_optimization.offload_optimizer.pin_memry=true: not a key of "
            "zero_optimization.offload_optimizer; did you mean "
            "zero_optimization.offload_optimizer.pin_memory?",
            id="nested-model-key",
        ),
        pytest.param(
            '{"zero_optimization": {"stage": 2}, "fp16": {"enabeld": "auto"}}',
            'fp16.enabeld="auto": not a key of fp16; did you mean fp16.enabled?',
            id="fp16-key",
        ),
        pytest.param(
            '{"zero_optimization": {"stage": 2}, "fp16": true}',
            "fp16=true: must be a JSON object",
            id="section-not-an-object",
        ),
        pytest.param(
            '{"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "parms": {}}}',
            "optimizer.parms={}: not a key of optimizer; did you mean optimizer.params?",
            id="optimizer-key",
        ),
        pytest.param(
            '{"zero_optimization": {"stage": 2}, "flops_profiler": {"profile_stp": 3}}',
            "flops_profiler.profile_stp=3: not a key of flops_profiler; "
            "did you mean flops_profiler.profile_step?",
            id="plain-section-key",
        ),
        pytest.param(
            '{"zero_optimization": {"stage": 2}, "tensorboard": {"output_pth": "tb"}}',
            "tensorboard.output_pth=",
            id="monitor-key",
        ),
        pytest.param(
            '{"zero_optimization": {"stage": 2}, "amp": {"enabled": true}}',
            'amp={"enabled": true}: NVIDIA Apex AMP integration has been removed',
            id="removed-key",
        ),
        pytest.param(
            '{"zero_optimization": true}',
            "zero_optimization=true: must be a JSON object",
            id="legacy-zero-flag",
        ),
        pytest.param(
            '{"zero_optimization": {"stage": true}}',
            "zero_optimization.stage=True; dpkit supports 1, 2 and 3",
            id="stage-true",
        ),
        pytest.param(
            '{"zero_optimization": {"stage": 4, "stage3_prefetch_bucket_size": 100}}',
            "zero_optimization.stage=4; dpkit supports 1, 2 and 3",
            id="stage-4-with-stage-3-keys",
        ),
        pytest.param("[1, 2]", "must be a JSON object", id="not-an-object"),
    ],
)
def test_ds_config_refused(text, message, tmp_path):
    path = _write(tmp_path, "ds.json", text)
    with pytest.raises(UsageError) as err:
        read_launch(StrategyConfig(deepspeed=str(path)), {}, on_cuda=False)
    assert str(err.value).startswith(f"deepspeed config {str(path)!r}: ")
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_valid_deepspeed_keys_are_accepted(tmp_path):
    """Field names, aliases, nested models and plain sections that DeepSpeed reads all pass."""
    path = _ds_config(
        tmp_path,
        "rich.json",
        zero_optimization={
            "stage": 1,
            "stage3_gather_16bit_weights_on_model_save": False,  # an alias
            "offload_optimizer": {"device": "none", "pin_memory": True},
            "round_robin_gradients": False,
        },
        optimizer={"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
        flops_profiler={"enabled": False, "profile_step": 2},
        tensorboard={"enabled": False, "output_path": "tb", "job_name": "x"},
        data_types={"grad_accum_dtype": "fp32"},
        communication_data_type="fp32",
        prescale_gradients=False,
    )
    launch = read_launch(StrategyConfig(deepspeed=path), {}, on_cuda=False)
    assert launch.strategy.name == "zero1"


def test_stage_3_with_its_own_keys_is_accepted(tmp_path):
    """A ZeRO-3 JSON with stage-3 keys resolves to zero3 (resolution only: nothing runs)."""
    path = _write(
        tmp_path,
        "ds.json",
        '{"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 100, '
        '"stage3_param_persistence_threshold": 1000}}',
    )
    launch = read_launch(StrategyConfig(deepspeed=str(path)), {}, on_cuda=False)
    assert launch.strategy.name == "zero3"
    assert launch.config_template["zero_optimization"]["stage3_prefetch_bucket_size"] == 100


def test_fp16_from_the_launcher_on_cpu():
    if _cuda():
        pytest.skip("fp16 is valid with a GPU")
    with pytest.raises(UsageError, match="the launcher's mixed_precision=fp16: needs a CUDA GPU"):
        read_precision(None, {"ACCELERATE_MIXED_PRECISION": "fp16"}, on_cuda=_cuda())


# ---- the command line and the dataclasses ------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--micro-batch-size", "-4"], "--micro-batch-size=-4: must be > 0"),
        (["--num-epochs", "0"], "--num-epochs=0: must be > 0"),
        (["--max-steps", "-3"], "--max-steps=-3: must be > 0 or -1"),
        (["--max-seq-length", "0"], "--max-seq-length=0: must be > 0"),
        (["--max-train-samples", "0"], "--max-train-samples=0: must be > 0"),
        (["--learning-rate", "nan"], "--learning-rate=nan: must be > 0"),
        (["--seed", "-1"], "--seed=-1: must be in [0, 2**32)"),
        (["--mixed-precision", "fp8"], "--mixed-precision: invalid choice: 'fp8'"),
        (["--micro-batch-size", "eight"], "invalid int value: 'eight'"),
        (
            ["--learning_rte", "1e-4"],
            "--learning_rte=1e-4: not a flag of this recipe; did you mean ",
        ),
        (["zero2"], "'zero2': unexpected argument"),
    ],
)
def test_command_line_refused(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        parse_finetune_args([*argv, "--output-dir", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err  # no usage block
    assert message in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("build", "message"),
    [
        pytest.param(
            lambda: StrategyConfig(strategy="zero4"),
            "--strategy='zero4': not one of auto, ddp, zero1, zero2, zero2_offload, zero3, "
            "zero3_offload, fsdp2_shard_grad_op, fsdp2_full_shard, fsdp2_full_shard_offload",
            id="strategy",
        ),
        pytest.param(
            lambda: StrategyConfig(mixed_precision="fp32"),
            "--mixed-precision='fp32': not one of",
            id="precision",
        ),
        pytest.param(
            lambda: DataConfig(split_seed=2**32),
            "--split-seed=4294967296: must be in [0, 2**32)",
            id="split-seed",
        ),
        pytest.param(
            lambda: TrainConfig(lr_scheduler="cosin"),
            "--lr-scheduler='cosin': not one of",
            id="scheduler",
        ),
        pytest.param(
            lambda: TrainConfig(learning_rate=math.inf),
            "--learning-rate=inf: must be > 0",
            id="lr-inf",
        ),
    ],
)
def test_configs_built_in_code_are_checked_too(build, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # TrainConfig's default output dir, relative
    with pytest.raises(UsageError, match=re.escape(message)):
        build()


# ---- the data, against the model ---------------------------------------------------------------


def _bert(**kwargs):
    from transformers import BertConfig

    return BertConfig(**kwargs)


CLASSIFIER_3 = {"architectures": ["BertForSequenceClassification"], "num_labels": 3}


@pytest.mark.parametrize(
    ("make_dataset", "overrides", "model_config", "message"),
    [
        pytest.param(
            lambda t: _csv(t, "d.csv", "text,stars", [f"t{i},{i % 2}" for i in range(40)]),
            {},
            {},
            "--label-column='label': not a column of",
            id="no-label-column",
        ),
        pytest.param(
            lambda t: str(_write(t, "empty.csv", "")),
            {},
            {},
            "empty.csv': the file is empty",
            id="empty-file",
        ),
        pytest.param(
            lambda t: _csv(t, "none.csv", "text,label", [",1", ",0"]),
            {},
            {},
            "none.csv': no example has both a text and a label",
            id="no-complete-example",
        ),
        pytest.param(
            lambda t: _labelled(t, "three.csv", [0, 1, 0]),
            {},
            {},
            "three.csv': 3 examples are too few for train, validation (0.1) and test (0.1) splits",
            id="too-few-to-split",
        ),
        pytest.param(
            lambda t: _labelled(t, "two.csv", [i % 2 for i in range(40)]),
            {},
            CLASSIFIER_3,
            "two.csv': 2 classes do not fit the 3 labels of --model=",
            id="fewer-classes-than-the-classifier",
        ),
        pytest.param(
            lambda t: _labelled(t, "words.csv", ["good", "bad", "meh", "great"] * 10),
            {},
            CLASSIFIER_3,
            "words.csv': 4 classes do not fit the 3 labels of --model=",
            id="string-labels-vs-classifier",
        ),
        pytest.param(
            lambda t: _labelled(t, "forty.csv", [i % 2 for i in range(40)]),
            {"micro_batch_size": 64},
            {},
            "--micro-batch-size=64: more than the 32 training examples",
            id="micro-batch-over-the-data",
        ),
    ],
)
def test_data_refused(make_dataset, overrides, model_config, message, tmp_path):
    data_cfg = DataConfig(dataset=make_dataset(tmp_path))
    train_cfg = TrainConfig(output_dir=str(tmp_path / "run"), **overrides)
    with pytest.raises(UsageError) as err:
        check_classification_data(ModelConfig(), data_cfg, train_cfg, _bert(**model_config))
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_data_that_fits_passes(tmp_path):
    dataset = _labelled(tmp_path, "ok.csv", [i % 3 for i in range(40)])
    labels = check_classification_data(
        ModelConfig(),
        DataConfig(dataset=dataset),
        TrainConfig(output_dir=str(tmp_path / "run"), micro_batch_size=8),
        _bert(**CLASSIFIER_3),
    )
    assert labels == ["0", "1", "2"]
    # Evaluation alone needs no full training batch.
    check_classification_data(
        ModelConfig(),
        DataConfig(dataset=dataset),
        TrainConfig(output_dir=str(tmp_path / "run"), micro_batch_size=64, eval_only=True),
        _bert(),
    )


def test_deepspeed_keys_come_from_the_installed_deepspeed():
    from dpkit.engines.deepspeed.config_keys import model_keys, pydantic_sections, top_level_keys

    keys = top_level_keys()
    assert keys is not None, "the DeepSpeedConfig probe failed: top-level keys would go unchecked"
    assert {"train_batch_size", "optimizer", "scheduler", "zero_optimization", "fp16"} <= keys
    zero = model_keys(pydantic_sections()["zero_optimization"])
    assert {
        "stage",
        "overlap_comm",
        "offload_optimizer",
        "stage3_prefetch_bucket_size",
    } <= zero.keys()
