"""An engine's checkpoint I/O: its state gathered by parameter name or written as this
rank's own shards, and put back re-sharded under any strategy and world size."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

    from dpkit.core.loss_scale import LossScaler
    from dpkit.core.shards import FlatShard


class CheckpointIO:
    """The checkpoint role (``engine.checkpoints``); the defaults are those of a backend
    whose every rank holds every tensor whole."""

    def loss_scaler(self, accelerator: Accelerator) -> LossScaler | None:
        """fp16's dynamic loss scaler of the run (:class:`dpkit.core.loss_scale.LossScaler`),
        or None when it scales no loss (fp32, bf16): here torch's ``GradScaler``, which
        accelerate makes for fp16 on a GPU."""
        from dpkit.core.loss_scale import TorchLossScaler

        scaler = getattr(accelerator, "scaler", None)
        return TorchLossScaler(scaler) if scaler is not None and scaler.is_enabled() else None

    def full_weights(
        self, accelerator: Accelerator, module: torch.nn.Module
    ) -> dict[str, torch.Tensor]:
        """Every parameter at full size in fp32 by name (the main process keeps a CPU
        copy; the dict is empty elsewhere). A collective: every rank calls."""
        raise NotImplementedError

    def full_moments(
        self, accelerator: Accelerator, module: torch.nn.Module, optimizer: Any
    ) -> dict | None:
        """Adam moments per parameter name at full size on the main process, or None when
        no step has run yet. A collective."""
        raise NotImplementedError

    def load_moments(
        self,
        accelerator: Accelerator,
        module: torch.nn.Module,
        optimizer: Any,
        moments: dict[str, dict[str, torch.Tensor]],
        step: int | None,
    ) -> None:
        """Put whole moments by name back, as this rank's part of them."""
        raise NotImplementedError

    def load_weights(
        self, accelerator: Accelerator, module: torch.nn.Module, weights: dict[str, torch.Tensor]
    ) -> None:
        """Set the module's parameters (and the buffers saved) to ``weights``: whole
        tensors by name, the same on every rank. Tied parameters are saved once: the
        names a checkpoint leaves out are set through the one it keeps."""
        import torch

        with torch.no_grad():
            module.load_state_dict(weights, strict=False)

    def load_fp32_masters(
        self, accelerator: Accelerator, module: torch.nn.Module, weights: dict[str, torch.Tensor]
    ) -> None:
        """Set the backend's own fp32 master copies exactly (where it keeps any)."""

    def own_shards(
        self, accelerator: Accelerator, module: torch.nn.Module, optimizer: Any
    ) -> dict[str, FlatShard]:
        """This rank's part of the weights (fp32) and Adam moments, by the sharded
        checkpoint's keys (:mod:`dpkit.core.shards`); nothing is gathered. Here:
        tensors every rank holds whole, split evenly, so the ranks share the writing."""
        from dpkit.core import shards

        return shards.replicated_state(
            module, optimizer, accelerator.process_index, accelerator.num_processes
        )

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
        """Fill this rank's weights and moments from a sharded checkpoint of any strategy
        and world size: ``read(shards)`` loads the ranges this rank asks for (a
        collective). Here: every tensor whole (the optimizer's state made first)."""
        from dpkit.core import shards

        targets = shards.replicated_targets(module, optimizer, step, with_moments=with_moments)
        read(targets.shards)
        targets.finish()
