"""The full training state of a run, from any engine: fp32 weights and Adam moments by parameter name, RNG streams, fp16's loss scale.

Each engine gathers its own layout (:meth:`~dpkit.engines.base.Engine.full_weights`,
:meth:`~dpkit.engines.base.Engine.full_moments`: DDP reads them, ZeRO gathers its
partitions with DeepSpeed's tensor-fragment API, FSDP2 its DTensor shards with torch
distributed checkpoint's state-dict API) and puts them back re-sharded for another
strategy or world size (:meth:`~dpkit.engines.base.Engine.load_moments`). Gathering is
a collective: every rank calls; the result exists on the main process.

fp16's dynamic loss scaler (:class:`LossScaler`) is the one piece of state that is the
same on every rank: it is read and restored locally, no collective.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import torch

from dpkit.checkpoints.folder import FORMAT_VERSION
from dpkit.core.walk import inner_torch_optimizer


def full_fp32_state_dict(
    engine: Any, accelerator: Any, model: Any
) -> dict[str, torch.Tensor] | None:
    """The model's state_dict with every parameter at full size in fp32, on CPU, on the
    main process (None elsewhere); a collective under the sharding engines."""
    module = accelerator.unwrap_model(model)
    state = engine.checkpoints.full_weights(accelerator, module)
    if not accelerator.is_main_process:
        return None
    # Floating tensors are stored in fp32.
    return {
        name: (value.to("cpu", torch.float32) if value.is_floating_point() else value.cpu())
        for name, value in state.items()
    }


def save_model(
    engine: Any,
    accelerator: Any,
    model: Any,
    path: str | Path,
    tokenizer: Any = None,
    *,
    for_resume: bool = False,
) -> None:
    """The model as a Hugging Face folder in fp32 (shards consolidated), written by the
    main process; a collective (every rank must call it).

    A LoRA model (peft) writes peft's adapter folder (``adapter_config.json``,
    ``adapter_model.safetensors``: the adapters and a classifier's head; it loads with
    ``PeftModel.from_pretrained`` over the base model). ``for_resume`` (a checkpoint)
    adds every weight by name in ``model.safetensors`` and the base model's
    ``config.json``, which a resume restores and checks against."""
    from dpkit.lora import is_lora_model

    weights = full_fp32_state_dict(engine, accelerator, model)
    if accelerator.is_main_process:
        module = accelerator.unwrap_model(model)
        module.save_pretrained(path, state_dict=weights, safe_serialization=True)
        if for_resume and is_lora_model(module):
            from safetensors.torch import save_file

            save_file(_unshared(weights), str(Path(path) / "model.safetensors"), {"format": "pt"})
            base = module.get_base_model()
            config = copy.deepcopy(base.config)  # the live one stays as it is
            config.architectures = [type(base).__name__]  # what consolidate --merge-lora builds
            config.save_pretrained(path)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)


def save_model_files(module: Any, path: str | Path, tokenizer: Any = None) -> None:
    """What a sharded checkpoint holds of the model besides its tensors: the config (with
    its architecture, what consolidate builds), the tokenizer, and for LoRA peft's
    ``adapter_config.json`` (the base model's config then). The main process calls it."""
    from dpkit.lora import is_lora_model

    base = module.get_base_model() if is_lora_model(module) else module
    if getattr(base, "config", None) is not None:
        config = copy.deepcopy(base.config)  # the live one stays as it is
        config.architectures = [type(base).__name__]
        config.save_pretrained(path)
    if is_lora_model(module):
        for adapter in module.peft_config.values():
            adapter.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def _unshared(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` with no two tensors on one storage (safetensors refuses tied ones)."""
    seen: set[int] = set()
    unshared = {}
    for name, value in weights.items():
        pointer = value.untyped_storage().data_ptr()
        unshared[name] = value.clone() if pointer in seen else value.contiguous()
        seen.add(pointer)
    return unshared


def full_optimizer_state(engine: Any, accelerator: Any, model: Any, optimizer: Any) -> dict | None:
    """Adam moments per parameter name at full size, the step count and each group's lr,
    on the main process (None elsewhere); a collective under the sharding engines."""
    from dpkit.core.shards import optimizer_step

    module = accelerator.unwrap_model(model)
    torch_opt = inner_torch_optimizer(optimizer)
    moments = engine.checkpoints.full_moments(accelerator, module, optimizer)
    if not accelerator.is_main_process:
        return None
    return optimizer_file_state(
        optimizer_step(optimizer), moments or {}, [float(g["lr"]) for g in torch_opt.param_groups]
    )


def optimizer_file_state(step: int, moments: dict, param_group_lrs: list[float]) -> dict:
    """What the full layout's ``optimizer.pt`` holds (a save and ``dpkit consolidate
    --with-optimizer`` both write it): Adam moments by parameter name at full size,
    the optimizer's step and each parameter group's lr."""
    return {
        "format_version": FORMAT_VERSION,
        "step": step,
        "moments": moments,
        "param_group_lrs": param_group_lrs,
    }


def restore_lrs(optimizer: Any, lrs: list[float]) -> None:
    """Each parameter group's lr as saved (the schedule resumes from it)."""
    for group, lr in zip(inner_torch_optimizer(optimizer).param_groups, lrs, strict=True):
        group["lr"] = lr


def load_optimizer_state(
    engine: Any, accelerator: Any, model: Any, optimizer: Any, saved: dict
) -> None:
    """Put consolidated moments back, re-sharded for this run's strategy and world size."""
    module = accelerator.unwrap_model(model)
    restore_lrs(optimizer, saved["param_group_lrs"])
    moments = saved["moments"]
    if not moments:
        return
    trainable = {name for name, p in module.named_parameters() if p.requires_grad}
    missing = sorted(trainable - set(moments))
    if missing:
        raise RuntimeError(f"checkpoint has no optimizer state for {missing[:3]}")
    engine.checkpoints.load_moments(
        accelerator, module, optimizer, moments, torch.tensor(float(saved["step"]))
    )


def rng_state() -> dict:
    """This rank's RNG states as plain lists (they travel through ``gather_object``)."""
    import numpy as np

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def set_rng_state(state: dict) -> None:
    import numpy as np

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))
