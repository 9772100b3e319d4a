"""The full training state of a run, from DDP or ZeRO alike: fp32 weights and Adam moments per parameter name.

Under ZeRO each rank holds a partition of the fp32 master weights and of the
optimizer state; these functions gather them per parameter with DeepSpeed's
tensor-fragment API (the mechanism of its universal checkpoint) and put them back
re-sharded for another strategy or world size. Under FSDP2 parameters and moments
are DTensors sharded on dim 0: torch distributed checkpoint's state-dict API
(``get_model_state_dict`` / ``get_optimizer_state_dict`` / ``set_optimizer_state_dict``
with full state dicts) gathers them by name and puts them back as each rank's rows.
Under DDP the module's parameters and the torch optimizer's state are read directly. Gathering is a collective:
every rank calls; the result exists on the main process.

fp16's dynamic loss scaler (:class:`LossScaler`) is the one piece of state that is
the same on every rank: it is read and restored locally, no collective.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dpkit.memory.walk import inner_torch_optimizer, is_zero_optimizer, unwrap_optimizer
from dpkit.train.fsdp2 import is_sharded, reshard

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")
FORMAT_VERSION = 1


def _zero_optimizer(optimizer) -> Any | None:
    """DeepSpeed's ZeRO optimizer behind accelerate's wrapper, or None under DDP."""
    owner = unwrap_optimizer(optimizer)
    return owner if is_zero_optimizer(owner) else None


def _sharded_by_fsdp2(module) -> bool:
    """Whether FSDP2 shards ``module`` (its parameters DTensors). An evaluation may have
    left shard-grad-op's parameters whole: they are sharded again first."""
    reshard(module)
    return any(is_sharded(p) for p in module.parameters())


def _full_on_main() -> Any:
    """DCP's options for a whole state dict, on CPU, kept by rank 0 only."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_fp32_state_dict(accelerator, model) -> dict[str, torch.Tensor] | None:
    """The model's state_dict with every parameter at full size in fp32, on CPU, on the
    main process (None elsewhere). Under ZeRO the fp32 master copies are gathered, under
    FSDP2 the shards (a collective: every rank must call this); under DDP the parameters
    are read."""
    from deepspeed.utils import safe_get_full_fp32_param
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    module = accelerator.unwrap_model(model)
    if _sharded_by_fsdp2(module):
        state = get_model_state_dict(module, options=_full_on_main())
    else:
        gathered = {}
        for name, param in module.named_parameters():
            full = safe_get_full_fp32_param(param)
            if accelerator.is_main_process:  # a copy: the live parameters keep training
                gathered[name] = (param.detach() if full is None else full).to("cpu").clone()
        state = {**module.state_dict(), **gathered}  # buffers from the module itself
    if not accelerator.is_main_process:
        return None
    # Floating tensors are stored in fp32.
    return {
        name: (value.to("cpu", torch.float32) if value.is_floating_point() else value.cpu())
        for name, value in state.items()
    }


def save_model(accelerator, model, path: str | Path, tokenizer=None) -> None:
    """The model as a Hugging Face folder in fp32 (ZeRO shards consolidated), written
    by the main process; a collective (every rank must call it)."""
    weights = full_fp32_state_dict(accelerator, model)
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(
            path, state_dict=weights, safe_serialization=True
        )
        if tokenizer is not None:
            tokenizer.save_pretrained(path)


def _relink_zero_moments(zero, torch_opt) -> None:
    """Point every parameter's fragment at its slice of the flat Adam moments.

    DeepSpeed links them once, right after the first group's step, while the later
    param groups have no state yet; with two groups (decay / no decay) the second
    group's parameters stay unlinked (measured with DeepSpeed 0.19.8).
    """
    from deepspeed.utils.mixed_precision_linkage import lazy_init_hp_params_optimizer_state

    for i, hp_partition in enumerate(zero.single_partition_of_fp32_groups):
        lazy_init_hp_params_optimizer_state(zero.bit16_groups[i], hp_partition, torch_opt.state)


def full_optimizer_state(accelerator, model, optimizer) -> dict | None:
    """Adam moments per parameter name at full size (gathered under ZeRO and FSDP2; a
    collective)."""
    from deepspeed.utils import safe_get_full_optimizer_state
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    module = accelerator.unwrap_model(model)
    fsdp2 = _sharded_by_fsdp2(module)
    torch_opt = inner_torch_optimizer(optimizer)
    zero = _zero_optimizer(optimizer)
    moments: dict[str, dict[str, torch.Tensor]] = {}
    steps = [
        float(s["step"]) for s in torch_opt.state.values() if isinstance(s, dict) and "step" in s
    ]
    has_state = bool(steps)
    if zero is not None:
        # Every rank decides the same way (the step has run on every rank or on none).
        has_state = bool(getattr(zero, "_hp_optimizer_states_linked", False))
    if has_state and zero is not None:
        _relink_zero_moments(zero, torch_opt)
    if has_state and fsdp2:
        # By parameter name, whole, on the main process (the others get an empty dict).
        state = get_optimizer_state_dict(module, torch_opt, options=_full_on_main()).get("state")
        for name, _ in module.named_parameters() if accelerator.is_main_process else ():
            moments[name] = {k: state[name][k].to("cpu", torch.float32) for k in ADAM_MOMENTS}
    elif has_state:
        for name, param in module.named_parameters():
            entry = {}
            for key in ADAM_MOMENTS:
                value = (
                    safe_get_full_optimizer_state(param, key)
                    if zero is not None
                    else torch_opt.state[param][key]
                )
                if accelerator.is_main_process:
                    entry[key] = value.to("cpu", torch.float32).clone()
            moments[name] = entry
    if not accelerator.is_main_process:
        return None
    return {
        "format_version": FORMAT_VERSION,
        "step": int(steps[0]) if steps else 0,
        "moments": moments,
        "param_group_lrs": [float(g["lr"]) for g in torch_opt.param_groups],
    }


def load_optimizer_state(accelerator, model, optimizer, saved: dict) -> None:
    """Put consolidated moments back, re-sharded for this run's strategy and world size."""
    from deepspeed.utils.tensor_fragment import map_to_flat_opt_states

    module = accelerator.unwrap_model(model)
    fsdp2 = _sharded_by_fsdp2(module)
    torch_opt = inner_torch_optimizer(optimizer)
    zero = _zero_optimizer(optimizer)
    for group, lr in zip(torch_opt.param_groups, saved["param_group_lrs"], strict=True):
        group["lr"] = lr
    moments = saved["moments"]
    if not moments:
        return
    named = dict(module.named_parameters())
    missing = sorted(set(named) - set(moments))
    if missing:
        raise RuntimeError(f"checkpoint has no optimizer state for {missing[:3]}")
    step = torch.tensor(float(saved["step"]))
    if fsdp2:
        _load_fsdp2_optimizer_state(module, torch_opt, moments, step)
        return
    if zero is None:
        for name, param in named.items():
            torch_opt.state[param] = {
                "step": step.clone(),
                **{k: moments[name][k].to(param.device, param.dtype) for k in ADAM_MOMENTS},
            }
        return
    # ZeRO: each rank keeps the slice of every moment that falls in its partition,
    # then DeepSpeed assembles its flat state from those fragments (the same path as
    # its universal-checkpoint load).
    name_of = {id(p): n for n, p in named.items()}
    for i, hp_partition in enumerate(zero.single_partition_of_fp32_groups):
        for lp in zero.bit16_groups[i]:
            mapping = lp._hp_mapping
            if mapping is None:
                continue
            address = mapping.lp_fragment_address
            if mapping.optim_fragment is None:  # no step has run yet in this process
                mapping.optim_fragment = {}
            for key in ADAM_MOMENTS:
                full = moments[name_of[id(lp)]][key].flatten()
                mapping.optim_fragment[key] = full.narrow(0, address.start, address.numel).to(
                    hp_partition.device, hp_partition.dtype
                )
        torch_opt.state[hp_partition]["step"] = step.clone()
        map_to_flat_opt_states(hp_partition, zero.bit16_groups[i], torch_opt.state, ADAM_MOMENTS)
    zero._hp_optimizer_states_linked = True


def _load_fsdp2_optimizer_state(module, torch_opt, moments: dict, step: torch.Tensor) -> None:
    """Whole moments by name (the same on every rank) into FSDP2's sharded state: DCP
    keeps each rank's rows of each; the parameter groups (their lrs already restored) are
    the optimizer's own, named."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    name_of = {id(p): n for n, p in module.named_parameters()}
    groups = [
        {**{k: v for k, v in group.items() if k != "params"},
         "params": [name_of[id(p)] for p in group["params"]]}
        for group in torch_opt.param_groups
    ]  # fmt: skip
    state = {
        name: {"step": step.clone(), **{k: moments[name][k] for k in ADAM_MOMENTS}}
        for name in name_of.values()
    }
    set_optimizer_state_dict(
        module,
        torch_opt,
        {"state": state, "param_groups": groups},
        options=StateDictOptions(full_state_dict=True),
    )


def load_fp32_masters(accelerator, model, weights: dict[str, torch.Tensor]) -> None:
    """Under ZeRO, set the fp32 master copies exactly (the module was loaded from the
    same weights, but a bf16 module would have rounded them)."""
    from deepspeed.utils import safe_set_full_fp32_param

    for name, param in accelerator.unwrap_model(model).named_parameters():
        if hasattr(param, "_hp_mapping"):
            safe_set_full_fp32_param(param, weights[name].to(param.device))


# The fields of DeepSpeed's DynamicLossScaler (runtime/fp16/loss_scaler.py) that change
# while training; the rest (min_scale, scale_window, delayed_shift) comes from the
# resuming run's own fp16 section.
_DEEPSPEED_SCALER_STATE = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


class LossScaler:
    """fp16's dynamic loss scaler, whichever library keeps it: torch's ``GradScaler`` under
    DDP (``accelerator.scaler``: accelerate makes one for fp16 on a GPU) or DeepSpeed's
    ``DynamicLossScaler`` inside the ZeRO optimizer (``fp16.enabled`` with the default
    ``loss_scale: 0``).

    A dpkit checkpoint is its own layout, not accelerate's ``save_state`` (which writes
    ``scaler.pt``) nor DeepSpeed's optimizer shards (which pickle ``loss_scaler``), so
    without this the scale restarts at its initial value (2**16) on resume: the first
    steps overflow and are skipped again, and the run is no longer the one that stopped.
    """

    def __init__(self, scaler: Any) -> None:
        """``scaler``: a ``torch.amp.GradScaler`` or a DeepSpeed ``DynamicLossScaler``."""
        self.scaler = scaler

    @classmethod
    def of(cls, accelerator: Any) -> LossScaler | None:
        """The run's dynamic loss scaler, or None when it scales no loss (fp32, bf16,
        DeepSpeed's static ``loss_scale``)."""
        scaler = getattr(accelerator, "scaler", None)
        if scaler is not None and scaler.is_enabled():
            return cls(scaler)
        wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
        zero = getattr(getattr(wrapped, "engine", None), "optimizer", None)
        loss_scaler = getattr(zero, "loss_scaler", None)
        # bf16 and fp32 ZeRO keep a static LossScaler(1.0), dynamic = False.
        return cls(loss_scaler) if getattr(loss_scaler, "dynamic", False) else None

    @property
    def kind(self) -> str:
        """``deepspeed`` or ``torch``: whose state :meth:`state_dict` holds."""
        return "deepspeed" if hasattr(self.scaler, "cur_scale") else "torch"

    @property
    def scale(self) -> float:
        """The scale the next backward multiplies the loss by."""
        if self.kind == "deepspeed":
            return float(self.scaler.cur_scale)
        return float(self.scaler.get_scale())

    @property
    def growth_tracker(self) -> int:
        """Steps without overflow counted toward the next growth of the scale: torch's
        ``_growth_tracker``; DeepSpeed's steps since the last overflow."""
        if self.kind == "deepspeed":
            return int(self.scaler.cur_iter - self.scaler.last_overflow_iter - 1)
        return int(self.scaler.state_dict()["_growth_tracker"])

    def state_dict(self) -> dict[str, Any]:
        """Plain numbers (JSON): ``kind``, ``scale`` and the library's own counters."""
        if self.kind == "deepspeed":
            native = {name: getattr(self.scaler, name) for name in _DEEPSPEED_SCALER_STATE}
        else:
            native = {"_growth_tracker": int(self.scaler.state_dict()["_growth_tracker"])}
        return {"kind": self.kind, "scale": self.scale, **native}

    def load_state_dict(self, saved: dict[str, Any]) -> str:
        """Restore ``saved`` (:meth:`state_dict`); returns what was restored, for the log.

        Written by the same library: the scale and its counters exactly. By the other one
        (a checkpoint resumed across DDP and ZeRO): the scale only, the growth count starts
        over, since torch and DeepSpeed count it differently. The growth and backoff
        settings stay this run's. DeepSpeed's scale is kept at or above this run's
        ``min_scale``: a scale below it would stop the run at its first overflow.
        """
        same = saved.get("kind") == self.kind
        if self.kind == "deepspeed":
            if same:
                for name in _DEEPSPEED_SCALER_STATE:
                    setattr(self.scaler, name, saved[name])
            self.scaler.cur_scale = max(float(saved["scale"]), float(self.scaler.min_scale))
        else:
            tracker = int(saved["_growth_tracker"]) if same else 0
            self.scaler.load_state_dict(
                {**self.scaler.state_dict(), "scale": float(saved["scale"]),
                 "_growth_tracker": tracker}
            )  # fmt: skip
        counters = "and its growth count" if same else f"only (written by {saved.get('kind')})"
        return f"fp16 loss scale {self.scale:g} {counters}"
