import json
import mmap
import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from backfill.errors import NodeProtocolError, OverAllocationError, SuspendError
from backfill.node.ipc import NodeClient
from backfill.memory.shared_pool import PoolConfig, SharedMemoryPool
from backfill.node.runtime import NodeRuntime, RuntimeConfig
from backfill.node.suspend import _proc_state
from backfill.policy.gate import GateConfig, IterationGate, LifecycleGate
from backfill.policy.reclaim import GreedyReclaimPolicy

REPO = Path(__file__).resolve().parents[2]
BLOCKS_PER_HANDLE = 4

# An offline engine: steps of 4 "layers" with a safepoint before each, a progress counter in a
# file-backed map, one request per handle it holds, and a log of invalidations it receives.
OFFLINE_ENGINE = textwrap.dedent("""
    import json, mmap, struct, sys
    from backfill.node.ipc import NodeClient
    sock, engine_id, counter, events, os_suspend, n_handles, bph = sys.argv[1:8]
    client = NodeClient.connect(sock, engine_id, "offline", os_suspend=os_suspend == "1")
    log = open(events, "a", buffering=1)
    client.on_invalidate(lambda msg: log.write(json.dumps(msg) + "\\n"))
    handles = client.allocate(int(n_handles)) if int(n_handles) else ()
    client.report_blocks({f"req{h}": [h * int(bph)] for h in handles}, {f"req{h}": 10 * (h + 1) for h in handles})
    log.write(json.dumps({"ready": list(handles)}) + "\\n")
    with open(counter, "r+b") as f:
        m = mmap.mmap(f.fileno(), 8)
    i = 0
    while True:
        with client.computing():
            for layer in range(4):
                client.wait_if_paused()
                sum(range(3000))
                i += 1
                m[:8] = struct.pack("Q", i)
""")


def wait_for(cond, timeout_s=10.0, what="condition"):
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


def read_counter(path):
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 8) as m:
        return struct.unpack("Q", m[:8])[0]


def progressing(path, window_s=0.15):
    before = read_counter(path)
    time.sleep(window_s)
    return read_counter(path) != before


def read_log(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]


@pytest.fixture
def offline_engine(tmp_path):
    procs = []

    def start(runtime, engine_id="off", os_suspend=False, n_handles=0):
        counter, events = tmp_path / f"{engine_id}.counter", tmp_path / f"{engine_id}.events"
        counter.write_bytes(b"\0" * 8)
        events.write_text("")
        env = dict(os.environ, PYTHONPATH=str(REPO))
        p = subprocess.Popen([sys.executable, "-c", OFFLINE_ENGINE, runtime.socket_path, engine_id, str(counter),
                              str(events), "1" if os_suspend else "0", str(n_handles), str(BLOCKS_PER_HANDLE)],
                             env=env)
        procs.append(p)
        wait_for(lambda: any("ready" in e for e in read_log(events)), what="offline engine to start")
        wait_for(lambda: read_counter(counter) > 0, what="offline progress")
        return p, str(counter), str(events)

    yield start
    for p in procs:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(p.pid, sig)
            except ProcessLookupError:
                pass
        p.wait(timeout=10)


@pytest.fixture
def runtime():
    rt = NodeRuntime(LifecycleGate(GateConfig(min_cooldown_s=0.3, max_cooldown_s=1.0)),
                     SharedMemoryPool(PoolConfig(num_handles=6, blocks_per_handle=BLOCKS_PER_HANDLE),
                                      reclaim_policy=GreedyReclaimPolicy()),
                     RuntimeConfig(tick_interval_s=0.02)).start()
    yield rt
    rt.stop()


def test_online_busy_pauses_offline_and_cooldown_is_honored(runtime, offline_engine):
    _, counter, _ = offline_engine(runtime)
    with NodeClient.connect(runtime.socket_path, "on", "online") as online:
        assert progressing(counter)
        online.report_busy(["r1"])
        # The cooperative flag flips and the engine parks at its next layer safepoint.
        wait_for(lambda: runtime.offline_paused and runtime.stats.ack_latencies_s, what="offline to park")
        assert not progressing(counter)
        for k in range(3):                                     # decode steps 50 ms apart
            online.report_decode_step(time.monotonic(), ["r1"])
            time.sleep(0.05)
        wait_for(lambda: runtime.gate.longest_gap_s is not None, what="decode steps")
        online.report_idle()
        idle_at = time.monotonic()
        cooldown_s = 0.3                                       # 2 x ~50 ms gap is under the floor
        wait_for(lambda: not runtime.offline_paused, what="gate to reopen")
        assert time.monotonic() - idle_at >= cooldown_s - 0.02
        assert progressing(counter)
    assert runtime.gate.stats.preemptions("r1") == 1


def test_reclamation_pauses_offline_and_delivers_invalidated_blocks(runtime, offline_engine):
    _, counter, events = offline_engine(runtime, n_handles=6)
    ready = [e for e in read_log(events) if "ready" in e][0]["ready"]
    # The block report is one-way and travels on the offline engine's own connection, so it
    # may still be in flight when the engine logs "ready"; reclaim only once the runtime has it.
    wait_for(lambda: len(runtime.pool.reported_requests("off")) == 6, what="block report")
    with NodeClient.connect(runtime.socket_path, "on", "online") as online:
        got = online.allocate(2)
        assert len(got) == 2 and set(got) <= set(ready)
        wait_for(lambda: any("block_ids" in e for e in read_log(events)), what="invalidation")
        (notice,) = [e for e in read_log(events) if "block_ids" in e]
        # Greedy picks the cheapest requests: req h costs 10 * (h + 1) tokens.
        assert sorted(notice["handle_ids"]) == sorted(got) == [0, 1]
        assert notice["request_ids"] == ["req0", "req1"]
        assert notice["block_ids"] == [0, BLOCKS_PER_HANDLE]
        assert runtime.pool.stats.reclamations == 1 and runtime.stats.ack_timeouts == 0
        assert progressing(counter)                            # the pause was lifted afterwards
        with pytest.raises(OverAllocationError):
            online.allocate(99)


def test_in_process_client_sees_invalidations_by_callback_and_by_poll(runtime):
    with NodeClient.connect(runtime.socket_path, "off", "offline") as offline, \
            NodeClient.connect(runtime.socket_path, "on", "online") as online:
        seen = []
        offline.on_invalidate(seen.append)
        handles = offline.allocate(6)
        offline.report_blocks({"a": [handles[0] * BLOCKS_PER_HANDLE]}, {"a": 5})
        wait_for(lambda: runtime.pool.reported_requests("off") == {"a": 5}, what="block report")
        online.allocate(6)
        wait_for(lambda: seen, what="callback")
        assert seen[0]["request_ids"] == ["a"] and offline.handles == ()
        assert runtime.pool.reported_requests("off") == {}
        assert offline.take_invalidated() == seen and offline.take_invalidated() == []


def test_shutdown_continues_an_os_suspended_engine(offline_engine):
    rt = NodeRuntime(LifecycleGate(GateConfig(min_cooldown_s=5.0, max_cooldown_s=5.0))).start()
    try:
        proc, counter, _ = offline_engine(rt, os_suspend=True)
        with NodeClient.connect(rt.socket_path, "on", "online") as online:
            online.report_busy(["r"])
            wait_for(lambda: rt.stats.os_pause_latencies_s, what="SIGSTOP")
            assert _proc_state(proc.pid) == "T"
            assert not progressing(counter)
    finally:
        rt.stop()
    assert _proc_state(proc.pid) not in ("T", None)
    assert progressing(counter)


def test_online_engine_that_disconnects_counts_as_idle(runtime, offline_engine):
    _, counter, _ = offline_engine(runtime)
    online = NodeClient.connect(runtime.socket_path, "on", "online")
    online.report_busy(["r"])
    wait_for(lambda: runtime.offline_paused, what="pause")
    online.close()
    wait_for(lambda: not runtime.offline_paused, what="resume after the online engine left")
    assert "on" not in runtime.engines()
    assert progressing(counter)


def test_iteration_gate_waits_for_the_offline_boundary():
    with NodeRuntime(IterationGate()) as rt, \
            NodeClient.connect(rt.socket_path, "off", "offline") as offline, \
            NodeClient.connect(rt.socket_path, "on", "online") as online:
        online.report_busy(["r"])
        wait_for(lambda: rt.gate.close_pending, what="busy")
        assert not offline.should_pause()
        offline.report_iteration_boundary()
        wait_for(offline.should_pause, what="pause at the boundary")
        online.report_idle()
        wait_for(lambda: not offline.should_pause(), what="resume")


def test_protocol_errors(runtime):
    with pytest.raises(NodeProtocolError, match="cannot reach"):
        NodeClient.connect(runtime.socket_path + ".missing", "x", "offline")
    with pytest.raises(NodeProtocolError, match="role"):
        NodeClient.connect(runtime.socket_path, "x", "sideline")
    with NodeClient.connect(runtime.socket_path, "off", "offline") as offline:
        with pytest.raises(NodeProtocolError, match="already registered"):
            NodeClient.connect(runtime.socket_path, "off", "offline")
        offline.report_busy(["r"])                             # online-only message: rejected
        wait_for(lambda: runtime.stats.rejected_messages >= 2, what="rejection")
        assert not runtime.offline_paused
        with pytest.raises(SuspendError, match="refusing"):            # the runtime's own pid
            NodeClient.connect(runtime.socket_path, "off2", "offline", os_suspend=True)
        assert sorted(runtime.engines()) == ["off"]
    # A garbled line ends that connection; the runtime keeps serving others.
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(runtime.socket_path)
    raw.sendall(b"not json\n")
    assert raw.recv(1) == b""
    raw.close()
    with NodeClient.connect(runtime.socket_path, "on", "online") as online:
        assert online.allocate(1)


def test_offline_token_counts_add_up_and_survive_a_disconnect(runtime):
    with NodeClient.connect(runtime.socket_path, "on", "online", pool=False) as online:
        online.report_offline_tokens(5)                      # only an offline engine generates offline tokens
        wait_for(lambda: runtime.stats.rejected_messages >= 1, what="rejection")
        with NodeClient.connect(runtime.socket_path, "a", "offline") as a, \
                NodeClient.connect(runtime.socket_path, "b", "offline") as b:
            a.report_offline_tokens(7)
            b.report_offline_tokens(3)
            a.report_offline_tokens(12)
            wait_for(lambda: runtime.offline_tokens() == 15, what="the sum of the last counts")
        wait_for(lambda: sorted(runtime.engines()) == ["on"], what="both offline engines gone")
        assert runtime.offline_tokens() == 15                # the node's count never steps back
