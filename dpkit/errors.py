"""The one exception type for bad input, the check that raises it naming the flag, and
the one-line reading of library failures that are training outcomes, not bugs."""

from __future__ import annotations


class UsageError(ValueError):
    """Bad input, found before any process group starts or anything is written.

    Entry points print it as one line naming the field and the value and exit
    with code 2.
    """


EXIT_USAGE = 2

# DeepSpeed 0.19.8 raises a bare ``Exception`` with this text (runtime/fp16/loss_scaler.py,
# DynamicLossScaler.update_scale) when fp16 gradients overflow at fp16.min_loss_scale; it
# is the only raise of its kind in DeepSpeed, matched on type and text so that no other
# bare Exception is read as a loss-scale failure.
_DEEPSPEED_MIN_LOSS_SCALE = "Current loss scale already at minimum - cannot decrease scale anymore"


def check_field(condition: bool, field_name: str, value: object, expectation: str) -> None:
    """Raise ``--field-name=value: expectation`` unless ``condition`` holds."""
    if not condition:
        raise UsageError(f"--{field_name.replace('_', '-')}={value!r}: {expectation}")


def training_failure(err: BaseException) -> str | None:
    """One line for a library exception that means the training itself failed (the entry
    point exits 3 on it, as on a non-finite loss), else None (keep the traceback).

    Today that is DeepSpeed's fp16 stop: the gradients still overflow at the minimum loss
    scale, so no step can be taken. Every rank raises it at the same step (DeepSpeed
    all-reduces the overflow flag), so printing it once, from rank 0, is enough.
    """
    if type(err) is not Exception or not str(err).startswith(_DEEPSPEED_MIN_LOSS_SCALE):
        return None
    return (
        f"fp16: the gradients overflow even at the minimum loss scale "
        f"(fp16.min_loss_scale={_raising_min_scale(err)}), so DeepSpeed cannot skip "
        "another step and stopped; train in bf16 (--mixed-precision bf16), lower "
        "--learning-rate, or lower fp16.min_loss_scale (or fp16.initial_scale_power) "
        "in the DeepSpeed JSON"
    )


def _raising_min_scale(err: BaseException) -> str:
    """The ``min_scale`` of the DynamicLossScaler that raised ``err``, as text.

    DeepSpeed's message names no value; the scaler that raised it is ``self`` in the
    innermost frame of the traceback (``update_scale``). "?" if it is not there.
    """
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    scaler = None if tb is None else tb.tb_frame.f_locals.get("self")
    min_scale = getattr(scaler, "min_scale", None)
    return f"{min_scale:g}" if isinstance(min_scale, (int, float)) else "?"
