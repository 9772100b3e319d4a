"""The learning rate of every optimizer step, against the linear schedule written out here, and what a resume does with the schedule (issue 53).

transformers' ``get_scheduler("linear")`` (transformers/optimization.py,
``_get_linear_schedule_with_warmup_lr_lambda``): after ``s`` scheduler steps the lr is
``peak * s / max(1, W)`` while ``s < W``, then ``peak * max(0, (T - s) / max(1, T - W))``,
for ``W`` warm-up steps of ``T``. torch's ``LambdaLR`` sets it at construction (``s = 0``)
and after each step, so optimizer step ``k`` (counted from 1) trains at ``s = k - 1``.
The recipe plans ``W = int(warmup_ratio * T)``.

Three launches, each once per module: a fresh run on 2 processes with gradient
accumulation 2 (steps 1-6), the same run extended from its last checkpoint with a
longer ``--max-steps`` (steps 7-9: before, step 7 trained at lr 0.0), and a resume from
its step-2 checkpoint with the same flags on 1 process (steps 3-6). The rest runs in
this process.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import get_scheduler

from dpkit.checkpoints import folder, resume
from dpkit.checkpoints.folder import LrPlan, TrainerState
from dpkit.errors import UsageError
from dpkit.train.finetune_config import TrainConfig
from tests.harness import Launch, accelerate_cmd, assert_refused, python_cmd, run


def linear_lr(peak: float, s: int, warmup: int, total: int) -> float:
    """The lr after ``s`` scheduler steps of transformers' linear schedule (above)."""
    if s < warmup:
        return peak * s / max(1, warmup)
    return peak * max(0.0, (total - s) / max(1, total - warmup))


def lr_of_step(peak: float, k: int, warmup: int, total: int) -> float:
    """The lr optimizer step ``k`` (from 1) trains at."""
    return linear_lr(peak, k - 1, warmup, total)


# ---- the launches ------------------------------------------------------------------------

PEAK = 1e-4
# 64 examples / micro-batch 4 / 2 processes = 8 micro-batches per process and epoch, 4
# optimizer steps at accumulation 2 (global batch 16): 6 steps cross an epoch boundary.
RUN = [
    "--max-train-samples", "64",
    "--max-eval-samples", "16",
    "--max-seq-length", "32",
    "--learning-rate", "1e-4",
    "--warmup-ratio", "0.5",
    "--logging-steps", "1",
    "--save-total-limit", "0",
    "--no-save-model",
]  # fmt: skip
TWO_PROCESSES = ["--micro-batch-size", "4", "--gradient-accumulation-steps", "2"]
ONE_PROCESS = ["--micro-batch-size", "8", "--gradient-accumulation-steps", "2"]  # global 16 too
DDP_YAML = ["--config_file", "ds_configs/accelerate/ddp.yaml", "--num_processes", "2"]
# The fresh run: T = 6, W = int(0.5 * 6) = 3; checkpoints at steps 2, 4 and 6.
FRESH_PLAN = {"scheduler": "linear", "peak_lr": 1e-4, "warmup_steps": 3, "total_steps": 6}
# Extended to 9 steps: W = int(0.5 * 9) = 4.
EXTENDED_PLAN = {"scheduler": "linear", "peak_lr": 1e-4, "warmup_steps": 4, "total_steps": 9}


def _two_process_run(out: Path, *args: str) -> Launch:
    cmd = accelerate_cmd(DDP_YAML, *RUN, *TWO_PROCESSES, *args, "--output-dir", str(out))
    return run(cmd, out).check()


@pytest.fixture(scope="module")
def fresh(module_tmp) -> Launch:
    return _two_process_run(module_tmp / "fresh", "--max-steps", "6", "--save-steps", "2")


@pytest.fixture(scope="module")
def extended(fresh, module_tmp) -> Launch:
    """The finished 6-step run resumed from its last checkpoint with ``--max-steps 9``."""
    last = fresh.output_dir / "checkpoints" / "step-000006"
    return _two_process_run(module_tmp / "extended", "--max-steps", "9", "--resume", str(last))


@pytest.fixture(scope="module")
def resumed(fresh, module_tmp) -> Launch:
    """The 6-step run resumed from step 2 (inside the warm-up) with the same flags, on 1
    process with the same global batch."""
    out = module_tmp / "resumed"
    step2 = fresh.output_dir / "checkpoints" / "step-000002"
    cmd = python_cmd(
        *RUN, *ONE_PROCESS, "--strategy", "ddp", "--max-steps", "6", "--no-save-checkpoints",
        "--resume", str(step2), "--output-dir", str(out),
    )  # fmt: skip
    return run(cmd, out).check()


def _lrs(launch: Launch) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in launch.train_log}


def _trainer_state(launch: Launch, step: int) -> dict:
    path = launch.output_dir / "checkpoints" / f"step-{step:06d}" / "trainer_state.json"
    return json.loads(path.read_text())


def _resume_lines(launch: Launch) -> list[str]:
    return [line for line in launch.output.splitlines() if "resuming from step" in line]


@pytest.mark.multiprocess
def test_every_step_of_a_fresh_run_follows_the_linear_schedule(fresh):
    lrs = _lrs(fresh)
    assert list(lrs) == [1, 2, 3, 4, 5, 6]
    expected = [lr_of_step(PEAK, k, warmup=3, total=6) for k in range(1, 7)]
    assert list(lrs.values()) == pytest.approx(expected, rel=1e-12, abs=1e-18)
    # The same, by hand: warm-up 0, 1/3, 2/3 of the peak; then (6 - s) / 3 for s = 3, 4, 5.
    by_hand = [0.0, PEAK / 3, 2 * PEAK / 3, PEAK, 2 * PEAK / 3, PEAK / 3]
    assert list(lrs.values()) == pytest.approx(by_hand, rel=1e-12, abs=1e-18)
    info = fresh.run_info
    assert (info["world_size"], info["gradient_accumulation_steps"]) == (2, 2)
    assert info["global_batch_size"] == 16
    assert info["lr_schedule"] == FRESH_PLAN  # a fresh run: no resume fields
    for step in (2, 4, 6):  # every checkpoint records the plan it followed
        assert _trainer_state(fresh, step)["lr_plan"] == FRESH_PLAN
    assert not _resume_lines(fresh)


@pytest.mark.multiprocess
def test_a_longer_max_steps_continues_the_schedule_planned_for_it(fresh, extended):
    lrs = _lrs(extended)
    assert list(lrs) == [7, 8, 9]
    # T = 9, W = 4: (9 - s) / 5 for s = 6, 7, 8.
    assert list(lrs.values()) == pytest.approx([0.6 * PEAK, 0.4 * PEAK, 0.2 * PEAK], rel=1e-12)
    expected = [lr_of_step(PEAK, k, warmup=4, total=9) for k in (7, 8, 9)]
    assert list(lrs.values()) == pytest.approx(expected, rel=1e-12)
    # Before: step 7 trained at the finished plan's lr after its last step, 0.0.
    assert lr_of_step(PEAK, 7, warmup=3, total=6) == 0.0
    assert min(lrs.values()) > 0
    losses = [r["loss"] for r in extended.train_log]
    assert all(loss == loss and loss > 0 for loss in losses)  # finite, trained
    (line,) = _resume_lines(extended)  # once, from the main process
    assert "resuming from step 6 (epoch 1, " in line
    assert (
        "lr schedule re-planned for 9 steps (linear, peak lr 0.0001, 4 warm-up of 9 steps;" in line
    )
    assert "the checkpoint's: linear, peak lr 0.0001, 3 warm-up of 6 steps)" in line
    assert "step 7 trains at lr 6e-05" in line
    assert "lr schedule carried over" not in line
    record = extended.run_info["lr_schedule"]
    assert record == {
        **EXTENDED_PLAN,
        "resumed_at_step": 6,
        "checkpoint_lr_schedule": FRESH_PLAN,
        "replanned": True,
    }
    assert _trainer_state(extended, 9)["lr_plan"] == EXTENDED_PLAN
    assert _trainer_state(extended, 9)["step"] == 9


@pytest.mark.multiprocess
def test_a_resume_with_the_same_flags_carries_the_schedule_over(fresh, resumed):
    lrs = _lrs(resumed)
    assert list(lrs) == [3, 4, 5, 6]
    expected = [lr_of_step(PEAK, k, warmup=3, total=6) for k in (3, 4, 5, 6)]
    assert list(lrs.values()) == pytest.approx(expected, rel=1e-12)
    assert list(lrs.values()) == pytest.approx([_lrs(fresh)[k] for k in (3, 4, 5, 6)], rel=1e-12)
    (line,) = _resume_lines(resumed)
    assert "as ddp on 1 process(es)" in line
    assert "lr schedule carried over (linear, peak lr 0.0001, 3 warm-up of 6 steps)" in line
    assert "step 3 trains at lr 6.667e-05" in line  # 2/3 of the peak, inside the warm-up
    assert resumed.run_info["lr_schedule"]["replanned"] is False


@pytest.mark.multiprocess
def test_the_recipe_refuses_another_schedule_before_any_process_group(fresh, tmp_path, warm_recipe):
    last = fresh.output_dir / "checkpoints" / "step-000006"
    out = tmp_path / "out"
    result = warm_recipe.run(
        *RUN, *ONE_PROCESS, "--max-steps", "9", "--lr-scheduler", "cosine",
        "--resume", str(last), "--output-dir", str(out),
    )  # fmt: skip
    assert_refused(
        result,
        f"--lr-scheduler=cosine: --resume={str(last)!r} trained with the 'linear' lr "
        "schedule; a resume continues its schedule: pass --lr-scheduler linear",
        out,
        exit_code=2,
    )


# ---- in this process ---------------------------------------------------------------------


def _optimizer(lr: float = PEAK) -> torch.optim.Optimizer:
    return torch.optim.AdamW(torch.nn.Linear(2, 1).parameters(), lr=lr)


@pytest.mark.parametrize(("warmup", "total"), [(0, 4), (1, 4), (3, 6), (4, 9), (5, 5)])
def test_the_formula_here_is_transformers_linear_schedule(warmup, total):
    optimizer = _optimizer()
    scheduler = get_scheduler(
        "linear", optimizer, num_warmup_steps=warmup, num_training_steps=total
    )
    seen = []
    for _ in range(total):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    expected = [lr_of_step(PEAK, k, warmup, total) for k in range(1, total + 1)]
    assert seen == pytest.approx(expected, rel=1e-12, abs=1e-18)


def _restored(saved_total: int, total: int, warmup: int, steps_done: int, saved_warmup: int = 0):
    """A scheduler planned for ``total`` steps, its state and the optimizer's lr restored
    from one planned for ``saved_total`` after ``steps_done`` steps, as a resume loads them
    (scheduler.pt, then the saved lrs)."""
    from accelerate.scheduler import AcceleratedScheduler

    optimizer = _optimizer()
    before = get_scheduler(
        "linear", optimizer, num_warmup_steps=saved_warmup, num_training_steps=saved_total
    )
    for _ in range(steps_done):
        optimizer.step()
        before.step()
    state, saved_lr = before.state_dict(), optimizer.param_groups[0]["lr"]
    optimizer = _optimizer()
    after = get_scheduler("linear", optimizer, num_warmup_steps=warmup, num_training_steps=total)
    wrapped = AcceleratedScheduler(after, optimizer, step_with_optimizer=False)
    wrapped.load_state_dict(state)
    optimizer.param_groups[0]["lr"] = saved_lr
    return wrapped, optimizer


def test_a_restored_scheduler_alone_trains_the_next_step_at_the_old_plans_lr():
    """Why continue_schedule exists: torch restores the step count and the last lr, not
    the lambdas' plan; the step after a finished 4-step linear plan trains at 0.0."""
    scheduler, optimizer = _restored(saved_total=4, total=5, warmup=0, steps_done=4)
    assert optimizer.param_groups[0]["lr"] == 0.0
    assert scheduler.get_last_lr() == [0.0]


def test_continue_schedule_follows_the_new_plan_from_the_checkpoints_step():
    scheduler, optimizer = _restored(saved_total=4, total=6, warmup=1, steps_done=4)
    next_lr = resume.continue_schedule(scheduler, 4)
    # Step 5 of a 6-step plan with 1 warm-up: (6 - 4) / 5 of the peak.
    assert next_lr == pytest.approx(0.4 * PEAK, rel=1e-12)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.4 * PEAK, rel=1e-12)
    assert scheduler.get_last_lr() == [pytest.approx(0.4 * PEAK, rel=1e-12)]
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(
        lr_of_step(PEAK, 6, warmup=1, total=6), rel=1e-12
    )


@pytest.mark.parametrize("steps_done", [1, 2, 3, 5])
def test_continue_schedule_with_the_same_plan_is_the_uninterrupted_run(steps_done):
    scheduler, optimizer = _restored(
        saved_total=6, total=6, warmup=3, steps_done=steps_done, saved_warmup=3
    )
    seen = [resume.continue_schedule(scheduler, steps_done)]
    for _ in range(steps_done + 1, 6):
        optimizer.step()
        scheduler.step()
        seen.append(optimizer.param_groups[0]["lr"])
    expected = [lr_of_step(PEAK, k, warmup=3, total=6) for k in range(steps_done + 1, 7)]
    assert seen == pytest.approx(expected, rel=1e-12)


def test_continue_schedule_leaves_another_kind_of_scheduler_as_restored():
    optimizer = _optimizer()
    step_lr = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    optimizer.param_groups[0]["lr"] = 3e-5
    assert resume.continue_schedule(step_lr, 4) is None
    assert optimizer.param_groups[0]["lr"] == 3e-5


# A checkpoint at step 4 of a 4-step linear plan without warm-up, written on 2 processes
# at global batch 16.
SAVED = LrPlan("linear", 5e-5, 0, 4)


def _state(lr_plan: LrPlan | None = SAVED, step: int = 4) -> TrainerState:
    return TrainerState(
        step=step, epoch=1, samples_in_epoch=0, global_batch_size=16, micro_batch_size=4,
        gradient_accumulation_steps=2, world_size=2, strategy="ddp", precision="fp32", seed=42,
        lr_plan=None if lr_plan is None else lr_plan.as_dict(),
    )  # fmt: skip


CKPT = Path("runs/a/checkpoints/step-000004")


def _check(tmp_path: Path, state: TrainerState | None = None, **flags) -> None:
    """``TrainConfig.check_resumed_schedule`` for a run of 64 examples on 2 processes
    (4 steps per epoch at micro-batch 4, accumulation 2), resuming ``state``."""
    settings = {"micro_batch_size": 4, "gradient_accumulation_steps": 2}
    settings |= {"learning_rate": 5e-5, "warmup_ratio": 0.0, **flags}
    cfg = TrainConfig(output_dir=str(tmp_path / "out"), **settings)
    schedule = cfg.schedule(64, 2)
    peak = cfg.learning_rate * (16 / 4 if cfg.scale_lr == "linear" else 1)
    cfg.check_resumed_schedule(resume.Resume(CKPT, state or _state()), schedule, peak)


@pytest.mark.parametrize(
    "flags",
    [
        {"max_steps": 5},  # the case: longer, re-planned
        {"max_steps": 400},
        {"max_steps": 4},  # nothing left to train: allowed (a requeued --resume auto)
        {"num_epochs": 3},  # 12 steps
        {"num_epochs": 1},  # 4 steps per epoch, all trained: allowed
        {"max_steps": 8, "warmup_ratio": 0.25},  # another warm-up: re-planned too
        {"max_steps": 3, "eval_only": True},  # nothing trains
    ],
    ids=["5-steps", "400-steps", "same-length", "3-epochs", "1-epoch", "warmup", "eval-only"],
)
def test_resume_accepts_another_length_or_warmup(tmp_path, flags):
    _check(tmp_path, **flags)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            {"max_steps": 3},
            f"--max-steps=3: plans 3 steps, but --resume={str(CKPT)!r} has already trained 4; "
            "ask for more than 4 steps to train on",
        ),
        (
            {"max_steps": 2, "num_epochs": 5},  # --max-steps wins over epochs, and is named
            "--max-steps=2: plans 2 steps",
        ),
        (
            {"max_steps": 6, "lr_scheduler": "cosine"},
            f"--lr-scheduler=cosine: --resume={str(CKPT)!r} trained with the 'linear' lr "
            f"schedule; a resume continues its schedule: pass --lr-scheduler linear, or start "
            f"a new run from its weights with --init-from {CKPT}",
        ),
        (
            {"max_steps": 6, "learning_rate": 1e-4},
            f"--learning-rate=0.0001: this run's lr schedule peaks at 0.0001, the one "
            f"--resume={str(CKPT)!r} trained with at 5e-05; a resume continues its schedule",
        ),
        (
            {"max_steps": 6, "scale_lr": "linear"},  # 5e-5 x 16 / 4
            "--learning-rate=5e-05 with --scale-lr=linear: this run's lr schedule peaks at 0.0002",
        ),
    ],
    ids=["fewer-steps", "max-steps-named", "scheduler", "lr", "scale-lr"],
)
def test_resume_refuses_what_cannot_continue_the_schedule(tmp_path, flags, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        _check(tmp_path, **flags)


def test_epochs_fewer_than_trained_are_named_with_their_steps(tmp_path):
    with pytest.raises(UsageError, match=re.escape("--num-epochs=1 (4 steps): plans 4 steps")):
        _check(tmp_path, _state(step=6), num_epochs=1)


def test_a_checkpoint_without_a_recorded_plan_is_checked_for_length_only(tmp_path):
    old = _state(lr_plan=None)
    _check(tmp_path, old, max_steps=6, lr_scheduler="cosine", learning_rate=1e-3)
    with pytest.raises(UsageError, match=r"--max-steps=3: plans 3 steps"):
        _check(tmp_path, old, max_steps=3)


def test_the_trainer_state_records_the_plan_and_reads_older_files():
    state = _state()
    written = json.loads(json.dumps(state.__dict__))
    assert written["lr_plan"] == {
        "scheduler": "linear", "peak_lr": 5e-5, "warmup_steps": 0, "total_steps": 4,
    }  # fmt: skip
    assert TrainerState(**written).planned == SAVED
    older = {k: v for k, v in written.items() if k != "lr_plan"}
    assert TrainerState(**older).planned is None


def _note(state: TrainerState, plan: LrPlan | None, next_lr: float | None) -> str:
    return resume.carry_over_note(state, strategy="ddp", world_size=2, plan=plan, next_lr=next_lr)


def test_the_resume_line_says_what_happens_to_the_schedule():
    longer = LrPlan("linear", 5e-5, 0, 6)
    # The run: 4 steps, resumed with --max-steps 6: step 5 at (6 - 4) / 6 of 5e-5.
    note = _note(_state(), longer, next_lr=5e-5 * 2 / 6)
    assert note.count("resuming from step 4") == 1 and "\n" not in note
    assert "weights, optimizer moments and data position carried over" in note
    assert (
        "lr schedule re-planned for 6 steps (linear, peak lr 5e-05, 0 warm-up of 6 steps; "
        "the checkpoint's: linear, peak lr 5e-05, 0 warm-up of 4 steps); step 5 trains at "
        "lr 1.667e-05, as in a run planned for 6 steps from the start"
    ) in note
    same = _note(_state(step=2), SAVED, next_lr=5e-5 * 2 / 4)
    assert (
        "lr schedule carried over (linear, peak lr 5e-05, 0 warm-up of 4 steps); step 3 trains at lr 2.5e-05"
        in same
    )
    done = _note(_state(), SAVED, next_lr=0.0)
    assert "nothing left to train" in done and "trains at" not in done
    older = _note(_state(lr_plan=None), longer, next_lr=5e-5 * 2 / 6)
    assert "the checkpoint does not record its own" in older
    untouched = _note(_state(), None, next_lr=None)
    assert "not re-planned" in untouched and "lr schedule carried over" not in untouched


def test_run_info_records_the_plan_and_the_resume():
    longer = LrPlan("linear", 5e-5, 0, 6)
    assert resume.schedule_record(None, None) is None
    assert resume.schedule_record(longer, None) == longer.as_dict()
    record = resume.schedule_record(longer, resume.Resume(CKPT, _state()))
    assert record == {
        "scheduler": "linear", "peak_lr": 5e-5, "warmup_steps": 0, "total_steps": 6,
        "resumed_at_step": 4, "checkpoint_lr_schedule": SAVED.as_dict(), "replanned": True,
    }  # fmt: skip
    older = resume.schedule_record(longer, resume.Resume(CKPT, _state(lr_plan=None)))
    assert older["replanned"] is None and older["checkpoint_lr_schedule"] is None


# ---- --resume RUN_DIR (issue 53 item 6) --------------------------------------------------


def _run_dir(tmp_path: Path, *steps: int) -> Path:
    run_dir = tmp_path / "run"
    for step in steps:
        (run_dir / "checkpoints" / f"step-{step:06d}").mkdir(parents=True)
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    return run_dir


def test_resume_of_a_run_folder_names_its_latest_checkpoint_and_latest(tmp_path):
    run_dir = _run_dir(tmp_path, 3, 6)
    expected = (
        f"--resume={str(run_dir)!r}: a run folder, not a checkpoint; pass one of its "
        f"checkpoints: --resume {run_dir}/checkpoints/step-000006 (its latest), or "
        f"--resume latest --output-dir {run_dir} to continue that run"
    )
    with pytest.raises(UsageError) as err:
        resume.find_resume(str(run_dir), str(tmp_path / "elsewhere"))
    assert str(err.value) == expected
    # Its checkpoints/ folder: the same answer.
    with pytest.raises(UsageError, match=re.escape(f"--resume {run_dir}/checkpoints/step-000006")):
        resume.find_resume(str(run_dir / "checkpoints"), str(tmp_path / "elsewhere"))


def test_a_run_folder_without_checkpoints_says_so(tmp_path):
    run_dir = _run_dir(tmp_path)
    with pytest.raises(UsageError) as err:
        resume.find_resume(str(run_dir), str(run_dir))
    assert str(err.value) == (
        f"--resume={str(run_dir)!r}: a run folder, not a checkpoint, and "
        f"{str(run_dir / 'checkpoints')!r} holds no complete step-* checkpoint"
    )


def test_init_from_a_run_folder_names_its_checkpoint_only(tmp_path):
    run_dir = _run_dir(tmp_path, 2)
    with pytest.raises(UsageError) as err:
        folder.verify_checkpoint(run_dir, "--init-from")
    assert str(err.value).endswith(f"--init-from {run_dir}/checkpoints/step-000002")
    assert "--resume" not in str(err.value)
