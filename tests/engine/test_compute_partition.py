"""Compute partitions (HARLI §5-§6's mechanism): the rounding a plan relies on, core partitions on
this CPU, the logged time-sliced fallback, and (BACKFILL_TEST_DEVICE=cuda) green contexts."""

from __future__ import annotations

import logging
import os
import threading

import pytest
import torch

from backfill.engine import compute_partition
from backfill.engine.compute_partition import CorePartitions, TimeSliced, round_to_units
from backfill.engine.partitions import make_partitions
from backfill.engine.green_context import planned_ft_sms, sm_group_for
from backfill.errors import PolicyInputError
from tests.conftest import TEST_DEVICE

CORES = sorted(os.sched_getaffinity(0))
two_cores = pytest.mark.skipif(len(CORES) < 2, reason="core partitions need two cores")


@pytest.mark.parametrize("shares,total,step,expected", [
    ((0.5, 0.5), 2, 1, (1, 1)),
    ((0.6, 0.4), 2, 1, (1, 1)),        # StaticMode's 60/40 on two cores
    ((0.9, 0.1), 2, 1, (2, 0)),        # 10% of two cores is no core while decode needs both
    ((1.0, 0.0), 2, 1, (2, 0)),
    ((0.0, 1.0), 2, 1, (0, 2)),
    ((0.0, 0.3), 4, 1, (0, 1)),        # a positive share alone gets at least one unit
    ((0.9, 0.1), 132, 8, (116, 16)),   # H200: 16 groups of 8 SMs, 4 left over go to decode
    ((0.4, 0.6), 132, 8, (52, 80)),
    ((0.0, 1.0), 132, 8, (0, 132)),    # finetuning alone takes the leftover SMs too
])
def test_round_to_units(shares, total, step, expected):
    infer, ft = round_to_units(*shares, total, step)
    assert (infer, ft) == expected
    assert infer + ft <= total
    assert infer % step in (0, total % step) and ft % step in (0, total % step)


@pytest.mark.parametrize("shares", [(0.7, 0.7), (-0.1, 0.5), (0.5, 1.2), (True, 0.0)])
def test_round_to_units_rejects_bad_shares(shares):
    with pytest.raises(PolicyInputError):
        round_to_units(*shares, 8)


def test_planned_sm_partitions_follow_the_driver_granularity():
    assert sm_group_for(9) == 8 and sm_group_for(8) == 2
    counts = planned_ft_sms(132, 8, 0.1)
    assert counts == sorted(set(counts))
    assert all(c % 8 == 0 and 8 <= c <= 124 for c in counts)
    assert counts[0] == 16 and counts[-1] == 112   # 10% -> 13.2 SMs -> 16; 90%: decode keeps 2 groups + 4


@two_cores
def test_core_partitions_realise_whole_cores_and_say_so():
    parts = CorePartitions(CORES[:2])
    assert parts.ft_shares() == (0.5,)
    split = parts.apply(0.7, 0.3)
    assert (split.share_infer, split.share_ft) == (0.5, 0.5)
    assert parts.cores_of("decode") == [CORES[0]] and parts.cores_of("finetune") == [CORES[1]]
    assert parts.round_split(0.9, 0.1).share_ft == 0.0
    idle = parts.apply(0.0, 1.0)
    assert idle.share_ft == 1.0 and parts.cores_of("finetune") == CORES[:2]
    with pytest.raises(PolicyInputError):
        parts.cores_of("prefill")


@two_cores
def test_entering_a_partition_pins_the_calling_thread_only():
    parts = CorePartitions(CORES[:2])
    parts.apply(0.5, 0.5)
    seen = {}

    def unit(name):
        parts.enter(name)
        x = torch.randn(64, 64)
        (x @ x).sum()
        seen[name] = (sorted(os.sched_getaffinity(0)), torch.get_num_threads())

    before = sorted(os.sched_getaffinity(0))
    threads = [threading.Thread(target=unit, args=(n,)) for n in ("decode", "finetune")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen["decode"] == ([CORES[0]], 1)
    assert seen["finetune"] == ([CORES[1]], 1)
    assert sorted(os.sched_getaffinity(0)) == before  # this thread was not moved


class UnitInFlight:
    """A finetuning unit on a thread of its own, inside its partition until end()."""

    def __init__(self, parts: CorePartitions) -> None:
        self.parts = parts
        self._entered, self._may_end = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()
        assert self._entered.wait(10)

    def _run(self) -> None:
        self.parts.enter("finetune")
        try:
            self._entered.set()
            self._may_end.wait(10)
        finally:
            self.parts.leave("finetune")

    def end(self) -> None:
        self._may_end.set()
        self._thread.join()


class DecodeStep:
    """A decode thread entering its partition; placed: the cores and threads it was given."""

    def __init__(self, parts: CorePartitions) -> None:
        self.placed: tuple[list[int], int] | None = None

        def run() -> None:
            parts.enter("decode")
            self.placed = (sorted(os.sched_getaffinity(0)), torch.get_num_threads())

        self.thread = threading.Thread(target=run)
        self.thread.start()

    def join(self, timeout_s: float = 10) -> tuple[list[int], int] | None:
        self.thread.join(timeout_s)
        return self.placed


@two_cores
def test_decode_given_every_core_takes_those_a_finetuning_unit_in_flight_leaves_free():
    parts = CorePartitions(CORES[:2])
    parts.apply(0.5, 0.5)
    unit = UnitInFlight(parts)
    parts.apply(1.0, 0.0)  # an arrival's prefill: decode is given every core while the unit runs
    running = DecodeStep(parts).join()
    unit.end()
    done = DecodeStep(parts).join()
    assert running == ([CORES[0]], 1)  # not on the unit's core, no wait
    assert done == (CORES[:2], 2)


@two_cores
def test_decode_waits_for_a_finetuning_unit_in_flight_on_every_core():
    parts = CorePartitions(CORES[:2])
    parts.apply(0.0, 1.0)  # no decode: finetuning on every core
    unit = UnitInFlight(parts)
    parts.apply(1.0, 0.0)  # an arrival's prefill: decode is given every core while the unit runs
    step = DecodeStep(parts)
    assert step.join(0.3) is None and step.thread.is_alive()  # waiting, not sharing a core with the unit
    unit.end()
    assert step.join() == (CORES[:2], 2)
    with pytest.raises(PolicyInputError):
        parts.leave("prefill")


@two_cores
def test_decode_keeps_one_core_past_the_wait_for_a_unit_that_does_not_end(monkeypatch):
    monkeypatch.setattr(compute_partition, "UNIT_WAIT_S", 0.05)
    parts = CorePartitions(CORES[:2])
    parts.apply(0.0, 1.0)
    unit = UnitInFlight(parts)
    parts.apply(1.0, 0.0)
    try:
        assert DecodeStep(parts).join() == ([CORES[0]], 1)
    finally:
        unit.end()


def test_one_core_falls_back_to_time_slicing_with_a_logged_reason(caplog):
    with caplog.at_level(logging.WARNING, logger="backfill.engine.partitions"):
        parts = make_partitions("cpu", cores=CORES[:1])
    assert isinstance(parts, TimeSliced) and parts.form == "time-sliced"
    assert "time-slice" in caplog.text and "at least 2 cores" in caplog.text
    assert parts.ft_shares() == ()
    assert (parts.apply(0.6, 0.4).share_infer, parts.current.share_ft) == (1.0, 0.0)
    assert parts.apply(0.0, 1.0).share_ft == 1.0
    with pytest.raises(PolicyInputError):
        make_partitions("cpu", form="cores", cores=CORES[:1])


@pytest.mark.skipif(TEST_DEVICE == "cuda", reason="this machine has CUDA")
def test_no_cuda_falls_back_to_time_slicing_with_a_logged_reason(caplog):
    with caplog.at_level(logging.WARNING, logger="backfill.engine.partitions"):
        parts = make_partitions("cuda")
    assert parts.form == "time-sliced" and "no green contexts" in caplog.text
    with pytest.raises(PolicyInputError):
        make_partitions("cuda", form="green-context")
    with pytest.raises(PolicyInputError):
        make_partitions("cpu", form="green-context")


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="green contexts need a CUDA device (BACKFILL_TEST_DEVICE=cuda)")
def test_green_context_partitions_run_work_on_their_streams():
    parts = make_partitions("cuda", form="green-context")
    try:
        assert parts.path in ("driver", "torch")
        shares = parts.ft_shares()
        assert shares and all(0 < s < 1 for s in shares)
        split = parts.apply(0.6, 0.4)
        assert split.share_ft in shares and split.share_infer + split.share_ft <= 1 + 1e-9
        x = torch.randn(1024, 1024, device="cuda")
        out = {}
        for unit in ("decode", "finetune"):
            parts.enter(unit)
            assert torch.cuda.current_stream() == parts.stream_of(unit)
            out[unit] = x @ x
        torch.cuda.synchronize()
        torch.testing.assert_close(out["decode"], out["finetune"])
    finally:
        torch.cuda.set_stream(torch.cuda.default_stream())
        parts.close()
