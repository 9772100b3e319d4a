"""DeepSpeed's own logger, quieted as dpkit's is: errors only on ranks but the main one, and
no "Setting accelerator to CPU" notice (dpkit's start-up line names the device)."""

from __future__ import annotations

import logging


class _ErrorsOnly(logging.Filter):
    """Lets errors through, nothing else."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


class _WithoutCpuNotice(logging.Filter):
    """Drops DeepSpeed's "Setting accelerator to CPU" (dpkit's start-up line names the
    device; DeepSpeed's launchers print the notice themselves)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Setting accelerator to CPU" not in record.getMessage()


def quiet_deepspeed_logger(is_main_process: bool) -> None:
    """Filter DeepSpeed's logger for this process (once; filters outlive the level
    DeepSpeed sets when it creates the logger on import)."""
    deepspeed_logger = logging.getLogger("DeepSpeed")
    wanted = _WithoutCpuNotice if is_main_process else _ErrorsOnly
    if not any(isinstance(f, wanted) for f in deepspeed_logger.filters):
        deepspeed_logger.addFilter(wanted())
