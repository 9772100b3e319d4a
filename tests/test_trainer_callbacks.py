"""dpkit's Trainer callbacks in one process: a real ``Trainer`` on CPU, tiny models.

What the 2-process launches of tests/test_trainer.py cannot show cheaply: the step phases
logged every N > 1 steps are the MEANS over those N steps (steps of known, different
lengths; the wall time between two log lines taken by the test's own clock), evaluation
lines left alone; and the memory report's arithmetic against figures worked by hand on a
model small enough to count (every model-state category, the total, ``dpkit plan
--against``).

Each Trainer run happens inside the one test that checks it, not in a shared fixture:
mutation testing (``make mutate``) times a test by its call and credits the code a
fixture reaches to the first test that used it only.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from dpkit.integrations.transformers import StepPhasesCallback

# --- StepPhasesCallback driven by hand: known phases per step ------------------------------


class _ScriptedClock:
    """The callback's clock with known figures: ``take()`` returns the next step's phases."""

    def __init__(self, steps: list[dict[str, float]]) -> None:
        self.steps = list(steps)
        self.removed = False

    def take(self) -> dict[str, float]:
        return self.steps.pop(0)

    def remove(self) -> None:
        self.removed = True


def _phases(data, forward, backward, sync, optimizer, other) -> dict[str, float]:
    return {
        "data_s": data,
        "forward_s": forward,
        "backward_s": backward,
        "grad_sync_s": sync,
        "optimizer_s": optimizer,
        "other_s": other,
    }


# Three steps, then two: each phase differs from step to step, so the mean over the steps
# since the last log line (what the Trainer's log promises) differs from their sum, from
# the last step's figure and from the first's.
FIRST_THREE = [
    _phases(0.01, 0.10, 0.40, 0.02, 0.05, 0.001),
    _phases(0.02, 0.20, 0.50, 0.04, 0.06, 0.002),
    _phases(0.09, 0.60, 0.90, 0.06, 0.13, 0.006),
]
NEXT_TWO = [
    _phases(0.30, 0.25, 0.70, 0.00, 0.08, 0.010),
    _phases(0.10, 0.45, 0.30, 0.10, 0.04, 0.030),
]
# The means, worked by hand: (0.01 + 0.02 + 0.09) / 3 = 0.04, and so on; step_s is the
# mean step, (0.581 + 0.822 + 1.786) / 3 = 1.063.
FIRST_THREE_MEANS = {
    "time/data_s": 0.04,
    "time/forward_s": 0.30,
    "time/backward_s": 0.60,
    "time/grad_sync_s": 0.04,
    "time/optimizer_s": 0.08,
    "time/other_s": 0.003,
    "time/step_s": 1.063,
}
# (0.30 + 0.10) / 2 = 0.20 ...; steps of 1.34 and 1.02 s: 1.18.
NEXT_TWO_MEANS = {
    "time/data_s": 0.20,
    "time/forward_s": 0.35,
    "time/backward_s": 0.50,
    "time/grad_sync_s": 0.05,
    "time/optimizer_s": 0.06,
    "time/other_s": 0.02,
    "time/step_s": 1.18,
}


def test_phases_logged_every_n_steps_are_the_means_of_those_steps():
    callback = StepPhasesCallback()
    callback.on_init_end(None, None, None)  # not called by a Trainer: nothing to reorder
    callback.on_step_end(None, None, None)  # before train(): no clock, nothing counted
    clock = _ScriptedClock(FIRST_THREE + NEXT_TWO)
    callback.phases = clock
    for _ in FIRST_THREE:
        callback.on_step_end(None, None, None)
    # Evaluation and prediction lines between two training lines get nothing and leave
    # the steps counted so far to the next training line.
    for prefix in ("eval", "test"):
        logs = {f"{prefix}_loss": 0.5}
        callback.on_log(None, None, None, logs=logs)
        assert logs == {f"{prefix}_loss": 0.5}
    callback.on_log(None, None, None, logs=None)  # no logs to add to: nothing happens
    logs = {"loss": 0.7}
    callback.on_log(None, None, None, logs=logs)
    assert logs.pop("loss") == 0.7
    assert logs == pytest.approx(FIRST_THREE_MEANS, abs=1e-6)  # rounded to 1e-6 s
    # The next line covers the steps since this one only.
    for _ in NEXT_TWO:
        callback.on_step_end(None, None, None)
    logs = {"loss": 0.6}
    callback.on_log(None, None, None, logs=logs)
    del logs["loss"]
    assert logs == pytest.approx(NEXT_TWO_MEANS, abs=1e-6)
    # No step since the last line (the Trainer's closing summary): nothing to add.
    logs = {"train_runtime": 9.0}
    callback.on_log(None, None, None, logs=logs)
    assert logs == {"train_runtime": 9.0}
    callback.on_train_end(None, None, None)
    assert clock.removed and callback.phases is None
    callback.on_train_end(None, None, None)  # twice: nothing left to remove
    # Driven without a Trainer (none on the stack): the clock goes on the model given.
    model = torch.nn.Linear(2, 2)
    callback.on_train_begin(None, None, None, model=model, optimizer=None)
    assert callback.phases.model is model
    callback.on_train_end(None, None, None)


# --- a real Trainer in this process, logging every 3 steps -------------------------------

# Each training step's forward sleeps its own time (seconds); the Trainer logs every 3
# steps. Mean of the first three 0.2 (sum 0.6), of the last three 0.3 (sum 0.9).
FORWARD_SLEEPS = [0.05, 0.10, 0.45, 0.35, 0.30, 0.25]
LOGGING_STEPS = 3
# An evaluation's forward (model.eval()) sleeps this long: it is not a step's forward;
# it falls in the next step's data (the time between two steps).
EVAL_SLEEP = 0.3
# Above the sleeps, what else a step's forward may hold on a busy 2-core machine: a
# 4 x 2 linear layer and the hooks (measured 0.2 ms; under load a scheduling delay of
# tens of ms). Below the gap between a mean and the sum (0.4 s and more), and below the
# smallest mean, so that a sum or a single step's figure falls outside.
SLACK = 0.12


class _SleepyClassifier(torch.nn.Module):
    """A linear classifier whose training forwards sleep FORWARD_SLEEPS, one per call,
    and whose evaluation forwards sleep EVAL_SLEEP."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        self.calls = 0

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.training:
            time.sleep(FORWARD_SLEEPS[self.calls])
            self.calls += 1
        else:
            time.sleep(EVAL_SLEEP)
        logits = self.linear(x)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


class _LogClock(TrainerCallback):
    """Each log line the Trainer sends, with the test's own clock read when it arrives
    (this callback comes after StepPhasesCallback, which puts itself first)."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, dict]] = []
        self.started: float | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.lines.append((time.perf_counter(), dict(logs)))


def _examples(count: int) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    return [
        {"x": torch.randn(4, generator=generator), "labels": torch.tensor(i % 2)}
        for i in range(count)
    ]


def _phased_run(out) -> _LogClock:
    """6 steps of the sleepy classifier, logging every 3 steps, evaluating every 2."""
    clock = _LogClock()
    args = TrainingArguments(
        output_dir=str(out),
        use_cpu=True,
        max_steps=len(FORWARD_SLEEPS),
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        logging_steps=LOGGING_STEPS,
        eval_strategy="steps",
        eval_steps=2,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=_SleepyClassifier(),
        args=args,
        train_dataset=_examples(12),
        eval_dataset=_examples(4),  # one batch: one evaluation forward
        callbacks=[clock, StepPhasesCallback()],
    )
    trainer.train()
    return clock


def test_a_real_trainer_logging_every_3_steps_logs_the_mean_step(tmp_path):
    phased_run = _phased_run(tmp_path)
    training = [(at, logs) for at, logs in phased_run.lines if "loss" in logs]
    assert [logs["epoch"] for _, logs in training] == [0.5, 1.0]  # steps 3 and 6
    previous = phased_run.started
    for window, (at, logs) in enumerate(training):
        sleeps = FORWARD_SLEEPS[window * LOGGING_STEPS : (window + 1) * LOGGING_STEPS]
        mean_sleep = sum(sleeps) / LOGGING_STEPS
        assert mean_sleep <= logs["time/forward_s"] < mean_sleep + SLACK, logs
        # The evaluation after step 2 (and after step 4) is in that window's data time,
        # spread over its 3 steps; its forward is not the steps'.
        assert logs["time/data_s"] >= EVAL_SLEEP / LOGGING_STEPS, logs
        # The mean step against the test's clock: the wall time since the last line
        # (since train() began, for the first) over the 3 steps. Between the clock's
        # last reading of a step and this callback the Trainer only logs (measured
        # under 5 ms); a sum of 3 steps would be 3x.
        wall_per_step = (at - previous) / LOGGING_STEPS
        assert logs["time/step_s"] == pytest.approx(wall_per_step, rel=0.05, abs=0.01), (
            logs,
            wall_per_step,
        )
        previous = at
        # Rounded to the microsecond (clock readings have nine more digits).
        phases = [value for key, value in logs.items() if key.startswith("time/")]
        assert len(phases) == 7 and all(value == round(value, 6) for value in phases)
        assert any(value != round(value, 5) for value in phases)
    # Evaluation lines carry no phases.
    evaluations = [logs for _, logs in phased_run.lines if "eval_loss" in logs]
    assert len(evaluations) == 3  # after steps 2, 4 and 6
    for logs in evaluations:
        assert not [key for key in logs if key.startswith("time/")], logs
    # The closing summary comes after the last training line: no step left to report.
    (summary,) = [logs for _, logs in phased_run.lines if "train_runtime" in logs]
    assert not [key for key in summary if key.startswith("time/")], summary


# --- MemoryReportCallback on a real Trainer in this process ------------------------------

# A BERT small enough to count by hand: embeddings 64 x 16 + 16 x 16 + 2 x 16 + LayerNorm
# 2 x 16 = 1,344; one layer: query, key, value and output 4 x (16 x 16 + 16) = 1,088,
# LayerNorm 32, intermediate 16 x 32 + 32 = 544, output 32 x 16 + 16 = 528, LayerNorm 32
# = 2,224; pooler 16 x 16 + 16 = 272; classifier 16 x 2 + 2 = 34. 3,874 in all, in 25
# tensors (torch's count is asserted below).
TINY_PSI = 3_874
TINY_TENSORS = 25
# fp32 AdamW in one process (DDP's world of one) by hand: parameters and gradients 4 bytes
# each; AdamW's two moments 8, plus its step, a float32 scalar tensor per parameter
# tensor (torch.optim.AdamW's state); no master copy.
TINY_STATES = {
    "params": 4 * TINY_PSI,
    "grads": 4 * TINY_PSI,
    "optimizer": 8 * TINY_PSI + 4 * TINY_TENSORS,
    "master": 0,
}
MIB = 2**20


def _tiny_bert():
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=2,
    )
    torch.manual_seed(0)
    return BertForSequenceClassification(config)


def _token_examples(count: int) -> list[dict]:
    generator = torch.Generator().manual_seed(1)
    return [
        {"input_ids": torch.randint(1, 64, (8,), generator=generator), "labels": i % 2}
        for i in range(count)
    ]


class _Logs(TrainerCallback):
    """Every log line the Trainer sends, with its step."""

    def __init__(self) -> None:
        self.lines: list[tuple[int, dict]] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.lines.append((state.global_step, dict(logs)))


def _reported_run(out):
    """3 steps of the tiny BERT (micro-batch 4, 2 micro-batches a step), reporting memory
    at step 2 (report_every) and at the end; the Trainer's own logging never due
    (logging_steps 100), so that only the memory report asks for log lines."""
    import contextlib
    import io

    from dpkit.integrations.transformers import MemoryReportCallback

    logs = _Logs()
    model = _tiny_bert()
    args = TrainingArguments(
        output_dir=str(out),
        use_cpu=True,
        max_steps=3,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        logging_steps=100,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    callback = MemoryReportCallback(report_every=2, model_name="tiny-bert")
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=_token_examples(24),
        callbacks=[logs, callback],
    )
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer.train()
    return {
        "out": out,
        "logs": logs.lines,
        "printed": printed.getvalue(),
        "trainer": trainer,
        "callback": callback,
    }


def test_a_trainer_runs_memory_report_plan_check_and_scalars(tmp_path):
    """One Trainer run (the training in this test's own call, so that mutation testing
    times it and runs every check for the code it reaches), checked three ways."""
    run = _reported_run(tmp_path)
    _check_the_report_holds_the_bytes_worked_by_hand(run)
    _check_dpkit_plan_against_checks_every_category_and_the_total(run)
    _check_the_memory_scalars_go_out_with_the_reporting_steps_logs(run)
    _check_the_timeline_holds_both_micro_batches_and_is_drawn(run)


def _check_the_report_holds_the_bytes_worked_by_hand(reported_run) -> None:
    import json

    assert sum(p.numel() for p in reported_run["trainer"].model.parameters()) == TINY_PSI
    assert len(list(reported_run["trainer"].model.parameters())) == TINY_TENSORS
    report = json.loads((reported_run["out"] / "memory_report.json").read_text())
    assert (report["strategy"], report["world_size"], report["precision"]) == ("ddp", 1, "fp32")
    assert report["offload_optimizer"] is None
    assert report["optimizer"] == "adamw" and report["num_params"] == TINY_PSI
    assert report["step"] == 3  # the last report: the end of training
    (row,) = report["ranks"]
    for category, expected in TINY_STATES.items():
        assert row[category] == expected, category
    assert row["model_state_total"] == sum(TINY_STATES.values())
    # Probed for the first 3 steps (the default) and off after the third.
    assert row["measured_at"] == "step probes" and row["probes_in_place"] is False
    # The record dpkit plan --against reads: the live model and the optimizer's groups.
    model = report["model"]
    assert model["name"] == "tiny-bert"  # model_name=
    assert model["class"] == "BertForSequenceClassification"
    assert model["micro_batch_size"] == 4 and model["gradient_accumulation_steps"] == 2
    groups = reported_run["trainer"].optimizer.optimizer.param_groups  # torch's AdamW
    assert [sum(group) for group in model["param_groups"]] == [
        sum(p.numel() for p in group["params"]) for group in groups
    ]
    assert len(groups) == 2  # the Trainer's decay and no-decay groups
    # Nothing to note: AdamW, the Trainer found from the callback.
    assert not [note for note in report["notes"] if "AdamW" in note or "Trainer" in note]


def _check_the_timeline_holds_both_micro_batches_and_is_drawn(reported_run) -> None:
    import json

    report = json.loads((reported_run["out"] / "memory_report.json").read_text())
    timeline = report["ranks"][0]["timeline"]
    # Probed for 3 steps (the callback's default): the third is kept, whole.
    assert timeline["step"] == 3 and timeline["complete"]
    names = [p["point"] for p in timeline["points"]]
    # gradient_accumulation_steps=2: two forwards and two backwards, then one update.
    assert names.count("forward_end") == 2 and names.count("backward_end") == 2
    assert names.index("optimizer_step_begin") > max(
        i for i, name in enumerate(names) if name == "backward_end"
    )
    assert names[0] == "forward_begin" and names[-1] == "optimizer_step_end"
    chart = reported_run["out"] / "memory_timeline.png"
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and chart.stat().st_size > 10_000


def _check_dpkit_plan_against_checks_every_category_and_the_total(reported_run) -> None:
    from dpkit.plan.check import check_dict, check_run

    check = check_dict(check_run(reported_run["out"]))
    assert check["strategy"] == "ddp" and check["world_size"] == 1
    # The prediction by hand: AdamW's state is 8 bytes per parameter (its steps are not
    # model states the plan counts per parameter: 100 bytes, 0.3% of the optimizer).
    predicted = {**TINY_STATES, "optimizer": 8 * TINY_PSI}
    # The model-state rows (since issue #30 the check also has buffers and activations).
    states = (*TINY_STATES, "total")
    measured_states = {k: check["measured_bytes"][k] for k in states}
    assert measured_states == {**TINY_STATES, "total": sum(TINY_STATES.values())}
    predicted_states = {k: check["predicted_bytes"][k] for k in states}
    assert predicted_states == {**predicted, "total": sum(predicted.values())}
    assert {"buffers", "activations"} <= set(check["predicted_bytes"])
    # The callback printed the same check after each report, and the report itself.
    printed = reported_run["printed"]
    # each check a blank line below its report's table
    assert printed.count(f"\n\ndpkit plan --against {reported_run['out']}") == 2
    assert printed.count("dpkit memory report, step 2\n") == 1
    assert printed.count("dpkit memory report, step 3\n") == 1
    assert "dpkit memory report, step 1" not in printed  # report_every=2: not due


def _check_the_memory_scalars_go_out_with_the_reporting_steps_logs(reported_run) -> None:
    """No log was due (logging_steps 100): the callback asks for lines at its reports,
    steps 2 and 3, and adds the memory scalars; per-rank and error figures stay out."""
    lines = reported_run["logs"]
    training = {step: line for step, line in lines if "loss" in line}
    assert sorted(training) == [2, 3]
    for line in training.values():
        assert line["memory/params_mib"] == pytest.approx(4 * TINY_PSI / MIB, rel=1e-9)
        assert line["memory/model_state_mib"] == pytest.approx(
            sum(TINY_STATES.values()) / MIB, rel=1e-9
        )
        assert line["memory/master_mib"] == 0
        assert not [k for k in line if k.startswith(("memory/rank", "memory/error_pct/"))]
    # The closing summary line (step 3 too) gets nothing more: the scalars went once.
    (summary,) = [line for _, line in lines if "train_runtime" in line]
    assert not [key for key in summary if key.startswith("memory/")], summary


def test_the_trainers_gradient_checkpointing_is_recorded_and_planned(tmp_path):
    """The Trainer's own ``activation_checkpointing=True`` (or its older name,
    ``gradient_checkpointing``; the Trainer checkpoints the model itself): the report
    records it from the model, and ``dpkit plan --against`` plans the
    checkpointed forward, within the 15% docs/plan.md states of what the run kept."""
    import json

    from dpkit.integrations.transformers import MemoryReportCallback
    from dpkit.plan.check import check_run

    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, max_steps=2, per_device_train_batch_size=4,
        activation_checkpointing=True, logging_steps=100, report_to="none", save_strategy="no",
        disable_tqdm=True,
    )  # fmt: skip
    callback = MemoryReportCallback(model_name="tiny-bert")
    trainer = Trainer(
        model=_tiny_bert(), args=args, train_dataset=_token_examples(8), callbacks=[callback]
    )
    trainer.train()
    report = json.loads((tmp_path / "memory_report.json").read_text())
    assert report["gradient_checkpointing"] is True
    check = check_run(tmp_path)
    assert check.gradient_checkpointing and check.activation_method == "trace"
    assert abs(check.error_pct["activations"]) <= 15, (check.predicted, check.measured)


def test_a_trainer_with_a_peft_lora_model_is_counted_and_planned(tmp_path):
    """A Trainer given a model the user wrapped with peft's LoRA: the frozen weights are
    parameters only (no gradient, no moments), in the report's measure, its prediction
    and ``dpkit plan --against``, which also traces the adapted model."""
    import json

    from peft import LoraConfig, get_peft_model

    from dpkit.integrations.transformers import MemoryReportCallback
    from dpkit.plan.check import check_run

    model = get_peft_model(
        _tiny_bert(), LoraConfig(r=2, lora_alpha=4, target_modules=["query", "value"],
                                 task_type="SEQ_CLS"),
    )  # fmt: skip
    # The adapters: 1 layer x 2 targets x (A 2 x 16 + B 16 x 2); the head's trained copy
    # 16 x 2 + 2. Frozen: the whole tiny BERT (its original head included).
    trainable = 1 * 2 * (2 * 16 + 16 * 2) + (16 * 2 + 2)
    frozen = TINY_PSI
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, max_steps=2, per_device_train_batch_size=4,
        logging_steps=100, report_to="none", save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    trainer = Trainer(
        model=model, args=args, train_dataset=_token_examples(8),
        callbacks=[MemoryReportCallback(model_name="tiny-bert-lora")],
    )  # fmt: skip
    trainer.train()
    report = json.loads((tmp_path / "memory_report.json").read_text())
    assert (report["num_params"], report["frozen_params"]) == (trainable, frozen)
    assert report["lora"]["r"] == 2 and report["lora"]["target_modules"] == ["query", "value"]
    (row,) = report["ranks"]
    assert row["params"] == 4 * (trainable + frozen)
    assert row["grads"] == 4 * trainable
    # Adam's two fp32 moments, plus one 4-byte step count per trained tensor (torch's).
    assert 8 * trainable <= row["optimizer"] <= 8 * trainable + 4 * 6
    assert report["predicted"]["params"] == 4 * (trainable + frozen)
    assert report["predicted"]["grads"] == 4 * trainable
    check = check_run(tmp_path)
    for category in ("params", "grads", "total"):
        assert abs(check.error_pct[category]) <= 1.0, (category, check.error_pct)
    # The plan's optimizer state is per parameter (the step counts are not: 1.8% here).
    assert check.predicted["optimizer"] == 8 * trainable, check.predicted
    assert abs(check.error_pct["activations"]) <= 15, (check.predicted, check.measured)


# --- finding the Trainer, and going first in its callback list ----------------------------


class _Handler:
    def __init__(self, callbacks: list) -> None:
        self.callbacks = callbacks


class _FakeTrainer:
    """What ``_calling_trainer`` looks for: a ``self`` with a callback handler holding
    the callback, some frames up the stack."""

    def __init__(self, callback) -> None:
        self.callback_handler = _Handler([object(), callback])

    def call_from_depth(self, depth: int, callback=None):
        return _nested(callback or self.callback_handler.callbacks[1], depth)

    def call_event(self, event: str, *args, **kwargs) -> None:
        """Call ``event`` on every callback from this object's frame, as the Trainer does."""
        for callback in self.callback_handler.callbacks[1:]:
            getattr(callback, event)(*args, **kwargs)


def _nested(callback, level: int):
    """``_calling_trainer(callback)`` from ``level`` frames below this one's caller."""
    from dpkit.integrations.transformers import _calling_trainer

    return _calling_trainer(callback) if level == 0 else _nested(callback, level - 1)


def test_the_trainer_is_found_however_deep_the_callback_is_called():
    """The Trainer calls a callback a few frames down (its method, the handler's
    call_event, the event); wrappers may add more: the whole stack is searched."""
    trainer = _FakeTrainer(StepPhasesCallback())
    assert trainer.call_from_depth(0) is trainer
    assert trainer.call_from_depth(40) is trainer
    # A handler that does not hold this callback is not its Trainer.
    assert trainer.call_from_depth(0, callback=StepPhasesCallback()) is None
    assert _nested(StepPhasesCallback(), 3) is None  # no Trainer on the stack at all


def test_both_callbacks_measure_the_model_the_trainer_wrapped(tmp_path, one_rank_group):
    """Under several ranks the Trainer's ``model_wrapped`` is a DDP wrapper around the
    model the events are given: the clock must time the wrapper's forward, and the
    memory report count its reducer's buckets (a real DDP on a one-rank gloo group;
    DDP's default buckets copy every gradient: 4 B x Psi of fp32 gradients) and record
    the model given, the precision asked for (bf16: autocast) and the optimizer run."""
    import json

    from transformers import TrainerControl, TrainerState

    from dpkit.integrations.transformers import MemoryReportCallback

    model = _tiny_bert()
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    phases, memory = StepPhasesCallback(), MemoryReportCallback(print_report=False)
    trainer = _FakeTrainer(phases)
    trainer.callback_handler.callbacks.append(memory)
    trainer.model_wrapped = wrapped
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, bf16=True, per_device_train_batch_size=2,
        report_to="none",
    )  # fmt: skip
    state, control = TrainerState(max_steps=1), TrainerControl()
    trainer.call_event("on_train_begin", args, state, control, model=model, optimizer=optimizer)
    assert phases.phases.model is wrapped
    _one_step(wrapped, optimizer)
    state.global_step = 1
    trainer.call_event("on_step_end", args, state, control)
    logs = {"loss": 1.0}
    phases.on_log(args, state, control, logs=logs)
    assert logs["time/optimizer_s"] > 0  # the clock's hooks are on the optimizer too
    trainer.call_event("on_train_end", args, state, control)
    report = json.loads((tmp_path / "memory_report.json").read_text())
    assert report["ranks"][0]["buffers"]["ddp_buckets"] == 4 * TINY_PSI
    assert report["model"]["class"] == "BertForSequenceClassification"
    assert (report["precision"], report["optimizer"]) == ("bf16", "sgd_momentum")
    assert not any("Trainer was not found" in note for note in report["notes"])


def test_a_deepspeed_run_is_read_from_its_engine_and_optimizer(
    tmp_path, one_rank_group, monkeypatch
):
    """DeepSpeed ZeRO-2 in bf16 as the Trainer runs it (its engine as ``model_wrapped``,
    its ZeRO optimizer), on a one-rank gloo group in this process: the strategy and the
    precision come from DeepSpeed's optimizer (16-bit partitions), not from the
    arguments, which ask for neither here; so does the optimizer's offload to the CPU
    (ZeRO-Offload with torch's AdamW, allowed by ``zero_force_ds_cpu_optimizer``, where
    DeepSpeed's own CPU Adam would be compiled first). Both engines on the one group:
    DeepSpeed keeps the first group it is given for the rest of the process."""
    import json

    import deepspeed
    from transformers import TrainerControl, TrainerState

    from dpkit.integrations.transformers import MemoryReportCallback

    # The arguments first: they (re)make accelerate's process-wide state, which with
    # LOCAL_RANK set would read a distributed CPU run, for this test and every later one.
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=2, report_to="none"
    )
    monkeypatch.setenv("LOCAL_RANK", "0")  # DeepSpeed's check that a launcher started it
    # As every dpkit DeepSpeed run does: no shared-memory all-reduce op, which DeepSpeed's
    # CPU backend would compile here under a lock file (a process stopped mid-build, as
    # make mutate stops one at its time limit, leaves the lock and every later init hangs).
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    from dpkit.engines.deepspeed.config import skip_deepspeed_cpu_shm_op

    shm_op = get_accelerator().create_op_builder("ShareMemCommBuilder").NAME
    compatible = deepspeed.ops.__compatible_ops__
    monkeypatch.setitem(compatible, shm_op, compatible[shm_op])  # put back after the test
    skip_deepspeed_cpu_shm_op()
    for offload in (None, "cpu"):  # each run's report replaces the last one's
        model = _tiny_bert()
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": 2},
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        }
        if offload:
            config["zero_optimization"]["offload_optimizer"] = {"device": offload}
            config["zero_force_ds_cpu_optimizer"] = False
        engine, optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        phases, memory = StepPhasesCallback(), MemoryReportCallback(print_report=False)
        trainer = _FakeTrainer(phases)
        trainer.callback_handler.callbacks.append(memory)
        trainer.model_wrapped = engine
        state, control = TrainerState(max_steps=1), TrainerControl()
        trainer.call_event("on_train_begin", args, state, control, model=model, optimizer=optimizer)
        assert phases.phases.model is engine
        batch = _token_examples(2)
        inputs = torch.stack([example["input_ids"] for example in batch])
        labels = torch.tensor([example["labels"] for example in batch])
        engine.backward(engine(input_ids=inputs, labels=labels).loss)
        engine.step()
        state.global_step = 1
        trainer.call_event("on_step_end", args, state, control)
        trainer.call_event("on_train_end", args, state, control)
        report = json.loads((tmp_path / "memory_report.json").read_text())
        strategy = "zero2_offload" if offload else "zero2"  # named from the ZeRO optimizer
        assert (report["strategy"], report["precision"]) == (strategy, "bf16")
        assert (report["optimizer"], report["offload_optimizer"]) == ("adamw", offload)
        assert report["model"]["class"] == "BertForSequenceClassification"
        # The record's groups are the parameters DeepSpeed partitions (its bit16 groups:
        # one group of the model's own, in order), not the flat partition it steps.
        assert report["model"]["param_groups"] == [[p.numel() for p in model.parameters()]]
        # By hand: the module's weights in bf16 (2 B each), DeepSpeed's fp32 master (4 B):
        # on the device, or in host memory under offload (the device then holds none).
        master = (report["measured"]["master"], report["measured_host"]["master"])
        assert report["measured"]["params"] == 2 * TINY_PSI
        assert master == ((0, 4 * TINY_PSI) if offload else (4 * TINY_PSI, 0))


def test_both_callbacks_put_themselves_first_for_the_loggers(tmp_path):
    from dpkit.integrations.transformers import MemoryReportCallback

    memory, phases = MemoryReportCallback(), StepPhasesCallback()
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", disable_tqdm=True
    )
    trainer = Trainer(model=_tiny_bert(), args=args, callbacks=[memory, phases])
    callbacks = trainer.callback_handler.callbacks
    # The Trainer puts its own (DefaultFlowCallback, the printer) before the user's; each
    # of dpkit's moves itself to the front when the Trainer is built, the last one first.
    assert callbacks[0] is phases and callbacks[1] is memory
    assert len(callbacks) == 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"report_every": -1}, "report_every=-1: must be 0 (end only) or positive"),
        (
            {"probe_steps": 0},
            "probe_steps=0: must be positive, or -1 (every step): gradients live only "
            "inside a step",
        ),
        (
            {"probe_steps": -2},
            "probe_steps=-2: must be positive, or -1 (every step): gradients live only "
            "inside a step",
        ),
    ],
)
def test_the_memory_callback_refuses_bad_arguments_in_one_line(kwargs, message):
    from dpkit.errors import UsageError
    from dpkit.integrations.transformers import MemoryReportCallback

    with pytest.raises(UsageError) as refused:
        MemoryReportCallback(**kwargs)
    assert str(refused.value) == message


def test_the_memory_callback_takes_its_arguments():
    from dpkit.integrations.transformers import MemoryReportCallback

    callback = MemoryReportCallback(
        report_every=0, probe_steps=-1, print_report=False, plan_check=False, model_name="m"
    )
    assert (callback.report_every, callback.probe_steps) == (0, -1)
    assert (callback.print_report, callback.plan_check, callback.model_name) == (
        False,
        False,
        "m",
    )
    default = MemoryReportCallback()
    assert (default.report_every, default.probe_steps, default.print_report) == (0, 3, True)
    assert default.plan_check is True and default.model_name is None


def _adagrad_run(out):
    """2 steps of the tiny BERT with the user's own Adagrad, probed at every step, the
    report printed without the plan check."""
    import contextlib
    import io

    from dpkit.integrations.transformers import MemoryReportCallback

    logs = _Logs()
    model = _tiny_bert()
    args = TrainingArguments(
        output_dir=str(out),
        use_cpu=True,
        max_steps=2,
        per_device_train_batch_size=4,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=_token_examples(8),
        optimizers=(torch.optim.Adagrad(model.parameters(), lr=0.01), None),
        callbacks=[logs, MemoryReportCallback(probe_steps=-1, plan_check=False)],
    )
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer.train()
    return {"out": out, "logs": logs.lines, "printed": printed.getvalue()}


def test_an_optimizer_without_figures_is_measured_and_noted(tmp_path):
    import json

    adagrad_run = _adagrad_run(tmp_path)

    report = json.loads((adagrad_run["out"] / "memory_report.json").read_text())
    # Adagrad keeps a running sum of squared gradients per parameter (4 bytes) and its
    # step, a float32 scalar per tensor; the prediction assumes AdamW's and says so.
    (row,) = report["ranks"]
    assert row["optimizer"] == 4 * TINY_PSI + 4 * TINY_TENSORS
    assert report["optimizer"] == "adamw"
    assert (
        "optimizer Adagrad: the prediction assumes AdamW's 8 bytes of state per parameter"
        in report["notes"]
    )
    assert report["step"] == 2
    assert row["probes_in_place"] is True  # probe_steps=-1: probed every step, never off
    model = report["model"]
    assert model["name"] == "BertForSequenceClassification"  # no name: the class's
    assert model["micro_batch_size"] == 4 and model["gradient_accumulation_steps"] == 1
    printed = adagrad_run["printed"]
    assert printed.count("dpkit memory report, step 2\n") == 1
    assert "dpkit memory report, step 1" not in printed  # report_every=0: the end only
    assert "dpkit plan --against" not in printed  # plan_check=False
    training = {step: line for step, line in adagrad_run["logs"] if "loss" in line}
    assert sorted(training) == [1, 2]
    assert "memory/params_mib" not in training[1]
    assert training[2]["memory/optimizer_mib"] == pytest.approx(row["optimizer"] / MIB)


def _one_step(model, optimizer) -> None:
    batch = _token_examples(2)
    inputs = torch.stack([example["input_ids"] for example in batch])
    labels = torch.tensor([example["labels"] for example in batch])
    model(input_ids=inputs, labels=labels).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def test_the_memory_callback_driven_by_hand_reports_once_and_notes_what_it_missed(tmp_path):
    """The callback's events called by the test, not by a Trainer: it cannot find the
    Trainer (so not DDP's buckets: a note says so); training stopped at step 3 of 5 (a
    resumed run's first step here) is reported when training ends, its timeline under the
    run's step; the scalars go out with one log line only."""
    import json

    from transformers import TrainerControl, TrainerState

    from dpkit.integrations.transformers import MemoryReportCallback

    model = _tiny_bert()
    optimizer = torch.optim.AdamW(model.parameters())
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=2, report_to="none"
    )
    state, control = TrainerState(max_steps=5), TrainerControl()
    callback = MemoryReportCallback(print_report=False)
    callback.on_train_begin(args, state, control, model=model, optimizer=optimizer)
    # A second train() on the same callback starts a new tracker.
    first_tracker = callback.tracker
    callback.on_train_begin(args, state, control, model=model, optimizer=optimizer)
    assert callback.tracker is not first_tracker
    _one_step(model, optimizer)
    state.global_step = 3  # a resumed run: this process's first step is the run's third
    callback.on_step_end(args, state, control)
    assert not (tmp_path / "memory_report.json").exists()  # not due: report_every=0
    assert control.should_log is False
    callback.on_train_end(args, state, control)  # stopped at step 3 of 5
    report = json.loads((tmp_path / "memory_report.json").read_text())
    assert report["step"] == 3
    assert report["ranks"][0]["timeline"]["step"] == 3  # the run's count, not the process's
    assert report["ranks"][0]["params"] == 4 * TINY_PSI
    assert (
        "the Trainer was not found from the callback: DDP's reducer buckets are not counted"
        in report["notes"]
    )
    logs = {"loss": 0.5}
    callback.on_log(args, state, control, logs=None)  # nothing to add to: kept for later
    callback.on_log(args, state, control, logs=logs)
    assert logs["memory/params_mib"] == pytest.approx(4 * TINY_PSI / MIB)
    later = {"loss": 0.4}
    callback.on_log(args, state, control, logs=later)
    assert later == {"loss": 0.4}  # sent once
    # Where the plan cannot be made, the printed check says why in one line.
    callback.report_path = tmp_path / "elsewhere" / "memory_report.json"
    assert callback._plan_text() == (
        "dpkit plan --against: not available for this run (--against="
        f"{str(tmp_path / 'elsewhere')!r}: no such run folder)"
    )


def test_the_memory_callback_before_training_and_at_every_step(tmp_path):
    """Events before train() do nothing (and hand the control back); report_every=1
    reports at every step."""
    import json
    from types import SimpleNamespace

    from transformers import TrainerControl, TrainerState

    from dpkit.integrations.transformers import MemoryReportCallback

    state, control = TrainerState(max_steps=5, global_step=1), TrainerControl()
    idle = MemoryReportCallback()
    idle.on_init_end(SimpleNamespace(deepspeed=None), state, control)  # no Trainer above
    assert idle.on_step_end(None, state, control) is control
    idle.on_train_end(None, state, control)
    assert control.should_log is False
    model = _tiny_bert()
    optimizer = torch.optim.AdamW(model.parameters())
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=2, report_to="none"
    )
    callback = MemoryReportCallback(report_every=1, print_report=False)
    callback.on_train_begin(args, state, control, model=model, optimizer=optimizer)
    _one_step(model, optimizer)
    callback.on_step_end(args, state, control)
    assert json.loads((tmp_path / "memory_report.json").read_text())["step"] == 1
    assert control.should_log is True


def test_the_model_record_names_the_model_by_its_checkpoint_name():
    from dpkit.integrations.transformers import model_record

    model = _tiny_bert()
    model.config._name_or_path = "org/tiny-bert"
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    record = model_record(model, optimizer, micro_batch_size=6, gradient_accumulation_steps=3)
    assert record["name"] == "org/tiny-bert"
    assert record["class"] == "BertForSequenceClassification"
    assert (record["micro_batch_size"], record["gradient_accumulation_steps"]) == (6, 3)
    assert record["param_groups"] == [[p.numel() for p in model.parameters()]]  # one group
    assert model_record(model, optimizer, 6, name="given")["name"] == "given"
    assert model_record(model, optimizer, 6)["gradient_accumulation_steps"] == 1


def test_the_memory_callback_reports_the_last_step_once(tmp_path):
    """The last step's report asks for a log line; training's end does not report again."""
    import json

    from transformers import TrainerControl, TrainerState

    from dpkit.integrations.transformers import MemoryReportCallback

    model = _tiny_bert()
    optimizer = torch.optim.AdamW(model.parameters())
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=2, report_to="none"
    )
    state, control = TrainerState(max_steps=1), TrainerControl()
    callback = MemoryReportCallback(print_report=False)
    callback.on_train_begin(args, state, control, model=model, optimizer=optimizer)
    _one_step(model, optimizer)
    state.global_step = 1
    assert callback.on_step_end(args, state, control) is control
    assert control.should_log is True
    report_file = tmp_path / "memory_report.json"
    assert json.loads(report_file.read_text())["step"] == 1
    report_file.write_text(json.dumps({"marker": True}))  # a second report would replace it
    callback.on_train_end(args, state, control)
    assert json.loads(report_file.read_text()) == {"marker": True}
    callback.on_train_end(args, state, control)  # the tracker is stopped: nothing more


def test_a_recipe_run_is_planned_from_its_run_config_even_with_a_model_record(tmp_path):
    """Recipe runs now record the model too; their run_config.json still decides."""
    from dpkit.plan.check import check_run

    report = {
        "strategy": "ddp", "world_size": 2, "precision": "fp32", "optimizer": "adamw",
        "device": "cpu", "model": {"name": "a record the recipe branch never reads"},
        "ranks": [{"rank": r, "params": 1.0, "grads": 1.0, "optimizer": 1.0, "master": 0.0,
                   "model_state_total": 3.0} for r in range(2)],
    }  # fmt: skip
    (tmp_path / "memory_report.json").write_text(json.dumps(report))
    workload = {"LMWorkload": {"size": "tiny", "seq_len": 32, "micro_batch_size": 2}}
    (tmp_path / "run_config.json").write_text(json.dumps(workload))
    assert check_run(tmp_path).model == "train_lm --size tiny"
