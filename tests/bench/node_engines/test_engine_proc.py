"""Real engine processes (tiny random model) colocated by a real node runtime."""

import os
import random
import signal
import time

import pytest

from backfill.engine.config import ModelConfig
from backfill.engine.kv_pool import KVBlockPool
from backfill.engine.model import LlamaModel
from backfill.engine.runner import ModelRunner
from backfill.engine.weights import random_model
from backfill.errors import EngineStoppedError, NodeError, PolicyInputError
from backfill.memory.kv_arena import make_arena
from backfill.bench.node_engines.engine_proc import (EngineProcess, EngineSpec, engine_kv_layout, make_request,
                                                    request_dict)
from backfill.node.ipc import NodeClient
from backfill.memory.shared_pool import PoolConfig, SharedMemoryPool
from backfill.node.runtime import NodeRuntime, RuntimeConfig
from backfill.node.suspend import _proc_state
from backfill.policy.baselines import FCFSPolicy
from backfill.policy.gate import GateConfig, LifecycleGate
from backfill.policy.miad import MIADReservation
from backfill.policy.reclaim import FIFOReclaimPolicy
from backfill.serving.scheduler import Scheduler

NUM_HANDLES, BLOCKS_PER_HANDLE, BLOCK_SIZE = 12, 2, 8


def wait_for(cond, timeout_s=20.0, what="condition"):
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


def spec(engine_id, role, **kw):
    return EngineSpec(engine_id, role, NUM_HANDLES, BLOCKS_PER_HANDLE, BLOCK_SIZE, model="tiny", **kw)


def offline_backlog(n, prompt_len=16, max_tokens=40, seed=1):
    rng = random.Random(seed)
    return [request_dict(f"off-{i}", [rng.randrange(3, 256) for _ in range(prompt_len)], max_tokens) for i in range(n)]


def reference_outputs(requests):
    """The same greedy requests on an in-process engine that nothing ever interrupts."""
    cfg = ModelConfig.tiny()
    runner = ModelRunner(LlamaModel(cfg, random_model(cfg, 0)), KVBlockPool(cfg, 256, BLOCK_SIZE))
    scheduler = Scheduler(runner, FCFSPolicy())
    out = {}
    for d in requests:
        scheduler.add(make_request(d, "offline"))
    while scheduler.has_work():
        for ev in scheduler.step():
            out.setdefault(ev.request_id, []).extend(ev.token_ids)
    return out


@pytest.fixture
def processes():
    started = []

    def start(s, runtime):
        p = EngineProcess(s, runtime.socket_path)
        started.append(p)
        return p.start()

    yield start
    for p in started:
        p.stop(timeout_s=10.0)
        assert not p.alive


def make_runtime(reclaim=FIFOReclaimPolicy()):
    pool = SharedMemoryPool(PoolConfig(NUM_HANDLES, BLOCKS_PER_HANDLE), reservation=MIADReservation(),
                            reclaim_policy=reclaim)
    return NodeRuntime(LifecycleGate(GateConfig(min_cooldown_s=0.05, max_cooldown_s=0.3)), pool,
                       RuntimeConfig(tick_interval_s=0.02))


@pytest.mark.parametrize("shared_kv", [False, True], ids=["private-kv", "shared-kv-arena"])
def test_reclaimed_offline_requests_recompute_to_the_same_greedy_tokens(processes, shared_kv):
    """With a shared arena both engines write one allocation: a handle reclaimed from offline is
    overwritten by online's KV, so any mistake in who owns which blocks changes offline's tokens."""
    backlog = offline_backlog(8)
    rng = random.Random(2)
    arena = make_arena(engine_kv_layout(spec("layout", "online")), "cpu") if shared_kv else None
    extra = {"kv_arena": arena.descriptor().to_json()} if arena is not None else {}
    with make_runtime() as rt:
        online = processes(spec("on", "online", **extra), rt)
        offline = processes(spec("off", "offline", max_batch_seqs=4, **extra), rt)
        offline.send("add", backlog)
        # Wait until offline holds computed KV, then make online need most of the pool.
        wait_for(lambda: any(t > 0 for t in rt.pool.reported_requests("off").values()), what="offline progress")
        for i in range(3):
            online.send("submit", request_dict(f"on-{i}", [rng.randrange(3, 256) for _ in range(30)], 8))
        wait_for(lambda: len(online.done) == 3, what="online requests")
        wait_for(lambda: len(offline.done) == len(backlog), what="offline backlog")
        off_stats = offline.stop()
        on_stats = online.stop()
        preemptions = rt.gate.stats.max_preemptions_per_request
    # FIFO reclaimed the oldest handles, which held computed offline KV: it was recomputed.
    assert off_stats["invalidations"] >= 1 and off_stats["lost_tokens"] > 0
    assert off_stats["recomputed_tokens"] >= off_stats["lost_tokens"]
    assert {d["request_id"]: d["output_token_ids"] for d in offline.done} == reference_outputs(backlog)
    assert off_stats["unfinished"] == [] and off_stats["finished"] == len(backlog)
    for record in online.done:
        assert record["output_tokens"] == 8 and record["finish_reason"] == "length"
        assert record["arrival_s"] <= record["first_token_s"] <= record["last_token_s"]
    assert on_stats["allocated_handles"] > 0 and on_stats["unfinished"] == []
    assert preemptions <= 1
    if arena is not None:
        assert arena.bytes.count_nonzero() > 0       # the engines' KV went into the arena
        arena.close()


def test_an_engine_refuses_an_arena_of_another_layout(tmp_path):
    arena = make_arena(engine_kv_layout(EngineSpec("layout", "online", NUM_HANDLES, BLOCKS_PER_HANDLE, 4, model="tiny")),
                       "cpu")
    try:
        with make_runtime() as rt:
            engine = EngineProcess(spec("on", "online", kv_arena=arena.descriptor().to_json()), rt.socket_path)
            with pytest.raises(NodeError, match="SharedMemoryError.*layout"):
                engine.start(timeout_s=60)
            assert not engine.alive
    finally:
        arena.close()


def test_cooperative_pause_parks_the_offline_engine_and_loses_nothing(processes):
    backlog = offline_backlog(400, max_tokens=60)
    with make_runtime() as rt:
        offline = processes(spec("off", "offline"), rt)
        offline.send("add", backlog)
        wait_for(lambda: offline.counters()["tokens_out"] > 0, what="offline tokens")
        with NodeClient.connect(rt.socket_path, "on", "online") as online:
            online.report_busy(["r1"])
            wait_for(lambda: rt.offline_paused and rt.stats.ack_latencies_s, what="offline to park")
            frozen = offline.counters()["tokens_out"]
            time.sleep(0.2)
            assert offline.counters()["tokens_out"] == frozen
            online.report_idle()
            wait_for(lambda: offline.counters()["tokens_out"] > frozen, what="offline to resume")
        stats = offline.stop()
        # The engine always reached a safepoint before the runtime gave up waiting for it.
        assert rt.stats.ack_timeouts == 0
    assert stats["parks"] + stats["steps"] > 0
    assert stats["submitted"] == len(backlog)
    assert stats["finished"] + stats["in_flight"] + stats["backlog"] == len(backlog)
    assert len(stats["unfinished"]) == stats["in_flight"]
    assert not offline.alive


def test_os_suspend_stops_the_process_and_continues_it(processes):
    with make_runtime() as rt:
        offline = processes(spec("off", "offline", os_suspend=True), rt)
        offline.send("add", offline_backlog(400, max_tokens=60))
        wait_for(lambda: offline.counters()["tokens_out"] > 0, what="offline tokens")
        with NodeClient.connect(rt.socket_path, "on", "online") as online:
            online.report_busy(["r1"])
            wait_for(lambda: rt.stats.os_pause_latencies_s, what="SIGSTOP")
            assert _proc_state(offline.pid) in ("T", "t")
            online.report_idle()
            wait_for(lambda: _proc_state(offline.pid) not in ("T", "t"), what="SIGCONT")
            before = offline.counters()["tokens_out"]
            wait_for(lambda: offline.counters()["tokens_out"] > before, what="offline to resume")
        offline.stop()
    assert not offline.alive


def test_stop_reaps_a_process_left_stopped(processes):
    with make_runtime() as rt:
        offline = processes(spec("off", "offline"), rt)
        os.kill(offline.pid, signal.SIGSTOP)
        wait_for(lambda: _proc_state(offline.pid) in ("T", "t"), what="stopped")
        assert offline.stop(timeout_s=0.5) is None
        assert not offline.alive
        with pytest.raises(EngineStoppedError):
            offline.send("add", [])


def test_engine_that_cannot_reach_the_runtime_fails_with_a_typed_error(tmp_path):
    p = EngineProcess(spec("off", "offline"), str(tmp_path / "missing.sock"))
    with pytest.raises(NodeError, match="cannot reach node runtime"):
        p.start()
    assert not p.alive


@pytest.mark.parametrize("kw, match", [
    ({"role": "both"}, "role"),
    ({"model": "huge"}, "model"),
    ({"num_handles": 0}, "num_handles"),
    ({"blocks_per_handle": 1.5}, "blocks_per_handle"),
    ({"policy": "coserve"}, "runs one of"),
    ({"role": "online", "os_suspend": True}, "OS-suspended"),
    ({"engine_id": ""}, "engine_id"),
    ({"model": "random:nope"}, "model"),
    ({"device": "tpu"}, "device"),
    ({"dtype": "int4"}, "dtype"),
])
def test_bad_specs_raise_typed_errors(kw, match):
    args = dict(engine_id="e", role="offline", num_handles=4, blocks_per_handle=2)
    args.update(kw)
    with pytest.raises(PolicyInputError, match=match):
        EngineSpec(**args)


def test_bench_rejects_unknown_gates_memory_policies_and_phases():
    from backfill.bench.node_bench import NodeBenchConfig, PhaseSpec

    with pytest.raises(PolicyInputError, match="memory policy"):
        PhaseSpec("x", memory="lru")
    with pytest.raises(PolicyInputError, match="unknown gate"):
        PhaseSpec("x", gate="always-open")
    with pytest.raises(PolicyInputError, match="unknown phases"):
        NodeBenchConfig(phases=("valve", "nope"))
