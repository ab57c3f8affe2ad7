"""Which compute partitions a device has (HARLI §5-§6): core partitions on a CPU, green contexts on a
CUDA device, else the time-sliced form, logged. Apart from compute_partition.py so that the CUDA form
(green_context.py) and the portable forms import not each other."""

from __future__ import annotations

import logging

from backfill.engine.compute_partition import FORMS, ComputePartitions, CorePartitions, TimeSliced
from backfill.errors import PolicyInputError

log = logging.getLogger(__name__)


def make_partitions(device: str = "cpu", form: str | None = None, *, cores: list[int] | None = None,
                    max_threads: int | None = None, sm_step: float = 0.1) -> ComputePartitions:
    """The partitions this device has: core partitions on a CPU with two or more cores, green
    contexts on a CUDA device whose torch or driver exposes them; otherwise the time-sliced form,
    logged with the reason. `form` forces one (an unavailable forced form raises)."""
    if form is not None and form not in FORMS:
        raise PolicyInputError(f"unknown partition form {form!r}; choose {', '.join(FORMS)}")
    if form == "time-sliced":
        return TimeSliced("asked for")
    reason = ""
    if device.startswith("cuda"):
        from backfill.engine.green_context import GreenContextPartitions, GreenContextUnavailable

        if form in (None, "green-context"):
            try:
                return GreenContextPartitions(device, sm_step)
            except GreenContextUnavailable as exc:
                if form == "green-context":
                    raise PolicyInputError(f"green contexts unavailable: {exc}") from exc
                reason = f"no green contexts ({exc})"
        else:
            raise PolicyInputError(f"form {form!r} is not a form of device {device!r}")
    else:
        if form in (None, "cores"):
            try:
                return CorePartitions(cores, max_threads)
            except PolicyInputError as exc:
                if form == "cores":
                    raise
                reason = f"no core partitions ({exc})"
        else:
            raise PolicyInputError(f"form {form!r} is not a form of device {device!r}")
    log.warning("compute partitions: %s; decode and finetuning time-slice the whole device "
                "(HARLI's spatial sharing gain needs partitions)", reason)
    return TimeSliced(reason)
