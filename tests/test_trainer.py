"""dpkit for the Transformers ``Trainer``: the memory report callback, dpkit's ZeRO settings, the run check.

The real ``Trainer`` example (``recipes/trainer_finetune.py``: MiniLM, the embedded
Rotten Tomatoes, ``MemoryReportCallback``) runs on 2 CPU processes as DDP
(``torchrun``), ZeRO-1 and ZeRO-2 (the ``deepspeed`` launcher with the shipped JSON),
ZeRO-2 under ``accelerate launch`` with the shipped YAML, and ZeRO-2 with DeepSpeed's
own defaults; each run is launched once (on first use) and checked many ways from what
it wrote: every rank measured, ZeRO's optimizer state DDP's / N, each model-state
category within 2% of ``dpkit plan --against`` run on it, and dpkit's bucket buffers
against DeepSpeed's defaults. Two runs that would train the wrong job without a word
are refused in one line.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dpkit.train.phases import PHASES
from tests.harness import REPO, Launch, accelerate_cmd, deepspeed_cmd, run, torchrun_cmd

RECIPE = "recipes/trainer_finetune.py"
PSI = 22_713_986  # MiniLM with a 2-class head: what transformers counts (checked below)
MIB = 2**20
PLAN_TOLERANCE_PCT = 2.0
# A few real optimizer steps of the real model on the real data; tqdm off so that the
# Trainer prints each step's logs as one line (PrinterCallback), where they can be read.
SHORT = [
    "--max_steps", "3", "--max_train_samples", "96", "--max_seq_length", "64",
    "--per_device_train_batch_size", "8", "--logging_steps", "1", "--do_eval", "false",
    "--disable_tqdm", "true",
]  # fmt: skip
# DeepSpeed as it runs without dpkit's settings: the Trainer fills only its own "auto"s.
DEEPSPEED_DEFAULTS = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {"stage": 2},
}


class TrainerRuns:
    """Each named run launched once, on first use, into its own folder."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.launches: dict[str, Launch] = {}

    def commands(self, name: str, out: Path) -> tuple[list[str], dict[str, str]]:
        args = [*SHORT, "--output_dir", str(out)]
        if name == "ddp":
            extra = ["--report_to", "tensorboard", "--memory_report_every", "2"]
            return torchrun_cmd(2, *args, *extra, recipe=RECIPE), {}
        if name in ("zero1", "zero2"):
            return deepspeed_cmd(
                2, *args, "--deepspeed", f"ds_configs/{name}.json", recipe=RECIPE
            ), {}
        if name == "zero2_accelerate":
            launch = ["--config_file", "ds_configs/accelerate/zero2.yaml", "--num_processes", "2"]
            return accelerate_cmd(launch, *args, recipe=RECIPE), {}
        if name == "zero2_deepspeed_defaults":
            config = self.root / "deepspeed_defaults.json"
            config.write_text(json.dumps(DEEPSPEED_DEFAULTS))
            extra = ["--deepspeed", str(config), "--zero_settings", "config"]
            return deepspeed_cmd(2, *args, *extra, recipe=RECIPE), {}
        if name == "unconnected":  # the Trainer's defaults on a machine without CUDA
            return torchrun_cmd(2, *args, "--cpu_arguments", "false", recipe=RECIPE), {}
        if name == "deepspeed_off":
            cmd = deepspeed_cmd(2, *args, "--deepspeed", "ds_configs/zero2.json", recipe=RECIPE)
            return cmd, {"ACCELERATE_USE_CPU": "true"}
        raise KeyError(name)

    def __getitem__(self, name: str) -> Launch:
        if name not in self.launches:
            out = self.root / name
            cmd, env = self.commands(name, out)
            self.launches[name] = run(cmd, output_dir=out, **env)
        return self.launches[name]

    def report(self, name: str) -> dict:
        launch = self[name].check()
        return json.loads((launch.output_dir / "memory_report.json").read_text())


@pytest.fixture(scope="module")
def runs(module_tmp) -> TrainerRuns:
    return TrainerRuns(module_tmp)


TRAINED = ["ddp", "zero1", "zero2", "zero2_accelerate", "zero2_deepspeed_defaults"]
STRATEGY = {
    "ddp": "ddp",
    "zero1": "zero1",
    "zero2": "zero2",
    "zero2_accelerate": "zero2",
    "zero2_deepspeed_defaults": "zero2",
}


def plan_against(folder: Path) -> dict:
    """What ``dpkit plan --against FOLDER --json`` prints (its own functions, in this
    process: the command itself is run by tests/test_memory_multiprocess.py)."""
    from dpkit.plan.check import check_dict, check_run

    return check_dict(check_run(folder))


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", TRAINED)
def test_every_rank_is_measured_on_the_trainers_own_model(runs, name):
    report = runs.report(name)
    assert report["strategy"] == STRATEGY[name]
    assert report["world_size"] == 2
    assert [row["rank"] for row in report["ranks"]] == [0, 1]
    assert report["grads_measured"] is True
    assert report["num_params"] == PSI
    assert report["step"] == 3  # the last step's report
    for row in report["ranks"]:
        # Every rank holds all fp32 parameters (ZeRO-1/2 shard no parameters): 4 bytes
        # each, plus at most DeepSpeed's alignment padding of its flat buffers.
        assert 4 * PSI <= row["params"] <= 4 * PSI + 2 * 64, row["params"]
        assert row["grads"] > 0 and row["optimizer"] > 0
        assert row["measured_at"] == "step probes"
        # Probed for the first 3 steps (the callback's default) and taken off after the
        # third: the report, at step 3, finds them gone; later steps run without them.
        assert row["probes_in_place"] is False and row["probe_seconds"] > 0
    # The record dpkit plan --against reads: the live model and the optimizer's own groups.
    model = report["model"]
    assert model["class"] == "BertForSequenceClassification"
    assert sum(sum(group) for group in model["param_groups"]) == PSI
    assert model["micro_batch_size"] == 8


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [n for n in TRAINED if n != "ddp"])
def test_zero_optimizer_state_is_ddps_over_n(runs, name):
    """ZeRO-1 and ZeRO-2 shard the optimizer state: each rank holds DDP's / N (AdamW's two
    fp32 moments; the scalar step counters differ, a few hundred bytes)."""
    ddp = runs.report("ddp")
    zero = runs.report(name)
    ddp_optimizer = max(row["optimizer"] for row in ddp["ranks"])
    assert ddp_optimizer == pytest.approx(8 * PSI, rel=1e-4)  # exp_avg + exp_avg_sq, fp32
    for row in zero["ranks"]:
        assert row["optimizer"] == pytest.approx(ddp_optimizer / 2, rel=1e-3)
        assert row["master"] == pytest.approx(4 * PSI / 2, rel=1e-3)  # the fp32 partition


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", TRAINED)
def test_each_model_state_is_within_2pct_of_dpkit_plan_against_the_run(runs, name):
    runs[name].check()
    check = plan_against(runs[name].output_dir)
    assert check["strategy"] == STRATEGY[name] and check["world_size"] == 2
    for category in ("params", "grads", "optimizer", "master", "total"):
        error = check["error_pct"][category]
        if check["measured_bytes"][category] == 0:
            assert check["predicted_bytes"][category] == 0, category
            continue
        assert abs(error) <= PLAN_TOLERANCE_PCT, (category, check)
    # The callback printed the same check at the end of training.
    assert f"dpkit plan --against {runs[name].output_dir}" in runs[name].output


@pytest.mark.multiprocess
def test_dpkit_settings_shrink_zero_buckets_against_deepspeed_defaults(runs):
    """The same Trainer run with DeepSpeed's defaults and with dpkit's settings.

    DeepSpeed's defaults: a 5e8-element ipg bucket allocated whole (contiguous_gradients
    on), and reductions of up to the whole model at once (the flat copy of a bucket
    holding every gradient). dpkit's, for MiniLM at 2 ranks: no pre-allocated bucket
    (contiguous_gradients off: the word embedding is larger than the bucket and a
    quarter of the partition) and reductions of at most 2^21 elements."""
    from dpkit.engines.deepspeed.settings import DEEPSPEED_DEFAULT_BUCKET, bucket_elements

    flat_copy = "zero_reduce_flat_copy (largest bucket copy, transient)"
    dpkit_run = runs.report("zero2")
    default_run = runs.report("zero2_deepspeed_defaults")
    bucket = bucket_elements(384, PSI)
    assert dpkit_run["settings"]["zero.reduce_bucket_size"] == bucket == 2**21
    assert dpkit_run["settings"]["zero.contiguous_gradients"] is False
    assert default_run["settings"]["zero.reduce_bucket_size"] == DEEPSPEED_DEFAULT_BUCKET
    assert default_run["settings"]["zero.contiguous_gradients"] is True
    for row in dpkit_run["ranks"]:
        assert "zero_ipg_bucket" not in row["buffers"]
        # A bucket is closed once it would pass the size, so a copy is at most the bucket
        # plus one parameter smaller than it (a larger one is reduced alone).
        assert 0 < row["buffers"][flat_copy] <= 2 * 4 * bucket
    for row in default_run["ranks"]:
        assert row["buffers"]["zero_ipg_bucket"] == 4 * DEEPSPEED_DEFAULT_BUCKET  # fp32, whole
        assert row["buffers"][flat_copy] == pytest.approx(4 * PSI, rel=1e-3)  # one reduction
    dpkit_buffers = max(row["buffers_total"] for row in dpkit_run["ranks"])
    default_buffers = max(row["buffers_total"] for row in default_run["ranks"])
    assert dpkit_buffers < 20 * MIB < 1900 * MIB < default_buffers


@pytest.mark.multiprocess
def test_accelerate_launch_runs_the_same_zero2_as_the_deepspeed_launcher(runs):
    """``accelerate launch`` with the shipped YAML: the callback's example takes the
    config accelerate was given and sizes it the same way; the per-rank breakdown is the
    deepspeed launcher's."""
    by_launcher = runs.report("zero2")
    by_accelerate = runs.report("zero2_accelerate")
    assert by_accelerate["settings"] == by_launcher["settings"]
    for a, b in zip(by_accelerate["ranks"], by_launcher["ranks"], strict=True):
        for category in ("params", "grads", "optimizer", "master", "buffers_total"):
            assert a[category] == pytest.approx(b[category], rel=1e-6), category


@pytest.mark.multiprocess
def test_ddp_report_names_the_trainers_reducer_buckets_and_reaches_report_to(runs):
    """The Trainer's DDP runs without ``gradient_as_bucket_view``: the reducer's buckets
    are a second full gradient copy, which the report names. Reports at step 2
    (``report_every``) and step 3 (the end); the memory scalars reach TensorBoard, the
    logger ``--report_to tensorboard`` asked for, at those steps."""
    report = runs.report("ddp")
    for row in report["ranks"]:
        assert row["buffers"]["ddp_buckets"] == pytest.approx(4 * PSI, rel=1e-4)
        assert row["grads"] == pytest.approx(4 * PSI, rel=1e-4)
    assert report["settings"]["ddp.gradient_as_bucket_view"] is False
    output = runs["ddp"].output
    assert output.count("dpkit memory report, step 2") == 1  # main process only
    assert output.count("dpkit memory report, step 3") == 1
    logged = _tensorboard_scalars(runs["ddp"], "train/memory/model_state_mib")
    assert sorted(logged) == [2, 3]
    assert logged[3] == pytest.approx(report["measured"]["model_state_total"] / MIB, rel=1e-6)


def _tensorboard_scalars(launch: Launch, tag: str) -> dict[int, float]:
    """``tag``'s values by step in the run's one TensorBoard event folder (``--report_to
    tensorboard``)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = {p.parent for p in launch.output_dir.rglob("events.out.tfevents.*")}
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    assert tag in accumulator.Tags()["scalars"], accumulator.Tags()["scalars"]
    return {event.step: event.value for event in accumulator.Scalars(tag)}


def _printed_logs(output: str, first_key: str) -> list[dict[str, float]]:
    """The ``time/*`` figures of each log line the Trainer printed (PrinterCallback, which
    prints each value to 4 significant digits, quoted) that starts with ``first_key``."""
    lines = [line for line in output.splitlines() if line.startswith(f"{{'{first_key}'")]
    return [
        {key: float(value) for key, value in re.findall(r"'(time/\w+)': '?([-+0-9.e]+)", line)}
        for line in lines
    ]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["ddp", "zero2"])
def test_each_logged_step_says_where_its_time_went(runs, name):
    """StepPhasesCallback: every training log line carries the step's phases (the main
    process's clock on the model and optimizer the Trainer prepared, inside DDP's and
    DeepSpeed's wrappers alike); they add up to the step figure and, over the run, to no
    more than the Trainer's own train_runtime; report_to receives them."""
    output = runs[name].check().output
    steps = _printed_logs(output, "loss")
    assert len(steps) == 3, output[-3000:]  # --logging_steps 1, --max_steps 3
    for logs in steps:
        phases = [logs[f"time/{phase}"] for phase in PHASES]
        assert min(phases) >= 0, logs
        assert logs["time/forward_s"] > 0 and logs["time/backward_s"] > 0, logs
        assert logs["time/optimizer_s"] > 0, logs  # the update was found under the wrappers
        assert logs["time/step_s"] == pytest.approx(sum(phases), rel=2e-3)
    (summary,) = _printed_logs(output, "train_runtime")
    assert summary == {}  # no step since the last line: nothing to add
    runtime = float(re.search(r"'train_runtime': '?([0-9.]+)", output).group(1))
    assert sum(logs["time/step_s"] for logs in steps) <= runtime
    if name == "ddp":
        logged = _tensorboard_scalars(runs["ddp"], "train/time/backward_s")
        assert sorted(logged) == [1, 2, 3]
        assert [logged[step] for step in (1, 2, 3)] == pytest.approx(
            [logs["time/backward_s"] for logs in steps], rel=1e-3
        )


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("unconnected", "WORLD_SIZE=2: the launcher started 2 processes but each trains alone"),
        ("deepspeed_off", "the run asked for DeepSpeed but runs without it"),
    ],
)
def test_a_run_that_would_train_the_wrong_job_is_refused_in_one_line(runs, name, message):
    """Without the callback both exit 0: two unconnected copies that drift apart, and a
    plain DDP run where DeepSpeed ZeRO-2 was asked for (``ACCELERATE_USE_CPU=true``)."""
    launch = runs[name]
    assert launch.returncode != 0, launch.output[-3000:]
    errors = [line for line in launch.output.splitlines() if "trainer_finetune.py: error:" in line]
    assert len(errors) == 1, launch.output[-3000:]
    assert message in errors[0]
    assert "use_cpu=True, ddp_backend='gloo'" in errors[0]
    assert "dpkit memory report" not in launch.output
    assert not (launch.output_dir / "memory_report.json").exists()


# --- in one process: the settings helper and the arguments ------------------------------


def _minilm_config():
    import dpkit

    return dpkit.load_model_config(dpkit.ModelConfig.model)[1]


def test_deepspeed_config_fills_dpkits_zero_settings_and_leaves_the_trainers_auto():
    from dpkit.integrations.transformers import deepspeed_config
    from dpkit.engines.deepspeed.settings import zero_memory_settings

    config = deepspeed_config(_minilm_config(), "zero2", world_size=4)
    expected = zero_memory_settings(
        PSI, 384, world_size=4, stage=2, largest_param_numel=30522 * 384, on_cuda=False
    )
    zero = config["zero_optimization"]
    for key, value in expected.items():
        assert zero[key] == value, key
    # MiniLM's word embedding is larger than the bucket and a quarter of a 4-rank partition.
    assert zero["contiguous_gradients"] is False and zero["reduce_bucket_size"] == 2**21
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_clipping"):
        assert config[key] == "auto", key  # the Trainer's to fill
    assert config["bf16"]["enabled"] == "auto"


def test_deepspeed_config_keeps_what_the_user_wrote():
    from dpkit.integrations.transformers import deepspeed_config

    written = {"zero_optimization": {"stage": 1, "reduce_bucket_size": 1000, "overlap_comm": True}}
    config = deepspeed_config(_minilm_config(), written, world_size=2)
    assert config["zero_optimization"]["reduce_bucket_size"] == 1000
    assert config["zero_optimization"]["overlap_comm"] is True
    assert config["zero_optimization"]["allgather_bucket_size"] == 2**21  # left out: dpkit's
    assert written["zero_optimization"] == {
        "stage": 1,
        "reduce_bucket_size": 1000,
        "overlap_comm": True,
    }  # the caller's dict is not modified


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"zero_optimization": {"stage": 3}}, "zero_optimization.stage=3; dpkit supports 1 and 2"),
        (
            {"zero_optimization": {"stage": 2}, "steps_per_print": "auto"},
            'steps_per_print="auto": neither dpkit nor the Trainer fills it',
        ),
        ("no/such/config.json", "no such file"),
    ],
)
def test_deepspeed_config_refuses_in_one_line(config, message):
    from dpkit.errors import UsageError
    from dpkit.integrations.transformers import deepspeed_config

    with pytest.raises(UsageError) as refused:
        deepspeed_config(_minilm_config(), config, world_size=2)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_deepspeed_config_takes_accelerates_config_or_none(monkeypatch):
    from dpkit.integrations.transformers import deepspeed_config

    monkeypatch.delenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", raising=False)
    assert deepspeed_config(_minilm_config()) is None  # no DeepSpeed asked for
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(REPO / "ds_configs/zero1.json"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = deepspeed_config(_minilm_config())
    assert config["zero_optimization"]["stage"] == 1
    assert config["zero_optimization"]["reduce_bucket_size"] == 2**21


def test_device_arguments_on_a_machine_without_cuda(monkeypatch):
    import torch

    from dpkit.integrations.transformers import device_arguments

    if torch.cuda.is_available():
        assert device_arguments() == {}
        return
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert device_arguments() == {"use_cpu": True}
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert device_arguments() == {"use_cpu": True, "ddp_backend": "gloo"}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"report_every": -1}, "report_every=-1"),
        ({"probe_steps": 0}, "probe_steps=0"),
    ],
)
def test_callback_refuses_bad_arguments(kwargs, message):
    from dpkit.errors import UsageError
    from dpkit.integrations.transformers import MemoryReportCallback

    with pytest.raises(UsageError, match=message):
        MemoryReportCallback(**kwargs)
