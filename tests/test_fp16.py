"""fp16's loss scaling on CPU: the stop at the minimum scale, skipped steps, the scale in checkpoints.

fp16 training needs CUDA (dpkit refuses it on CPU, and DeepSpeed's CPU accelerator has no
fp16 here), so no fp16 run happens in these tests. What they run instead is the real
code of each piece on CPU:

* DeepSpeed's own ``DynamicLossScaler`` (the object its ZeRO optimizer builds for
  fp16), constructed directly: its real exception at the minimum scale, and its state;
* accelerate's real DDP fp16 path (``Accelerator.backward`` through the scaler,
  ``AcceleratedOptimizer.step`` through ``GradScaler.step``, ``optimizer_step_was_skipped``)
  with a CPU ``torch.amp.GradScaler`` in the slot accelerate fills with a CUDA one on a
  GPU (``Accelerator.__init__``, ``get_grad_scaler``). The overflow is a real inf in the
  gradients.

In process, no process group; each Accelerator's shared state is cleared afterwards.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from dpkit.core.loss_scale import TorchLossScaler
from dpkit.engines import STRATEGIES, engine_of
from dpkit.engines.deepspeed.checkpoint import DeepSpeedLossScaler
from dpkit.errors import training_failure

DDP, ZERO2 = STRATEGIES["ddp"], STRATEGIES["zero2"]


def _deepspeed_scaler(init_scale: float, min_scale: float, *, scale_window: int = 1000,
                      delayed_shift: int = 1):  # fmt: skip
    """DeepSpeed's DynamicLossScaler, as its ZeRO optimizer builds it for fp16."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    return DynamicLossScaler(
        init_scale=init_scale,
        scale_window=scale_window,
        min_scale=min_scale,
        delayed_shift=delayed_shift,
        consecutive_hysteresis=False,
        dtype=torch.half,
    )


@pytest.fixture
def rank0(monkeypatch):
    """DeepSpeed's scaler asks deepspeed.comm for the rank to log an overflow; without a
    process group that asserts. Rank 0, as in a one-process job."""
    from deepspeed.runtime.fp16 import loss_scaler

    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda group=None: 0)


def _min_scale_error(min_scale: float) -> Exception:
    """DeepSpeed's own exception: an overflow at the minimum scale, hysteresis spent."""
    scaler = _deepspeed_scaler(init_scale=min_scale, min_scale=min_scale)
    with pytest.raises(Exception) as caught:  # noqa: B017 (DeepSpeed raises a bare Exception)
        scaler.update_scale(True)
    assert type(caught.value) is Exception
    return caught.value


# ---------------------------------------------------------------------------
# (a) the stop at the minimum loss scale
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(("min_scale", "shown"), [(1, "1"), (0.25, "0.25")])
def test_min_loss_scale_stop_is_one_line_naming_the_scale(min_scale, shown):
    line = training_failure(_min_scale_error(min_scale))
    assert line is not None and "\n" not in line
    assert f"fp16.min_loss_scale={shown})" in line
    for remedy in ("--mixed-precision bf16", "--learning-rate", "fp16.initial_scale_power"):
        assert remedy in line


def test_only_deepspeeds_min_scale_exception_is_read():
    deepspeed_error = _min_scale_error(1)
    message = str(deepspeed_error)

    class Subclass(Exception):
        pass

    for other in (
        Exception("something else went wrong"),
        RuntimeError(message),  # the text alone is not enough: the type must be Exception
        Subclass(message),
        ValueError(message),
    ):
        assert training_failure(other) is None, repr(other)
    # Raised without a traceback (re-created by a caller): still read, the scale unknown.
    assert "fp16.min_loss_scale=?)" in training_failure(Exception(message))


def test_run_and_exit_ends_the_min_scale_stop_with_one_line_and_exit_3(monkeypatch, capsys):
    from dpkit.train import guards

    class Exited(BaseException):
        pass

    def exit_process(code: int):
        raise Exited(code)

    monkeypatch.setattr(guards, "exit_process", exit_process)
    monkeypatch.setenv("RANK", "0")
    scaler = _deepspeed_scaler(init_scale=1, min_scale=1)

    with pytest.raises(Exited) as exited:
        guards.run_and_exit(lambda: scaler.update_scale(True))
    assert exited.value.args == (3,)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "fp16.min_loss_scale=1)" in lines[0], lines


# ---------------------------------------------------------------------------
# DDP's path: accelerate with a GradScaler, on CPU
# ---------------------------------------------------------------------------


@pytest.fixture
def accelerator():
    """A one-process CPU Accelerator; accelerate's shared state cleared afterwards."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _with_grad_scaler(accelerator, init_scale: float, growth_interval: int):
    """Put a CPU GradScaler where accelerate puts its CUDA one for fp16 on a GPU; prepare
    objects afterwards so the optimizer steps through it."""
    accelerator.scaler = torch.amp.GradScaler(
        "cpu", init_scale=init_scale, growth_interval=growth_interval
    )
    return accelerator.scaler


def _run(accelerator, output, position, info=None, strategy=DDP) -> SimpleNamespace:
    """What TrainingLog and Checkpointer read of a prepared :class:`dpkit.Run`, from the
    pieces the test builds itself: its Accelerator (with the CPU GradScaler), its folder,
    where training stands (``position``), what runs (``info``) and the strategy's engine."""
    return SimpleNamespace(
        accelerator=accelerator,
        output=output,
        position=position,
        info=info,
        strategy=strategy,
        engine=engine_of(strategy),
        memory=None,
    )


def _train(accelerator, model, optimizer, overflows: list[bool]) -> Iterator[None]:
    """One optimizer step per entry, yielding after each; True puts an inf in every
    gradient (what an fp16 overflow is), so the GradScaler skips the update."""
    for overflow in overflows:
        loss = model(torch.ones(2, 4)).sum() * (float("inf") if overflow else 1.0)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        yield


def test_skipped_steps_are_logged_recorded_and_counted(accelerator, tmp_path, caplog):
    from dpkit.checkpoints.checkpointer import Position
    from dpkit.train.output import RunOutput, read_jsonl
    from dpkit.train.progress import TrainingLog

    _with_grad_scaler(accelerator, init_scale=1024.0, growth_interval=3)
    model = torch.nn.Linear(4, 1)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    output = RunOutput(str(tmp_path), is_main_process=True)
    output.start({})
    position = Position(step=10, skipped_steps=1)  # resumed at step 10, one skip before
    log = TrainingLog(_run(accelerator, output, position), total_steps=16, logging_steps=100)
    overflows = [False, False, True, False, True, False]
    with caplog.at_level(logging.INFO, logger="dpkit"):
        for step, _ in enumerate(_train(accelerator, model, optimizer, overflows), start=11):
            log.step({"step": step, "loss": 0.5})
        log.close()

    records = read_jsonl(tmp_path / "train_log.jsonl")
    assert [r["step"] for r in records] == list(range(11, 17))
    assert [r.get("skipped", False) for r in records] == overflows
    assert [r["skipped_steps"] for r in records] == [1, 1, 2, 2, 3, 3]
    # GradScaler's rules, by hand: two clean steps (tracker 2), overflow halves 1024 and
    # resets the tracker, one clean step, overflow halves again. The record holds the
    # scale the step ran at.
    assert [r["loss_scale"] for r in records] == [1024, 1024, 1024, 512, 512, 256]
    assert position.skipped_steps == log.skipped_steps == 3
    skipped_lines = [r.getMessage() for r in caplog.records if "update skipped" in r.getMessage()]
    assert skipped_lines == [
        "step 13/16: update skipped (gradients overflowed at loss scale 1024, now 512); "
        "2 skipped so far",
        "step 15/16: update skipped (gradients overflowed at loss scale 512, now 256); "
        "3 skipped so far",
    ]
    summary = json.loads((tmp_path / "train_summary.json").read_text())
    assert summary == {"last_step": 16, "skipped_steps": 3, "loss_scale": 256.0}


def test_no_loss_scaling_adds_nothing(accelerator, tmp_path, caplog):
    from dpkit.checkpoints.checkpointer import Position
    from dpkit.train.output import RunOutput, read_jsonl
    from dpkit.train.progress import TrainingLog

    model = torch.nn.Linear(4, 1)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    output = RunOutput(str(tmp_path), is_main_process=True)
    output.start({})
    log = TrainingLog(_run(accelerator, output, Position()), total_steps=2, logging_steps=100)
    with caplog.at_level(logging.INFO, logger="dpkit"):
        for step, _ in enumerate(_train(accelerator, model, optimizer, [False, False]), 1):
            log.step({"step": step, "loss": 0.5})
        log.close()
    # The record as given, with the step figures every record gets; no loss-scale fields.
    timing = ["samples_per_rank", "step_cpu_s", "step_time_s", "tokens_per_rank"]
    expected = sorted(["loss", "step", *timing])
    assert [sorted(r) for r in read_jsonl(tmp_path / "train_log.jsonl")] == [expected] * 2
    assert not [r for r in caplog.records if "skipped" in r.getMessage()]
    summary = json.loads((tmp_path / "train_summary.json").read_text())
    assert summary == {"last_step": 2, "skipped_steps": 0, "loss_scale": None}


def test_grad_scaler_and_skipped_count_survive_a_checkpoint(accelerator, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from dpkit.checkpoints.checkpointer import Checkpointer, Position
    from dpkit.checkpoints.resume import find_resume as resolve_resume
    from dpkit.train.run import RunInfo

    info = RunInfo(
        strategy="ddp", strategy_source="test", distributed_type="NO", world_size=1,
        backend=None, device="cpu", wrapper="GPT2LMHeadModel", zero_stage=0,
        precision="fp16", micro_batch_size=2, gradient_accumulation_steps=1,
        global_batch_size=2, learning_rate=0.1, num_params=0,
    )  # fmt: skip
    config = GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=2)
    torch.manual_seed(0)
    scaler = _with_grad_scaler(accelerator, init_scale=1024.0, growth_interval=3)
    model = GPT2LMHeadModel(config)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    tokens = torch.arange(8).reshape(2, 4)
    for overflow in (False, True, False, False):
        loss = model(tokens, labels=tokens).loss * (float("inf") if overflow else 1.0)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    saved = scaler.state_dict()
    # By hand: the overflow halved 1024 and reset the tracker; two clean steps since.
    assert (saved["scale"], saved["_growth_tracker"]) == (512.0, 2)
    out = tmp_path / "run"
    saved_at = Position(step=4, skipped_steps=1)
    Checkpointer(_run(accelerator, None, saved_at, info), out, seed=0).save(
        model, optimizer, None, saved_at
    )

    # A new run: a fresh scaler at its initial state, the model from the checkpoint.
    fresh = _with_grad_scaler(accelerator, init_scale=1024.0, growth_interval=3)
    assert (fresh.get_scale(), fresh.state_dict()["_growth_tracker"]) == (1024.0, 0)  # control
    resume = resolve_resume("latest", str(out))
    model = GPT2LMHeadModel(config)  # the restore below sets the checkpoint's weights
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    checkpoints = Checkpointer(_run(accelerator, None, None, info), out, seed=0)
    position = checkpoints.restore(model, optimizer, None, resume)
    assert position.skipped_steps == 1
    restored = fresh.state_dict()
    assert (restored["scale"], restored["_growth_tracker"]) == (512.0, 2)
    # The run's own settings are kept (not the checkpoint's): only the state moves.
    assert restored["growth_interval"] == 3
    # And it counts on from there: one clean step reaches the interval of 3 and doubles
    # the scale (an unrestored scaler would stand at 1024 with a tracker of 1).
    accelerator.backward(model(tokens, labels=tokens).loss)
    optimizer.step()
    assert (fresh.get_scale(), fresh.state_dict()["_growth_tracker"]) == (1024.0, 0)


# ---------------------------------------------------------------------------
# DeepSpeed's scaler: its state through dpkit's LossScaler
# ---------------------------------------------------------------------------


def test_deepspeed_scaler_state_round_trip_continues_exactly(rank0):
    # hysteresis 2: the first overflow after a clean stretch only spends hysteresis.
    kwargs = {"init_scale": 2.0**16, "min_scale": 1, "scale_window": 3, "delayed_shift": 2}
    original, restored, fresh = (_deepspeed_scaler(**kwargs) for _ in range(3))
    for overflow in (True, True, True, False, False, True):
        original.update_scale(overflow)
    state = json.loads(
        json.dumps(DeepSpeedLossScaler(original).state_dict())
    )  # as the file holds it
    assert state["kind"] == "deepspeed"
    DeepSpeedLossScaler(restored).load_state_dict(state)
    for name in ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis"):
        assert getattr(restored, name) == getattr(original, name), name
    assert (
        DeepSpeedLossScaler(restored).growth_tracker == DeepSpeedLossScaler(original).growth_tracker
    )

    def trajectory(scaler) -> list[float]:
        scales = []
        for overflow in (False, False, False, False, True, False, True, True):
            scaler.update_scale(overflow)
            scales.append(scaler.cur_scale)
        return scales

    expected = trajectory(original)
    assert trajectory(restored) == expected
    assert trajectory(fresh) != expected  # control: an unrestored scaler goes elsewhere


def test_deepspeed_scale_is_kept_at_or_above_the_runs_minimum():
    saved = DeepSpeedLossScaler(_deepspeed_scaler(init_scale=0.5, min_scale=0.25)).state_dict()
    stricter = _deepspeed_scaler(init_scale=2.0**16, min_scale=1)
    DeepSpeedLossScaler(stricter).load_state_dict(saved)
    assert stricter.cur_scale == 1


def test_scale_carries_across_libraries_but_not_the_growth_count(rank0):
    deepspeed_scaler = _deepspeed_scaler(init_scale=2.0**10, min_scale=1)
    deepspeed_scaler.update_scale(True)  # 512
    for _ in range(5):
        deepspeed_scaler.update_scale(False)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    note = TorchLossScaler(grad_scaler).load_state_dict(
        DeepSpeedLossScaler(deepspeed_scaler).state_dict()
    )
    assert grad_scaler.get_scale() == 512.0
    assert grad_scaler.state_dict()["_growth_tracker"] == 0
    assert "written by deepspeed" in note


def test_of_finds_deepspeeds_dynamic_scaler_and_ignores_its_static_one():
    from deepspeed.runtime.fp16.loss_scaler import LossScaler as StaticLossScaler

    def accelerator_with(loss_scaler):
        # accelerate's attribute path: Accelerator.deepspeed_engine_wrapped (a
        # DeepSpeedEngineWrapper).engine (DeepSpeedEngine).optimizer (the ZeRO optimizer).
        zero = SimpleNamespace(loss_scaler=loss_scaler)
        wrapped = SimpleNamespace(engine=SimpleNamespace(optimizer=zero))
        return SimpleNamespace(scaler=None, deepspeed_engine_wrapped=wrapped)

    dynamic = _deepspeed_scaler(init_scale=2.0**16, min_scale=1)
    # The DeepSpeed engine finds the run's scaler (TrainingLog and checkpoints ask it).
    found = engine_of(ZERO2).checkpoints.loss_scaler(accelerator_with(dynamic))
    assert found is not None and found.kind == "deepspeed" and found.scale == 2.0**16
    # bf16 and fp32 ZeRO keep a static scaler of 1.0: nothing to log or save.
    assert (
        engine_of(ZERO2).checkpoints.loss_scaler(accelerator_with(StaticLossScaler(scale=1)))
        is None
    )


# ---------------------------------------------------------------------------
# A real ZeRO-2 engine (one process, in a subprocess: it needs a process group)
# ---------------------------------------------------------------------------

# DeepSpeed builds no fp16 engine on this CPU, so the run is fp32 ZeRO-2 with the scaler
# DeepSpeed's fp16 path builds (CreateLossScaler: a DynamicLossScaler) put in the ZeRO
# optimizer after prepare. The optimizer then scales the loss, finds the inf gradients,
# skips the update and backs off the scale as under fp16; only the gradients' dtype differs.
_ZERO2_WITH_FP16_SCALER = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path
    import torch
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.utils import InitProcessGroupKwargs
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from transformers import GPT2Config, GPT2LMHeadModel
    from dpkit.errors import training_failure
    from dpkit.engines import STRATEGIES, engine_of
    from types import SimpleNamespace
    from dpkit.checkpoints.resume import find_resume as resolve_resume
    from dpkit.checkpoints.checkpointer import Checkpointer, Position
    from dpkit.engines.deepspeed.config import skip_deepspeed_cpu_shm_op
    from dpkit.train.progress import TrainingLog
    from dpkit.train.run import RunInfo
    from dpkit.train.logs import log_once_per_job
    from dpkit.train.output import RunOutput, read_jsonl

    FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
    ZERO2 = STRATEGIES["zero2"]
    out = Path(sys.argv[1])
    skip_deepspeed_cpu_shm_op()
    plugin = DeepSpeedPlugin(hf_ds_config={
        "train_micro_batch_size_per_gpu": 2, "train_batch_size": 2,
        "gradient_accumulation_steps": 1, "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 4096,
                              "allgather_bucket_size": 4096},
    })
    acc = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")],
                      deepspeed_plugin=plugin)
    log_once_per_job(True)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=2))
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    engine = acc.deepspeed_engine_wrapped.engine
    report = {"static_found": engine_of(ZERO2).checkpoints.loss_scaler(acc) is not None}
    engine.optimizer.loss_scaler = DynamicLossScaler(
        init_scale=1024, scale_window=1000, min_scale=1, delayed_shift=1,
        consecutive_hysteresis=False, dtype=torch.half)
    output = RunOutput(str(out), True)
    output.start({})
    position = Position()
    info = RunInfo(strategy="zero2", strategy_source="test", distributed_type="DEEPSPEED",
                   world_size=1, backend="gloo", device="cpu", wrapper="DeepSpeedEngine",
                   zero_stage=2, precision="fp16", micro_batch_size=2,
                   gradient_accumulation_steps=1, global_batch_size=2, learning_rate=1e-3,
                   num_params=0)
    # What TrainingLog and Checkpointer read of a prepared dpkit.Run, from these pieces.
    run = SimpleNamespace(accelerator=acc, output=output, position=position, info=info,
                          strategy=ZERO2, engine=engine_of(ZERO2), memory=None)
    log = TrainingLog(run, total_steps=4, logging_steps=100)
    tokens = torch.arange(8).reshape(2, 4)
    for step, overflow in enumerate([False, True, False, True], 1):
        loss = model(tokens, labels=tokens).loss * (float("inf") if overflow else 1.0)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        position.step = step
        log.step({"step": step, "loss": 0.5})
    log.close()
    report["engine_skipped_steps"] = engine.skipped_steps
    checkpoints = Checkpointer(run, out, seed=0)
    report["saved"] = {k: getattr(engine.optimizer.loss_scaler, k) for k in FIELDS}
    checkpoints.save(model, opt, None, position)
    report["files"] = sorted(p.name for p in checkpoints.last.iterdir())
    # As a fresh run's scaler would be; then the checkpoint restores it in place.
    engine.optimizer.loss_scaler.__init__(
        init_scale=2**16, scale_window=1000, min_scale=1, delayed_shift=1,
        consecutive_hysteresis=False, dtype=torch.half)
    report["fresh"] = {k: getattr(engine.optimizer.loss_scaler, k) for k in FIELDS}
    restored_at = checkpoints.restore(model, opt, None, resolve_resume("latest", str(out)))
    report["restored"] = {k: getattr(engine.optimizer.loss_scaler, k) for k in FIELDS}
    report["restored_skipped_steps"] = restored_at.skipped_steps
    # Gradients that overflow at the minimum scale: DeepSpeed's stop, via accelerate.
    engine.optimizer.loss_scaler.cur_scale = 1
    try:
        acc.backward(model(tokens, labels=tokens).loss * float("inf"))
    except Exception as err:
        report["stop"] = training_failure(err)
    print("REPORT" + json.dumps(report), flush=True)
    os._exit(0)  # no interpreter teardown of the process group (dpkit.train.guards.exit_process)
    """
)


def test_zero2_engine_skips_counts_checkpoints_and_stops_at_min_scale(tmp_path):
    from dpkit.train.output import read_jsonl
    from tests.harness import REPO, free_port, launch_env

    script = tmp_path / "zero2_fp16_scaler.py"
    script.write_text(_ZERO2_WITH_FP16_SCALER)
    out = tmp_path / "run"
    env = launch_env(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
        PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    )  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(script), str(out)],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("REPORT"))[6:])

    assert report["static_found"] is False  # fp32 ZeRO's own scaler is static: not found
    records = read_jsonl(out / "train_log.jsonl")
    assert [r.get("skipped", False) for r in records] == [False, True, False, True]
    assert [r["skipped_steps"] for r in records] == [0, 1, 1, 2]
    assert [r["loss_scale"] for r in records] == [1024, 1024, 512, 512]
    assert report["engine_skipped_steps"] == 2  # DeepSpeed's own count agrees
    skipped_lines = [x for x in proc.stderr.splitlines() if "update skipped" in x]
    assert len(skipped_lines) == 2 and "at loss scale 512, now 256" in skipped_lines[1]
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary == {"last_step": 4, "skipped_steps": 2, "loss_scale": 256.0}

    assert "loss_scale.json" in report["files"]
    assert report["saved"] == {
        "cur_scale": 256.0, "cur_iter": 4, "last_overflow_iter": 3, "cur_hysteresis": 1
    }  # fmt: skip
    assert report["fresh"] != report["saved"]  # control: the restore had work to do
    assert report["restored"] == report["saved"]
    assert report["restored_skipped_steps"] == 2
    assert "fp16.min_loss_scale=1)" in report["stop"]
