"""fp16's dynamic loss scaler, whichever library keeps it, as one interface: what a
checkpoint saves and restores of it (:mod:`dpkit.checkpoints`), and what each engine
finds in its run (:meth:`dpkit.engines.base.Engine.loss_scaler`)."""

from __future__ import annotations

from typing import Any


class LossScaler:
    """fp16's dynamic loss scaler, whichever library keeps it: the run's engine finds it
    (:meth:`~dpkit.engines.base.Engine.loss_scaler`): torch's ``GradScaler``
    (:class:`TorchLossScaler`; ``accelerator.scaler``, which accelerate makes for fp16 on
    a GPU) or DeepSpeed's ``DynamicLossScaler`` inside the ZeRO optimizer
    (``dpkit.engines.deepspeed.checkpoint.DeepSpeedLossScaler``).

    A dpkit checkpoint is its own layout, not accelerate's ``save_state`` (which writes
    ``scaler.pt``) nor DeepSpeed's optimizer shards (which pickle ``loss_scaler``), so
    without this the scale restarts at its initial value (2**16) on resume: the first
    steps overflow and are skipped again, and the run is no longer the one that stopped.
    """

    kind = ""
    """Whose state :meth:`state_dict` holds (``torch``, ``deepspeed``)."""

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler

    @property
    def scale(self) -> float:
        """The scale the next backward multiplies the loss by."""
        raise NotImplementedError

    @property
    def growth_tracker(self) -> int:
        """Steps without overflow counted toward the next growth of the scale."""
        raise NotImplementedError

    def native_state(self) -> dict[str, Any]:
        """The library's own counters, as plain numbers."""
        raise NotImplementedError

    def restore(self, saved: dict[str, Any], same_library: bool) -> None:
        """Set the scale (and, written by the same library, its counters) from ``saved``."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Plain numbers (JSON): ``kind``, ``scale`` and the library's own counters."""
        return {"kind": self.kind, "scale": self.scale, **self.native_state()}

    def load_state_dict(self, saved: dict[str, Any]) -> str:
        """Restore ``saved`` (:meth:`state_dict`); returns what was restored, for the log.

        Written by the same library: the scale and its counters exactly. By the other one
        (a checkpoint resumed across DDP and ZeRO): the scale only, the growth count starts
        over, since the libraries count it differently. The growth and backoff settings
        stay this run's.
        """
        same = saved.get("kind") == self.kind
        self.restore(saved, same)
        counters = "and its growth count" if same else f"only (written by {saved.get('kind')})"
        return f"fp16 loss scale {self.scale:g} {counters}"


class TorchLossScaler(LossScaler):
    """torch's ``GradScaler``: the scale and ``_growth_tracker``."""

    kind = "torch"

    @property
    def scale(self) -> float:
        return float(self.scaler.get_scale())

    @property
    def growth_tracker(self) -> int:
        return int(self.scaler.state_dict()["_growth_tracker"])

    def native_state(self) -> dict[str, Any]:
        return {"_growth_tracker": self.growth_tracker}

    def restore(self, saved: dict[str, Any], same_library: bool) -> None:
        tracker = int(saved["_growth_tracker"]) if same_library else 0
        self.scaler.load_state_dict(
            {**self.scaler.state_dict(), "scale": float(saved["scale"]), "_growth_tracker": tracker}
        )
