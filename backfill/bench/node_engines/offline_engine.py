"""The offline engine process: works through a backlog of best-effort requests in the compute and
memory the online engine leaves idle (Valve §4-§5).

Compute: every step runs inside `client.computing()`, and between layers (three safepoints per
layer) the runner calls our gate point, which parks there while the runtime asks for a pause
(cooperative gate: the pause takes effect within one sub-layer). With `os_suspend` the runtime
SIGSTOPs the process instead and the gate point does not park. Each finished step is reported
as an iteration boundary (for the iteration-level baseline gate).

Memory: the engine only uses blocks of handles the runtime granted it. It admits a backlog
request only when the blocks of its whole life (prompt + max_tokens) are free, allocating
handles from the pool's free list when they are not, and reports which blocks each running
request occupies (with its computed tokens, the recompute cost) after every step, so the pool's
reclamation policy can choose cheap handles (Valve Algorithm 1).

Reclamation (Valve §5): the runtime pauses us first, takes handles, and sends an invalidation.
The reader thread only queues it and bumps a counter; a step in flight aborts at its next gate
point (nothing committed), and the engine thread hands the blocks to
`scheduler.invalidate_blocks`, which sends the requests on them back to recompute. No request is
ever dropped: each one finishes or is still queued when the engine stops.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from typing import Any

from backfill.errors import OverAllocationError
from backfill.bench.node_engines.engine_proc import EngineSpec, build_engine_runner, make_request, run_child
from backfill.node.gated import HandleBlocks, stream_drain
from backfill.node.ipc import NodeClient

IDLE_SLEEP_S = 0.002
ALLOCATE_BACKOFF_S = 0.05


class OfflineEngine:
    def __init__(self, spec: EngineSpec, client: NodeClient, conn) -> None:
        self.spec = spec
        self.client = client
        self.conn = conn
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pending_handles: list[int] = []
        self._received = 0          # invalidations delivered by the reader thread
        self._drained = 0           # ... of which the engine thread has applied
        self._finish_launched = stream_drain(spec.device)
        self.runner, self.scheduler = build_engine_runner(spec, self._gate_point)
        self.kv = self.runner.kv
        self.handles = HandleBlocks(self.kv, spec.num_handles, spec.blocks_per_handle)
        self.backlog: deque[dict[str, Any]] = deque()
        self.admitted: dict[str, int] = {}          # request id -> blocks of its whole life
        self.outputs: dict[str, list[int]] = {}
        self._last_report: tuple | None = None
        self._backoff_until = 0.0
        self.counters = {"submitted": 0, "finished": 0, "invalidated_requests": 0,
                         "lost_tokens": 0, "parks": 0, "allocated_handles": 0, "released_handles": 0}
        client.on_invalidate(self._on_invalidate)

    # --- threads other than the engine's -----------------------------------------------------

    def _on_invalidate(self, msg: dict[str, Any]) -> None:
        with self._lock:
            self._pending_handles.extend(int(h) for h in msg["handle_ids"])
            self._received += 1

    def _pipe_loop(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.conn.poll(0.05):
                    continue
                kind, payload = self.conn.recv()
            except (EOFError, OSError):
                self._stop.set()
                break
            if kind == "add":
                with self._lock:
                    self.backlog.extend(payload)
                    self.counters["submitted"] += len(payload)
            elif kind == "report":
                self._send(("counters", self.snapshot()))
            elif kind == "stop":
                self._stop.set()

    def _send(self, msg: tuple[str, Any]) -> None:
        with self._send_lock:
            self.conn.send(msg)

    # --- compute ------------------------------------------------------------------------------

    def _gate_point(self, layer: int) -> bool:
        if not self.spec.os_suspend and self.client.wait_if_paused(drain=self._finish_launched):
            self.counters["parks"] += 1
        # Valve §5: a step that may touch reclaimed blocks is abandoned, not committed.
        return self._stop.is_set() or self._received != self._drained

    def run(self) -> dict[str, Any]:
        pipe = threading.Thread(target=self._pipe_loop, name="offline-pipe", daemon=True)
        pipe.start()
        try:
            while not self._stop.is_set():
                self._drain_invalidations()
                self._admit()
                self._report_blocks()
                steps = self.scheduler.stats.steps
                if self.scheduler.has_work():
                    with self.client.computing():
                        events = self.scheduler.step()
                    self.client.report_iteration_boundary()
                    self._record(events)
                else:
                    self._release_spare()
                if self.scheduler.stats.steps == steps:
                    time.sleep(IDLE_SLEEP_S)
        finally:
            self._stop.set()
            pipe.join(timeout=1.0)
        return self.stats()

    def _record(self, events) -> None:
        for ev in events:
            if ev.token_ids:
                self.outputs.setdefault(ev.request_id, []).extend(ev.token_ids)
            if ev.finished:
                self.admitted.pop(ev.request_id, None)
                self.counters["finished"] += 1
                self._send(("done", {"request_id": ev.request_id, "finished_s": ev.time,
                                     "output_token_ids": self.outputs.pop(ev.request_id, [])}))

    # --- memory -------------------------------------------------------------------------------

    def _drain_invalidations(self) -> None:
        with self._lock:
            taken, self._pending_handles = self._pending_handles, []
            received = self._received
        if taken:
            blocks = self.handles.forget(taken)
            lost = set(blocks)
            for seq in self.scheduler.seqs.values():
                if lost.intersection(seq.block_table):
                    # No host checkpoints: everything computed so far is recomputed.
                    self.counters["lost_tokens"] += seq.num_computed
                    self.counters["invalidated_requests"] += 1
            self.scheduler.invalidate_blocks(blocks)
        self._drained = received

    def _footprint(self, d: dict[str, Any]) -> int:
        return self.kv.blocks_needed(len(d["prompt_token_ids"]) + d["max_tokens"])

    def _available_blocks(self) -> int:
        """Free blocks not yet promised to an admitted request."""
        promised = sum(self.admitted.values()) - sum(len(s.block_table) for s in self.scheduler.seqs.values())
        return self.kv.num_free - promised

    def _admit(self) -> None:
        available = self._available_blocks()
        while len(self.admitted) < self.spec.max_batch_seqs:
            with self._lock:
                nxt = self.backlog[0] if self.backlog else None
            if nxt is None:
                break
            need = self._footprint(nxt)
            if need > available:
                self._grow(need - available)
                available = self._available_blocks()
                if need > available:
                    break
            with self._lock:
                self.backlog.popleft()
            self.scheduler.add(make_request(nxt, "offline"))
            self.admitted[nxt["request_id"]] = need
            available -= need
        if available < 0:
            # Reclamation left admitted requests short: take memory back when some is free.
            self._grow(-available)

    def _grow(self, n_blocks: int) -> None:
        if time.monotonic() < self._backoff_until:
            return
        want = -(-n_blocks // self.spec.blocks_per_handle)
        for n in dict.fromkeys((want, 1)):
            try:
                granted = self.client.allocate(n)
            except OverAllocationError:
                continue
            self.handles.admit(granted)
            self.counters["allocated_handles"] += len(granted)
            return
        self._backoff_until = time.monotonic() + ALLOCATE_BACKOFF_S

    def _release_spare(self) -> None:
        """With nothing to do, give every handle back."""
        with self._lock:
            idle = not self.backlog
        free = self.handles.fully_free()
        if idle and not self.admitted and free:
            self.handles.retire(free)
            self.client.release(free)
            self.counters["released_handles"] += len(free)

    def _report_blocks(self) -> None:
        blocks: dict[str, list[int]] = {}
        tokens: dict[str, int] = {}
        for rid, seq in self.scheduler.seqs.items():
            if seq.block_table and self.handles.covers(seq.block_table):
                blocks[rid] = list(seq.block_table)
                tokens[rid] = seq.num_computed
        key = (tuple(sorted((r, tuple(b)) for r, b in blocks.items())), tuple(sorted(tokens.items())))
        if key != self._last_report:
            self.client.report_blocks(blocks, tokens)
            self._last_report = key

    # --- stats --------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        s = self.scheduler.stats
        with self._lock:
            backlog = len(self.backlog)
        return {**self.counters, "invalidations": self._received, "tokens_out": s.output_tokens["offline"],
                "recomputed_tokens": s.recomputed_tokens,
                "aborted_steps": s.aborted_steps, "resumed_steps": s.resumed_steps,
                "wasted_tokens": s.wasted_tokens, "steps": s.steps,
                "backlog": backlog, "in_flight": len(self.admitted), "handles": len(self.handles.held)}

    def stats(self) -> dict[str, Any]:
        return {**self.snapshot(), "step_durations_s": list(self.runner.step_durations_s),
                "num_layers": self.runner.config.num_layers, "unfinished": sorted(self.admitted)}


def run_offline_engine(spec: EngineSpec, socket_path: str, conn) -> None:
    def body() -> dict[str, Any]:
        client = NodeClient.connect(socket_path, spec.engine_id, "offline", os_suspend=spec.os_suspend)
        try:
            engine = OfflineEngine(spec, client, conn)
            engine._send(("ready", {"pid": os.getpid(), "num_layers": engine.runner.config.num_layers}))
            return engine.run()
        finally:
            client.close()

    run_child(spec, conn, body)
