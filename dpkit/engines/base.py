"""What every backend answers: the one interface between dpkit and DDP, DeepSpeed ZeRO or FSDP2.

An :class:`Engine` owns everything that differs by backend, so that no code outside
``dpkit/engines/`` asks which backend runs (the shape of Lightning Fabric's
``Strategy`` classes and torchtitan's ``parallelize``):

* **settings**: the flags it refuses and the configuration it builds before any
  process group (:meth:`Engine.configure`), and what the Accelerator needs to run it
  (:meth:`Engine.accelerator_options`);
* **wrapping**: what it does to the model before the optimizer exists
  (:meth:`Engine.before_optimizer`) and the check after ``accelerator.prepare``
  (:meth:`Engine.after_prepare`);
* **memory**: where its training state lives, counted tensor by tensor
  (:meth:`Engine.walk`), and the points inside a step where it is probed
  (:meth:`Engine.install_probes`);
* **plan**: the bytes it holds per rank, predicted (:meth:`Engine.model_state_bytes`,
  :meth:`Engine.buffer_bytes`, :meth:`Engine.gradient_layout`...);
* **checkpoints**: the full fp32 weights and Adam moments gathered by parameter
  name, and put back re-sharded (:meth:`Engine.full_weights`,
  :meth:`Engine.full_moments`, :meth:`Engine.load_moments`).

A :class:`~dpkit.core.strategy.Strategy` is a row of the strategy table: a name, the
key of its engine and the engine's settings (ZeRO stage, offload, resharding); each
engine declares its own rows (:attr:`Engine.strategies`). Adding a backend is one engine
package under ``dpkit/engines/`` and one line in the registry (``docs/architecture.md``).

This module imports nothing heavy: ``dpkit plan`` reads the engines without torch.
Methods that need torch, accelerate or DeepSpeed import them when called.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from dpkit.core.launch import Launch
from dpkit.core.strategy import Strategy

if TYPE_CHECKING:
    from dpkit.core.spec import ModelSpec, PlanInputs
    from dpkit.core.units import GradientHighWater, ModelStateBytes


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


@dataclass(frozen=True)
class Prepared:
    """What runs, read back from the live objects after ``accelerator.prepare``."""

    wrapper: str
    """How the model and optimizer are wrapped (``DistributedDataParallel``,
    ``DeepSpeedEngine+DeepSpeedZeroOptimizer``, ``FSDP2 fully_shard (7 units)+AdamW``)."""
    zero_stage: int
    """What is sharded, in ZeRO's terms, as the live objects say."""
    run_info: dict[str, Any] = field(default_factory=dict)
    """Engine fields for ``run_info.json`` known only once prepared."""


class Engine:
    """One backend. Subclasses answer every question; the defaults are those of a
    backend that shards nothing and has no settings of its own."""

    name: ClassVar[str] = ""
    """``ddp``, ``deepspeed`` or ``fsdp2``: as ``run_info.json`` and the plan's JSON show it."""
    label: ClassVar[str] = ""
    """How the docs and logs name the backend: ``torch DDP``, ``DeepSpeed ZeRO``..."""
    config_file: ClassVar[str | None] = None
    """The file a run writes with the backend's resolved configuration (``ds_config.json``),
    or None: the bench and the tune read it back."""
    tunable: ClassVar[tuple[str, ...]] = ()
    """Settings of the backend's own that ``dpkit tune`` varies (DeepSpeed's ZeRO buckets)."""
    reads_config_file: ClassVar[bool] = False
    """Whether the backend is configured by a file the run names (``--deepspeed``)."""
    needs_process_group: ClassVar[bool] = False
    """Whether one process alone still needs a process group (DeepSpeed, fully_shard)."""
    collectives: ClassVar[tuple[str, ...]] = ()
    """The communication patterns of the backend that ``dpkit bench``'s collectives phase
    times (keys of its ``collectives.json``)."""
    collectives_note: ClassVar[str] = ""
    """What the bench says of how those collectives overlap the compute."""
    strategies: ClassVar[tuple[Strategy, ...]] = ()
    """This backend's rows of the strategy table (:data:`dpkit.engines.STRATEGIES`), least
    sharding first."""

    def runnable(
        self, *, zero_stage: int | None = None, reshard_after_forward: bool | None = None
    ) -> Strategy:
        """This backend's runnable strategy with the given settings (a DeepSpeed JSON's
        stage, an FSDP launch's resharding); :class:`ValueError` where it has none."""
        for strategy in self.strategies:
            if (
                strategy.runnable
                and zero_stage in (None, strategy.zero_stage)
                and reshard_after_forward in (None, strategy.reshard_after_forward)
            ):
                return strategy
        raise ValueError(
            f"no runnable {self.name} strategy with zero_stage={zero_stage}, "
            f"reshard_after_forward={reshard_after_forward}"
        )

    # ---- settings, before any process group -------------------------------------------

    def launched(self, args: Any, env: Mapping[str, str]) -> Launch | None:
        """What this backend's launcher configuration asks for (an accelerate FSDP or
        DeepSpeed config, a ``--deepspeed`` JSON), as a :class:`~dpkit.core.launch.Launch`;
        None when there is none. A ``--strategy`` that contradicts it is refused here."""
        return None

    def from_flag(self, strategy: Strategy, args: Any, env: Mapping[str, str]) -> Launch:
        """The :class:`~dpkit.core.launch.Launch` of ``--strategy`` when no launcher
        configuration decided; refuses a launcher that cannot run it."""
        return Launch(strategy, f"--strategy {strategy.name}")

    def configure(self, strategy: Strategy, request: Any) -> EngineSettings:
        """Check what the run asks of this backend and build its settings.

        ``request`` (:class:`dpkit.train.resolution.Request`) holds the flags, the
        launcher's environment, the precision, the batch and the model (a module, a
        config or sizes). Bad input raises :class:`~dpkit.errors.UsageError`.
        """
        return EngineSettings()

    def accelerator_options(self, strategy: Strategy, resolution: Any) -> dict[str, Any]:
        """Keyword arguments for ``Accelerator(...)`` beyond the process group's:
        ``cpu``, ``deepspeed_plugin``, extra ``kwargs_handlers``. May adjust the
        launcher's environment that accelerate would misread (said in a comment)."""
        return {"cpu": not resolution.on_cuda}

    def config_in_effect(self, accelerator: Any) -> dict | None:
        """The backend's configuration as it runs with it (written to the run folder as
        :attr:`config_file`), or None."""
        return None

    def optimizer_in_config(self, settings: EngineSettings) -> bool:
        """Whether the backend's configuration builds the optimizer itself (a DeepSpeed
        JSON's ``optimizer`` section): the run then hands accelerate a placeholder."""
        return False

    def scheduler_in_config(self, settings: EngineSettings) -> bool:
        """Whether the backend's configuration builds the lr scheduler itself."""
        return False

    def before_process_group(self, *, on_cuda: bool) -> None:
        """Set what this backend needs in the process before any group starts, for a run
        dpkit does not start itself (a Transformers ``Trainer``'s)."""

    def trainer_config(
        self, sizes: Any, config: Any, *, world_size: int, on_cuda: bool
    ) -> dict[str, Any]:
        """The backend's own config file (``config``: a shipped name, a path or a dict)
        resolved for a Transformers ``Trainer`` run with dpkit's settings, for a model of
        ``sizes`` (:class:`dpkit.models.ModelSizes`); only a backend that
        :attr:`reads_config_file` has one."""
        raise NotImplementedError(f"{self.label} is configured by no file")

    def quiet_logs(self, is_main_process: bool) -> None:
        """Quiet the backend's own logger as dpkit's is (its lines from the main process,
        errors only elsewhere); called when a run starts, before the backend is known."""

    # ---- wrapping ---------------------------------------------------------------------

    def prepare(self, run: Any, objects: Sequence[Any]) -> tuple[Any, ...]:
        """``objects`` (the model, its optimizer, loaders, a scheduler) wrapped for this
        backend: ``accelerator.prepare``, which builds DDP or DeepSpeed's engine."""
        prepared = run.accelerator.prepare(*objects)
        return prepared if isinstance(prepared, tuple) else (prepared,)

    def before_optimizer(self, run: Any, model: Any) -> Any:
        """The model as the optimizer must see it (FSDP2 replaces parameters by shards);
        ``model`` itself where the backend wraps it in ``accelerator.prepare``."""
        return model

    def after_prepare(self, run: Any, model: Any, optimizer: Any) -> Prepared:
        """Check that the prepared objects are what was asked for (a mismatch is a
        ``RuntimeError``, not a warning), apply what the backend takes only once built,
        and describe it."""
        raise NotImplementedError

    def after_evaluation(self, model: Any) -> None:
        """Give back what a forward without a backward left held (FSDP2 shard-grad-op's
        whole parameters)."""

    def own_timing(self, model: Any) -> dict[str, Any]:
        """The backend's own timing of a step, for ``train_summary.json`` (DDP's
        ``ddp_timing``: None under a backend that times nothing)."""
        return {"ddp_timing": None}

    def recognise(self, model: Any, optimizer: Any) -> Strategy | None:
        """The strategy these live objects run under this backend, or None if they are
        not this backend's (the Trainer integration reads a run it did not set up)."""
        return None

    # ---- memory, measured -------------------------------------------------------------

    def walk(self, ledger: Any, model: Any, optimizer: Any) -> dict[str, Any]:
        """Claim every tensor this rank holds for training into ``ledger``
        (:class:`dpkit.core.walk.Ledger`) by category and holder; returns what the walk
        found about the backend (its ``kind`` and settings)."""
        raise NotImplementedError

    def install_probes(self, probes: Any, model: Any, optimizer: Any) -> None:
        """Hook :class:`dpkit.memory.probes.StepProbes` into the points of a step where
        this backend holds memory the optimizer's own step hooks do not see."""

    def precision_in_effect(self, optimizer: Any) -> str | None:
        """The precision the live objects keep the parameters in, where the backend casts
        them itself (DeepSpeed's 16-bit partitions); None: the run's own setting stands."""
        return None

    def optimizer_groups(self, optimizer: Any) -> list[list[Any]]:
        """The parameters of each optimizer group as the backend lays them out (the plan
        partitions the same groups): here the torch optimizer's own."""
        from dpkit.core.walk import inner_torch_optimizer

        torch_opt = inner_torch_optimizer(optimizer)
        return [list(g["params"]) for g in torch_opt.param_groups] if torch_opt is not None else []

    def settings_in_effect(self, model: Any, optimizer: Any) -> dict[str, Any]:
        """The memory-relevant settings as the live objects hold them (not as configured),
        keyed ``<backend>.<setting>``."""
        return {}

    def report_notes(self, strategy: Strategy, model: Any, optimizer: Any) -> list[str]:
        """What the memory report must say about these live objects (a backend asked
        for but not found, say)."""
        return []

    def offload_in_effect(self, optimizer: Any) -> str | None:
        """Where the live optimizer keeps its state off the device (``cpu``), or None."""
        return None

    def report_param_shapes(self) -> bool:
        """Whether the memory report records every parameter's shape: the plan needs them
        where the backend pads per parameter (FSDP2)."""
        return False

    # ---- memory, planned (pure arithmetic: no torch) ----------------------------------

    def model_facts(self, model: Any, params: Sequence[Any]) -> dict[str, Any]:
        """Fields of :class:`~dpkit.core.spec.ModelSpec` that this backend's plan reads of
        ``model``'s parameters (``params``, each once) besides their sizes: ZeRO-3's
        persistent small tensors, FSDP2's units. The only method here that sees a module."""
        return {}

    def model_state_bytes(
        self,
        strategy: Strategy,
        num_params: float,
        world_size: int,
        precision: str,
        optimizer: str,
        param_shapes: Sequence[Sequence[int]] | None,
    ) -> ModelStateBytes:
        """Per-rank parameters, gradients, optimizer state and master weights."""
        raise NotImplementedError

    def paper_grad_bytes(
        self, strategy: Strategy, num_params: float, world_size: int, precision: str
    ) -> float:
        """The ZeRO paper's per-rank gradient figure for this strategy."""
        raise NotImplementedError

    def plan_settings(self, spec: ModelSpec, world_size: int, on_cuda: bool) -> dict[str, Any]:
        """The buffer settings a dpkit run of this backend uses, as ``dpkit plan`` assumes
        them (keys of the backend's own; :func:`dpkit.plan.estimate.buffer_settings`)."""
        return {}

    def buffer_bytes(
        self,
        strategy: Strategy,
        spec: ModelSpec,
        world_size: int,
        precision: str,
        settings: Mapping[str, Any],
        grads: float,
    ) -> dict[str, float]:
        """Per-GPU communication buffers held through forward and backward, by name."""
        return {}

    def gradient_layout(
        self, strategy: Strategy, inputs: PlanInputs, settings: Mapping[str, Any]
    ) -> GradientHighWater | None:
        """The worst rank's gradient holding from the parameter layout, where the backend
        lays gradients out otherwise than the paper counts them; None elsewhere."""
        return None

    def step_bytes(
        self,
        strategy: Strategy,
        num_params: float,
        world_size: int,
        precision: str,
        grads_laid_out: bool,
    ) -> dict[str, float]:
        """Per-GPU temporaries of the optimizer step, by name."""
        return {}

    def activation_extras(
        self, strategy: Strategy, num_params: float, precision: str
    ) -> dict[str, float]:
        """What the backend adds to the bytes saved for backward (autocast's weight copies)."""
        return {}

    def activations_under_autocast(self, strategy: Strategy, precision: str) -> bool:
        """Whether the forward runs under torch autocast over fp32 weights (the plan then
        uses the trace made under autocast, which holds the weight copies
        :meth:`activation_extras` would add); False where the backend casts the weights
        themselves to 16 bits."""
        return False

    def host_bytes(self, strategy: Strategy, num_params: float, world_size: int) -> float:
        """Host bytes per GPU beyond the offloaded model states (offload's fp32 gradients)."""
        return 0.0

    def optimizer_for_plan(self, strategy: Strategy, optimizer: str) -> str | None:
        """The optimizer whose state the plan counts under ``strategy``, or None where it
        cannot run there."""
        return None if optimizer == "cpu_adam" else optimizer

    def plan_settings_text(self, settings: Mapping[str, Any]) -> str:
        """The plan's note on this backend's buffer settings ("" for none)."""
        return ""

    def plan_row_note(self, strategy: Strategy, row: Any) -> str:
        """A note under the plan's table on what one row of this backend holds ("" for none)."""
        return ""

    def unprobed_buffer_parts(self, strategy: Strategy) -> tuple[str, ...]:
        """The plan's buffer parts (:meth:`buffer_bytes`) of ``strategy`` that live only
        between the memory report's probe points, so that a run's counted tensors never
        include them (a GPU's allocator peak does)."""
        return ()

    def why(self, strategy: Strategy, row: Any, inputs: PlanInputs) -> str:
        """What choosing ``strategy`` buys and costs, for the plan's recommendation."""
        raise NotImplementedError

    # ---- checkpoints ------------------------------------------------------------------

    def loss_scaler(self, accelerator: Any) -> Any:
        """fp16's dynamic loss scaler of the run (:class:`dpkit.core.loss_scale.LossScaler`),
        or None when it scales no loss (fp32, bf16): here torch's ``GradScaler``, which
        accelerate makes for fp16 on a GPU."""
        from dpkit.core.loss_scale import TorchLossScaler

        scaler = getattr(accelerator, "scaler", None)
        return TorchLossScaler(scaler) if scaler is not None and scaler.is_enabled() else None

    def full_weights(self, accelerator: Any, module: Any) -> dict[str, Any]:
        """Every parameter at full size in fp32 by name (the main process keeps a CPU
        copy; the dict is empty elsewhere). A collective: every rank calls."""
        raise NotImplementedError

    def full_moments(self, accelerator: Any, module: Any, optimizer: Any) -> dict | None:
        """Adam moments per parameter name at full size on the main process, or None when
        no step has run yet. A collective."""
        raise NotImplementedError

    def load_moments(
        self, accelerator: Any, module: Any, optimizer: Any, moments: dict, step: Any
    ) -> None:
        """Put whole moments by name back, as this rank's part of them."""
        raise NotImplementedError

    def load_weights(self, accelerator: Any, module: Any, weights: dict) -> None:
        """Set the module's parameters (and the buffers saved) to ``weights``: whole
        tensors by name, the same on every rank. Tied parameters are saved once: the
        names a checkpoint leaves out are set through the one it keeps."""
        import torch

        with torch.no_grad():
            module.load_state_dict(weights, strict=False)

    def load_fp32_masters(self, accelerator: Any, module: Any, weights: dict) -> None:
        """Set the backend's own fp32 master copies exactly (where it keeps any)."""

    def own_shards(self, accelerator: Any, module: Any, optimizer: Any) -> dict[str, Any]:
        """This rank's part of the weights (fp32) and Adam moments, by the sharded
        checkpoint's keys (:mod:`dpkit.core.shards`); nothing is gathered. Here:
        tensors every rank holds whole, split evenly, so the ranks share the writing."""
        from dpkit.core import shards

        return shards.replicated_state(
            module, optimizer, accelerator.process_index, accelerator.num_processes
        )

    def load_own_shards(
        self,
        accelerator: Any,
        module: Any,
        optimizer: Any,
        read: Any,
        step: Any,
        *,
        with_moments: bool,
    ) -> None:
        """Fill this rank's weights and moments from a sharded checkpoint of any strategy
        and world size: ``read(shards)`` loads the ranges this rank asks for (a
        collective). Here: every tensor whole (the optimizer's state made first)."""
        from dpkit.core import shards

        targets = shards.replicated_targets(module, optimizer, step, with_moments=with_moments)
        read(targets.shards)
        targets.finish()

    # ---- bench and tune -----------------------------------------------------------------

    def accelerate_yaml(
        self, strategy: Strategy, folder: Any, overrides: Mapping[str, Any], config: Any
    ) -> str:
        """The text of dpkit's accelerate YAML for ``strategy``, to launch from any folder
        (a backend config it names made absolute, ``config`` or dpkit's own with
        :attr:`tunable` ``overrides``, written into ``folder``)."""
        from dpkit import resources

        return resources.accelerate_config(strategy.name).read_text()

    default_bucket: ClassVar[int] = 0
    """The backend's own bucket size in elements where a config gives none (0: no buckets
    that ``dpkit tune`` varies)."""

    def aligned_bucket(self, elements: float) -> int:
        """A bucket size near ``elements`` that the backend accepts (clamped to its default,
        rounded up to its alignment), for ``dpkit tune``'s variants."""
        raise NotImplementedError(f"{self.label} has no buckets dpkit tune varies")

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

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"
