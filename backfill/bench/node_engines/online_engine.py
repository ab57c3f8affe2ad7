"""The online engine process: serves latency-critical requests and tells the node runtime about
its lifecycle (Valve §4.2) and its memory (Valve §5).

Each loop: take requests from the driver's pipe; if there is work, report busy (with the request
ids) before anything else, so offline compute is being paused while this step is planned; make
sure enough KV blocks are free for the step by allocating handles from the shared pool (headroom
first; the pool reclaims offline handles only when it must); run one scheduler step; report the
decode step time and idle. Whole handles whose blocks are all free go back to the pool.

Per request it records the arrival (the driver's CLOCK_MONOTONIC stamp), first token and last
token times, and sends them back when the request finishes.
"""

from __future__ import annotations

import os
import time
from typing import Any

from backfill.errors import OverAllocationError
from backfill.bench.node_engines.engine_proc import EngineSpec, build_engine_runner, make_request, run_child
from backfill.node.gated import HandleBlocks
from backfill.node.ipc import NodeClient

IDLE_POLL_S = 0.001


class OnlineEngine:
    def __init__(self, spec: EngineSpec, client: NodeClient, conn) -> None:
        self.spec = spec
        self.client = client
        self.conn = conn
        self.runner, self.scheduler = build_engine_runner(spec)
        self.kv = self.runner.kv
        self.handles = HandleBlocks(self.kv, spec.num_handles, spec.blocks_per_handle)
        self.active: dict[str, dict[str, Any]] = {}
        self.counters = {"requests": 0, "finished": 0, "allocations": 0, "allocated_handles": 0,
                         "released_handles": 0, "allocation_failures": 0, "busy_s": 0.0}
        self._busy = False
        self._stop = False

    # --- the loop ------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        while not self._stop:
            self._take_messages(block=not self.active)
            if self._stop:
                break
            if not self.active:
                self._go_idle()
                continue
            self._step()
        self._go_idle()
        return self.stats()

    def _take_messages(self, block: bool) -> None:
        timeout = IDLE_POLL_S if block else 0.0
        while self.conn.poll(timeout):
            kind, payload = self.conn.recv()
            timeout = 0.0
            if kind == "stop":
                self._stop = True
            elif kind == "submit":
                self._admit(payload)
            elif kind == "report":
                self.conn.send(("counters", dict(self.counters)))

    def _admit(self, d: dict[str, Any]) -> None:
        request = make_request(d, "online")
        self.scheduler.add(request)
        self.active[request.request_id] = {"request_id": request.request_id, "arrival_s": request.arrival_time,
                                           "prompt_tokens": len(request.prompt_token_ids),
                                           "max_tokens": request.sampling.max_tokens, "token_times_s": []}
        self.counters["requests"] += 1

    def _step(self) -> None:
        ids = sorted(self.active)
        # Valve §4.2: busy the moment compute is about to be in flight for these requests.
        self.client.report_busy(ids)
        self._busy = True
        self._ensure_blocks()
        started = time.perf_counter()
        events = self.scheduler.step()
        now = time.monotonic()
        self.counters["busy_s"] += time.perf_counter() - started
        stepped = []
        for ev in events:
            record = self.active.get(ev.request_id)
            if record is None or not ev.token_ids:
                continue
            record["token_times_s"].extend([ev.time] * len(ev.token_ids))
            stepped.append(ev.request_id)
            if ev.finished:
                self._finish(self.active.pop(ev.request_id), ev)
        if stepped:
            self.client.report_decode_step(now, stepped)
        # Idle between steps: the lifecycle gate's cooldown keeps offline out of these short
        # gaps; the timeslice baseline lets it in (its per-step preemptions).
        self.client.report_idle()
        self._busy = False
        self._release_spare()

    def _finish(self, record: dict[str, Any], ev) -> None:
        times = record.pop("token_times_s")
        record.update(first_token_s=times[0], last_token_s=times[-1], output_tokens=len(times),
                      finish_reason=ev.finish_reason.value if ev.finish_reason else None)
        self.conn.send(("done", record))
        self.counters["finished"] += 1

    def _go_idle(self) -> None:
        if self._busy:
            self.client.report_idle()
            self._busy = False
        self._release_spare()

    # --- memory ---------------------------------------------------------------------------------

    def _blocks_needed_next_step(self) -> int:
        """Free blocks the next step can use: every active request grown by one token."""
        need = 0
        for rid, record in self.active.items():
            seq = self.scheduler.seqs.get(rid)
            tokens = record["prompt_tokens"] + (len(seq.output_ids) if seq else 0)
            have = len(seq.block_table) if seq else 0
            need += max(0, self.kv.blocks_needed(tokens + 1) - have)
        return need

    def _ensure_blocks(self) -> None:
        short = self._blocks_needed_next_step() - self.kv.num_free
        if short <= 0:
            return
        bph = self.spec.blocks_per_handle
        n = -(-short // bph)
        try:
            granted = self.client.allocate(n)
        except OverAllocationError:
            # The pool cannot supply it all: serve what fits, the policy queues the rest.
            self.counters["allocation_failures"] += 1
            return
        self.handles.admit(granted)
        self.counters["allocations"] += 1
        self.counters["allocated_handles"] += len(granted)

    def _release_spare(self) -> None:
        spare_blocks = self.kv.num_free - self._blocks_needed_next_step()
        free_handles = self.handles.fully_free()
        n = min(len(free_handles), spare_blocks // self.spec.blocks_per_handle)
        if n <= 0:
            return
        give = free_handles[-n:]
        self.handles.retire(give)
        self.client.release(give)
        self.counters["released_handles"] += len(give)

    def stats(self) -> dict[str, Any]:
        durations = self.runner.step_durations_s
        return {**self.counters, "steps": self.scheduler.stats.steps, "step_durations_s": list(durations),
                "num_layers": self.runner.config.num_layers, "unfinished": sorted(self.active)}


def run_online_engine(spec: EngineSpec, socket_path: str, conn) -> None:
    def body() -> dict[str, Any]:
        client = NodeClient.connect(socket_path, spec.engine_id, "online")
        try:
            engine = OnlineEngine(spec, client, conn)
            conn.send(("ready", {"pid": os.getpid(), "num_layers": engine.runner.config.num_layers}))
            return engine.run()
        finally:
            client.close()

    run_child(spec, conn, body)
