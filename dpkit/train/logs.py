"""A run's logs: dpkit's own lines from the main process, every library's warnings once per job.

Called when a run starts (:func:`dpkit.train.parsing.parse_args`,
:func:`dpkit.train.setup.setup`) and again once the Accelerator knows the main process
(:func:`dpkit.train.accelerator.start_accelerator`); importing dpkit changes nothing.
"""

from __future__ import annotations

import logging
import os

from dpkit.engines import ENGINES


def log_once_per_job(is_main_process: bool | None = None) -> None:
    """dpkit's own lines from the main process; library warnings once per job.

    dpkit's logger gets a handler of its own only when the script configured none (so
    its lines show in a bare script); other ranks log warnings and errors only, and
    transformers, datasets and Python warnings stay quiet there: every rank would print
    the same copy. Errors on any rank still reach the terminal. ``None``: the main
    process is global rank 0 of the launcher's environment (before any process group;
    :func:`~dpkit.train.accelerator.start_accelerator` calls it again with accelerate's answer). A run sets this when it
    starts (:func:`dpkit.train.parsing.parse_args`, :func:`dpkit.train.setup.setup`): importing dpkit
    changes nothing.
    """
    import warnings

    if is_main_process is None:
        is_main_process = os.environ.get("RANK", "0") == "0"
    dpkit_logger = logging.getLogger("dpkit")
    if not dpkit_logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
        dpkit_logger.addHandler(handler)
        dpkit_logger.propagate = False
    dpkit_logger.setLevel(logging.INFO if is_main_process else logging.WARNING)
    for engine in ENGINES:  # a backend's own logger (DeepSpeed's) quieted as dpkit's is
        engine.quiet_logs(is_main_process)
    if not is_main_process:
        import datasets
        import transformers

        transformers.logging.set_verbosity_error()
        datasets.logging.set_verbosity_error()
        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
