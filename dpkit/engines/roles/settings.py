"""An engine's settings: what it reads of the launch and the flags, refuses, and builds
before any process group; what the Accelerator needs to run it; its config file."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from dpkit.core.launch import Launch
from dpkit.core.strategy import Strategy

if TYPE_CHECKING:
    from accelerate import Accelerator

    from dpkit.engines.roles.views import FlagsView, RequestView, ResolutionView
    from dpkit.models import ModelSizes


@dataclass(frozen=True)
class EngineSettings:
    """What an engine resolved for one run before any process group (its own fields,
    read by nothing outside the engine but :meth:`as_run_info` and the run's files)."""

    notes: tuple[str, ...] = ()
    """What the run does otherwise than a flag reads, said once in the log."""

    def run_info(self) -> dict[str, Any]:
        """Fields of ``run_info.json`` (:class:`~dpkit.train.run.RunInfo`) this engine fills."""
        return {}

    @property
    def config(self) -> Mapping[str, Any] | None:
        """The backend's own configuration as it will be handed over (DeepSpeed's
        resolved JSON), or None where the backend has no such file."""
        return None

    @property
    def config_path(self) -> str | None:
        """The file that configuration was resolved from, or None."""
        return None


class Settings:
    """The settings role (every engine is one): before any process group."""

    reads_config_file: ClassVar[bool] = False
    """Whether the backend is configured by a file the run names (``--deepspeed``)."""
    needs_process_group: ClassVar[bool] = False
    """Whether one process alone still needs a process group (DeepSpeed, fully_shard)."""

    def launched(self, args: FlagsView, env: Mapping[str, str]) -> Launch | None:
        """What this backend's launcher configuration asks for (an accelerate FSDP or
        DeepSpeed config, a ``--deepspeed`` JSON), as a :class:`~dpkit.core.launch.Launch`;
        None when there is none. A ``--strategy`` that contradicts it is refused here."""
        return None

    def from_flag(self, strategy: Strategy, args: FlagsView, env: Mapping[str, str]) -> Launch:
        """The :class:`~dpkit.core.launch.Launch` of ``--strategy`` when no launcher
        configuration decided; refuses a launcher that cannot run it."""
        return Launch(strategy, f"--strategy {strategy.name}")

    def configure(self, strategy: Strategy, request: RequestView) -> EngineSettings:
        """Check what the run asks of this backend and build its settings.

        ``request`` (:class:`dpkit.train.resolution.Request`) holds the flags, the
        launcher's environment, the precision, the batch and the model (a module, a
        config or sizes). Bad input raises :class:`~dpkit.errors.UsageError`.
        """
        return EngineSettings()

    def accelerator_options(self, strategy: Strategy, resolution: ResolutionView) -> dict[str, Any]:
        """Keyword arguments for ``Accelerator(...)`` beyond the process group's:
        ``cpu``, ``deepspeed_plugin``, extra ``kwargs_handlers``. May adjust the
        launcher's environment that accelerate would misread (said in a comment)."""
        return {"cpu": not resolution.on_cuda}

    def config_in_effect(self, accelerator: Accelerator) -> dict | None:
        """The backend's configuration as it runs with it (written to the run folder as
        :attr:`config_file`), or None."""
        return None

    def optimizer_in_config(self, settings: EngineSettings) -> bool:
        """Whether the backend's configuration builds the optimizer itself (a DeepSpeed
        JSON's ``optimizer`` section): the run then hands accelerate a placeholder."""
        return False

    def build_optimizer(
        self, settings: EngineSettings, params: Any, lr: float, weight_decay: float
    ) -> Any | None:
        """The optimizer this backend must step (DeepSpeed offload: its CPU Adam), or None
        for the run's torch AdamW."""
        return None

    def scheduler_in_config(self, settings: EngineSettings) -> bool:
        """Whether the backend's configuration builds the lr scheduler itself."""
        return False

    def check_options(self, strategy: Strategy, checkpoint_format: str) -> None:
        """Refuse (:class:`~dpkit.errors.UsageError`) a run option this backend cannot
        honour under ``strategy``, before any process group; every option: nothing."""

    def before_process_group(self, *, on_cuda: bool) -> None:
        """Set what this backend needs in the process before any group starts, for a run
        dpkit does not start itself (a Transformers ``Trainer``'s)."""

    def trainer_config(
        self,
        sizes: ModelSizes,
        config: str | Mapping[str, Any],
        *,
        world_size: int,
        on_cuda: bool,
    ) -> dict[str, Any] | None:
        """The backend's own config file (``config``: a shipped name, a path or a dict)
        resolved for a Transformers ``Trainer`` run with dpkit's settings, for a model of
        ``sizes``; None for a backend that :attr:`reads_config_file` is False for."""
        return None

    def before_trainer_arguments(self, config: Any, *, on_cuda: bool) -> None:
        """What a Transformers ``Trainer`` run with this backend's ``config`` (what goes to
        ``TrainingArguments``) needs started before the arguments are built; nothing."""

    def trainer_refusal(self, *, model: Any = None, optimizer: Any = None) -> str | None:
        """What a Transformers ``Trainer`` run must not train with under this backend, as
        one line (the model handed to the Trainer, or the optimizer once prepared); None."""
        return None

    def quiet_logs(self, is_main_process: bool) -> None:
        """Quiet the backend's own logger as dpkit's is (its lines from the main process,
        errors only elsewhere); called when a run starts, before the backend is known."""
