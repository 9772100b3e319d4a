"""An engine's bench and tune knobs: its accelerate YAML from any folder, the settings
``dpkit tune`` varies, the collectives the bench times and its bare twin."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from dpkit.core.strategy import Strategy


class BenchKnobs:
    """The bench/tune role (every engine is one)."""

    config_file: ClassVar[str | None] = None
    """The file a run writes with the backend's resolved configuration (``ds_config.json``),
    or None: the bench and the tune read it back."""
    tunable: ClassVar[tuple[str, ...]] = ()
    """Settings of the backend's own that ``dpkit tune`` varies (DeepSpeed's ZeRO buckets)."""
    collectives: ClassVar[tuple[str, ...]] = ()
    """The communication patterns of the backend that ``dpkit bench``'s collectives phase
    times (keys of its ``collectives.json``)."""
    collectives_note: ClassVar[str] = ""
    """What the bench says of how those collectives overlap the compute."""

    def accelerate_yaml(
        self, strategy: Strategy, folder: Path, overrides: Mapping[str, Any], config: Any
    ) -> str:
        """The text of dpkit's accelerate YAML for ``strategy``, to launch from any folder
        (a backend config it names made absolute, ``config`` or dpkit's own with
        :attr:`tunable` ``overrides``, written into ``folder``)."""
        from dpkit import resources

        return resources.accelerate_config(strategy.name).read_text()

    def tuning_variants(
        self,
        strategy: Strategy,
        ran_with: Mapping[str, Any],
        *,
        bucket_sizes: Sequence[int] | None,
        on_cuda: bool,
    ) -> list[tuple[tuple[str, Any], ...]]:
        """``dpkit tune``'s second round: variants of the :attr:`tunable` settings around
        what a candidate ran with (``ran_with``, its written config's section), each a
        tuple of (setting, value); ``bucket_sizes``: the sizes the user asked to try."""
        return []

    def bucket_refusal(self, elements: int) -> str:
        """Why the backend would refuse ``elements`` as a bucket size ("" where it accepts it)."""
        return ""

    def tunable_in_effect(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """The :attr:`tunable` settings as a run's written :attr:`config_file` holds them."""
        return {}

    def bare_baseline(self, strategy: Strategy) -> tuple[str, str, list[str]]:
        """The bench's bare twin of ``strategy``: the launcher, its flag for the number of
        processes, and the module arguments of a loop that uses the backend without
        dpkit or accelerate."""
        raise NotImplementedError
