"""``dpkit consolidate``: a checkpoint to a Hugging Face model folder (fp32, safetensors).

Takes either
* a dpkit checkpoint (``<run>/checkpoints/step-*``): verified against its manifest,
  then its model files are copied (the full layout's are consolidated already) or, from
  a sharded checkpoint, streamed one tensor at a time into safetensors files;
  a LoRA run's gives peft's adapter folder, or with ``--merge-lora`` the model with
  the adapters merged into its weights. ``--with-optimizer`` writes the full
  (single-file) checkpoint layout instead: the model folder plus ``optimizer.pt``
  (every Adam moment by parameter name), the scheduler, RNG and trainer state, and a
  manifest, which ``--resume`` reads at any strategy and world size; or
* a DeepSpeed ZeRO checkpoint (what ``engine.save_checkpoint`` or accelerate's
  ``save_state`` writes under DeepSpeed): DeepSpeed's own ``zero_to_fp32`` merges the
  shards of every rank into fp32 weights, loaded into the architecture of ``--model``.

The result loads with ``from_pretrained`` in a process without DeepSpeed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
from pathlib import Path

from dpkit.errors import UsageError

# What a dpkit checkpoint holds beyond the Hugging Face model folder.
_TRAINING_STATE = {
    "optimizer.pt",
    "scheduler.pt",
    "rng.pt",
    "trainer_state.json",
    "manifest.json",
    "tensors.json",
    "loss_scale.json",
}
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
"""Past this, the model's weights are split over several safetensors files (what
``save_pretrained`` does; each is held in memory while written)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint", help="a dpkit checkpoint folder, or a DeepSpeed checkpoint folder"
    )
    parser.add_argument("--output-dir", required=True, help="where to write the model folder")
    parser.add_argument(
        "--model",
        help="DeepSpeed checkpoints: the model the run trained (Hub name or folder), for its "
        "architecture, config and tokenizer",
    )
    parser.add_argument(
        "--tag",
        help="DeepSpeed checkpoints: the tag folder to read (default: the one named in 'latest')",
    )
    parser.add_argument(
        "--merge-lora",
        action="store_true",
        help="a LoRA checkpoint (--lora-r): write the model with the adapters merged into "
        "its weights (loads with from_pretrained, no peft) instead of peft's adapter folder",
    )
    parser.add_argument(
        "--max-shard-mb",
        type=float,
        help="a sharded checkpoint's weights go into safetensors files of at most this many "
        f"MiB each (one file is held in memory while written; default "
        f"{DEFAULT_MAX_SHARD_BYTES // 1024**2})",
    )
    parser.add_argument(
        "--with-optimizer",
        action="store_true",
        help="a dpkit checkpoint: write the full checkpoint layout (one model.safetensors, "
        "optimizer.pt with every Adam moment by parameter name, scheduler, RNG, trainer "
        "state, manifest; --resume reads it) instead of the model folder alone. Holds the "
        "weights and moments in memory at once",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing non-empty --output-dir"
    )


def _deepspeed_tag(checkpoint: Path, tag: str | None) -> str:
    """The tag to read; refused in one line where DeepSpeed would return None or guess."""
    tags = sorted(
        p.name for p in checkpoint.iterdir() if p.is_dir() and list(p.glob("*optim_states.pt"))
    )
    if not tags:
        raise UsageError(
            f"checkpoint={str(checkpoint)!r}: neither a dpkit checkpoint (manifest.json) nor a "
            "DeepSpeed one (no <tag>/*optim_states.pt)"
        )
    if tag is None:
        latest = checkpoint / "latest"
        if not latest.is_file():
            raise UsageError(
                f"checkpoint={str(checkpoint)!r}: no 'latest' file; pass --tag (one of: "
                f"{', '.join(tags)})"
            )
        tag = latest.read_text().strip()
    if tag not in tags:
        raise UsageError(f"--tag={tag!r}: not in {str(checkpoint)!r} (found: {', '.join(tags)})")
    return tag


def _model_for(state_dict: dict, config, model: str):
    """The architecture whose parameters are exactly the checkpoint's: the config's own,
    or a task head on it (a classifier fine-tuned from an encoder-only checkpoint)."""
    import torch
    import transformers

    candidates = [getattr(transformers, a) for a in (config.architectures or [])]
    classifier = [v for k, v in state_dict.items() if k.startswith(("classifier.", "score."))]
    if classifier:
        config.num_labels = classifier[0].shape[0]
        candidates.append(transformers.AutoModelForSequenceClassification)
    candidates += [transformers.AutoModelForCausalLM, transformers.AutoModel]
    for candidate in candidates:
        build = getattr(candidate, "from_config", None) or candidate
        try:
            with torch.device("meta"):
                probe = build(config)
        except ValueError:  # this auto class has no mapping for the config
            continue
        tied = set(getattr(probe, "_tied_weights_keys", None) or [])
        expected = set(probe.state_dict())
        missing = expected - set(state_dict) - tied
        if not missing and set(state_dict) <= expected:
            return build(config).float()
    raise UsageError(
        f"--model={model!r}: no architecture of its config matches the checkpoint's "
        f"{len(state_dict)} tensors (e.g. {sorted(state_dict)[:2]})"
    )


def _checkpoint_weights(checkpoint: Path) -> dict:
    """Every weight of a dpkit checkpoint, whole, by name (full: its ``model.safetensors``;
    sharded: read from the shards on this one process)."""
    from safetensors.torch import load_file

    from dpkit.core import shards

    if not shards.is_sharded(checkpoint):
        return load_file(checkpoint / "model.safetensors")
    index = shards.TensorIndex.read(checkpoint)
    return {name: index.weight(checkpoint, name) for name in index.shapes}


def _lora_model(checkpoint: Path):
    """The checkpoint's peft model: the base architecture from its ``config.json``, every
    weight (base and adapters) from the checkpoint."""
    import transformers
    from peft import LoraConfig, get_peft_model

    config = transformers.AutoConfig.from_pretrained(checkpoint)
    model_class = getattr(transformers, (config.architectures or [""])[0], None)
    if model_class is None:
        raise UsageError(
            f"checkpoint={str(checkpoint)!r}: its config.json names no transformers "
            f"architecture ({config.architectures}); load the adapters with peft instead"
        )
    lora_config = LoraConfig.from_pretrained(checkpoint)
    base = model_class._from_config(config).float()
    base.name_or_path = lora_config.base_model_name_or_path  # the model it was trained from
    model = get_peft_model(base, lora_config)
    incompatible = model.load_state_dict(_checkpoint_weights(checkpoint), strict=False)
    tied = set(getattr(model.get_base_model(), "_tied_weights_keys", None) or [])
    missing = [
        k for k in incompatible.missing_keys if k.removeprefix("base_model.model.") not in tied
    ]
    if missing or incompatible.unexpected_keys:
        raise UsageError(
            f"checkpoint={str(checkpoint)!r}: its weights are not its model's "
            f"(missing {missing[:2]}, unexpected {incompatible.unexpected_keys[:2]})"
        )
    return model


def write_full_layout(checkpoint: Path, output_dir: Path) -> int:
    """A sharded checkpoint rewritten in the full layout (what ``--checkpoint-format
    full`` saves): ``model.safetensors`` with every weight, ``optimizer.pt`` with every
    Adam moment by parameter name, the step and the lrs, the run's scheduler, RNG,
    trainer state and loss scale as saved, and a new manifest. The model's other files
    (config, tokenizer) are already in ``output_dir``. Read on this one process; the
    weights, then the moments, are held whole while written. Returns the number of
    moments written."""
    import torch
    from safetensors.torch import save_file

    from dpkit.checkpoints.folder import LOSS_SCALE_FILE, write_manifest
    from dpkit.checkpoints.state import optimizer_file_state
    from dpkit.core import shards

    index = shards.TensorIndex.read(checkpoint)
    weights = {name: index.weight(checkpoint, name) for name in index.shapes}
    save_file(weights, str(output_dir / "model.safetensors"), {"format": "pt"})
    del weights
    moments = {
        name: {
            moment: shards.read_tensor(
                checkpoint, shards.moment_key(name, moment), index.shapes[name], torch.float32
            )
            for moment in saved
        }
        for name, saved in index.moments.items()
    }
    torch.save(
        optimizer_file_state(index.step, moments, index.param_group_lrs),
        output_dir / "optimizer.pt",
    )
    for name in ("scheduler.pt", "rng.pt", "trainer_state.json", LOSS_SCALE_FILE):
        if (checkpoint / name).is_file():
            shutil.copy2(checkpoint / name, output_dir / name)
    write_manifest(output_dir)
    return sum(len(saved) for saved in moments.values())


def stream_to_model_folder(
    checkpoint: Path, output_dir: Path, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> int:
    """The weights of a sharded checkpoint as safetensors files a ``from_pretrained``
    reads (``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` with their
    index past ``max_shard_bytes``), read one tensor at a time: the memory held is one
    output file's tensors, not the model. Returns the number of files."""
    from safetensors.torch import save_file

    from dpkit.core import shards

    index = shards.TensorIndex.read(checkpoint)
    files: list[list[str]] = [[]]
    size = 0
    for name in index.shapes:
        nbytes = index.nbytes(name)
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
    names = (
        ["model.safetensors"]
        if len(files) == 1
        else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    )
    for file_name, tensor_names in zip(names, files, strict=True):
        tensors = {name: index.weight(checkpoint, name) for name in tensor_names}
        save_file(tensors, str(output_dir / file_name), {"format": "pt"})
        del tensors
    if len(files) > 1:
        total = sum(index.nbytes(name) for name in index.shapes)
        weight_map = {n: f for f, group in zip(names, files, strict=True) for n in group}
        (output_dir / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
            + "\n"
        )
    return len(files)


def consolidate(
    checkpoint: Path,
    output_dir: Path,
    *,
    model: str | None,
    tag: str | None,
    merge_lora: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    with_optimizer: bool = False,
) -> str:
    """Write the model folder (``with_optimizer``: the full checkpoint layout, a dpkit
    checkpoint only); returns a one-line description of what was done."""
    from dpkit.checkpoints.folder import verify_checkpoint
    from dpkit.checkpoints.resume import LORA_ADAPTER_CONFIG
    from dpkit.core.shards import is_sharded

    if (checkpoint / "manifest.json").is_file():
        state = verify_checkpoint(checkpoint, flag="checkpoint")
        what = f"dpkit checkpoint at step {state.step} ({state.strategy}, {state.world_size} processes)"
        lora = (checkpoint / LORA_ADAPTER_CONFIG).is_file()
        if merge_lora and not lora:
            raise UsageError(
                f"--merge-lora: checkpoint={str(checkpoint)!r} trained the whole model (no "
                f"{LORA_ADAPTER_CONFIG}); drop --merge-lora"
            )
        layout = "sharded" if is_sharded(checkpoint) else "full"
        if with_optimizer and lora:
            raise UsageError(
                f"--with-optimizer: checkpoint={str(checkpoint)!r} is a LoRA run's; its "
                "optimizer state is resumed from the checkpoint itself (--resume)"
            )
        already_full = with_optimizer and layout == "full"  # copied as it is
        # A LoRA checkpoint's model.safetensors and config.json (every weight by peft's
        # names, for a resume) are not a model folder: the adapter folder, or the merge.
        skipped = (
            set()
            if already_full
            else _TRAINING_STATE | ({"model.safetensors", "config.json"} if lora else set())
        )
        if merge_lora:
            skipped |= {LORA_ADAPTER_CONFIG, "adapter_model.safetensors", "README.md"}
        # A sharded checkpoint has no adapter weights file: peft writes the folder.
        peft_model = (
            _lora_model(checkpoint) if merge_lora or (lora and layout == "sharded") else None
        )
        output_dir.mkdir(parents=True, exist_ok=True)
        for file in checkpoint.iterdir():
            if file.is_file() and file.name not in skipped:
                shutil.copy2(file, output_dir / file.name)
        if already_full:
            return f"{what}, already in the full layout: copied"
        if merge_lora:
            merged = peft_model.merge_and_unload()
            merged.save_pretrained(output_dir, safe_serialization=True)
            return f"{what}, LoRA adapters merged into {type(merged).__name__}"
        if lora:
            if peft_model is not None:
                peft_model.save_pretrained(output_dir)
            return f"{what}, LoRA adapters (peft's folder)"
        if with_optimizer:
            moments = write_full_layout(checkpoint, output_dir)
            return (
                f"{what}, rewritten in the full layout: model.safetensors, optimizer.pt "
                f"({moments} moments), the run's state and a manifest (--resume reads it)"
            )
        if layout == "sharded":
            files = stream_to_model_folder(checkpoint, output_dir, max_shard_bytes=max_shard_bytes)
            return f"{what}, streamed from its shards into {files} safetensors file(s)"
        return what
    if merge_lora:
        raise UsageError("--merge-lora: only for a dpkit checkpoint of a LoRA run")
    if with_optimizer:
        raise UsageError(
            "--with-optimizer: only for a dpkit checkpoint (a DeepSpeed checkpoint's "
            "optimizer state stays in its own layout)"
        )

    tag = _deepspeed_tag(checkpoint, tag)
    if model is None:
        raise UsageError("--model: required for a DeepSpeed checkpoint (its architecture)")
    import transformers
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from dpkit.models import load_model_config

    model_path, config = load_model_config(model)
    state_dict = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=tag)
    module = _model_for(state_dict, config, model)
    module.load_state_dict(state_dict, strict=False)
    module.save_pretrained(output_dir, safe_serialization=True)
    # A model without a tokenizer gets weights and config only.
    with contextlib.suppress(OSError, ValueError):
        transformers.AutoTokenizer.from_pretrained(model_path).save_pretrained(output_dir)
    return f"DeepSpeed checkpoint {tag}, {len(state_dict)} tensors, as {type(module).__name__}"


def main(args: argparse.Namespace) -> int:
    checkpoint = Path(args.checkpoint)
    output_dir = Path(args.output_dir)
    from dpkit.train.output import check_output_dir

    if not checkpoint.is_dir():
        raise UsageError(f"checkpoint={args.checkpoint!r}: no such folder")
    # A file, a folder that cannot be created or written; emptiness is checked below.
    check_output_dir(args.output_dir, overwrite=True)
    if (
        output_dir.resolve() == checkpoint.resolve()
        or checkpoint.resolve() in output_dir.resolve().parents
    ):
        raise UsageError(
            f"--output-dir={args.output_dir!r}: inside the checkpoint it reads; choose another"
        )
    if output_dir.exists() and any(output_dir.iterdir()) and not args.overwrite:
        raise UsageError(
            f"--output-dir={args.output_dir!r}: not empty; pass --overwrite or choose another"
        )
    if args.max_shard_mb is not None and args.max_shard_mb <= 0:
        raise UsageError(f"--max-shard-mb={args.max_shard_mb}: must be > 0")
    if args.max_shard_mb is not None and args.with_optimizer:
        raise UsageError(
            f"--max-shard-mb={args.max_shard_mb}: not with --with-optimizer (that layout "
            "keeps the weights in one model.safetensors)"
        )
    max_shard_mb = args.max_shard_mb or DEFAULT_MAX_SHARD_BYTES / 1024**2
    what = consolidate(
        checkpoint,
        output_dir,
        model=args.model,
        tag=args.tag,
        merge_lora=args.merge_lora,
        max_shard_bytes=int(max_shard_mb * 1024**2),
        with_optimizer=args.with_optimizer,
    )
    print(f"dpkit consolidate: {what} -> {output_dir} (fp32, safetensors)")
    return 0
