"""The node runtime: one per device, owning the compute gate and the shared memory pool for the
engines (separate processes) that register with it over a Unix socket (Valve §3-§5).

    online engine  reports busy / idle / decode steps -> the gate (policy/gate.py) decides
                   whether offline may run; the runtime applies that to every offline engine.
    offline engine is paused cooperatively through its pause flag (checked at layer safepoints)
                   and, if it asked for it, also stopped at the OS level (SIGSTOP/SIGCONT).
    memory         allocate / release go to the pool (memory/shared_pool.py); when the online engine
                   needs offline memory, the pool pauses offline compute through this runtime,
                   takes handles, and the runtime forwards the invalidated block ids.

Shutdown, and the loss of any engine's connection, always lifts pauses and continues stopped
processes (in `finally`), so an offline engine is never left stopped by a runtime that exits.
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from backfill.errors import BackfillError, NodeProtocolError, PolicyInputError
from backfill.node.ipc import EngineState, JsonLineChannel, PauseFlag
from backfill.memory.shared_pool import EngineRole, Invalidation, SharedMemoryPool
from backfill.node.suspend import ProcessSuspender
from backfill.policy.gate import ComputeGate


@dataclass(frozen=True)
class RuntimeConfig:
    socket_dir: str | None = None        # None: a fresh private directory under the system tmp
    # Reclamation waits at most this long for offline engines to reach a safepoint; after that
    # it proceeds (the invalidation still tells the engine to recompute what it touched).
    pause_ack_timeout_s: float = 1.0
    tick_interval_s: float = 0.05        # how often time advances MIAD without any event

    def __post_init__(self) -> None:
        if not (self.pause_ack_timeout_s > 0 and math.isfinite(self.pause_ack_timeout_s)):
            raise PolicyInputError(f"pause_ack_timeout_s must be > 0, got {self.pause_ack_timeout_s}")
        if not self.tick_interval_s > 0:
            raise PolicyInputError(f"tick_interval_s must be > 0, got {self.tick_interval_s}")


@dataclass
class RuntimeStats:
    offline_pauses: int = 0                                   # times offline was told to stop
    offline_resumes: int = 0
    # Pause flag set -> engine parked at a safepoint or idle (cooperative pause latency).
    ack_latencies_s: list[float] = field(default_factory=list)
    ack_timeouts: int = 0
    os_pause_latencies_s: list[float] = field(default_factory=list)  # SIGSTOP -> stopped
    rejected_messages: int = 0


@dataclass
class _Engine:
    engine_id: str
    role: EngineRole
    pid: int
    channel: JsonLineChannel
    flag: PauseFlag | None = None
    suspender: ProcessSuspender | None = None
    pause_sent_at: float | None = None      # perf_counter when the pause was set, until acked
    uses_pool: bool = True                  # registered as an owner of the shared memory pool
    offline_tokens: int = 0                 # output tokens it reported generating (cumulative)


class NodeRuntime:
    def __init__(self, gate: ComputeGate, pool: SharedMemoryPool | None = None,
                 config: RuntimeConfig = RuntimeConfig(), clock: Callable[[], float] = time.monotonic) -> None:
        self.gate = gate
        self.pool = pool
        self.config = config
        self.stats = RuntimeStats()
        self._clock = clock
        self._last_now = -math.inf
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._engines: dict[str, _Engine] = {}
        self._paused = False
        self._memory_pauses = 0
        self._reopen_at_s: float | None = None
        self._stopping = False
        self._threads: list[threading.Thread] = []
        self._channels: set[JsonLineChannel] = set()
        self._flag_seq = 0
        self._busy_online: set[str] = set()    # online engines with compute in flight
        self._offline_tokens_of_gone = 0       # reported by engines that have disconnected since
        self._own_dir = config.socket_dir is None
        self._dir = tempfile.mkdtemp(prefix="backfill-node-") if self._own_dir else str(config.socket_dir)
        self.socket_path = os.path.join(self._dir, "node.sock")
        self._listener: socket.socket | None = None
        if pool is not None:
            pool.compute = self

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> "NodeRuntime":
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(self.socket_path)
        except OSError as exc:
            listener.close()
            raise NodeProtocolError(f"cannot listen on {self.socket_path}: {exc}") from exc
        listener.listen(16)
        listener.settimeout(0.05)   # lets the accept loop notice stop()
        self._listener = listener
        for target, name in ((self._accept_loop, "node-accept"), (self._control_loop, "node-control")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            self._wake.notify_all()
        try:
            if self._listener is not None:
                self._listener.close()
            for ch in list(self._channels):
                ch.close()
            for t in list(self._threads):
                if t is not threading.current_thread():
                    t.join(timeout=5.0)
        finally:
            with self._lock:
                for engine in list(self._engines.values()):
                    self._forget(engine)
            if os.path.exists(self.socket_path):
                os.unlink(self.socket_path)
            if self._own_dir:
                shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "NodeRuntime":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- views ----------------------------------------------------------------------------

    @property
    def offline_paused(self) -> bool:
        return self._paused

    @property
    def online_busy(self) -> bool:
        """Whether any online engine has compute in flight now (the node's C_n samples this)."""
        return bool(self._busy_online)

    def offline_tokens(self) -> int:
        """Output tokens the offline engines reported generating so far, lines in progress included."""
        with self._lock:
            return self._offline_tokens_of_gone + sum(e.offline_tokens for e in self._engines.values())

    def engines(self) -> dict[str, EngineRole]:
        with self._lock:
            return {eid: e.role for eid, e in self._engines.items()}

    def memory_snapshot(self) -> dict[str, Any]:
        """The pool now: handles per engine, free, online headroom and MIAD's release interval."""
        with self._lock:
            if self.pool is None:
                return {}
            pool = self.pool
            return {"held": {eid: len(pool.handles_of(eid)) for eid, e in self._engines.items() if e.uses_pool},
                    "free": pool.free_handles, "headroom": pool.reserved_handles,
                    "release_interval_s": pool.reservation.release_interval_s if pool.reservation else None,
                    "pressure_events": pool.reservation.pressure_events if pool.reservation else None,
                    "reclamations": pool.stats.reclamations}

    # --- ComputeControl (used by the memory pool during reclamation) -------------------------

    def pause_offline(self) -> None:
        # Valve §5: offline compute stops before any of its pages are taken.
        with self._lock:
            self._memory_pauses += 1
            self._apply_gate()
            deadline = time.perf_counter() + self.config.pause_ack_timeout_s
            for engine in self._offline():
                while not self._acked(engine):
                    if time.perf_counter() > deadline:
                        self.stats.ack_timeouts += 1
                        break
                    time.sleep(0.0002)

    def unpause_offline(self) -> None:
        with self._lock:
            self._memory_pauses -= 1
            self._apply_gate()

    # --- gate application ---------------------------------------------------------------------

    def _now(self) -> float:
        self._last_now = max(self._last_now, self._clock())
        return self._last_now

    def _apply_gate(self) -> None:
        decision = self.gate.decide(self._now())
        self._reopen_at_s = decision.reopen_at_s
        paused = not decision.open or self._memory_pauses > 0
        if paused != self._paused:
            self._paused = paused
            if paused:
                self.stats.offline_pauses += 1
            else:
                self.stats.offline_resumes += 1
            for engine in self._offline():
                self._set_paused(engine, paused)
        self._wake.notify_all()

    def _set_paused(self, engine: _Engine, paused: bool) -> None:
        assert engine.flag is not None
        if paused:
            engine.flag.set_pause(True)
            engine.pause_sent_at = time.perf_counter()
            if engine.suspender is not None:
                self.stats.os_pause_latencies_s.append(engine.suspender.suspend())
        else:
            engine.flag.set_pause(False)
            engine.pause_sent_at = None
            if engine.suspender is not None:
                engine.suspender.resume()

    def _acked(self, engine: _Engine) -> bool:
        assert engine.flag is not None
        if engine.suspender is not None and engine.suspender.suspended:
            acked = True
        else:
            acked = engine.flag.engine_state in (EngineState.IDLE, EngineState.PARKED)
        if acked and engine.pause_sent_at is not None:
            self.stats.ack_latencies_s.append(time.perf_counter() - engine.pause_sent_at)
            engine.pause_sent_at = None
        return acked

    def _offline(self) -> list[_Engine]:
        return [e for e in self._engines.values() if e.role is EngineRole.OFFLINE]

    # --- threads -------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping:
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                break
            conn.settimeout(None)
            channel = JsonLineChannel(conn)
            with self._lock:
                if self._stopping:
                    channel.close()
                    break
                self._channels.add(channel)
                t = threading.Thread(target=self._serve, args=(channel,), name="node-conn", daemon=True)
                self._threads.append(t)
            t.start()

    def _control_loop(self) -> None:
        """Reopens the gate when a cooldown ends, advances MIAD, and measures pause acks."""
        with self._lock:
            while not self._stopping:
                self._apply_gate()
                if self.pool is not None:
                    self.pool.tick(self._now())
                waiting_ack = [e for e in self._offline() if e.pause_sent_at is not None and not self._acked(e)]
                timeout_s = self.config.tick_interval_s
                if self._reopen_at_s is not None:
                    timeout_s = min(timeout_s, max(0.0, self._reopen_at_s - self._clock()))
                if waiting_ack:
                    timeout_s = min(timeout_s, 0.0005)
                self._wake.wait(timeout_s)

    def _serve(self, channel: JsonLineChannel) -> None:
        engine: _Engine | None = None
        try:
            while True:
                try:
                    msg = channel.recv()
                except NodeProtocolError:
                    self.stats.rejected_messages += 1
                    break
                if msg is None:
                    break
                with self._lock:
                    if self._stopping:
                        break
                    engine = self._handle(channel, engine, msg)
        finally:
            with self._lock:
                self._channels.discard(channel)
                if engine is not None and self._engines.get(engine.engine_id) is engine:
                    self._forget(engine)
                    if not self._stopping:
                        self._apply_gate()
            channel.close()

    # --- messages ------------------------------------------------------------------------------

    def _handle(self, channel: JsonLineChannel, engine: _Engine | None, msg: dict[str, Any]) -> _Engine | None:
        kind = msg["type"]
        try:
            if kind == "register":
                if engine is not None:
                    raise NodeProtocolError("this connection already registered")
                engine = self._register(channel, msg)
                self._reply(channel, msg, flag_path=engine.flag.path if engine.flag else None)
                if engine.suspender is not None and self._paused:
                    self.stats.os_pause_latencies_s.append(engine.suspender.suspend())
                return engine
            if engine is None:
                raise NodeProtocolError(f"{kind} before register")
            self._dispatch(engine, msg)
        except BackfillError as exc:
            self.stats.rejected_messages += 1
            if "seq" in msg:
                self._reply(channel, msg, ok=False, error=str(exc), error_type=type(exc).__name__)
        return engine

    def _dispatch(self, engine: _Engine, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        now_s = self._now()
        if kind in ("busy", "idle", "decode_step") and engine.role is not EngineRole.ONLINE:
            raise NodeProtocolError(f"{kind} comes from the online engine, not {engine.engine_id!r}")
        if kind == "busy":
            # Several models on one node each report their own online work; the device is busy
            # while any of them is.
            self._busy_online.add(engine.engine_id)
            self.gate.on_busy(now_s, msg["request_ids"])
            self._apply_gate()
        elif kind == "idle":
            self._busy_online.discard(engine.engine_id)
            if not self._busy_online:
                self.gate.on_idle(now_s)
            self._apply_gate()
        elif kind == "decode_step":
            # The engine's timestamp is more precise than our receipt time, but must not step
            # behind events the gate has already seen.
            self._last_now = max(self._last_now, min(float(msg["t_s"]), now_s))
            self.gate.on_decode_step(self._last_now, msg["request_ids"])
        elif kind == "offline_tokens":
            if engine.role is not EngineRole.OFFLINE:
                raise NodeProtocolError(f"offline_tokens comes from an offline engine, not {engine.engine_id!r}")
            engine.offline_tokens = max(engine.offline_tokens, msg["count"])
        elif kind == "iteration_end":
            self.gate.on_offline_iteration_boundary(now_s)
            self._apply_gate()
        elif kind in ("allocate", "release", "report_blocks"):
            if self.pool is None:
                raise NodeProtocolError("this runtime has no memory pool")
            if kind == "allocate":
                handles = self.pool.allocate(engine.engine_id, msg["n_handles"], now_s)
                self._reply(engine.channel, msg, handles=list(handles))
            elif kind == "release":
                self.pool.release(engine.engine_id, msg["handle_ids"], now_s)
                self._reply(engine.channel, msg)
            else:
                self.pool.report_blocks(engine.engine_id, msg["request_blocks"], msg["request_tokens"])
        else:
            raise NodeProtocolError(f"engines do not send {kind!r}")

    def _register(self, channel: JsonLineChannel, msg: dict[str, Any]) -> _Engine:
        engine_id, pid = msg["engine_id"], msg["pid"]
        try:
            role = EngineRole(msg["role"])
        except ValueError:
            raise NodeProtocolError(f"role must be 'online' or 'offline', got {msg['role']!r}") from None
        if not engine_id or engine_id in self._engines:
            raise NodeProtocolError(f"engine id {engine_id!r} is empty or already registered")
        # An online engine that holds no pool memory (pool: false) only reports its lifecycle, so
        # several models' online endpoints can share the gate; one online pool owner at most.
        uses_pool = self.pool is not None and msg.get("pool", True) is not False
        if role is EngineRole.ONLINE and uses_pool and any(
                e.role is EngineRole.ONLINE and e.uses_pool for e in self._engines.values()):
            raise NodeProtocolError("an online engine is already registered on this node")
        engine = _Engine(engine_id, role, pid, channel, uses_pool=uses_pool)
        if role is EngineRole.OFFLINE and msg["os_suspend"]:
            engine.suspender = ProcessSuspender(pid)
        if uses_pool:
            self.pool.register(engine_id, role, now_s=self._now(),
                               on_invalidate=lambda n, e=engine: self._notify_invalidation(e, n))
        if role is EngineRole.OFFLINE:
            self._flag_seq += 1
            engine.flag = PauseFlag(os.path.join(self._dir, f"pause-{self._flag_seq}.flag"), create=True)
            engine.flag.set_pause(self._paused)
            if self._paused:
                engine.pause_sent_at = time.perf_counter()
        self._engines[engine_id] = engine
        return engine

    def _notify_invalidation(self, engine: _Engine, notice: Invalidation) -> None:
        try:
            engine.channel.send({"type": "invalidate", "handle_ids": list(notice.handle_ids),
                                 "block_ids": list(notice.block_ids),
                                 "request_ids": sorted(notice.request_ids)})
        except NodeProtocolError:
            pass  # the engine is gone; its connection thread cleans up

    def _reply(self, channel: JsonLineChannel, msg: dict[str, Any], ok: bool = True, **fields: Any) -> None:
        try:
            channel.send({"type": "reply", "seq": msg.get("seq", 0), "ok": ok, **fields})
        except NodeProtocolError:
            pass

    def _forget(self, engine: _Engine) -> None:
        """Drop an engine; never leaves its process paused or stopped."""
        try:
            if engine.flag is not None:
                engine.flag.set_pause(False)
            if engine.suspender is not None:
                engine.suspender.close()
        finally:
            if engine.flag is not None:
                engine.flag.close()
                if os.path.exists(engine.flag.path):
                    os.unlink(engine.flag.path)
            self._engines.pop(engine.engine_id, None)
            self._offline_tokens_of_gone += engine.offline_tokens   # the node's count never steps back
            if self.pool is not None and engine.engine_id in self.pool.owners():
                self.pool.unregister(engine.engine_id)
            self._busy_online.discard(engine.engine_id)
            if engine.role is EngineRole.ONLINE and not self._stopping and not self._busy_online:
                # An online engine that vanished is idle from now on.
                self.gate.on_idle(self._now())
