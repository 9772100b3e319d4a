"""Files dpkit reads at run time, shipped inside the package and found with ``importlib.resources``.

They work the same from this checkout (an editable install) and from a wheel
installed anywhere:

* ``configs/deepspeed/zero{1,2}.json`` and ``configs/accelerate/*.yaml``: copies of
  the repository's user-facing ``ds_configs/`` (a test holds them identical);
* ``configs/models/*.json``: the model configs ``dpkit plan`` knows by short name;
* ``metrics/<name>/<name>.py``: ``evaluate`` metric modules (the Hub is not needed);
* ``dpkit.recipes``: the repository's ``recipes/`` folder, packaged as a subpackage
  (``pyproject.toml`` maps it), so ``dpkit bench`` can launch ``train_lm.py`` anywhere.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def _path(package: str, *parts: str) -> Path:
    # dpkit is installed as plain files (a wheel or an editable checkout, never a zip),
    # so the resource is a real path that launchers and DeepSpeed can open.
    return Path(str(files(package).joinpath(*parts)))


def deepspeed_config(strategy_name: str) -> Path:
    """dpkit's DeepSpeed JSON for ``zero1`` or ``zero2``."""
    return _path("dpkit", "configs", "deepspeed", f"{strategy_name}.json")


def accelerate_config(strategy_name: str) -> Path:
    """dpkit's accelerate YAML for a runnable strategy (``ddp``, ``zero2``, ``fsdp2_full_shard``...)."""
    return _path("dpkit", "configs", "accelerate", f"{strategy_name}.yaml")


def model_configs_dir() -> Path:
    """The folder of bundled model configs (``gpt2.json``, ``llama-7b.json``...)."""
    return _path("dpkit", "configs", "models")


def metric_dir(name: str) -> Path:
    """The folder of an ``evaluate`` metric module shipped with dpkit (``accuracy``, ``f1``)."""
    return _path("dpkit", "metrics", name)


def recipe(filename: str) -> Path:
    """A recipe script (``train_lm.py``, ``finetune.py``), wherever dpkit is installed."""
    return _path("dpkit.recipes", filename)
