"""Local IPC between engines and the node runtime: JSON lines over a Unix domain socket, plus a
file-backed shared pause flag per offline engine.

Engine -> runtime (fire and forget unless marked "reply"):
    register        {engine_id, role, pid, os_suspend}              reply: {flag_path}
    busy            {request_ids}          online compute in flight for these requests
    idle            {}                     online has no compute in flight
    decode_step     {t_s, request_ids}     online finished a decode step (CLOCK_MONOTONIC)
    iteration_end   {}                     offline finished an iteration (iteration-level gate)
    allocate        {n_handles}                                     reply: {handles}
    release         {handle_ids}                                    reply: {}
    report_blocks   {request_blocks, request_tokens}                offline KV occupancy
    offline_tokens  {count}                output tokens this offline engine generated so far,
                                           lines still in progress included (Valve §6's measured rate)
Runtime -> engine:
    reply           {seq, ok, error?, ...}
    invalidate      {handle_ids, block_ids, request_ids}            offline lost these (Valve §5)

Requests that expect a reply carry a `seq`. The pause decision does not travel on the socket:
the runtime writes it into the engine's pause flag, which the engine reads at its layer
safepoints for the price of one memory load.
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import threading
import time
from typing import Any, Callable

from backfill import errors
from backfill.errors import NodeProtocolError

MAX_LINE_BYTES = 1 << 22

# Message type -> required fields and their JSON types.
_SCHEMA: dict[str, dict[str, type | tuple[type, ...]]] = {
    "register": {"engine_id": str, "role": str, "pid": int, "os_suspend": bool},
    "busy": {"request_ids": list},
    "idle": {},
    "decode_step": {"t_s": (int, float), "request_ids": list},
    "iteration_end": {},
    "allocate": {"n_handles": int},
    "release": {"handle_ids": list},
    "report_blocks": {"request_blocks": dict, "request_tokens": dict},
    "offline_tokens": {"count": int},
    "reply": {"seq": int, "ok": bool},
    "invalidate": {"handle_ids": list, "block_ids": list, "request_ids": list},
}


def encode(msg: dict[str, Any]) -> bytes:
    validate(msg)
    return json.dumps(msg, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> dict[str, Any]:
    try:
        msg = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise NodeProtocolError(f"message is not JSON: {line[:80]!r}") from exc
    validate(msg)
    return msg


def validate(msg: Any) -> None:
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise NodeProtocolError(f"message must be an object with a string 'type': {msg!r:.120}")
    schema = _SCHEMA.get(msg["type"])
    if schema is None:
        raise NodeProtocolError(f"unknown message type {msg['type']!r}")
    for name, kind in schema.items():
        value = msg.get(name)
        # bool is an int in Python; an int field must not accept True/False.
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise NodeProtocolError(f"{msg['type']}: field {name!r} must be {kind}, got {value!r:.80}")
    if "seq" in msg and (not isinstance(msg["seq"], int) or isinstance(msg["seq"], bool)):
        raise NodeProtocolError(f"{msg['type']}: seq must be an int")


class JsonLineChannel:
    """A connected Unix socket carrying one JSON message per line; send() is thread-safe."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._reader = sock.makefile("rb")
        self._send_lock = threading.Lock()
        self._closed = False

    def send(self, msg: dict[str, Any]) -> None:
        data = encode(msg)
        with self._send_lock:
            try:
                self._sock.sendall(data)
            except OSError as exc:
                raise NodeProtocolError(f"peer went away: {exc}") from exc

    def recv(self) -> dict[str, Any] | None:
        """The next message, or None at end of stream."""
        try:
            line = self._reader.readline(MAX_LINE_BYTES + 1)
        except (OSError, ValueError):
            return None
        if not line:
            return None
        if len(line) > MAX_LINE_BYTES or not line.endswith(b"\n"):
            raise NodeProtocolError("message line too long or truncated")
        return decode(line)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._reader.close()
        self._sock.close()


class EngineState:
    """What an offline engine says about its compute, in byte 1 of its pause flag."""

    IDLE = 0      # outside any step: holds no compute, safe to reclaim under
    RUNNING = 1   # inside a step, between safepoints
    PARKED = 2    # waiting at a safepoint because a pause was requested


class PauseFlag:
    """A 2-byte file-backed shared flag: byte 0 written by the runtime (1 = pause requested),
    byte 1 by the engine (an EngineState). Both sides map the same file."""

    SIZE = 2

    def __init__(self, path: str, *, create: bool = False) -> None:
        self.path = path
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as exc:
            raise NodeProtocolError(f"cannot open pause flag {path}: {exc}") from exc
        try:
            if create:
                os.ftruncate(fd, self.SIZE)
            elif os.fstat(fd).st_size != self.SIZE:
                raise NodeProtocolError(f"{path} is not a pause flag")
            self._map = mmap.mmap(fd, self.SIZE)
        finally:
            os.close(fd)

    @property
    def pause_requested(self) -> bool:
        return self._map[0] != 0

    def set_pause(self, pause: bool) -> None:
        self._map[0] = 1 if pause else 0

    @property
    def engine_state(self) -> int:
        return self._map[1]

    def set_engine_state(self, state: int) -> None:
        self._map[1] = state

    def close(self) -> None:
        if not self._map.closed:
            self._map.close()


class NodeClient:
    """The engine-facing side of the node runtime: all an engine needs to be colocated.

    Offline engines call `wait_if_paused()` (or poll `should_pause()`) at their layer
    safepoints inside `with client.computing():`, and handle `on_invalidate` / `take_invalidated`.
    Online engines call `report_busy` / `report_idle` / `report_decode_step`.
    """

    def __init__(self, channel: JsonLineChannel, engine_id: str, role: str, flag: PauseFlag | None) -> None:
        self.engine_id = engine_id
        self.role = role
        self._channel = channel
        self._flag = flag
        self._seq = 0
        self._lock = threading.Lock()
        self._replies: dict[int, dict[str, Any]] = {}
        self._reply_ready = threading.Condition(self._lock)
        self._invalidated: list[dict[str, Any]] = []
        self._callbacks: list[Callable[[dict[str, Any]], None]] = []
        self._handles: set[int] = set()
        self._closed = False
        self._reader = threading.Thread(target=self._read_loop, name=f"node-client-{engine_id}", daemon=True)
        self._reader.start()

    @classmethod
    def connect(cls, socket_path: str, engine_id: str, role: str, *, pid: int | None = None,
                os_suspend: bool = False, timeout_s: float = 5.0, pool: bool = True) -> "NodeClient":
        """pool=False: register without holding memory of the shared pool (an online engine that
        only reports its lifecycle to the gate)."""
        if role not in ("online", "offline"):
            raise NodeProtocolError(f"role must be 'online' or 'offline', got {role!r}")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)
            sock.connect(socket_path)
            sock.settimeout(None)
        except OSError as exc:
            sock.close()
            raise NodeProtocolError(f"cannot reach node runtime at {socket_path}: {exc}") from exc
        client = cls(JsonLineChannel(sock), engine_id, role, None)
        try:
            reply = client._call({"type": "register", "engine_id": engine_id, "role": role,
                                  "pid": os.getpid() if pid is None else pid, "os_suspend": os_suspend,
                                  "pool": bool(pool)},
                                 timeout_s)
            if role == "offline":
                client._flag = PauseFlag(reply["flag_path"])
        except BaseException:
            client.close()
            raise
        return client

    # --- offline: compute safepoints ----------------------------------------------------------

    def should_pause(self) -> bool:
        """True when the runtime wants offline compute stopped (one shared-memory load)."""
        return self._flag is not None and self._flag.pause_requested

    def wait_if_paused(self, poll_s: float = 0.0005, give_up: Callable[[], bool] | None = None,
                       drain: Callable[[], None] | None = None) -> bool:
        """At a safepoint: block while a pause is requested, or until give_up() says to stop
        waiting (the caller then aborts its step). Returns True if it had to wait.

        drain() runs before the engine says PARKED: on a GPU it waits for the kernels already
        launched, so the runtime never reclaims memory a running kernel still writes (Valve §5)."""
        flag = self._flag
        if flag is None or not flag.pause_requested:
            return False
        if drain is not None:
            drain()
        previous = flag.engine_state
        flag.set_engine_state(EngineState.PARKED)
        try:
            while flag.pause_requested and not self._closed and not (give_up is not None and give_up()):
                time.sleep(poll_s)
        finally:
            flag.set_engine_state(previous)
        return True

    def computing(self) -> "_Computing":
        """Context manager around one offline step: marks it RUNNING, waits out a pause first."""
        return _Computing(self)

    def report_iteration_boundary(self) -> None:
        self._send({"type": "iteration_end"})

    def report_offline_tokens(self, count: int) -> None:
        """The engine's cumulative offline output tokens, counted per step (unfinished lines too)."""
        self._send({"type": "offline_tokens", "count": int(count)})

    # --- online: lifecycle ----------------------------------------------------------------------

    def report_busy(self, request_ids: list[str] | tuple[str, ...]) -> None:
        self._send({"type": "busy", "request_ids": [str(r) for r in request_ids]})

    def report_idle(self) -> None:
        self._send({"type": "idle"})

    def report_decode_step(self, t_s: float | None = None, request_ids: list[str] | tuple[str, ...] = ()) -> None:
        """t_s on CLOCK_MONOTONIC (time.monotonic()), shared by all processes on the node."""
        self._send({"type": "decode_step", "t_s": time.monotonic() if t_s is None else float(t_s),
                    "request_ids": [str(r) for r in request_ids]})

    # --- memory ------------------------------------------------------------------------------

    def allocate(self, n_handles: int, timeout_s: float = 10.0) -> tuple[int, ...]:
        reply = self._call({"type": "allocate", "n_handles": n_handles}, timeout_s)
        handles = tuple(reply["handles"])
        with self._lock:
            self._handles.update(handles)
        return handles

    def release(self, handle_ids: list[int] | tuple[int, ...], timeout_s: float = 10.0) -> None:
        self._call({"type": "release", "handle_ids": list(handle_ids)}, timeout_s)
        with self._lock:
            self._handles.difference_update(handle_ids)

    def report_blocks(self, request_blocks: dict[str, list[int]], request_tokens: dict[str, int]) -> None:
        self._send({"type": "report_blocks", "request_blocks": {str(k): list(v) for k, v in request_blocks.items()},
                    "request_tokens": {str(k): int(v) for k, v in request_tokens.items()}})

    @property
    def handles(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(sorted(self._handles))

    def on_invalidate(self, callback: Callable[[dict[str, Any]], None]) -> None:
        """callback(msg) runs on the client's reader thread for every invalidation; msg has
        handle_ids, block_ids, request_ids."""
        with self._lock:
            self._callbacks.append(callback)

    def take_invalidated(self) -> list[dict[str, Any]]:
        """Invalidations received since the last call (Valve §5: polled after each step)."""
        with self._lock:
            taken, self._invalidated = self._invalidated, []
        return taken

    def close(self) -> None:
        self._closed = True
        self._channel.close()
        if self._reader is not threading.current_thread():
            self._reader.join(timeout=5.0)
        if self._flag is not None:
            self._flag.close()

    def __enter__(self) -> "NodeClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals ----------------------------------------------------------------------------

    def _send(self, msg: dict[str, Any]) -> None:
        if self._closed:
            raise NodeProtocolError("client is closed")
        self._channel.send(msg)

    def _call(self, msg: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        with self._lock:
            self._seq += 1
            seq = msg["seq"] = self._seq
        self._send(msg)
        with self._reply_ready:
            if not self._reply_ready.wait_for(lambda: seq in self._replies or self._closed, timeout_s):
                raise NodeProtocolError(f"no reply to {msg['type']} within {timeout_s} s")
            if seq not in self._replies:
                raise NodeProtocolError(f"connection closed before the reply to {msg['type']}")
            reply = self._replies.pop(seq)
        if not reply["ok"]:
            raise _rebuild_error(reply.get("error_type"), reply.get("error", "runtime refused the request"))
        return reply

    def _read_loop(self) -> None:
        try:
            while True:
                msg = self._channel.recv()
                if msg is None:
                    break
                if msg["type"] == "reply":
                    with self._reply_ready:
                        self._replies[msg["seq"]] = msg
                        self._reply_ready.notify_all()
                elif msg["type"] == "invalidate":
                    with self._lock:
                        self._handles.difference_update(msg["handle_ids"])
                        self._invalidated.append(msg)
                        callbacks = list(self._callbacks)
                    for cb in callbacks:
                        cb(msg)
        except NodeProtocolError:
            pass  # a garbled stream ends the session like EOF does
        finally:
            with self._reply_ready:
                self._closed = True
                self._reply_ready.notify_all()


class _Computing:
    def __init__(self, client: NodeClient) -> None:
        self._client = client

    def __enter__(self) -> NodeClient:
        flag = self._client._flag
        if flag is not None:
            # RUNNING is published before the pause flag is read, so a runtime that asks for a
            # pause at the same moment either sees RUNNING or we see its request.
            flag.set_engine_state(EngineState.RUNNING)
            self._client.wait_if_paused()
        return self._client

    def __exit__(self, *exc: object) -> None:
        flag = self._client._flag
        if flag is not None:
            flag.set_engine_state(EngineState.IDLE)


def _rebuild_error(type_name: str | None, message: str) -> Exception:
    """Re-raise the runtime's typed error on the engine side (only BackfillError subclasses)."""
    cls = getattr(errors, type_name or "", None)
    if isinstance(cls, type) and issubclass(cls, errors.BackfillError):
        return cls(message)
    return NodeProtocolError(message)
