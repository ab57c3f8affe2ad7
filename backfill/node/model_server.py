"""One model of a node as its own process: the OpenAI server (online endpoint, Batch API, store)
over an engine whose steps pass through the node runtime's gate and whose KV blocks come from
the node's shared memory pool (Valve §3-§5).

    python -m backfill.node.model_server SOCKET DB NODE_JSON MODEL_JSON MODELS  (started by node/host.py)

Two registrations with the runtime: `<name>` as an offline engine (its pause flag, its pool
handles) and `<name>/online` as an online engine without pool memory, which reports busy while the
server has online requests in flight, so any model's online traffic closes the gate for the
offline work of every model on the device.

Inside the engine its own policy (coserve, priority, ...) mixes online and offline; the gate only
parks a step of offline work alone, and only while this model has no online request of its own:
an online request that arrives while a step is parked ends the wait and aborts the step, so its
own engine serves it at once (a parked step must never stand between a model and its own online
requests). KV memory: the engine starts with no blocks; between steps it takes handles from the
pool's free list to keep a reserve free, and gives fully free handles back when it has no work.
"""

from __future__ import annotations

import ctypes
import json
import logging
import signal
import sys
import time
from collections import deque
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Callable

from backfill.errors import OverAllocationError
from backfill.node.config import ModelEntry, NodeSettings
from backfill.node.gated import GatedRunner, HandleBlocks, stream_drain
from backfill.node.ipc import NodeClient

if TYPE_CHECKING:
    from backfill.serving.async_engine import AsyncEngine
    from backfill.serving.config import ServingConfig
    from backfill.serving.stats import SchedulerStats

_PR_SET_PDEATHSIG = 1


class NodeGatedRunner(GatedRunner):
    """A GatedRunner that knows whether the step it runs carries online tokens of its own engine
    (the scheduler marks them, SeqChunk.online), and reports each such step to the runtime as an
    online decode step (the lifecycle gate's cooldown is measured from the gaps between them)."""

    def __init__(self, model, kv, gate_point: Callable[[int], bool], on_online_step: Callable[[], None]) -> None:
        super().__init__(model, kv, gate_point)
        self.step_durations_s = deque(maxlen=4096)   # a server runs for days: keep the recent steps only
        self.on_online_step = on_online_step
        self.step_has_online = False

    def execute(self, chunks, safepoint=None, resume=None):
        self.step_has_online = any(c.online for c in chunks)
        try:
            return super().execute(chunks, safepoint, resume)
        finally:
            if self.step_has_online:
                self.on_online_step()
            self.step_has_online = False


class SafepointGate:
    """The gate point of a model's steps. Parks an offline-only step while the runtime asks for a
    pause, unless this model has online requests of its own: those end the wait and abort the step."""

    def __init__(self, client: NodeClient, own_online_waiting: Callable[[], bool],
                 drain: Callable[[], None] | None = None) -> None:
        """drain: what the launched work needs to finish before the step parks (gated.stream_drain)."""
        self.client = client
        self.own_online_waiting = own_online_waiting
        self.drain = drain
        self._gated_runner: NodeGatedRunner | None = None
        self.parks = 0
        self.aborts_for_own_online = 0

    def attach_runner(self, runner: NodeGatedRunner) -> None:
        """The runner whose steps pass through this gate: a step it marks online never parks."""
        self._gated_runner = runner

    def __call__(self, layer: int) -> bool:
        if self._gated_runner is not None and self._gated_runner.step_has_online:
            return False                     # our own online work never waits for the gate
        if not self.client.should_pause() or self.own_online_waiting():
            return False
        self.parks += 1
        self.client.wait_if_paused(give_up=self.own_online_waiting, drain=self.drain)
        if self.client.should_pause() and self.own_online_waiting():
            self.aborts_for_own_online += 1
            return True                      # abort: the scheduler plans the online request next
        return False


class PoolMemory:
    """The engine's share of the node's KV pool, kept between steps (a between-steps task of the engine)."""

    def __init__(self, client: NodeClient, handles: HandleBlocks, engine: AsyncEngine, reserve_blocks: int) -> None:
        self.client = client
        self.handles = handles
        self.engine = engine
        self.reserve_blocks = reserve_blocks
        self._pending: list[int] = []
        self.allocation_failures = 0
        client.on_invalidate(lambda msg: self._pending.extend(int(h) for h in msg["handle_ids"]))

    def keep(self) -> bool:
        """Top the free blocks up to the reserve; give back fully free handles when idle."""
        if self._pending:
            taken, self._pending = self._pending, []
            self.engine.invalidate_blocks(self.handles.forget(taken))   # Valve §5: recompute
        kv, bph = self.handles.kv, self.handles.blocks_per_handle
        short = self.reserve_blocks - kv.num_free
        if short > 0:
            for n in dict.fromkeys((-(-short // bph), 1)):   # all it is short of, else one handle
                try:
                    self.handles.admit(self.client.allocate(n))
                    return False
                except OverAllocationError:
                    continue
            self.allocation_failures += 1
            return False
        if not self.engine.has_work():
            spare = self.handles.fully_free()
            keep = -(-self.reserve_blocks // bph)
            give = spare[keep:]
            if give:
                self.handles.retire(give)
                self.client.release(give)
        return False

    @property
    def held_blocks(self) -> int:
        return len(self.handles.held) * self.handles.blocks_per_handle


class OfflineTokenReporter:
    """Between steps: tell the runtime how many offline tokens the engine has generated (Valve §6
    measures a job's throughput as it runs, not when its lines finish), then keep the pool share."""

    def __init__(self, client: NodeClient, stats: SchedulerStats, keep: Callable[[], bool],
                 interval_s: float = 0.1) -> None:
        self.client, self.stats, self.keep, self.interval_s = client, stats, keep, interval_s
        self._reported, self._at_s = 0, 0.0

    def __call__(self) -> bool:
        count, now = self.stats.output_tokens["offline"], time.monotonic()
        if count != self._reported and now - self._at_s >= self.interval_s:
            self.client.report_offline_tokens(count)
            self._reported, self._at_s = count, now
        return self.keep()


def build_model_engine(entry: ModelEntry, node: NodeSettings, gate: SafepointGate,
                       decode_step: Callable[[], None]) -> tuple[AsyncEngine, NodeGatedRunner, ServingConfig]:
    """(AsyncEngine, runner, its ServingConfig) of one model on the node's KV layout; runs on the torch thread."""
    from backfill.engine.config import ModelConfig
    from backfill.policy import registry
    from backfill.policy.latency_model import LatencyModel
    from backfill.serving.build import TINY_LATENCY_PROFILE, build_serving_stack

    if entry.model == "tiny":
        from backfill.engine.byte_tokenizer import ByteTokenizer
        from backfill.engine.weights import random_model

        config = ModelConfig.tiny()
        weights, tokenizer = random_model(config, 0), ByteTokenizer(config.vocab_size)
    else:
        from backfill.engine.weights import load_model

        loaded = load_model(None if entry.model == "default" else entry.model)
        config, weights, tokenizer = loaded.config, loaded.weights, loaded.tokenizer
    # On a GPU every model process of the node runs on the same device; each keeps its own KV
    # tensor the size of the pool (the models' KV shapes differ) and uses the handles it holds.
    serving = entry.serving_config(node)
    latency = (LatencyModel(*TINY_LATENCY_PROFILE)
               if entry.model == "tiny" and registry.entry(entry.policy).needs_latency_model else None)

    def make_runner(model, kv, graphs) -> NodeGatedRunner:
        return NodeGatedRunner(model, kv, gate, decode_step)

    # As node models always ran: no arrival gather, and no background compile of the larger decode
    # buckets (the node's other model processes share its cores).
    stack = build_serving_stack(replace(serving, arrival_gather_ms=0.0), config, weights, tokenizer,
                                latency=latency, num_kv_blocks=node.num_blocks, make_runner=make_runner,
                                compile_buckets=False)
    runner = stack.runner
    assert isinstance(runner, NodeGatedRunner)
    gate.attach_runner(runner)
    return stack.engine, runner, serving


def reserve_blocks(max_model_len: int, node: NodeSettings, models: int) -> int:
    """Free blocks a model keeps between steps: one longest sequence, at most its even share of
    the pool, so every model on the node can start."""
    return max(1, min(-(-max_model_len // node.block_size), node.num_blocks // max(1, models)))


def serve_model(socket_path: str, db_path: str, node: NodeSettings, entry: ModelEntry, len_models: int = 1) -> int:
    from backfill.server.app import create_app
    from backfill.server.config import ServerConfig
    from backfill.server.http_timeouts import header_timeout_protocol
    from backfill.server.serve import DrainingServer
    from backfill.server.store import Store
    from backfill.serving.torch_thread import run_on_torch_thread
    import uvicorn

    offline = NodeClient.connect(socket_path, entry.name, "offline")
    online = NodeClient.connect(socket_path, entry.name + "/online", "online", pool=False)
    in_flight = {"online": 0}
    gate = SafepointGate(offline, lambda: in_flight["online"] > 0, stream_drain(node.device))
    engine, runner, serving = run_on_torch_thread(build_model_engine, entry, node, gate,
                                                  lambda: online.report_decode_step(time.monotonic()))
    memory = PoolMemory(offline, HandleBlocks(runner.kv, node.num_handles, node.blocks_per_handle),
                        engine, reserve_blocks(engine.max_model_len, node, len_models))
    run_on_torch_thread(memory.keep)
    engine.add_between_steps_task(OfflineTokenReporter(offline, engine.stats, memory.keep))
    config = ServerConfig(host=node.host, port=entry.port, db=db_path, served_model_name=entry.name,
                          max_offline_in_flight=entry.max_offline_in_flight, max_online_queue=entry.max_online_queue,
                          drain_timeout_s=5.0, log_level="warning", serving=serving)
    store = Store(db_path)

    def on_change(request_class: str, count: int) -> None:
        if request_class != "online":
            return
        was, in_flight["online"] = in_flight["online"], count
        # Valve §4.2: busy the moment an online request is admitted, idle when the last one ends.
        if count > 0 and was == 0:
            online.report_busy([])
        elif count == 0 and was > 0:
            online.report_idle()

    try:
        app = create_app(engine, config, store)
        app.state.backfill.on_in_flight_change = on_change
        app.state.backfill.offline_paused = offline.should_pause
        server = DrainingServer(uvicorn.Config(app, host=node.host, port=entry.port, log_level="warning",
                                               timeout_graceful_shutdown=5.0, lifespan="on", access_log=False,
                                               http=header_timeout_protocol(config.header_timeout_s)),
                                app.state.backfill)
        try:
            server.run()
        except SystemExit as exc:
            return exc.code if isinstance(exc.code, int) else 1
        return 0 if server.started else 1
    finally:
        store.close()
        online.close()
        offline.close()


def main(argv: list[str]) -> int:
    socket_path, db_path, node_json, model_json, models = argv
    # A node whose host process dies (killed) takes its model processes with it.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Measuring a model's latency profile takes minutes on a slow CPU: its progress lines show.
    for name in ("backfill.serving.profiler", "backfill.serving.build", "backfill.engine.native_build"):
        logging.getLogger(name).setLevel(logging.INFO)
    return serve_model(socket_path, db_path, NodeSettings(**json.loads(node_json)),
                       ModelEntry(**json.loads(model_json)), int(models))


def command_line(socket_path: str, db_path: str, node: NodeSettings, entry: ModelEntry, models: int) -> list[str]:
    return [sys.executable, "-m", "backfill.node.model_server", socket_path, db_path,
            json.dumps(asdict(node)), json.dumps(asdict(entry)), str(models)]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
