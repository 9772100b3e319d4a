"""``dpkit plan``: per-GPU memory of DDP, ZeRO and FSDP2 before launching, and the least sharding that fits.

    dpkit plan --model gpt2-xl                    # bundled config; 8 x 80GiB, bf16, AdamW
    dpkit plan --model llama-7b --gpu-memory 24GB --activation-checkpointing
    dpkit plan --model ./my-model/config.json --gpus-per-node 4 --nodes 2 --json
    dpkit plan --params 1.5B --precision fp32 --optimizer sgd_momentum
    dpkit plan --model minilm --task classification --num-labels 2 --micro-batch 16 --seq-len 128

``--model`` is looked up in this order: a config bundled in ``dpkit/configs``
(``gpt2``, ``gpt2-medium``, ``gpt2-large``, ``gpt2-xl``, ``llama-7b``), a local
``config.json`` or a folder holding one, then the Hugging Face Hub (or its
local cache). Only the config is read; the model is built on the meta device,
with the head ``--task`` names (``auto``: the config's own, from its
``architectures``; a bare encoder such as MiniLM's ``BertModel`` gets a sequence
classifier); the plan's ``task:`` line says which and why.

This module is the command line: the flags (:func:`add_arguments`), their
parsing into :class:`~dpkit.plan.inputs.PlanInputs` (:func:`inputs_from_args`)
and :func:`main`; ``--against RUN_DIR`` hands over to :mod:`dpkit.plan.check`.
What the plan counts is in :mod:`dpkit.plan.estimate`, what it leaves out in
:data:`dpkit.plan.output.NOT_COUNTED`.
"""

from __future__ import annotations

import argparse
import json

from dpkit.core.spec import ATTENTION_CHOICES, OPTIMIZER_CHOICES, ModelSpec, PlanInputs
from dpkit.core.units import PRECISIONS
from dpkit.errors import UsageError
from dpkit.plan import check as plan_check
from dpkit.plan.inputs import (
    ACTIVATION_METHODS,
    TASKS,
    PlannedTask,
    bundled_models,
    load_planned_model,
    parse_count,
    parse_fraction,
    parse_memory,
    parse_positive_int,
)
from dpkit.plan.output import format_table, plan_dict
from dpkit.plan.recommend import make_plan

# The sequence length defaults to the model's context, but no longer than this:
# long-context configs (128k positions) would otherwise plan for a run nobody does.
MAX_DEFAULT_SEQ_LEN = 4096


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``dpkit plan`` flags. Values are parsed in :func:`main` so that every
    bad value gets the same one-line error (argparse's own spans several lines)."""
    parser.epilog = __doc__.split("\n\n")[1] if __doc__ else None
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    model = parser.add_argument_group("model (one of)")
    model.add_argument(
        "--model",
        metavar="NAME_OR_PATH",
        help=f"bundled config ({', '.join(bundled_models())}), a config.json or its folder, "
        "or a Hub name; built on the meta device, no weights read",
    )
    model.add_argument(
        "--params", metavar="N", help="a bare parameter count (124M, 1.5B); no activations"
    )
    head = parser.add_argument_group("the model's head (with --model)")
    head.add_argument(
        "--task",
        metavar="{auto,causal_lm,classification}",
        default=None,
        help="the head the model trains with, which decides its logits' size: causal_lm "
        "(a vocabulary per token), classification (a sequence classifier, --num-labels per "
        "sample, as recipes/finetune.py trains), or auto: the config's own head (its "
        "architectures); a bare encoder (BertModel: minilm) gets a classifier, a bare "
        "decoder an LM head. Default: auto",
    )
    head.add_argument(
        "--num-labels",
        metavar="N",
        default=None,
        help="with --task classification: the classes (default: the config's, 2 where it "
        "names none)",
    )
    machine = parser.add_argument_group("machines")
    machine.add_argument("--gpus-per-node", metavar="N", default="8", help="default: 8")
    machine.add_argument("--nodes", metavar="N", default="1", help="default: 1")
    machine.add_argument(
        "--gpu-memory",
        metavar="SIZE",
        default="80GiB",
        help="per GPU: 80GiB, 24GB (GB=1e9, GiB=2**30, bare G=GiB); default: 80GiB",
    )
    machine.add_argument(
        "--host-memory",
        metavar="SIZE",
        default=None,
        help="host memory per node, shared by its GPUs' offloaded states; default: this machine's",
    )
    step = parser.add_argument_group("training step")
    step.add_argument(
        "--precision",
        metavar="{fp32,bf16,fp16}",
        default="bf16",
        help=f"{'/'.join(PRECISIONS)}; default: bf16",
    )
    step.add_argument(
        "--optimizer",
        metavar="{adamw,sgd,sgd_momentum,cpu_adam}",
        default="adamw",
        help="adamw, sgd, sgd_momentum, or cpu_adam (DeepSpeed's CPU Adam: offload only); "
        "the offload row runs AdamW as CPU Adam. Default: adamw",
    )
    step.add_argument("--micro-batch", metavar="N", default="1", help="samples per GPU; default: 1")
    step.add_argument(
        "--gradient-accumulation-steps",
        metavar="N",
        default="1",
        help="micro-batches per optimizer step (ZeRO-2 holds more gradients with more than "
        "one); default: 1",
    )
    step.add_argument(
        "--seq-len",
        metavar="N",
        default=None,
        help=f"tokens per sample; default: the model's positions, at most {MAX_DEFAULT_SEQ_LEN}",
    )
    step.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each layer in backward (keeps only layer inputs)",
    )
    step.add_argument(
        "--lora-r",
        metavar="N",
        default=None,
        help="LoRA adapters of rank N train, the other weights frozen (as a run's --lora-r): "
        "gradients and optimizer states for the adapters only",
    )
    step.add_argument(
        "--lora-target-modules",
        metavar="NAMES",
        default=None,
        help="with --lora-r: the layers that get adapters (default: peft's for the model)",
    )
    step.add_argument(
        "--attention",
        metavar="{sdpa,eager}",
        default="sdpa",
        help="sdpa (fused kernel, no scores kept) or eager (scores kept); default: sdpa",
    )
    estimate_group = parser.add_argument_group("estimate")
    estimate_group.add_argument(
        "--activation-estimate",
        metavar="{trace,formula}",
        default="trace",
        help="trace (the model's forward on the meta device) or formula "
        "(Korthikanti et al. 2022); default: trace",
    )
    estimate_group.add_argument(
        "--reserve",
        metavar="SIZE",
        default="2GiB",
        help="per GPU for what holds no tensor: the CUDA context, NCCL, the caching "
        "allocator's rounding and slack (in the total, not in the predicted peak); "
        "default: 2GiB",
    )
    estimate_group.add_argument(
        "--headroom",
        metavar="FRACTION",
        default="0.1",
        help="share of each GPU kept free for what the estimate misses; default: 0.1 (10%%)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--against",
        metavar="RUN_DIR",
        help="check the plan against a finished run (recipes/finetune.py, recipes/train_lm.py, "
        "dpkit bench): its model, strategy, world size and settings; predicted vs measured "
        "model states per category",
    )


def _choice(value: str, flag: str, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``, else the one-line error naming ``flag``."""
    if value not in choices:
        raise UsageError(f"{flag}={value!r}: not one of {', '.join(choices)}")
    return value


def inputs_from_args(args: argparse.Namespace) -> PlanInputs:
    """Parse and check the flags (one-line UsageError on the first bad one)."""
    return request_from_args(args)[0]


def request_from_args(args: argparse.Namespace) -> tuple[PlanInputs, PlannedTask | None]:
    """Parse and check the flags (one-line UsageError on the first bad one): the inputs,
    and the head the model was built with (None for a bare ``--params``)."""
    if args.model is None and args.params is None:
        raise UsageError(
            "--model / --params: neither given; give --model NAME_OR_FOLDER "
            "(gpt2, minilm, a Hub name, a folder) or --params N (e.g. 1.5B)"
        )
    if args.model is not None and args.params is not None:
        raise UsageError(
            f"--model={args.model!r} / --params={args.params!r}: give exactly one of them"
        )
    precision = _choice(args.precision, "--precision", PRECISIONS)
    optimizer = _choice(args.optimizer, "--optimizer", OPTIMIZER_CHOICES)
    attention = _choice(args.attention, "--attention", ATTENTION_CHOICES)
    method = _choice(args.activation_estimate, "--activation-estimate", ACTIVATION_METHODS)
    gpus_per_node = parse_positive_int(args.gpus_per_node, "--gpus-per-node")
    nodes = parse_positive_int(args.nodes, "--nodes")
    gpu_memory = parse_memory(args.gpu_memory, "--gpu-memory")
    if gpu_memory <= 0:
        raise UsageError(f"--gpu-memory={args.gpu_memory!r}: must be positive")
    reserve = parse_memory(args.reserve, "--reserve")
    host_memory = None
    if args.host_memory is not None:
        host_memory = parse_memory(args.host_memory, "--host-memory")
        if host_memory <= 0:
            raise UsageError(f"--host-memory={args.host_memory!r}: must be positive")
    headroom = parse_fraction(args.headroom, "--headroom")
    micro_batch = parse_positive_int(args.micro_batch, "--micro-batch")
    accumulation = parse_positive_int(
        args.gradient_accumulation_steps, "--gradient-accumulation-steps"
    )
    seq_len = None if args.seq_len is None else parse_positive_int(args.seq_len, "--seq-len")
    task = "auto" if args.task is None else _choice(args.task, "--task", TASKS)
    num_labels = (
        None if args.num_labels is None else parse_positive_int(args.num_labels, "--num-labels")
    )
    if args.params is not None and (args.task is not None or num_labels is not None):
        flag = f"--task={args.task!r}" if args.task is not None else f"--num-labels={num_labels}"
        raise UsageError(
            f"{flag}: needs --model (the head's shapes come from its config), not a bare --params"
        )
    lora = None
    if args.lora_r is not None:
        from dpkit.lora import LoraSettings

        if args.params is not None:
            raise UsageError(
                f"--lora-r={args.lora_r}: needs --model (the adapters' layers and sizes come "
                "from its config), not a bare --params"
            )
        lora = LoraSettings.from_flags(
            {
                "lora_r": parse_positive_int(args.lora_r, "--lora-r"),
                "lora_target_modules": args.lora_target_modules,
            }
        )
    elif args.lora_target_modules is not None:
        raise UsageError(
            f"--lora-target-modules={args.lora_target_modules}: has no effect without --lora-r"
        )
    planned = None
    if args.params is not None:
        spec = ModelSpec(name=args.params, source="count", num_params=parse_count(args.params))
    else:
        spec, planned = load_planned_model(args.model, task, num_labels, lora=lora)
    if seq_len is None:
        seq_len = min(spec.max_positions or 1024, MAX_DEFAULT_SEQ_LEN)
    inputs = PlanInputs(
        model=spec,
        gpus_per_node=gpus_per_node,
        nodes=nodes,
        gpu_memory=gpu_memory,
        precision=precision,
        optimizer=optimizer,
        micro_batch=micro_batch,
        gradient_accumulation_steps=accumulation,
        seq_len=seq_len,
        activation_checkpointing=args.activation_checkpointing,
        attention=attention,
        activation_method=method,
        reserve=reserve,
        headroom=headroom,
        host_memory=host_memory,
    )
    return inputs, planned


def main(args: argparse.Namespace) -> int:
    """Run ``dpkit plan``; bad input raises UsageError (exit code 2 from the CLI)."""
    if args.against is not None:
        if args.model is not None or args.params is not None:
            raise UsageError(
                f"--against={args.against!r}: the run says which model; drop --model/--params"
            )
        check = plan_check.check_run(args.against)
        text = json.dumps(plan_check.check_dict(check), indent=2)
        print(text if args.json else plan_check.format_check(check))
        return 0
    plan = make_plan(*request_from_args(args))
    print(json.dumps(plan_dict(plan), indent=2) if args.json else format_table(plan))
    return 0
