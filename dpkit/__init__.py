"""dpkit: data-parallel training on Accelerate and DeepSpeed (DDP, ZeRO-1, ZeRO-2) with measured per-GPU memory."""

__version__ = "0.1.0"
