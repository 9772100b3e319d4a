"""Config files a user names: found from any directory, and ``dpkit configs export``.

A path to a config file reaches dpkit three ways: a flag (``--deepspeed``), a key of an
accelerate YAML (``deepspeed_config_file``, which ``accelerate launch`` hands the script
as ``ACCELERATE_DEEPSPEED_CONFIG_FILE``, as written, relative or not) or an environment
variable. :func:`find_config` looks for it, in order:

1. as named, relative to the current directory (what accelerate and DeepSpeed do);
2. relative to the folder of the accelerate YAML that named it, when that YAML is known:
   ``ds_configs/accelerate/zero2.yaml`` names ``ds_configs/zero2.json``, a path that only
   exists from the repository root;
3. dpkit's packaged copy, when the name is one of the shipped configs (``zero2.json``,
   ``ds_configs/zero2.json``): a wheel install has no ``ds_configs/`` beside the script.

A path found by 2 or 3 comes with a note for the run's log; a path found nowhere is a
one-line :class:`~dpkit.errors.UsageError` naming the file and where the path came from.

accelerate does not pass the YAML's path to the script: :func:`launcher_yaml` reads it
from the ``accelerate launch`` command line of the parent process, the only place it is.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from dpkit import resources
from dpkit.errors import UsageError

# The repository's user-facing folder and, for each of its files, the packaged copy.
SHIPPED_FOLDER = "ds_configs"


@dataclass(frozen=True)
class FoundConfig:
    """A config file found for a path a user gave."""

    path: str
    """The file to open."""
    note: str | None = None
    """How it was found when not where named (for the run's log), else None."""


def shipped_configs() -> dict[str, Path]:
    """Every shipped config, by its path in the repository (``ds_configs/zero2.json``,
    ``ds_configs/accelerate/zero2.yaml``) -> the packaged copy dpkit reads."""
    shipped = {
        f"{SHIPPED_FOLDER}/{path.name}": path
        for path in sorted(resources.deepspeed_config("zero1").parent.glob("*.json"))
    }
    for path in sorted(resources.accelerate_config("ddp").parent.glob("*.yaml")):
        shipped[f"{SHIPPED_FOLDER}/accelerate/{path.name}"] = path
    return shipped


def shipped_copy(named: str) -> Path | None:
    """dpkit's packaged copy of a shipped config named relatively, as in the repository
    (``ds_configs/zero2.json``) or by its bare name (``zero2.json``); None otherwise."""
    path = Path(named)
    if path.is_absolute():
        return None  # an absolute path names the user's own file, not ours
    parts = [p for p in path.parts if p != "."]
    shipped = shipped_configs()
    for key, copy in shipped.items():
        key_parts = key.split("/")
        # The whole repository path, or its tail after ds_configs/ (zero2.json, accelerate/x.yaml).
        if parts == key_parts or parts == key_parts[1:] or parts == [key_parts[-1]]:
            return copy
    return None


def find_config(named: str, source: str, *, beside: str | Path | None = None) -> FoundConfig:
    """The file ``named`` (from ``source``: ``--deepspeed``, a YAML key, a variable),
    looked for as named, then relative to ``beside`` (the folder of the YAML that named
    it), then as one of dpkit's shipped configs.

    Raises:
        UsageError: one line, ``source`` and the path, where it was looked for.
    """
    path = Path(named).expanduser()
    if path.is_file():
        return FoundConfig(str(path))
    if beside is not None and not path.is_absolute():
        candidate = Path(beside) / path
        if candidate.is_file():
            return FoundConfig(
                str(candidate.resolve()),
                f"{source}: {named!r} is not in the current directory; using "
                f"{candidate.resolve()} (relative to the YAML's folder)",
            )
    copy = shipped_copy(named)
    if copy is not None:
        return FoundConfig(
            str(copy),
            f"{source}: {named!r} is not in the current directory; using dpkit's copy {copy}",
        )
    where = "the current directory" + (f" or {beside}" if beside is not None else "")
    alike = sorted({Path(key).name for key in shipped_configs() if Path(key).suffix == path.suffix})
    shipped = f", and not one of dpkit's shipped configs ({', '.join(alike)})" if alike else ""
    raise UsageError(f"{source}={named!r}: no such file in {where}{shipped}")


def accelerate_deepspeed_config(env: Mapping[str, str]) -> FoundConfig | None:
    """The DeepSpeed JSON ``accelerate launch`` handed the script, or None when it named none.

    accelerate passes the YAML's ``deepspeed_config_file`` as written
    (``ACCELERATE_DEEPSPEED_CONFIG_FILE``): a path that is not found as named is looked
    for beside the YAML (read from the launch command line, :func:`launcher_yaml`, only
    then: it costs a look at the parent process) and as a shipped config's name.

    Raises:
        UsageError: one line naming the YAML (or the variable) and the path.
    """
    named = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or None
    if named is None:
        return None
    if Path(named).expanduser().is_file():
        return FoundConfig(named)
    yaml = launcher_yaml(env)
    if yaml is None:
        return find_config(named, "deepspeed_config_file (ACCELERATE_DEEPSPEED_CONFIG_FILE)")
    return find_config(named, f"{yaml} deepspeed_config_file", beside=yaml.parent)


def launcher_yaml(env: Mapping[str, str], parent_argv: list[str] | None = None) -> Path | None:
    """The accelerate YAML this process was launched with (``accelerate launch
    --config_file X``), or None: no accelerate launch, no ``--config_file``, or a parent
    whose command line cannot be read (not Linux).

    ``parent_argv``: the parent's command line (default: read from ``/proc``); it is
    parsed with accelerate's own launch parser, so the script's own flags are not read.
    """
    if not any(key.startswith("ACCELERATE_") for key in env):  # no accelerate launch
        return None
    parent_cwd = Path.cwd()
    if parent_argv is None:
        try:
            raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
            parent_cwd = Path(os.readlink(f"/proc/{os.getppid()}/cwd"))
        except OSError:
            return None
        parent_argv = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
    names = [Path(arg).name for arg in parent_argv[:3]]
    if "accelerate" not in names or "launch" not in parent_argv[:4]:
        return None  # the parent is another launcher (torchrun, deepspeed) or a shell
    from accelerate.commands.launch import launch_command_parser

    try:
        launch_args, _ = launch_command_parser().parse_known_args(
            parent_argv[parent_argv.index("launch") + 1 :]
        )
    except SystemExit:  # not a command line accelerate itself would have run
        return None
    if not launch_args.config_file:
        return None
    return (parent_cwd / Path(launch_args.config_file).expanduser()).resolve()


def export(folder: str | Path) -> list[Path]:
    """Write every shipped config into ``folder`` (``zero2.json``,
    ``accelerate/zero2.yaml``...), each YAML naming its DeepSpeed JSON by the exported
    copy's absolute path, so they work from any directory and can be edited. Refuses a
    folder that is a file or already holds one of these files (nothing is written then).
    """
    given = str(folder)  # as the user wrote it, for the message
    folder = Path(folder).expanduser().resolve()
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"DIR={given!r}: is a file, not a folder")
    targets = {key: folder / Path(key).relative_to(SHIPPED_FOLDER) for key in shipped_configs()}
    taken = [str(target) for target in targets.values() if target.exists()]
    if taken:
        raise UsageError(f"DIR={given!r}: already holds {taken[0]}; export into a new folder")
    written = []
    for key, target in targets.items():
        text = shipped_configs()[key].read_text()
        for other_key, other_target in targets.items():
            # A YAML names its JSON by the repository path (ds_configs/zero2.json).
            if other_key != key and other_key.endswith(".json"):
                text = text.replace(other_key, str(other_target))
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        written.append(target)
    return written


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``dpkit configs export DIR``."""
    sub = parser.add_subparsers(dest="action", required=True)
    export_parser = sub.add_parser(
        "export", help="write dpkit's DeepSpeed JSONs and accelerate YAMLs into DIR, to edit"
    )
    export_parser.add_argument("dir", metavar="DIR", help="a new or empty folder")


def main(args: argparse.Namespace) -> int:
    """Export the shipped configs and print what was written."""
    for path in export(args.dir):
        print(path)
    return 0
