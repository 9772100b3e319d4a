"""``make mutate``: mutation testing of the modules whose mistakes are silent, and its score.

Runs ``mutmut run`` (the modules and test selection are ``[tool.mutmut]`` in
pyproject.toml: fast tests only, ``-m "not multiprocess"``), then reads mutmut's
results and prints, per module, how many mutants the tests killed. A surviving mutant
is either a missing test or a change that cannot alter behaviour; the second kind is
listed, with a one-line reason, in ``tests/mutation_equivalents.txt``, keyed by the
function and the line before and after the change (not by mutmut's numbering, which
moves whenever a function changes). The score is killed / (all - equivalent).

A listed reason that starts with ``launch only:`` explains a survivor that is not
equivalent: only a path a real launch takes reaches it (several ranks, a DeepSpeed
launch), where mutmut cannot see the mutant. It names the launch test that covers the
path; it counts as not killed in the score, and is shown in its own column.

The mutants listed there are not run: before mutmut tests anything, each one whose diff
matches a listed line is marked skipped (it cannot be killed, and a survivor costs every
test that reaches it). Remove a line to have its mutant tested again.

Incremental: mutmut keeps every verdict in ``mutants/`` and re-tests only the mutants
of functions that changed since; the survivors of the last run (and mutants no test
reached, and the skipped ones) are re-tested every time, since a test may have been
added for them. The first run checks every mutant (see docs/testing.md for how long
that takes).

Exit status: 0 when the score reaches ``--target`` (0.90) and every survivor is either
killed or explained; 2 when some mutants were not checked (a run stopped early: the
table scores the checked ones); 1 otherwise, with the unexplained survivors' diffs in
``mutants/mutation-report.md``. ``--no-run`` reports on the last run only;
``PATTERN ...`` (mutmut's mutant-name globs, e.g. ``'dpkit.tune.decide*'``) re-tests
every mutant of a part, and reports on that part.

Usage: python tests/mutation_report.py [--no-run] [--target 0.9] [PATTERN ...]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EQUIVALENTS = REPO / "tests" / "mutation_equivalents.txt"
REPORT = REPO / "mutants" / "mutation-report.md"
# mutmut counts a timeout (the mutant looped) as detected, like a kill.
KILLED = {"killed", "timeout", "caught by type check", "segfault"}
SKIPPED_EXIT_CODE = 34  # mutmut's "skipped"
LAUNCH_ONLY = "launch only:"


@dataclass(frozen=True)
class Mutant:
    name: str
    """mutmut's name: ``dpkit.tune.decide.x__deviation__mutmut_5``."""
    path: str
    status: str
    function: str
    """``Class.method`` or ``function``."""
    removed: str
    added: str
    diff: str
    seconds: float = 0.0
    """Wall time of its test run (0 where not recorded: skipped, no tests)."""

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.path, self.function, self.removed, self.added)


def _changed_lines(diff: str) -> tuple[str, str]:
    """The removed and the added lines of a unified diff, each stripped, joined by ' / '."""
    removed, added = [], []
    for line in diff.splitlines():
        if line.startswith(("---", "+++")):
            continue
        if line.startswith("-"):
            removed.append(line[1:].strip())
        elif line.startswith("+"):
            added.append(line[1:].strip())
    return " / ".join(removed), " / ".join(added)


def read_results(with_diffs: bool = True) -> list[Mutant]:
    """Every mutant of the last run, with its status (and, for survivors, its diff)."""
    os.chdir(REPO)
    from mutmut.mutation.data import SourceFileMutationData
    from mutmut.mutation.diff_apply import get_diff_for_mutant
    from mutmut.stats import status_by_exit_code
    from mutmut.utils.file_utils import walk_mutatable_files
    from mutmut.utils.format_utils import orig_function_and_class_names_from_key

    mutants = []
    for path in walk_mutatable_files():
        data = SourceFileMutationData(path=path)
        data.load()
        for name, exit_code in data.exit_code_by_key.items():
            status = status_by_exit_code[exit_code]
            function, cls = orig_function_and_class_names_from_key(name)
            function = f"{cls}.{function}" if cls else function
            diff = removed = added = ""
            if with_diffs and status not in KILLED and status != "not checked":
                diff = get_diff_for_mutant(name, path=path)
                removed, added = _changed_lines(diff)
            seconds = float(data.durations_by_key.get(name) or 0.0)
            mutants.append(Mutant(name, str(path), status, function, removed, added, diff, seconds))
    return mutants


def recheck_survivors() -> int:
    """Mark the last run's survivors, untested and skipped mutants unchecked, so that the
    next ``mutmut run`` tests them again (mutmut itself re-tests only changed functions)."""
    os.chdir(REPO)
    from mutmut.mutation.data import SourceFileMutationData
    from mutmut.stats import status_by_exit_code
    from mutmut.utils.file_utils import walk_mutatable_files

    count = 0
    for path in walk_mutatable_files():
        if not (REPO / "mutants" / f"{path}.meta").exists():
            continue
        data = SourceFileMutationData(path=path)
        data.load()
        stale = [
            name
            for name, code in data.exit_code_by_key.items()
            if code is not None and status_by_exit_code[code] in ("survived", "no tests", "skipped")
        ]
        for name in stale:
            data.exit_code_by_key[name] = None
        if stale:
            data.save()
        count += len(stale)
    return count


def run_mutmut_skipping_equivalents(patterns: list[str]) -> int:
    """``mutmut run PATTERN ...`` in this process, with the listed equivalents marked
    skipped between mutmut's mutant generation and its first test.

    mutmut has no option for this: its run reads the mutants to test from
    ``collect_source_file_mutation_data``, which this wraps (mutmut is pinned to 3.8).
    Only the functions named in the list have their diffs read."""
    import mutmut.__main__ as mutmut_main
    from mutmut.mutation.diff_apply import get_diff_for_mutant
    from mutmut.utils.format_utils import orig_function_and_class_names_from_key

    equivalents = read_equivalents()
    listed_functions = {(path, function) for path, function, _, _ in equivalents}
    collect = mutmut_main.collect_source_file_mutation_data

    def collect_skipping_equivalents(*, mutant_names):
        mutants, data_by_path = collect(mutant_names=mutant_names)
        kept, skipped = [], 0
        for data, name, result in mutants:
            function, cls = orig_function_and_class_names_from_key(name)
            function = f"{cls}.{function}" if cls else function
            path = str(data.path)
            if (result is None or mutant_names) and (path, function) in listed_functions:
                removed, added = _changed_lines(get_diff_for_mutant(name, path=path))
                if (path, function, removed, added) in equivalents:
                    data.exit_code_by_key[name] = SKIPPED_EXIT_CODE
                    skipped += 1
                    continue
            kept.append((data, name, result))
        for data in data_by_path.values():
            data.save()
        print(f"skipping {skipped} mutants listed in {EQUIVALENTS.name}")
        return kept, data_by_path

    mutmut_main.collect_source_file_mutation_data = collect_skipping_equivalents
    _time_each_mutant(mutmut_main)
    try:
        mutmut_main.cli(["run", *patterns])
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 1
    return 0


def _time_each_mutant(mutmut_main) -> None:
    """Record each mutant's wall time in mutmut's ``durations_by_key`` (its fork server
    leaves them 0): from the moment it is handed to a free worker to its verdict."""
    import dataclasses
    import time

    started: dict[str, float] = {}
    make_runner, register = mutmut_main.get_mutant_runner, mutmut_main._register_mutant_result

    def timed_runner(*args, **kwargs):
        runner = make_runner(*args, **kwargs)
        submit = runner.submit

        def timed_submit(mutant_name, *rest, **options):
            started[mutant_name] = time.monotonic()
            return submit(mutant_name, *rest, **options)

        runner.submit = timed_submit
        return runner

    def register_timed(result, data_by_name):
        if result.mutant_name in started:
            seconds = time.monotonic() - started.pop(result.mutant_name)
            result = dataclasses.replace(result, duration=seconds)
        register(result, data_by_name)

    mutmut_main.get_mutant_runner = timed_runner
    mutmut_main._register_mutant_result = register_timed


def read_equivalents(path: Path = EQUIVALENTS) -> dict[tuple[str, str, str, str], str]:
    """``path | function | line before | line after | why`` per line; ``#`` comments."""
    entries = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        # A " | " inside a line of code is written " \| " (a type like `Path \| None`).
        parts = [part.strip().replace("\\|", "|") for part in re.split(r" (?<!\\)\| ", line)]
        if len(parts) != 5 or not parts[4]:
            raise SystemExit(f"{path.name}:{number}: want 'path | function | before | after | why'")
        entries[tuple(parts[:4])] = parts[4]
    return entries


def score(mutants: list[Mutant], equivalents: dict) -> dict:
    """Per module and in all: killed, equivalent, surviving (unexplained), and the score."""
    per_module: dict[str, Counter] = defaultdict(Counter)
    per_function: Counter = Counter()  # worker seconds, by path:function
    unexplained = []
    for mutant in mutants:
        counts = per_module[mutant.path]
        counts["total"] += 1
        counts["seconds"] += mutant.seconds
        per_function[f"{mutant.path}:{mutant.function}"] += mutant.seconds
        if mutant.status == "not checked":  # a run stopped early: not in the score
            counts["unchecked"] += 1
        elif mutant.status in KILLED:
            counts["killed"] += 1
        elif mutant.key in equivalents and equivalents[mutant.key].startswith(LAUNCH_ONLY):
            counts["launch only"] += 1  # explained, but not killed: in the score's denominator
        elif mutant.key in equivalents:
            counts["equivalent"] += 1
        else:
            counts["surviving"] += 1
            unexplained.append(mutant)
    total = sum(per_module.values(), Counter())
    return {
        "per_module": dict(per_module),
        "total": total,
        "unexplained": unexplained,
        "per_function": per_function,
    }


def ratio(counts: Counter) -> float:
    judged = counts["total"] - counts["unchecked"] - counts["equivalent"]
    return counts["killed"] / judged if judged else 1.0


def format_report(result: dict, stale: list) -> str:
    lines = [
        "| module | mutants | checked | killed | equivalent | launch only | surviving | score "
        "| worker min |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows = sorted(result["per_module"].items()) + [("all", result["total"])]
    for module, c in rows:
        checked = c["total"] - c["unchecked"]
        score = f"{100 * ratio(c):.1f}%" if checked > c["equivalent"] else "-"
        lines.append(
            f"| {module} | {c['total']:,} | {checked:,} | {c['killed']:,} | "
            f"{c['equivalent']} | {c['launch only']} | {c['surviving']} | {score} | "
            f"{c['seconds'] / 60:.1f} |"
        )
    slowest = [(f, t) for f, t in result["per_function"].most_common(8) if t > 0]
    if slowest:
        lines += ["", "Slowest functions to test (worker minutes):"]
        lines += [f"- {function}: {seconds / 60:.1f}" for function, seconds in slowest]
    for mutant in result["unexplained"]:
        lines += ["", f"### {mutant.name} ({mutant.status})", "```diff", mutant.diff, "```"]
    if stale:
        lines += ["", "Entries of tests/mutation_equivalents.txt that match no mutant now:"]
        lines += [f"- {' | '.join(key)}" for key in stale]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("patterns", nargs="*", help="mutant-name globs (default: all)")
    parser.add_argument("--no-run", action="store_true", help="report on the last run")
    parser.add_argument("--target", type=float, default=0.90)
    parser.add_argument("--mutmut-run", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mutmut_run:  # the child below: mutmut's run, in a process of its own
        os.chdir(REPO)
        return run_mutmut_skipping_equivalents(args.patterns)
    if not args.no_run:
        if not args.patterns and (REPO / "mutants").is_dir():
            print(f"re-testing {recheck_survivors()} survivors of the last run")
        done = subprocess.run([sys.executable, __file__, "--mutmut-run", *args.patterns], cwd=REPO)
        if done.returncode not in (0, 1):
            return done.returncode
    mutants = read_results()
    if args.patterns:
        from fnmatch import fnmatch

        mutants = [m for m in mutants if any(fnmatch(m.name, p) for p in args.patterns)]
    unchecked = sum(m.status == "not checked" for m in mutants)
    equivalents = read_equivalents()
    result = score(mutants, equivalents)
    present = {m.key for m in mutants}
    stale = [key for key in equivalents if key not in present] if not args.patterns else []
    text = format_report(result, stale)
    REPORT.parent.mkdir(exist_ok=True)
    REPORT.write_text(text + "\n")
    print(text.split("\n\n###")[0])
    total = result["total"]
    print(
        f"\nmutation score {100 * ratio(total):.1f}% (target {100 * args.target:.0f}%); "
        f"{len(result['unexplained'])} unexplained survivors; report: {REPORT.relative_to(REPO)}"
    )
    if unchecked and unchecked == len(mutants) and not args.no_run:
        # mutmut stops before any mutant when the unmutated tests fail, and keeps their
        # output to itself (seen once, on a first run right after `make setup`; the next
        # run passed): say so rather than print a score of nothing.
        print(
            "no mutant was checked: mutmut's run of the unmutated tests failed; "
            "`mutmut run` again, or add `debug = true` under [tool.mutmut] to see the failure"
        )
        return 2
    if unchecked:
        print(f"{unchecked:,} mutants not checked (the run stopped early): the score is partial")
        return 2
    return 0 if ratio(total) >= args.target and not result["unexplained"] else 1


if __name__ == "__main__":
    sys.exit(main())
