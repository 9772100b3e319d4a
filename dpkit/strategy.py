"""Strategy resolution: the only module that knows DDP from ZeRO, CPU from GPU, gloo from nccl.

A recipe calls :func:`resolve_strategy` (pure, before any process group), then
:func:`build_accelerator`, then after ``accelerator.prepare`` it calls
:func:`verify_prepared`, which checks that what runs is what was asked for.

What this module works around (measured, see ../shared/STACK-NOTES.md):

* ``accelerate launch --multi_gpu`` without CUDA starts N processes that each
  train alone unless the Accelerator is built with ``cpu=True``.
* ``accelerate launch --use_deepspeed`` without CUDA counts one process and
  DeepSpeed's batch assertion fails, unless the process-group backend is given
  explicitly (gloo).
* ``accelerate launch --cpu --num_processes N`` starts one process: refused
  with the launch form to use instead.
* ``python recipe.py --strategy zero2`` has no process group for DeepSpeed:
  a one-process rendezvous on localhost is set up.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import socket
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from dpkit.errors import UsageError
from dpkit.memory_settings import bucket_elements

logger = logging.getLogger(__name__)

DS_CONFIG_DIR = Path(__file__).resolve().parents[1] / "ds_configs"
STAGE_TO_STRATEGY = {1: "zero1", 2: "zero2"}
STRATEGY_TO_STAGE = {"ddp": 0, "zero1": 1, "zero2": 2}

# A collective that does not complete within this time fails the job instead of
# hanging it (DeepSpeed's and torch's defaults are 30 minutes); --collective-timeout.
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class StrategyChoice:
    """What will run, decided from the recipe flags and the launcher's environment."""

    name: str
    """``ddp``, ``zero1`` or ``zero2``."""
    source: str
    """Where the choice came from, for the log (a flag, a launcher, a config file)."""
    ds_config_path: str | None
    """The DeepSpeed JSON the config was read from (ZeRO only)."""
    ds_template: dict | None
    """That JSON as read, ``"auto"`` values still in it (ZeRO only)."""
    expected_world_size: int
    """Processes the launcher started (``WORLD_SIZE``), checked once the group is up."""

    @property
    def zero_stage(self) -> int:
        return STRATEGY_TO_STAGE[self.name]

    @property
    def uses_deepspeed(self) -> bool:
        return self.name != "ddp"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


class _DuplicateKeyError(ValueError):
    pass


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    """``json`` keeps the last of two equal keys; DeepSpeed would see one value of two."""
    config: dict = {}
    for key, value in pairs:
        if key in config:
            raise _DuplicateKeyError(
                f"{key}={json.dumps(config[key])} and {key}={json.dumps(value)}: "
                "the key is given twice; keep one"
            )
        config[key] = value
    return config


def _read_ds_config(path: str) -> dict:
    """The JSON as written, refused (one line) if it is malformed or has a key DeepSpeed
    would ignore or reject; see :mod:`dpkit.ds_config_keys`."""
    from dpkit.ds_config_keys import check_ds_config_keys

    where = f"deepspeed config {path!r}"
    try:
        with open(path) as f:
            config = json.load(f, object_pairs_hook=_refuse_duplicate_keys)
    except FileNotFoundError:
        raise UsageError(f"{where}: no such file") from None
    except json.JSONDecodeError as err:
        raise UsageError(f"{where}: not valid JSON ({err})") from None
    except _DuplicateKeyError as err:
        raise UsageError(f"{where}: {err}") from None
    if not isinstance(config, dict):
        raise UsageError(f"{where}: must be a JSON object")
    check_ds_config_keys(config, where)
    return config


def _stage_of(config: dict, path: str) -> int:
    zero = config.get("zero_optimization", {})
    stage = zero.get("stage") if isinstance(zero, dict) else None
    if isinstance(stage, bool) or stage not in STAGE_TO_STRATEGY:
        raise UsageError(
            f"deepspeed config {path!r}: zero_optimization.stage={stage!r}; dpkit supports 1 and 2"
        )
    return stage


def check_launcher(env: Mapping[str, str]) -> None:
    """Refuse launch forms that would silently run something else than asked."""
    if env.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        raise UsageError(
            "accelerate launch --use_fsdp: dpkit runs DDP, ZeRO-1 and ZeRO-2, not FSDP"
        )
    # accelerate's simple launcher sets MASTER_PORT when more than one process was
    # asked for, but starts only one and sets no RANK.
    simple_launcher = "ACCELERATE_USE_CPU" in env and "RANK" not in env
    if simple_launcher and "MASTER_PORT" in env and "WORLD_SIZE" not in env:
        raise UsageError(
            "accelerate launch --cpu --num_processes N starts a single process; use "
            "`accelerate launch --multi_gpu --num_processes N` (dpkit runs it on CPU with gloo) "
            "or --config_file ds_configs/accelerate/ddp.yaml"
        )


def expected_world_size(env: Mapping[str, str]) -> int:
    return int(env.get("WORLD_SIZE", "1"))


def resolve_strategy(
    strategy_flag: str, deepspeed_flag: str | None, env: Mapping[str, str] | None = None
) -> StrategyChoice:
    """Decide the strategy from ``--strategy``, ``--deepspeed`` and the launcher.

    The launcher's choice (an accelerate DeepSpeed config, or ``--deepspeed``
    given to the recipe by the deepspeed launcher) and ``--strategy`` must agree;
    ``--strategy auto`` follows the launcher and falls back to ``ddp``.
    """
    env = os.environ if env is None else env
    check_launcher(env)
    world_size = expected_world_size(env)

    launcher_path: str | None = None
    launcher_source = ""
    if env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        launcher_path = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or None
        launcher_source = "accelerate launch (DeepSpeed)"
        if launcher_path is None:
            stage = int(env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))
            if stage not in STAGE_TO_STRATEGY:
                raise UsageError(
                    f"accelerate launch --zero_stage {stage}: dpkit supports ZeRO stages 1 and 2"
                )
            launcher_path = str(DS_CONFIG_DIR / f"zero{stage}.json")
    accelerate_without_ds = "ACCELERATE_DYNAMO_BACKEND" in env and not launcher_source

    if deepspeed_flag is not None:
        if launcher_path is not None:
            flag_stage = _stage_of(_read_ds_config(deepspeed_flag), deepspeed_flag)
            launcher_stage = _stage_of(_read_ds_config(launcher_path), launcher_path)
            if flag_stage != launcher_stage:
                raise UsageError(
                    f"--deepspeed={deepspeed_flag!r} is ZeRO-{flag_stage} but {launcher_source} "
                    f"is ZeRO-{launcher_stage}: drop one of them"
                )
        launcher_path, launcher_source = deepspeed_flag, f"--deepspeed {deepspeed_flag}"

    if launcher_path is not None:
        template = _read_ds_config(launcher_path)
        launcher_strategy = STAGE_TO_STRATEGY[_stage_of(template, launcher_path)]
        if strategy_flag not in ("auto", launcher_strategy):
            raise UsageError(
                f"--strategy={strategy_flag} conflicts with {launcher_source} "
                f"({launcher_strategy}): drop one of them"
            )
        return StrategyChoice(
            launcher_strategy, launcher_source, launcher_path, template, world_size
        )

    if strategy_flag in ("auto", "ddp"):
        source = "--strategy ddp" if strategy_flag == "ddp" else "default (no DeepSpeed config)"
        return StrategyChoice("ddp", source, None, None, world_size)

    if accelerate_without_ds:
        raise UsageError(
            f"--strategy={strategy_flag} conflicts with accelerate launch without DeepSpeed: "
            f"use --config_file ds_configs/accelerate/{strategy_flag}.yaml"
        )
    path = str(DS_CONFIG_DIR / f"{strategy_flag}.json")
    return StrategyChoice(
        strategy_flag, f"--strategy {strategy_flag}", path, _read_ds_config(path), world_size
    )


def resolve_precision(flag: str | None, env: Mapping[str, str] | None = None) -> str:
    """The flag wins over the launcher's default ``no``; two explicit, different values conflict."""
    env = os.environ if env is None else env
    launcher = env.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if flag is not None and launcher not in ("no", flag):
        raise UsageError(
            f"--mixed-precision={flag} conflicts with the launcher's mixed_precision={launcher}"
        )
    precision = flag or launcher
    if precision not in ("no", "bf16", "fp16"):
        raise UsageError(f"mixed_precision={precision!r}: dpkit supports no, bf16 and fp16")
    if precision == "fp16" and not _cuda_available():
        source = "--mixed-precision" if flag else "the launcher's mixed_precision"
        raise UsageError(f"{source}=fp16: needs a CUDA GPU; use bf16 on CPU")
    return precision


def _set_if_auto(config: dict, key: str, value: Any, where: str, why: str = "") -> None:
    """Fill ``"auto"``; a value the user wrote must equal what the recipe runs with."""
    current = config.get(key, "auto")
    if current == "auto":
        config[key] = value
    elif current != value:
        raise UsageError(
            f"deepspeed config {where}{key}={current!r} disagrees with the recipe's {value!r}"
            f'{why}: set it to "auto" or change the recipe flag'
        )


def fill_deepspeed_config(
    template: dict,
    *,
    micro_batch_size: int,
    gradient_accumulation_steps: int,
    world_size: int,
    max_grad_norm: float,
    precision: str,
    hidden_size: int | None,
    learning_rate: float,
    weight_decay: float,
    zero_settings: dict | None = None,
) -> dict:
    """Resolve every ``"auto"`` so that the batch identity holds by construction:
    ``train_batch_size = micro_batch x gradient_accumulation x world_size``.

    ``zero_settings`` (from :func:`dpkit.memory_settings.zero_memory_settings`)
    fills the ``zero_optimization`` keys left ``"auto"``; values the user wrote stay.
    """
    config = copy.deepcopy(template)
    _set_if_auto(config, "train_micro_batch_size_per_gpu", micro_batch_size, "")
    _set_if_auto(config, "gradient_accumulation_steps", gradient_accumulation_steps, "")
    _set_if_auto(
        config,
        "train_batch_size",
        micro_batch_size * gradient_accumulation_steps * world_size,
        "",
        f" (micro_batch {micro_batch_size} x accumulation {gradient_accumulation_steps} "
        f"x world_size {world_size})",
    )
    _set_if_auto(config, "gradient_clipping", float(max_grad_norm), "")
    for name in ("bf16", "fp16"):
        section = config.setdefault(name, {})
        _set_if_auto(section, "enabled", precision == name, f"{name}.")
        if not section["enabled"]:
            # DeepSpeed reads fp16's loss-scaling keys only when fp16 is on.
            config[name] = {"enabled": False}

    zero = config.setdefault("zero_optimization", {})
    # Buckets sized to the model (dpkit.memory_settings) instead of DeepSpeed's 5e8
    # default, which for a model under ~100M parameters is a bucket larger than all
    # the gradients together; refined once the parameter count is known.
    bucket = bucket_elements(hidden_size)
    # contiguous_gradients/overlap_comm: DeepSpeed's own defaults until
    # PreparedStrategy.apply_model_settings() knows the model's sizes.
    settings = {
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
        "contiguous_gradients": True,
        "overlap_comm": False,
        **(zero_settings or {}),
    }
    for key in ("reduce_bucket_size", "allgather_bucket_size"):
        zero.setdefault(key, "auto")
    for key, value in settings.items():
        if zero.get(key) == "auto":
            zero[key] = value

    # A user-defined optimizer/scheduler section gets the recipe's lr and decay.
    for section_name, key, value in (
        ("optimizer", "lr", learning_rate),
        ("optimizer", "weight_decay", weight_decay),
    ):
        params = config.get(section_name, {}).get("params")
        if isinstance(params, dict) and key in params:
            _set_if_auto(params, key, value, f"{section_name}.params.")

    leftover = [path for path, value in _walk(config) if value == "auto"]
    if leftover:
        raise UsageError(f'deepspeed config: dpkit cannot fill {", ".join(leftover)}="auto"')
    identity = micro_batch_size * gradient_accumulation_steps * world_size
    if config["train_batch_size"] != identity:
        raise UsageError(
            f"deepspeed config train_batch_size={config['train_batch_size']} != micro_batch "
            f"{micro_batch_size} x accumulation {gradient_accumulation_steps} x world_size {world_size}"
        )
    return config


def _walk(node: Any, prefix: str = ""):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _walk(value, f"{prefix}{key}.")
    else:
        yield prefix.rstrip("."), node


def skip_deepspeed_cpu_shm_op() -> None:
    """Keep DeepSpeed's CPU backend from building and mapping its shared-memory all-reduce.

    Training never calls it (only ``inference_all_reduce`` does), yet under the
    ``deepspeed`` launcher it JIT-compiles a C++ op on first use and writes a 66 MB
    ``/dev/shm/deepspeed_allreduce_buffer_*`` segment per rank that it never unlinks.
    Measured here: leaked segments filled a 24 GiB machine's RAM, a rank was killed
    while holding the compile lock, and every later DeepSpeed run hung in its init.
    Call before DeepSpeed's comm backend starts.
    """
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        # DeepSpeed's own switch: an op marked incompatible is never built or loaded.
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ensure_single_process_rendezvous() -> None:
    """DeepSpeed needs a process group even for one process (plain ``python recipe.py``)."""
    if "RANK" in os.environ:
        return
    os.environ.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
    )


@dataclass
class RunInfo:
    """What really runs, read back from accelerate/torch after ``prepare``."""

    strategy: str
    strategy_source: str
    distributed_type: str
    world_size: int
    backend: str | None
    device: str
    wrapper: str
    zero_stage: int
    precision: str
    micro_batch_size: int
    gradient_accumulation_steps: int
    global_batch_size: int
    learning_rate: float

    def describe(self) -> str:
        return (
            f"strategy={self.strategy} ({self.strategy_source}) | world_size={self.world_size} | "
            f"distributed_type={self.distributed_type} | wrapper={self.wrapper} | "
            f"zero_stage={self.zero_stage} | backend={self.backend} | device={self.device} | "
            f"precision={self.precision} | global_batch={self.global_batch_size} "
            f"(micro {self.micro_batch_size} x accumulation {self.gradient_accumulation_steps} "
            f"x processes {self.world_size}) | lr={self.learning_rate:g}"
        )

    def as_dict(self) -> dict:
        return asdict(self)


def scaled_learning_rate(base_lr: float, rule: str, world_size: int, accumulation: int) -> float:
    """Scale the lr with the global batch relative to one process without accumulation."""
    factor = world_size * accumulation
    if rule == "linear":
        return base_lr * factor
    if rule == "sqrt":
        return base_lr * math.sqrt(factor)
    return base_lr


@dataclass
class PreparedStrategy:
    """Everything the recipe needs from this module, built once."""

    accelerator: Any
    choice: StrategyChoice
    precision: str
    ds_config: dict | None
    micro_batch_size: int
    gradient_accumulation_steps: int

    @property
    def world_size(self) -> int:
        return self.accelerator.num_processes

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps * self.world_size

    @property
    def analytic_precision(self) -> str:
        """Precision in :mod:`dpkit.analytic` terms."""
        return "fp32" if self.precision == "no" else self.precision

    def apply_model_settings(self, model) -> dict:
        """Fill the ZeRO memory settings that depend on the model (bucket sizes,
        contiguous gradients) into the live DeepSpeed config, before ``prepare``.

        Only keys the user's JSON left ``"auto"`` (or omitted, for the buckets)
        change; :mod:`dpkit.memory_settings` argues each value. Returns them.
        """
        if self.ds_config is None:
            return {}
        from dpkit.memory_settings import zero_memory_settings
        from dpkit.models import count_parameters

        params = list(model.parameters())
        hidden = getattr(getattr(model, "config", None), "hidden_size", None)
        settings = zero_memory_settings(
            count_parameters(model),
            hidden,
            world_size=self.choice.expected_world_size,
            stage=self.choice.zero_stage,
            largest_param_numel=max(p.numel() for p in params),
            on_cuda=_cuda_available(),
        )
        template = (self.choice.ds_template or {}).get("zero_optimization", {})
        live = self.accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"]
        applied = {}
        for key, value in settings.items():
            default = "auto" if key.endswith("bucket_size") else None
            if template.get(key, default) == "auto":
                live[key] = value
                self.ds_config["zero_optimization"][key] = value
                applied[key] = value
        return applied

    def make_optimizer(self, params, lr: float, weight_decay: float):
        """torch AdamW for every strategy, so losses compare across strategies; a
        DeepSpeed JSON with its own ``optimizer`` section gets accelerate's DummyOptim."""
        import torch
        from accelerate.utils import DummyOptim

        if self.ds_config is not None and "optimizer" in self.ds_config:
            return DummyOptim(params, lr=lr, weight_decay=weight_decay)
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)

    def make_scheduler(self, name: str, optimizer, warmup_steps: int, total_steps: int):
        from accelerate.utils import DummyScheduler
        from transformers import get_scheduler

        if self.ds_config is not None and "scheduler" in self.ds_config:
            return DummyScheduler(
                optimizer, total_num_steps=total_steps, warmup_num_steps=warmup_steps
            )
        return get_scheduler(
            name, optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps
        )

    def verify_prepared(self, model, optimizer, learning_rate: float) -> RunInfo:
        """Check the prepared objects against the choice; a mismatch is an error, not a warning."""
        import torch.distributed as dist

        acc = self.accelerator
        world_size = acc.num_processes
        if world_size != self.choice.expected_world_size:
            raise RuntimeError(
                f"the launcher started {self.choice.expected_world_size} processes but the process "
                f"group has {world_size}: the processes would train unconnected copies"
            )
        wrapper = type(model).__name__
        zero_stage = 0
        if self.choice.uses_deepspeed:
            engine = acc.deepspeed_engine_wrapped.engine if acc.deepspeed_engine_wrapped else model
            zero_stage = int(engine.zero_optimization_stage())
            inner = type(getattr(optimizer, "optimizer", optimizer)).__name__
            wrapper = f"{type(engine).__name__}+{inner}"
            if zero_stage != self.choice.zero_stage:
                raise RuntimeError(
                    f"asked for ZeRO-{self.choice.zero_stage}, DeepSpeed runs stage {zero_stage}"
                )
        elif world_size > 1 and wrapper != "DistributedDataParallel":
            raise RuntimeError(
                f"{world_size} processes but the model is not wrapped in DDP ({wrapper})"
            )
        backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else None
        return RunInfo(
            strategy=self.choice.name,
            strategy_source=self.choice.source,
            distributed_type=str(acc.distributed_type).split(".")[-1],
            world_size=world_size,
            backend=backend,
            device=str(acc.device),
            wrapper=wrapper,
            zero_stage=zero_stage,
            precision=self.precision,
            micro_batch_size=self.micro_batch_size,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            global_batch_size=self.global_batch_size,
            learning_rate=learning_rate,
        )


def build_accelerator(
    choice: StrategyChoice,
    *,
    precision: str,
    micro_batch_size: int,
    gradient_accumulation_steps: int,
    max_grad_norm: float,
    hidden_size: int | None,
    learning_rate: float,
    weight_decay: float,
    data_seed: int,
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
    log_with: str | None = None,
    project_dir: str | None = None,
) -> PreparedStrategy:
    """Build the Accelerator for ``choice``: backend, CPU/GPU, DDP kwargs or the resolved ZeRO config.

    Call :meth:`PreparedStrategy.apply_model_settings` once the model exists.
    """
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.utils import (
        DataLoaderConfiguration,
        DistributedDataParallelKwargs,
        InitProcessGroupKwargs,
    )

    from dpkit import guards
    from dpkit.memory_settings import ddp_kwargs

    on_cuda = _cuda_available()
    backend = "nccl" if on_cuda else "gloo"
    handlers: list = []
    if choice.expected_world_size > 1 or choice.uses_deepspeed:
        # Naming the backend is what makes `accelerate launch --use_deepspeed` form a
        # real N-process group on CPU; a single plain process must not get one.
        handlers.append(
            InitProcessGroupKwargs(backend=backend, timeout=timedelta(seconds=collective_timeout_s))
        )
        # The one-line message for a collective that timed out names this value.
        guards.COLLECTIVE_TIMEOUT_S = collective_timeout_s
    ds_config = None
    plugin = None
    if choice.uses_deepspeed:
        _ensure_single_process_rendezvous()
        ds_config = fill_deepspeed_config(
            choice.ds_template or {},
            micro_batch_size=micro_batch_size,
            gradient_accumulation_steps=gradient_accumulation_steps,
            world_size=choice.expected_world_size,
            max_grad_norm=max_grad_norm,
            precision=precision,
            hidden_size=hidden_size,
            learning_rate=learning_rate,
            weight_decay=weight_decay,
        )
        # The launcher's settings (gradient accumulation, clipping, precision from an
        # accelerate YAML) were read by resolve_strategy/resolve_precision and are in
        # the resolved dict; accelerate would refuse them next to a config file.
        os.environ.pop("ACCELERATE_CONFIG_DS_FIELDS", None)
        skip_deepspeed_cpu_shm_op()
        plugin = DeepSpeedPlugin(hf_ds_config=copy.deepcopy(ds_config))
    else:
        # Gradients as views into DDP's reduction buckets: one gradient copy, not two.
        handlers.append(DistributedDataParallelKwargs(**ddp_kwargs()))

    accelerator = Accelerator(
        # Without CUDA, plain multi-process runs need cpu=True to form a gloo group
        # (otherwise each process trains alone as rank 0); DeepSpeed finds its CPU
        # accelerator itself.
        cpu=not on_cuda and not choice.uses_deepspeed,
        mixed_precision=precision,
        gradient_accumulation_steps=gradient_accumulation_steps,
        # The recipe steps the schedule once per optimizer step itself; accelerate's
        # default steps it once per process, assuming an lr schedule counted in
        # unsharded batches.
        step_scheduler_with_optimizer=False,
        deepspeed_plugin=plugin,
        # The shuffle order of epoch e is a function of (data_seed, e) alone: the same on
        # every rank and world size, and reproducible when a run resumes mid-way.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=data_seed),
        kwargs_handlers=handlers,
        log_with=log_with,
        project_dir=project_dir,
    )
    if accelerator.num_processes > 1:
        # Every rank checks --output-dir while parsing its arguments, and the main process
        # writes run_config.json there right after this returns. A lazily connected process
        # group (NCCL's default; TORCH_GLOO_LAZY_INIT=1 on CPU) lets the main process get
        # here before a slower rank (another node) has parsed: that rank then refused the
        # run as "holds another run" while the main process waited for it (measured).
        accelerator.wait_for_everyone()
    return PreparedStrategy(
        accelerator=accelerator,
        choice=choice,
        precision=precision,
        ds_config=ds_config,
        micro_batch_size=micro_batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
    )
