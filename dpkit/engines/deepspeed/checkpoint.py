"""ZeRO's training state by parameter name: each rank holds a partition of the fp32 master
weights and of the optimizer state; DeepSpeed's tensor-fragment API (the mechanism of its
universal checkpoint) gathers them per parameter and puts them back re-sharded for
another world size."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from dpkit.core.loss_scale import LossScaler
from dpkit.core.walk import inner_torch_optimizer
from dpkit.engines.deepspeed.memory import stage3_optimizer, zero_optimizer
from dpkit.engines.roles.checkpoint_io import CheckpointIO

if TYPE_CHECKING:
    from collections.abc import Callable

    from accelerate import Accelerator

    from dpkit.core.shards import FlatShard

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def _relink_moments(zero: Any, torch_opt: Any) -> None:
    """Point every parameter's fragment at its slice of the flat Adam moments.

    DeepSpeed links them once, right after the first group's step, while the later
    param groups have no state yet; with two groups (decay / no decay) the second
    group's parameters stay unlinked (measured with DeepSpeed 0.19.8).
    """
    from deepspeed.utils.mixed_precision_linkage import lazy_init_hp_params_optimizer_state

    for i, hp_partition in enumerate(zero.single_partition_of_fp32_groups):
        lazy_init_hp_params_optimizer_state(zero.bit16_groups[i], hp_partition, torch_opt.state)


# The fields of DeepSpeed's DynamicLossScaler (runtime/fp16/loss_scaler.py) that change
# while training; the rest (min_scale, scale_window, delayed_shift) comes from the
# resuming run's own fp16 section.
_SCALER_STATE = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


class DeepSpeedLossScaler(LossScaler):
    """DeepSpeed's ``DynamicLossScaler`` inside the ZeRO optimizer (``fp16.enabled`` with
    the default ``loss_scale: 0``)."""

    kind = "deepspeed"

    @property
    def scale(self) -> float:
        return float(self.scaler.cur_scale)

    @property
    def growth_tracker(self) -> int:
        """DeepSpeed's steps since the last overflow."""
        return int(self.scaler.cur_iter - self.scaler.last_overflow_iter - 1)

    def native_state(self) -> dict[str, Any]:
        return {name: getattr(self.scaler, name) for name in _SCALER_STATE}

    def restore(self, saved: dict[str, Any], same_library: bool) -> None:
        """The scale is kept at or above this run's ``min_scale``: a scale below it would
        stop the run at its first overflow."""
        if same_library:
            for name in _SCALER_STATE:
                setattr(self.scaler, name, saved[name])
        self.scaler.cur_scale = max(float(saved["scale"]), float(self.scaler.min_scale))


def _partitioned(zero: Any) -> dict[int, Any]:
    """id -> the parameter, of every parameter in ZeRO's groups (those it partitions)."""
    return {id(p): p for group in zero.bit16_groups for p in group}


def _stage3_slices(module: torch.nn.Module) -> Iterator[tuple[str, Any, int, int]]:
    """(name, parameter, offset, length) of this rank's slice of every ZeRO-3 parameter:
    rank r holds elements ``[r * p, (r + 1) * p)`` of the flattened parameter, ``p`` its
    ``ds_tensor``'s size (the last rank's slice is padded past ``ds_numel``: cut here)."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0  # ZeRO-3 partitions over the DP group
    for name, param in module.named_parameters():
        if not hasattr(param, "ds_id"):
            continue
        size = param.ds_tensor.ds_numel
        offset = rank * size
        length = max(0, min(size, param.ds_numel - offset))
        if length:
            yield name, param, offset, length


class DeepSpeedCheckpoints(CheckpointIO):
    """DeepSpeed ZeRO's checkpoint I/O: fp32 masters and moments gathered per parameter from the partitions (the fragment API), put back re-sharded."""

    def loss_scaler(self, accelerator: Accelerator) -> Any:
        """DeepSpeed's ``DynamicLossScaler`` inside the ZeRO optimizer (``fp16.enabled``
        with the default ``loss_scale: 0``); None for the static ``LossScaler(1.0)`` bf16
        and fp32 ZeRO keep."""
        from dpkit.engines.deepspeed.checkpoint import DeepSpeedLossScaler

        wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
        zero = getattr(getattr(wrapped, "engine", None), "optimizer", None)
        loss_scaler = getattr(zero, "loss_scaler", None)
        return DeepSpeedLossScaler(loss_scaler) if getattr(loss_scaler, "dynamic", False) else None

    def full_weights(self, accelerator: Accelerator, module: torch.nn.Module) -> dict[str, Any]:
        """The fp32 master copies gathered per parameter (a collective), with the module's
        own buffers; on the main process."""
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters
        from deepspeed.utils import safe_get_full_fp32_param

        gathered = {}
        for name, param in module.named_parameters():
            full = safe_get_full_fp32_param(param)
            if full is None and getattr(param, "ds_id", None) is not None:
                # A ZeRO-3 parameter without a master (frozen: LoRA's base weights) is
                # gathered whole from its 16-bit slices (a collective).
                with GatheredParameters([param]):
                    full = param.detach().to("cpu").clone()
            if accelerator.is_main_process:  # a copy: the live parameters keep training
                gathered[name] = (param.detach() if full is None else full).to("cpu").clone()
        if not accelerator.is_main_process:
            return {}
        return {**module.state_dict(), **gathered}

    def full_moments(
        self, accelerator: Accelerator, module: torch.nn.Module, optimizer: Any
    ) -> dict | None:
        """Adam moments per parameter name at full size, gathered (a collective); None before
        the first step (every rank decides the same way: the step has run on all or none)."""
        from deepspeed.utils import safe_get_full_optimizer_state

        zero = zero_optimizer(optimizer)
        torch_opt = inner_torch_optimizer(optimizer)
        if not getattr(zero, "_hp_optimizer_states_linked", False):
            return None
        _relink_moments(zero, torch_opt)
        moments = {}
        for name, param in module.named_parameters():
            if not param.requires_grad:  # a frozen weight (LoRA's) is in no ZeRO group
                continue
            entry = {}
            for key in ADAM_MOMENTS:
                value = safe_get_full_optimizer_state(param, key)
                if accelerator.is_main_process:
                    entry[key] = value.to("cpu", torch.float32).clone()
            moments[name] = entry
        return moments if accelerator.is_main_process else {}

    def load_moments(
        self,
        accelerator: Accelerator,
        module: torch.nn.Module,
        optimizer: Any,
        moments: dict,
        step: int | None,
    ) -> None:
        """Each rank keeps the slice of every moment that falls in its partition, then
        DeepSpeed assembles its flat state from those fragments (the same path as its
        universal-checkpoint load)."""
        from deepspeed.utils.tensor_fragment import map_to_flat_opt_states

        zero = zero_optimizer(optimizer)
        torch_opt = inner_torch_optimizer(optimizer)
        name_of = {id(p): n for n, p in module.named_parameters()}
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
            map_to_flat_opt_states(
                hp_partition, zero.bit16_groups[i], torch_opt.state, ADAM_MOMENTS
            )
        zero._hp_optimizer_states_linked = True

    def load_fp32_masters(
        self, accelerator: Accelerator, module: torch.nn.Module, weights: dict
    ) -> None:
        """Set the fp32 master copies exactly (the module was loaded from the same weights,
        but a bf16 module would have rounded them)."""
        from deepspeed.utils import safe_set_full_fp32_param

        for name, param in module.named_parameters():
            if hasattr(param, "_hp_mapping"):
                safe_set_full_fp32_param(param, weights[name].to(param.device))

    def own_shards(
        self, accelerator: Accelerator, module: torch.nn.Module, optimizer: Any
    ) -> dict[str, Any]:
        """This rank's part of the training state by key (:mod:`dpkit.core.shards`):
        its fragment of each partitioned parameter's fp32 master and Adam moments (where the
        parameter falls in its partition), an even share of the frozen ones, no gather."""
        from dpkit.core import shards

        if stage3_optimizer(optimizer) is not None:
            return self._own_stage3_shards(accelerator, module, optimizer)
        zero = zero_optimizer(optimizer)
        partitioned = _partitioned(zero)
        linked = getattr(zero, "_hp_optimizer_states_linked", False)
        if linked:
            _relink_moments(zero, inner_torch_optimizer(optimizer))
        state = shards.replicated_state(
            module,
            optimizer,
            accelerator.process_index,
            accelerator.num_processes,
            skip=set(partitioned),
        )
        for name, param in module.named_parameters():
            mapping = getattr(param, "_hp_mapping", None) if id(param) in partitioned else None
            if mapping is None:  # not partitioned, or no fragment of it on this rank
                continue
            address = mapping.lp_fragment_address
            state[shards.weight_key(name)] = shards.FlatShard(
                param.numel(), address.start, mapping.hp_fragment.detach()
            )
            for moment in ADAM_MOMENTS if linked else ():
                state[shards.moment_key(name, moment)] = shards.FlatShard(
                    param.numel(), address.start, mapping.optim_fragment[moment].detach()
                )
        return state

    def load_own_shards(
        self,
        accelerator: Accelerator,
        module: torch.nn.Module,
        optimizer: Any,
        read: Callable[[dict[str, FlatShard]], None],
        step: int | None,
        *,
        with_moments: bool,
    ) -> None:
        """Read this rank's fragments of the fp32 masters and moments (and the frozen weights
        whole) from a sharded checkpoint of any layout, then let DeepSpeed copy the masters
        into the module's weights on every rank and assemble its flat optimizer state."""
        from deepspeed.utils.tensor_fragment import map_to_flat_opt_states

        from dpkit.core import shards

        if stage3_optimizer(optimizer) is not None:
            self._load_own_stage3_shards(module, optimizer, read, step, with_moments)
            return
        zero = zero_optimizer(optimizer)
        torch_opt = inner_torch_optimizer(optimizer)
        partitioned = _partitioned(zero)
        targets = shards.replicated_targets(
            module, optimizer, step, with_moments=False, skip=set(partitioned)
        )
        moments: dict[int, dict[str, torch.Tensor]] = {}
        for name, param in module.named_parameters():
            mapping = getattr(param, "_hp_mapping", None) if id(param) in partitioned else None
            if mapping is None:
                continue
            address = mapping.lp_fragment_address
            targets.shards[shards.weight_key(name)] = shards.FlatShard(
                param.numel(), address.start, mapping.hp_fragment.data
            )
            if with_moments:
                moments[id(param)] = {
                    moment: torch.empty_like(mapping.hp_fragment.data) for moment in ADAM_MOMENTS
                }
                for moment, local in moments[id(param)].items():
                    targets.shards[shards.moment_key(name, moment)] = shards.FlatShard(
                        param.numel(), address.start, local
                    )
        read(targets.shards)
        targets.finish()
        zero.update_lp_params()  # the module's weights from the masters just read (a collective)
        if not with_moments:
            return
        for i, hp_partition in enumerate(zero.single_partition_of_fp32_groups):
            for lp in zero.bit16_groups[i]:
                mapping = lp._hp_mapping
                if mapping is None:
                    continue
                mapping.optim_fragment = moments[id(lp)]
            torch_opt.state[hp_partition]["step"] = step.clone()
            map_to_flat_opt_states(
                hp_partition, zero.bit16_groups[i], torch_opt.state, ADAM_MOMENTS
            )
        zero._hp_optimizer_states_linked = True

    # ---- ZeRO-3: the parameters themselves are partitioned ------------------------------

    def _own_stage3_shards(
        self, accelerator: Accelerator, module: torch.nn.Module, optimizer: Any
    ) -> dict[str, Any]:
        """This rank's slice of every parameter's fp32 master and Adam moments, read through
        DeepSpeed's ZeRO-3 local API (a frozen parameter: its own slice of the weight)."""
        from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

        from dpkit.core import shards

        zero = stage3_optimizer(optimizer)
        torch_opt = inner_torch_optimizer(optimizer)
        stepped = any(
            "step" in torch_opt.state.get(flat, {}) for flat in zero.fp32_partitioned_groups_flat
        )
        state: dict[str, Any] = {}
        for name, param, offset, length in _stage3_slices(module):
            whole = param.ds_numel
            if not param.requires_grad:
                local = param.ds_tensor.detach().reshape(-1).narrow(0, 0, length).float()
                state[shards.weight_key(name)] = shards.FlatShard(whole, offset, local)
                continue
            master = safe_get_local_fp32_param(param).narrow(0, 0, length)
            state[shards.weight_key(name)] = shards.FlatShard(whole, offset, master.detach())
            for moment in ADAM_MOMENTS if stepped else ():
                local = safe_get_local_optimizer_state(param, moment).narrow(0, 0, length)
                state[shards.moment_key(name, moment)] = shards.FlatShard(
                    whole, offset, local.detach()
                )
        if accelerator.process_index == 0:
            for name, buffer in shards.persistent_buffers(module).items():
                state[shards.weight_key(name)] = shards.fp32(
                    shards.FlatShard.whole(buffer.detach())
                )
        return state

    def _load_own_stage3_shards(
        self,
        module: torch.nn.Module,
        optimizer: Any,
        read: Callable[[dict[str, FlatShard]], None],
        step: int | None,
        with_moments: bool,
    ) -> None:
        """Read this rank's slices of the masters and moments, put them into DeepSpeed's
        partitions (its local setters) and copy the masters into the parameters' own slices."""
        from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

        from dpkit.core import shards

        zero = stage3_optimizer(optimizer)
        torch_opt = inner_torch_optimizer(optimizer)
        targets = shards.LoadTargets()
        loaded: list[tuple[Any, int, dict[str, torch.Tensor]]] = []
        for name, param, offset, length in _stage3_slices(module):
            whole = param.ds_numel
            buffers = {"weight": torch.zeros(param.ds_tensor.ds_numel, dtype=torch.float32)}
            targets.shards[shards.weight_key(name)] = shards.FlatShard(
                whole, offset, buffers["weight"][:length]
            )
            for moment in ADAM_MOMENTS if with_moments and param.requires_grad else ():
                buffers[moment] = torch.zeros_like(buffers["weight"])
                targets.shards[shards.moment_key(name, moment)] = shards.FlatShard(
                    whole, offset, buffers[moment][:length]
                )
            loaded.append((param, length, buffers))
        for name, buffer in shards.persistent_buffers(module).items():
            targets.whole(shards.weight_key(name), buffer)
        read(targets.shards)
        targets.finish()
        if with_moments:  # before this process's first step ZeRO-3 holds no Adam state yet
            for flat in zero.fp32_partitioned_groups_flat:
                state = torch_opt.state[flat]
                for moment in ADAM_MOMENTS:
                    state.setdefault(moment, torch.zeros_like(flat))
        with torch.no_grad():
            for param, _, buffers in loaded:
                device, dtype = param.ds_tensor.device, param.ds_tensor.dtype
                param.ds_tensor.data.copy_(buffers["weight"].to(device, dtype))
                if not param.requires_grad:
                    continue
                safe_set_local_fp32_param(param, buffers["weight"].to(device))
                for moment in ADAM_MOMENTS if with_moments else ():
                    safe_set_local_optimizer_state(param, buffers[moment].to(device), moment)
        if with_moments:
            for flat in zero.fp32_partitioned_groups_flat:
                torch_opt.state[flat]["step"] = step.clone()
