"""Real worker processes: lazy eviction, kill and restore give the undisturbed output bit for bit."""

import os
import sys
import time

import pytest
import torch

from backfill.errors import RealtimeError
from backfill.bench.realtime_bench import DisbSource, dnn_preset, run_disb, run_once, summarize
from backfill.realtime.task_scheduler import Request, RealtimeScheduler, TaskSchedulerConfig

SHAPES = ("resnet152", "vgg19", "bert", "gpt2")


class _Quiet:
    def due(self, now_s):
        return []

    def next_s(self):
        return float("inf")

    def on_complete(self, request, now_s):
        pass


def _parent_pid(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _bits(t):
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _serve_until(sched, stream, cond, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "worker made no progress"
        sched.service_be(_Quiet())
        time.sleep(0.0002)


@pytest.mark.parametrize("path", ["kill", "evict"])
@pytest.mark.parametrize("name", SHAPES)
def test_preempted_be_request_output_is_bit_exact(tiny_models, name, path):
    served = tiny_models[name]
    ref = _bits(served.model.infer(served.model.example_input))
    n = len(served.model)
    with RealtimeScheduler(TaskSchedulerConfig(mode="reef", preempt_path=path), tiny_models, {"be": name}) as sched:
        s = sched.streams["be"]
        sched.submit(Request("be", name, False, served.model.example_input, time.perf_counter()))
        sched.service_be(_Quiet())
        assert s.current is not None
        for frac in (0.2, 0.5, 0.8):  # three preemptions spread over the request
            _serve_until(sched, s, lambda: s.worker.last_done >= int(frac * n) or s.current is None)
            if s.current is None:
                break
            sched.preempt_all(Request("rt", name, True, served.model.example_input, time.perf_counter()))
            assert s.preempted and not s.host_queue
            if sched.preemptions[-1].path == "kill":
                assert s.worker.pid is None
                assert s.worker.spare_ready(timeout_s=10.0)  # forked ahead by the fork server
        _serve_until(sched, s, lambda: s.current is None)
        req = sched.completed[-1]
        assert _bits(req.output) == ref
        assert req.preemptions >= 1
        if path == "kill":
            assert s.worker.restarts == sum(p.path == "kill" for p in sched.preemptions)
            # every worker, restored ones included, comes from the fork server: the scheduler never forks
            assert _parent_pid(s.worker.pid) == s.worker._server_pid != os.getpid()
        else:
            assert s.worker.restarts == 0 and req.reexecuted_ops == 0


def test_disb_a_runs_every_mode_and_only_reef_preempts(tiny_models):
    solo = {n: m.solo_s for n, m in tiny_models.items()}
    wl = dnn_preset("A", solo, 1.0)
    results = [run_once(wl, mode, tiny_models, 0.8, seed=0) for mode in ("rt-only", "seq", "concurrent", "reef", "reef-pad")]
    rows = summarize(results, wl, tiny_models)
    expected_rt = len(DisbSource(wl, tiny_models, 0.0, 0.8, 0, True).rt)
    for mode, row in rows.items():
        assert row["rt_requests"] == expected_rt, mode  # every RT request that arrived was served
        assert row["throughput_norm"] > 0
    assert rows["reef"]["preemptions"] > 0 and rows["seq"]["preemptions"] == 0
    assert rows["rt-only"]["rt_p99_vs_rt_only"] == 1.0 and rows["seq"]["throughput_vs_seq"] == 1.0
    assert rows["rt-only"]["throughput_norm"] < rows["seq"]["throughput_norm"]  # BE adds work


def test_config_errors_are_typed(tiny_models):
    for bad in (dict(mode="fifo"), dict(preempt_path="wait"), dict(inflight_capacity=0), dict(rt_threads=3), dict(spin_ms=-1)):
        with pytest.raises(RealtimeError):
            TaskSchedulerConfig(**bad)
    with pytest.raises(RealtimeError, match="no served model"):
        RealtimeScheduler(TaskSchedulerConfig(), tiny_models, {"be": "yolo"})
    base = os.getpriority(os.PRIO_PROCESS, 0)
    with pytest.raises(RealtimeError, match="pad needs 512 cores"):
        RealtimeScheduler(TaskSchedulerConfig(pad=True, cores=512), tiny_models, {"be": "bert"})
    assert os.getpriority(os.PRIO_PROCESS, 0) == base  # refused before the scheduler raised itself
    with RealtimeScheduler(TaskSchedulerConfig(), tiny_models, {"be": "bert"}) as sched:
        with pytest.raises(RealtimeError, match="no BE stream"):
            sched.submit(Request("other", "bert", False, tiny_models["bert"].model.example_input, 0.0))
    with pytest.raises(RealtimeError, match="unknown DISB"):
        dnn_preset("F", {}, 1.0)


def test_restart_waits_for_the_spare_and_never_forks_in_the_caller(tiny_models):
    import multiprocessing

    from backfill.realtime.worker import BEWorker

    served = tiny_models["vgg19"]
    ref = _bits(served.model.infer(served.model.example_input))
    with BEWorker(served.model, 4, multiprocessing.get_context("fork").Semaphore(0)) as w:
        for _ in range(3):  # back-to-back kills: a restore may find its spare still forking
            first, before = w.pid, w.restarts
            w.kill()
            assert w.pid is None
            if not w.restart():
                assert w.pid is None and w.restarts == before  # nothing changed
                assert w.spare_ready(timeout_s=10.0)
                assert w.restart()
            assert w.pid not in (None, first) and _parent_pid(w.pid) == w._server_pid
        assert w.restarts == 3 and len(w.fork_s) >= 3
        w.begin_request(served.model.example_input)
        n = len(served.model)
        for i in range(n):
            while not w.push(i):
                time.sleep(0.0002)
        deadline = time.monotonic() + 20
        while w.last_done != n - 1:
            assert time.monotonic() < deadline
            time.sleep(0.0005)
        assert _bits(w.ws.output()) == ref


class _Affinities(_Quiet):
    """Records the scheduler's and the live BE workers' cores whenever padding (between RT ops) polls
    the source."""

    def __init__(self, sched):
        self.sched, self.during = sched, []

    def due(self, now_s):
        if sys._getframe(1).f_code.co_name == "_pad":
            be = [os.sched_getaffinity(s.worker.pid) for s in self.sched.streams.values() if s.worker.pid]
            self.during.append((os.sched_getaffinity(0), be))
        return []


@pytest.mark.parametrize("cores", [2, 1])
def test_padding_keeps_a_be_stream_on_each_core_the_rt_op_leaves(tiny_models, cores):
    """§5 on a CPU: with one RT thread on 2 cores one BE stream goes on through the RT request
    (its ops topped up between RT ops) and the other is preempted; on 1 core both are. Outputs stay
    bit-exact either way."""
    refs = {m: _bits(tiny_models[m].model.infer(tiny_models[m].model.example_input)) for m in ("resnet152", "vgg19")}
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores")
    all_cores = os.sched_getaffinity(0)
    config = TaskSchedulerConfig(mode="reef", pad=True, cores=cores, rt_threads=1)
    base = os.getpriority(os.PRIO_PROCESS, 0)
    with RealtimeScheduler(config, tiny_models, {"be-a": "resnet152", "be-b": "vgg19"}) as sched:
        seen = _Affinities(sched)
        # stream priority: the scheduler be_nice levels above BE, by raising itself where permitted
        gap = [os.getpriority(os.PRIO_PROCESS, s.worker.pid) - os.getpriority(os.PRIO_PROCESS, 0)
               for s in sched.streams.values()]
        assert gap == [config.be_nice] * 2
        assert os.getpriority(os.PRIO_PROCESS, 0) == base - sched._raise
        for client, model in (("be-a", "resnet152"), ("be-b", "vgg19")):
            sched.submit(Request(client, model, False, tiny_models[model].model.example_input, time.perf_counter()))
        sched.service_be(_Quiet())
        assert all(s.current is not None for s in sched.streams.values())
        for _ in range(10):  # RT work long enough for the padded worker to take more ops
            sched.submit(Request("rt", "vgg19", True, tiny_models["vgg19"].model.example_input, time.perf_counter()))
        sched.run(seen, until_s=time.perf_counter())  # serves the RT requests that arrived, then returns
        assert [r.client for r in sched.completed if r.realtime] == ["rt"] * 10
        assert sched.preemptions[-1].streams == 3 - cores  # the padded stream was not preempted
        assert (sched.padded_ops > 0) == (cores == 2)
        if cores == 2:  # in real-time mode the RT op has the first core, BE workers the other
            first = min(all_cores)
            assert seen.during and all(rt == {first} and all(w == all_cores - {first} for w in be)
                                       for rt, be in seen.during)
        assert os.sched_getaffinity(0) == all_cores  # normal mode: everything runs anywhere
        for s in sched.streams.values():
            _serve_until(sched, s, lambda s=s: s.current is None)
        be = {r.model: r for r in sched.completed if not r.realtime}
        assert {m: _bits(r.output) for m, r in be.items()} == refs
        assert sorted(r.preemptions for r in be.values()) == ([0, 1] if cores == 2 else [1, 1])
    assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the raise is undone on close


def test_rt_load_scale_scales_every_rt_rate_and_is_checked(tiny_models):
    solo = {n: m.solo_s for n, m in tiny_models.items()}
    full = dnn_preset("D", solo, 1.0, SHAPES)
    scaled = dnn_preset("D", solo, 1.0, SHAPES, rt_load_scale=0.8)
    for a, b in zip(full.clients, scaled.clients):
        if a.priority == "real-time":
            assert b.rate_per_s == pytest.approx(0.8 * a.rate_per_s)
    for bad in (0.0, 1.5):
        with pytest.raises(RealtimeError, match="rt_load_scale"):
            dnn_preset("A", solo, 1.0, SHAPES, rt_load_scale=bad)
    with pytest.raises(RealtimeError, match="rt_load_scale"):  # refused before any model is built
        run_disb(["A"], ["rt-only"], 1.0, 1, rt_load_scale=2.0, scales={})
