"""What the launcher asked for: the strategy and precision, from the flags and the launcher's environment, in one pass.

Pure functions of their arguments (the environment is one of them), called before
any process group exists, so every conflict is a one-line
:class:`~dpkit.errors.UsageError`. Each engine reads its own launcher configuration
(:meth:`dpkit.engines.base.Engine.launched`: an accelerate FSDP or DeepSpeed config, a
``--deepspeed`` JSON) and refuses a ``--strategy`` that contradicts it; what this module
works around itself (measured, see docs/stack-notes.md):

* ``accelerate launch --cpu --num_processes N`` starts one process: refused with
  the launch form to use instead.
* A strategy flag that contradicts the launcher is refused rather than one of them
  winning (the engines' messages).
* DeepSpeed settings an accelerate YAML gives (accumulation, clipping, offload):
  honoured where they agree with the run, refused where they do not (accelerate
  would otherwise drop them without a word beside a DeepSpeed config file).
* More NCCL processes on a node than visible GPUs: accelerate gives each process
  ``cuda:(LOCAL_RANK % device_count)``, so two ranks share a GPU, which NCCL refuses
  once the group is up; refused before it (:func:`check_ranks_per_gpu`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dpkit.core.launch import Launch
from dpkit.engines import ENGINES, REFERENCE, engine_of, get_strategy
from dpkit.errors import UsageError

PRECISIONS = ("no", "bf16", "fp16")
# Where launchers say how many processes they started on this node: torchrun and
# accelerate launch, the deepspeed launcher, Open MPI's mpirun.
LOCAL_PROCESS_COUNT_VARIABLES = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")


def check_launcher(env: Mapping[str, str]) -> None:
    """Refuse launch forms that would silently run something else than asked."""
    # accelerate's simple launcher sets MASTER_PORT when more than one process was
    # asked for, but starts only one and sets no RANK.
    simple_launcher = "ACCELERATE_USE_CPU" in env and "RANK" not in env
    if simple_launcher and "MASTER_PORT" in env and "WORLD_SIZE" not in env:
        raise UsageError(
            "accelerate launch --cpu --num_processes N starts a single process; use "
            "`accelerate launch --multi_gpu --num_processes N` (dpkit runs it on CPU with gloo) "
            "or --config_file ds_configs/accelerate/ddp.yaml"
        )


def read_launch(args: Any, env: Mapping[str, str], *, on_cuda: bool) -> Launch:
    """The strategy from ``--strategy``, ``--deepspeed`` and the launcher, and the precision.

    An engine whose launcher configuration is present (first an accelerate FSDP launch,
    then a DeepSpeed config or ``--deepspeed``) decides, refusing a ``--strategy`` that
    contradicts it; otherwise ``--strategy`` does (``auto``: DDP), its engine checking
    that the launcher can run it.
    """
    check_launcher(env)
    named = None if args.strategy == "auto" else get_strategy(args.strategy)
    if args.deepspeed is not None and named is not None and not engine_of(named).reads_config_file:
        raise UsageError(
            f"--strategy={args.strategy} conflicts with --deepspeed={args.deepspeed!r}: "
            f"{engine_of(named).label} takes no DeepSpeed config; drop one of them"
        )
    world_size = int(env.get("WORLD_SIZE", "1"))
    # The first engine whose launcher started this process (accelerate's or DeepSpeed's
    # own env, a DeepSpeed JSON); none: the flag (or DDP) says.
    launch = next(
        (found for engine in ENGINES if (found := engine.launched(args, env)) is not None), None
    )
    if launch is None:
        strategy = REFERENCE if args.strategy == "auto" else get_strategy(args.strategy)
        launch = engine_of(strategy).from_flag(strategy, args, env)
    precision = read_precision(args.mixed_precision, env, on_cuda=on_cuda)
    return Launch(
        strategy=launch.strategy,
        source=launch.source,
        precision=precision,
        world_size=world_size,
        config_path=launch.config_path,
        config_template=launch.config_template,
        fsdp_layer_override=launch.fsdp_layer_override,
        notes=launch.notes,
    )


def read_precision(flag: str | None, env: Mapping[str, str], *, on_cuda: bool) -> str:
    """The flag wins over the launcher's default ``no``; two explicit, different values conflict."""
    launcher = env.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if flag is not None and launcher not in ("no", flag):
        raise UsageError(
            f"--mixed-precision={flag} conflicts with the launcher's mixed_precision={launcher}"
        )
    precision = flag or launcher
    if precision not in PRECISIONS:
        raise UsageError(f"mixed_precision={precision!r}: dpkit supports no, bf16 and fp16")
    if precision == "fp16" and not on_cuda:
        source = "--mixed-precision" if flag else "the launcher's mixed_precision"
        raise UsageError(f"{source}=fp16: needs a CUDA GPU; use bf16 on CPU")
    return precision


def check_accelerate_settings(
    env: Mapping[str, str], *, gradient_accumulation_steps: int, max_grad_norm: float
) -> None:
    """DeepSpeed settings from an accelerate config must agree with the run's own flags."""
    given = env.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
    if given not in (None, "", "auto") and int(given) != gradient_accumulation_steps:
        raise UsageError(
            f"accelerate config gradient_accumulation_steps={given} disagrees with the run's "
            f"{gradient_accumulation_steps} (--gradient-accumulation-steps): make them equal"
        )
    given = env.get("ACCELERATE_GRADIENT_CLIPPING")
    if given not in (None, "", "auto", "none") and float(given) != float(max_grad_norm):
        raise UsageError(
            f"accelerate config gradient_clipping={given} disagrees with the run's "
            f"{max_grad_norm:g} (--max-grad-norm): make them equal"
        )


def local_process_count(env: Mapping[str, str]) -> tuple[int, str]:
    """How many processes the launcher started on this node, and where that was read
    (``LOCAL_WORLD_SIZE=8``), for the error line.

    Without a count, ``LOCAL_RANK`` gives a lower bound (this rank and those below it);
    without either, this process is alone (``python recipe.py``).
    """
    for name in LOCAL_PROCESS_COUNT_VARIABLES:
        value = env.get(name, "")
        if value:
            return int(value), f"{name}={value}"
    local_rank = env.get("LOCAL_RANK", "")
    if local_rank:
        count = int(local_rank) + 1
        return count, f"LOCAL_RANK={local_rank}, so at least {count}"
    return 1, "1"


def check_ranks_per_gpu(
    local_processes: int, visible_cuda_devices: int, *, source: str | None = None
) -> None:
    """Refuse a NCCL launch that would put two ranks of one communicator on one GPU.

    accelerate maps each process to ``cuda:(LOCAL_RANK % device_count)``, so with more
    processes on a node than visible devices two ranks share one; NCCL refuses that
    (docs/stack-notes.md), but only once the process group is up, in an error
    that names neither the launch flag nor the count. Call before the group starts.

    Args:
        local_processes: processes the launcher started on this node
            (:func:`local_process_count`).
        visible_cuda_devices: ``torch.cuda.device_count()``, which honours
            ``CUDA_VISIBLE_DEVICES``; 0 means a CPU run (gloo), which this does not concern.
        source: how the launcher gave ``local_processes``, for the message (default
            ``LOCAL_WORLD_SIZE=<local_processes>``).
    """
    if visible_cuda_devices <= 0 or local_processes <= visible_cuda_devices:
        return
    source = source or f"LOCAL_WORLD_SIZE={local_processes}"
    devices = "device" if visible_cuda_devices == 1 else "devices"
    n = visible_cuda_devices
    raise UsageError(
        f"{source} processes on this node but {n} visible CUDA {devices}: NCCL refuses two "
        f"ranks on one GPU; start one process per visible GPU (torchrun --nproc_per_node {n}, "
        f"deepspeed --num_gpus {n}, accelerate launch --num_processes {n} per machine) "
        "or make more GPUs visible (CUDA_VISIBLE_DEVICES)"
    )
