import socket
import threading
import time

import pytest

from backfill.errors import NodeProtocolError
from backfill.node.ipc import EngineState, JsonLineChannel, NodeClient, PauseFlag, decode, encode


def test_encode_decode_round_trip_and_validation():
    msg = {"type": "decode_step", "t_s": 1.5, "request_ids": ["a"]}
    assert decode(encode(msg)) == msg
    for bad in (b"not json", b"[1]", b'{"type": "nope"}', b'{"type": "busy"}',
                b'{"type": "allocate", "n_handles": true}', b'{"type": "allocate", "n_handles": 1.5}',
                b'{"type": "idle", "seq": "x"}'):
        with pytest.raises(NodeProtocolError):
            decode(bad)
    with pytest.raises(NodeProtocolError):
        encode({"type": "register", "engine_id": "e"})


def test_channel_carries_lines_both_ways_and_reports_eof():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    left, right = JsonLineChannel(a), JsonLineChannel(b)
    left.send({"type": "idle"})
    left.send({"type": "busy", "request_ids": ["x", "y"]})
    assert right.recv() == {"type": "idle"}
    assert right.recv()["request_ids"] == ["x", "y"]
    left.close()
    assert right.recv() is None
    right.close()
    with pytest.raises(NodeProtocolError, match="went away"):
        right.send({"type": "idle"})


def test_pause_flag_is_shared_between_mappings(tmp_path):
    path = str(tmp_path / "f.flag")
    runtime_side, engine_side = PauseFlag(path, create=True), None
    engine_side = PauseFlag(path)
    assert not engine_side.pause_requested
    runtime_side.set_pause(True)
    assert engine_side.pause_requested
    engine_side.set_engine_state(EngineState.PARKED)
    assert runtime_side.engine_state == EngineState.PARKED
    with pytest.raises(NodeProtocolError):
        PauseFlag(path, create=True)                            # exists already
    (tmp_path / "other").write_bytes(b"123")
    with pytest.raises(NodeProtocolError, match="not a pause flag"):
        PauseFlag(str(tmp_path / "other"))
    runtime_side.close()
    engine_side.close()


def test_safepoints_park_while_paused_and_mark_compute_state(tmp_path):
    path = str(tmp_path / "f.flag")
    runtime_side = PauseFlag(path, create=True)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    client = NodeClient(JsonLineChannel(a), "off", "offline", PauseFlag(path))
    assert runtime_side.engine_state == EngineState.IDLE
    assert client.wait_if_paused() is False
    runtime_side.set_pause(True)
    assert client.should_pause()
    waited = []
    worker = threading.Thread(target=lambda: waited.append(client.computing().__enter__() and True))
    worker.start()
    deadline = time.monotonic() + 10
    while runtime_side.engine_state != EngineState.PARKED:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert worker.is_alive()                                    # blocked at the safepoint
    runtime_side.set_pause(False)
    worker.join(timeout=10)
    assert waited == [True] and runtime_side.engine_state == EngineState.RUNNING
    client.computing().__exit__(None, None, None)
    assert runtime_side.engine_state == EngineState.IDLE
    client.close()
    b.close()
    runtime_side.close()


def test_a_safepoint_drains_launched_work_before_it_says_parked(tmp_path):
    """On a GPU the drain waits for the kernels already launched: the runtime must not see PARKED
    (and reclaim memory) before that work has finished (Valve §5)."""
    path = str(tmp_path / "f.flag")
    runtime_side = PauseFlag(path, create=True)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    client = NodeClient(JsonLineChannel(a), "off", "offline", PauseFlag(path))
    states_during_drain = []
    drained = threading.Event()

    def drain():
        states_during_drain.append(runtime_side.engine_state)
        time.sleep(0.05)                 # the launched work still running
        drained.set()

    assert client.wait_if_paused(drain=drain) is False and not states_during_drain   # no pause: no drain
    runtime_side.set_engine_state(EngineState.RUNNING)
    runtime_side.set_pause(True)
    worker = threading.Thread(target=client.wait_if_paused, kwargs={"drain": drain})
    worker.start()
    deadline = time.monotonic() + 10
    while runtime_side.engine_state != EngineState.PARKED:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert drained.is_set() and states_during_drain == [EngineState.RUNNING]
    runtime_side.set_pause(False)
    worker.join(timeout=10)
    assert not worker.is_alive()
    client.close()
    b.close()
    runtime_side.close()
