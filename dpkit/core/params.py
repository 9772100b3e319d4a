"""A parameter's whole size, whatever holds it: the number every count and shape reads.

Under DeepSpeed ZeRO-3 a parameter is an empty placeholder between uses (``shape``
``(0,)``, ``numel()`` 0) and its whole shape is ``ds_shape`` (``ds_numel`` elements);
an FSDP2 ``DTensor`` reports its whole shape itself. Counting with ``numel()`` reads 0
(or only the small parameters ZeRO-3 keeps whole) under ZeRO-3: a report of a 0-parameter
model, LoRA's frozen count 0, every matrix put in the no-decay group. Ground level: no
import of torch or of any backend.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def whole_shape(param: Any) -> tuple[int, ...]:
    """The parameter's whole shape: ZeRO-3's ``ds_shape``, else its own ``shape``."""
    return tuple(int(d) for d in getattr(param, "ds_shape", param.shape))


def whole_numel(param: Any) -> int:
    """The parameter's whole element count: ZeRO-3's ``ds_numel``, else ``numel()``."""
    numel = getattr(param, "ds_numel", None)
    return int(param.numel() if numel is None else numel)


@contextlib.contextmanager
def whole_to_write(param: Any) -> Iterator[None]:
    """Inside: ``param`` whole, to be written on the main process. A ZeRO-3 parameter is
    gathered on every rank (a collective: every rank must enter with the same
    parameters, in the same order) and, on leaving, the main process's values are
    partitioned back; any other parameter is already whole."""
    if getattr(param, "ds_id", None) is None:
        yield
        return
    # Only a ZeRO-3 parameter gets here: DeepSpeed is installed.
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    with GatheredParameters([param], modifier_rank=0):
        yield
