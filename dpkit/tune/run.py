"""``dpkit tune`` from start to report: :func:`run_tune`.

Resolve and check everything (:func:`dpkit.tune.config.tune_settings`), predict each
candidate's memory and prune what cannot fit, then measure the rest one launch at a
time (:mod:`dpkit.tune.trials`), reusing an earlier tune's trials; decide
(:mod:`dpkit.tune.decide`) and write the report and the winner's files
(:mod:`dpkit.tune.report`). SIGINT or SIGTERM stops after the running trial (a second
one stops that trial too) and the report of what was measured is still written.
"""

from __future__ import annotations

import shlex
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from dpkit.bench import launch
from dpkit.bench.results import TARGET_PLAN_ERROR_PCT
from dpkit.engines import engine_of
from dpkit.errors import UsageError
from dpkit.tune import report, space
from dpkit.tune.config import TuneConfig, TuneSettings, tune_settings
from dpkit.tune.decide import decide, verdicts
from dpkit.tune.trials import FAILED, NOT_RUN, OK, PRUNED, Trial, load_previous, run_trial

MIB = 2**20
# dpkit plan's bound on its own error against a measurement: the step peak it prunes by is
# within 1.3% on the first steps docs/peak.md measured, a later step within 6%
# (FSDP2 shard-grad-op, docs/peak.md); a candidate within this of the budget is measured.
PLAN_MARGIN = TARGET_PLAN_ERROR_PCT / 100


class _Stop:
    """Set by SIGINT/SIGTERM: no new trial starts. A second signal interrupts the
    running trial (its launch's whole session is killed)."""

    def __init__(self) -> None:
        self.requested: str | None = None

    def __call__(self, signum: int, _frame: Any) -> None:
        if self.requested is not None:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name
        print(
            f"\ndpkit tune: {self.requested}: stopping after this trial (again to stop it now)",
            file=sys.stderr,
            flush=True,
        )


@contextmanager
def _stop_on_signals() -> Iterator[_Stop]:
    stop = _Stop()
    if threading.current_thread() is not threading.main_thread():
        yield stop  # signal handlers can only be set from the main thread
        return
    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class _Tuner:
    """One tune's state: the settings, the plan, the trials so far, the bar."""

    def __init__(self, settings: TuneSettings, env: dict[str, str], stop: _Stop) -> None:
        self.settings = settings
        self.env = env
        self.stop = stop
        self.plan, self.plan_note = space.memory_plan(settings)
        self.trials: list[Trial] = []
        self.known: set[str] = set()
        """The names of the candidates considered so far (a twin is added once)."""
        self.started = time.perf_counter()
        self.stopped: str | None = None
        self.bar: Any = None

    def predict(self, candidates: list[space.Candidate]) -> list[Trial]:
        """A trial per candidate, the ones predicted over the budget already pruned."""
        budget = self.settings.memory_budget
        trials = []
        for candidate in candidates:
            trial = Trial(candidate)
            if self.plan is not None:
                trial.predicted_bytes = self.plan.predict(candidate)
                # Within the plan's own error bound of the budget it may still fit:
                # the measurement decides.
                if budget is not None and trial.predicted_bytes > budget * (1 + PLAN_MARGIN):
                    trial.status = PRUNED
                    trial.reason = (
                        f"dpkit plan predicts {trial.predicted_bytes / MIB:.1f} MiB per rank, "
                        f"over the {budget / MIB:.1f} MiB budget by more than its "
                        f"{PLAN_MARGIN:.0%} error bound"
                    )
            trials.append(trial)
        return trials

    def _budget_left(self) -> str:
        """Why no further trial may start, or ''."""
        config = self.settings.config
        if self.stop.requested:
            return f"stopped by {self.stop.requested}"
        elapsed = time.perf_counter() - self.started
        if config.time_budget_s is not None and elapsed >= config.time_budget_s:
            return f"time budget of {config.time_budget_s:g} s spent"
        measured = sum(t.status in (OK, FAILED) for t in self.trials)
        if config.max_trials is not None and measured >= config.max_trials:
            return f"max trials ({config.max_trials}) measured"
        return ""

    def measure_more(self, trials: list[Trial]) -> None:
        """Trials a later round brings: added to the progress bar's total, then measured."""
        self.bar.total += len(trials)
        self.bar.refresh()
        self.measure(trials)

    def measure(self, trials: list[Trial]) -> None:
        """Run (or reuse) every trial not pruned, one after another."""
        for trial in trials:
            self.trials.append(trial)
            if trial.status == PRUNED:
                self.bar.update(1)
                continue
            previous = load_previous(self.settings, trial.candidate)
            if previous is not None:
                previous.predicted_bytes = trial.predicted_bytes
                self.trials[-1] = trial = previous
            else:
                why = self._budget_left()
                if why:
                    trial.reason = why
                    self.stopped = self.stopped or why
                    self.bar.update(1)
                    continue
                index, count = self.bar.n + 1, self.bar.total
                done = run_trial(self.settings, trial.candidate, index, count, self.env)
                done.predicted_bytes = trial.predicted_bytes
                self.trials[-1] = trial = done
            self.bar.update(1)
            self._show_best()

    def _show_best(self) -> None:
        found = verdicts(self.trials, self.settings.memory_budget, self.settings.precision)
        eligible = [t for t in self.trials if found[t.name].eligible]
        if eligible:
            best = min(eligible, key=lambda t: t.step_time)
            self.bar.set_postfix_str(f"best {best.name} {best.step_time:.3f} s/step")

    def first_round(self) -> list[Trial]:
        """The first round, predicted; under ``gradient_checkpointing="auto"`` followed by
        the checkpointed twin of every candidate the plan pruned (itself predicted, and
        pruned too where it does not fit either). Where the plan prunes every one of them,
        the fallback strategies (ZeRO-3, the offloads) follow, predicted the same way."""
        first = self.predict(space.first_round(self.settings))
        self.known = {t.name for t in first}
        first += self._twins_of_pruned(first)
        if all(t.status == PRUNED for t in first):
            fallbacks = self.predict(space.fallback_round(self.settings, self.known))
            first += fallbacks + self._twins_of_pruned(fallbacks)
        return first

    def _twins_of_pruned(self, trials: list[Trial]) -> list[Trial]:
        pruned = [t.candidate for t in trials if t.status == PRUNED]
        return self.predict(space.checkpointed_twins(pruned, self.known, self.settings))

    def fallbacks_where_nothing_fits(self) -> list[Trial]:
        """After the first round and its twins: where every candidate was pruned, measured
        over the budget or ran out of memory, the fallback strategies' candidates not tried
        yet, predicted (with the twins of those the plan prunes, under ``auto``); else
        none. A trial that failed otherwise, or was not run, says nothing of memory."""
        not_fitting = {c.name for c in self.did_not_fit()}
        if not self.trials or not all(
            t.status == PRUNED or t.name in not_fitting for t in self.trials
        ):
            return []
        fallbacks = self.predict(space.fallback_round(self.settings, self.known))
        return fallbacks + self._twins_of_pruned(fallbacks)

    def twins_of_what_did_not_fit(self) -> list[Trial]:
        """After the first round, under ``auto``: the checkpointed twins, predicted, of the
        candidates measured over the budget or out of memory, not tried yet."""
        twins = space.checkpointed_twins(self.did_not_fit(), self.known, self.settings)
        return self.predict(twins)

    def did_not_fit(self) -> list[space.Candidate]:
        """The measured candidates that do not fit: over the budget, or out of memory."""
        found = verdicts(self.trials, self.settings.memory_budget, self.settings.precision)
        return [
            t.candidate
            for t in self.trials
            if found[t.name].fits is False
            or (t.status == FAILED and "out of memory" in t.reason.lower())
        ]

    def second_round(self) -> list[space.Candidate]:
        """Bucket and flag variants of each DeepSpeed ZeRO strategy's best first-round
        trial (DDP and FSDP2 have no ZeRO settings to vary)."""
        found = verdicts(self.trials, self.settings.memory_budget, self.settings.precision)
        names = {t.name for t in self.trials}
        candidates: list[space.Candidate] = []
        if not self.settings.config.zero_variants:
            return candidates
        tried = {t.candidate.strategy for t in self.trials}
        fallbacks = [n for n in self.settings.config.fallback_strategies if n in tried]
        for strategy in dict.fromkeys([*self.settings.config.strategies, *fallbacks]):
            if not engine_of(strategy).tunable:
                continue
            ran = [
                t
                for t in self.trials
                if t.candidate.strategy == strategy and found[t.name].eligible
            ]
            if not ran:
                continue
            best = min(ran, key=lambda t: t.step_time)
            zero = best.figures.get("zero_optimization") or {}
            for candidate in space.second_round(best.candidate, zero, self.settings):
                if candidate.name not in names:
                    candidates.append(candidate)
                    names.add(candidate.name)
        return candidates


def _check_something_fits(tuner: _Tuner, trials: list[Trial]) -> None:
    if all(t.status == PRUNED for t in trials):
        smallest = min(trials, key=lambda t: t.predicted_bytes)
        raise UsageError(
            f"--memory-budget={tuner.settings.memory_budget / MIB:.1f}MiB: no candidate fits; "
            f"the smallest, {smallest.name}, needs {smallest.predicted_bytes / MIB:.1f} MiB "
            f"per rank by dpkit plan (more than {PLAN_MARGIN:.0%} over)"
        )


def run_tune(config: TuneConfig, command: str | None = None) -> dict[str, Any]:
    """Tune: measure the candidates, choose, write the report and the winner's files
    into ``config.output_dir``; returns ``results.json``'s content.

    Bad input raises :class:`~dpkit.errors.UsageError` before anything launches. A
    trial that fails is recorded with its reason and the tune goes on.
    """
    import torch
    from tqdm.auto import tqdm

    from dpkit.bench.machine import machine_description

    gpu_count = torch.cuda.device_count()
    help_env = launch.launch_env({"threads_per_process": None})
    settings = tune_settings(config, gpu_count, help_env)
    env = launch.launch_env(settings.launch_settings())
    command = command or "dpkit.run_tune(" + shlex.join(settings.config.recipe_args) + ")"
    with _stop_on_signals() as stop:
        tuner = _Tuner(settings, env, stop)
        first = tuner.first_round()
        _check_something_fits(tuner, first)
        report.clear_outputs(settings.output_dir)
        print(
            f"dpkit tune: {settings.recipe.path.name} at {settings.nproc} processes on "
            f"{settings.device}, global batch {settings.global_batch_size}, "
            f"{len(first)} candidates first, {settings.config.warmup_steps} warm-up + "
            f"{settings.config.steps} timed steps each; {tuner.plan_note} -> "
            f"{settings.output_dir}",
            file=sys.stderr,
            flush=True,
        )
        tuner.bar = tqdm(total=len(first), desc="tune", unit="trial", file=sys.stderr)
        try:
            tuner.measure(first)
            tuner.measure_more(tuner.twins_of_what_did_not_fit())
            tuner.measure_more(tuner.fallbacks_where_nothing_fits())
            # The fallbacks' own checkpointed twins, where they did not fit either.
            tuner.measure_more(tuner.twins_of_what_did_not_fit())
            tuner.measure_more(tuner.predict(tuner.second_round()))
        except KeyboardInterrupt:
            # The trial that was running is not in the report: it has no figures.
            tuner.stopped = f"stopped by {stop.requested or 'SIGINT'} during a trial"
            if tuner.trials and tuner.trials[-1].status == NOT_RUN:
                tuner.trials[-1].reason = tuner.stopped
        finally:
            tuner.bar.close()
    decision = decide(
        tuner.trials,
        space.baseline(settings).name,
        settings.memory_budget,
        settings.precision,
        settings.config.tie_tolerance,
    )
    results = report.build_results(
        settings,
        tuner.trials,
        decision,
        plan_note=tuner.plan_note,
        machine=machine_description(env),
        command=command,
        wall_s=time.perf_counter() - tuner.started,
        stopped=tuner.stopped,
    )
    report.write_all(settings, results, decision)
    return results
