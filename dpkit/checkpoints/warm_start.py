"""``--init-from``: a checkpoint's weights as the start of a new run, not a resume.

A resume continues the same run (model, labels, optimizer, schedule, data position) and
refuses anything else. Starting a new task from a fine-tuned checkpoint (another label
set, a new head) is this: every weight whose name and shape the new model shares is
copied; the rest (the head) stays as the model was built, and the log says which.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dpkit.errors import UsageError


def check_init_from(path: str, resume: str | None) -> Path:
    """``--init-from``, checked before any process group: a complete dpkit checkpoint of
    a whole model (not LoRA adapters), and not together with ``--resume``."""
    from dpkit.checkpoints.folder import verify_checkpoint
    from dpkit.checkpoints.resume import LORA_ADAPTER_CONFIG

    if resume is not None:
        raise UsageError(
            f"--init-from={path!r}: not with --resume={resume!r} (a resume continues its own "
            "run; --init-from starts a new one from a checkpoint's weights)"
        )
    folder = Path(path)
    verify_checkpoint(folder, flag="--init-from")
    if (folder / LORA_ADAPTER_CONFIG).is_file():
        raise UsageError(
            f"--init-from={path!r}: a LoRA checkpoint; merge its adapters first (dpkit "
            "consolidate CHECKPOINT --output-dir DIR --merge-lora) and pass --model DIR"
        )
    return folder


def init_from(model: Any, path: str | Path) -> str:
    """Copy into ``model`` every weight of the checkpoint at ``path`` that it has under the
    same name and shape (read on this process, one tensor at a time for a sharded
    checkpoint; a ZeRO-3 model built partitioned is gathered one parameter at a time and
    written from the main process); returns the log line saying what was left as built."""
    import torch

    from dpkit.checkpoints.resume import saved_shapes
    from dpkit.core import shards
    from dpkit.core.params import whole_shape, whole_to_write

    path = Path(path)
    own = dict(model.named_parameters())
    own.update(shards.persistent_buffers(model))
    saved = saved_shapes(path)
    if shards.is_sharded(path):
        index = shards.TensorIndex.read(path)

        def read(name: str) -> torch.Tensor:
            return index.weight(path, name)

    else:
        from safetensors import safe_open

        handle = safe_open(str(path / "model.safetensors"), framework="pt")
        read = handle.get_tensor

    copied, other_shape = [], []
    with torch.no_grad():
        for name, tensor in own.items():
            if name not in saved:
                continue
            shape = list(whole_shape(tensor))
            if saved[name] != shape:
                other_shape.append(f"{name} {saved[name]} -> {shape}")
                continue
            with whole_to_write(tensor):  # ZeRO-3: gathered, one parameter at a time
                tensor.copy_(read(name))
            copied.append(name)
    if not copied:
        raise UsageError(
            f"--init-from={str(path)!r}: no weight of the checkpoint has this model's names "
            f"(it saved e.g. {sorted(saved)[:2]}, this model has {sorted(own)[:2]})"
        )
    as_built = [n for n in own if n not in copied]
    line = f"init from {path}: {len(copied)} of {len(own)} weights copied"
    if as_built:
        shown = ", ".join(as_built[:4]) + (
            f" and {len(as_built) - 4} more" if len(as_built) > 4 else ""
        )
        line += f"; left as built (a new head or task): {shown}"
    if other_shape:
        line += f"; of another shape in the checkpoint: {', '.join(other_shape[:2])}"
    return line
