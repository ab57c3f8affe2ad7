"""Node benchmark (Valve §7): an online and an offline engine process on one machine, one bursty
online trace, compute gates and memory policies side by side.

    python -m backfill.bench.node_bench --json results.json [--duration-s 60] [--phases alone,valve,...]
    python -m backfill.bench.node_bench --device cuda --model random:smollm2-135m ...   (one GPU)

On a GPU (`--device cuda`) both engine processes run on the same device and their KV pool is one
device allocation shared through CUDA IPC (memory/kv_arena.py): a reclaimed handle changes owner
without a copy. `--shared-kv` does the same on the CPU with a /dev/shm segment; without it each
CPU engine keeps a private KV tensor of the pool's size (the logical pool).

Every phase replays the same trace (gamma arrivals with cv > 1, the same prompts) against a fresh
node runtime and fresh engine processes; the offline engine gets the same large backlog. Each
engine process runs torch with one thread (EngineSpec.threads), so on a 2-core machine the two
engines do not fight over cores; they still share memory bandwidth while both compute.

Phases (gate / memory / pause mechanism):
    alone       online engine only (the latency baseline)
    valve       lifecycle gate / MIAD + selective reclamation / cooperative safepoints
    valve-os    lifecycle gate / MIAD + selective / SIGSTOP-SIGCONT
    timeslice   reopen whenever online is idle (GPreempt-like) / MIAD + selective / cooperative
    iteration   a pause waits for the offline iteration boundary / MIAD + selective
    fifo        lifecycle gate / MIAD + FIFO reclamation / cooperative
    static      lifecycle gate / StaticMem partition / cooperative
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from backfill.bench.arrivals import parse_arrival_spec
from backfill.progress import Heartbeat
from backfill.bench.verdict import MIN_EVENTS, MIN_SAMPLES_P99, Verdict, closing_sentence
from backfill.errors import PolicyInputError
from backfill.bench.node_engines.engine_proc import (EngineProcess, EngineSpec, engine_kv_layout, engine_model_config,
                                                    request_dict)
from backfill.memory.shared_pool import PoolConfig, SharedMemoryPool, StaticMemPool
from backfill.node.runtime import NodeRuntime, RuntimeConfig
from backfill.policy.gate import GateConfig, make_gate
from backfill.policy.miad import MIADConfig, MIADReservation
from backfill.policy.reclaim import FIFOReclaimPolicy, GreedyReclaimPolicy

MEMORY_POLICIES = ("valve", "fifo", "static")


@dataclass(frozen=True)
class PhaseSpec:
    name: str
    gate: str = "valve"          # policy/gate.py: valve (lifecycle), timeslice, iteration
    memory: str = "valve"        # valve: MIAD + selective (Algorithm 1); fifo: MIAD + FIFO; static: StaticMem
    os_suspend: bool = False
    offline: bool = True

    def __post_init__(self) -> None:
        if self.memory not in MEMORY_POLICIES:
            raise PolicyInputError(f"memory policy must be one of {MEMORY_POLICIES}, got {self.memory!r}")
        make_gate(self.gate)     # raises PolicyInputError for an unknown gate


PHASES: dict[str, PhaseSpec] = {p.name: p for p in (
    PhaseSpec("alone", offline=False),
    PhaseSpec("valve"),
    PhaseSpec("valve-os", os_suspend=True),
    PhaseSpec("timeslice", gate="timeslice"),
    PhaseSpec("iteration", gate="iteration"),
    PhaseSpec("fifo", memory="fifo"),
    PhaseSpec("static", memory="static"),
)}


@dataclass(frozen=True)
class NodeBenchConfig:
    duration_s: float = 60.0                 # online trace length per phase
    phases: tuple[str, ...] = tuple(PHASES)
    model: str = "default"                   # EngineSpec.model: default, tiny, random:SHAPE
    device: str = "cpu"                      # EngineSpec.device: both engines on this device
    dtype: str = "float32"                   # EngineSpec.dtype
    shared_kv: bool = False                  # CPU: one /dev/shm KV arena (always shared on CUDA)
    seed: int = 0
    # The online rate is this share of what the online engine serves on this machine, one request
    # at a time (measured before the phases: measure_machine), in bursty gamma arrivals.
    online_load: float = 0.4
    arrivals_cv: float = 2.0
    arrivals: str | None = None              # an explicit arrival spec instead (e.g. gamma:0.5:2)
    online_prompt_tokens: tuple[int, int] = (64, 128)
    online_output_tokens: tuple[int, int] = (16, 32)
    # None: sized so that one offline batch finishes in a share of the window on this machine
    # (size_to_machine); at most these defaults.
    offline_prompt_tokens: tuple[int, int] | None = None
    offline_output_tokens: int | None = None
    offline_backlog: int = 2000
    # 32 handles = 2,048 tokens: the offline batch (8 requests of up to 320 tokens) fills the pool,
    # so online pressure has to reclaim (Valve §5's setting: offline uses all spare memory).
    num_handles: int = 32
    blocks_per_handle: int = 4
    block_size: int = 16
    static_online_handles: int = 8           # StaticMem: the online partition
    offline_batch_tokens: int = 128           # bounds one offline layer's time (the pause latency)
    offline_batch_seqs: int = 8
    miad: MIADConfig = field(default_factory=lambda: MIADConfig(
        target_events_per_min=6.0, initial_headroom_handles=2, initial_interval_s=2.0, min_interval_s=0.5,
        interval_factor=1.5, interval_step_s=0.25, rate_window_s=30.0, control_period_s=2.5))
    gate: GateConfig = field(default_factory=GateConfig)
    warmup_s: float = 3.0
    engine_start_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        unknown = [p for p in self.phases if p not in PHASES]
        if unknown:
            raise PolicyInputError(f"unknown phases {unknown}; choose from {list(PHASES)}")
        if not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise PolicyInputError(f"duration_s must be > 0, got {self.duration_s}")
        if not (0 < self.online_load <= 1):
            raise PolicyInputError(f"online_load is a share of this machine's capacity, in (0, 1]; got "
                                   f"{self.online_load}")
        if self.arrivals is not None:
            parse_arrival_spec(self.arrivals)
        # A bad model, device or dtype fails here, before any process starts.
        EngineSpec("check", "online", self.num_handles, self.blocks_per_handle, model=self.model,
                   device=self.device, dtype=self.dtype)


# The rate the docs' figures were measured at (a fixed spec, as the pool simulation replays it).
REFERENCE_ARRIVALS = "gamma:0.5:2"
# The largest offline prompt and output (the pool holds 8 requests of up to 320 tokens).
OFFLINE_PROMPT_MAX = (128, 256)
OFFLINE_OUTPUT_MAX = 64
# One offline batch (8 prompts, then their outputs) should take at most this share of the window at
# the offline engine's speed, so that offline work finishes, and is counted, within the window.
OFFLINE_BATCH_SHARE_OF_WINDOW = 0.15


@dataclass(frozen=True)
class MachineSpeed:
    """What one request costs the online engine alone on this machine (one torch thread)."""

    prefill_ms_per_token: float
    decode_ms_per_token: float
    request_s: float            # one mean online request, prompt and output, served alone

    @property
    def requests_per_s(self) -> float:
        return 1.0 / self.request_s


def measure_machine(cfg: NodeBenchConfig, log=print, requests: int = 3) -> MachineSpeed:
    """Serve a few mean-sized online requests one at a time on a fresh online engine process."""
    gate = make_gate("valve", cfg.gate)
    pool = _make_pool(cfg, "valve")
    runtime = NodeRuntime(gate, pool, RuntimeConfig()).start()
    prompt = (cfg.online_prompt_tokens[0] + cfg.online_prompt_tokens[1]) // 2
    out = (cfg.online_output_tokens[0] + cfg.online_output_tokens[1]) // 2
    engine = EngineProcess(EngineSpec("online", "online", max_batch_tokens=512, max_batch_seqs=32,
                                      num_handles=cfg.num_handles, blocks_per_handle=cfg.blocks_per_handle,
                                      block_size=cfg.block_size, model=cfg.model, seed=cfg.seed, device=cfg.device,
                                      dtype=cfg.dtype), runtime.socket_path)
    try:
        engine.start()
        for i in range(requests + 1):   # the first one pays first-call costs and is not counted
            engine.send("submit", {**request_dict(f"speed-{i}", list(range(3, 3 + prompt)), out),
                                   "arrival_s": time.monotonic()})
            deadline = time.monotonic() + 300.0
            while len(engine.done) < i + 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            if len(engine.done) < i + 1:
                raise PolicyInputError("the online engine did not answer one request in 300 s on this machine")
            log(f"[node bench] measuring this machine: request {i + 1}/{requests + 1} "
                f"{engine.done[-1]['last_token_s'] - engine.done[-1]['arrival_s']:.2f} s")
    finally:
        engine.stop()
        runtime.stop()
    timed = engine.done[1:]
    ttft = float(np.mean([r["first_token_s"] - r["arrival_s"] for r in timed]))
    tpot = float(np.mean([(r["last_token_s"] - r["first_token_s"]) / max(1, r["output_tokens"] - 1) for r in timed]))
    total = float(np.mean([r["last_token_s"] - r["arrival_s"] for r in timed]))
    return MachineSpeed(prefill_ms_per_token=ttft * 1e3 / prompt, decode_ms_per_token=tpot * 1e3, request_s=total)


def size_to_machine(cfg: NodeBenchConfig, speed: MachineSpeed) -> NodeBenchConfig:
    """The online rate as cfg.online_load of this machine; offline prompts and outputs sized so one
    offline batch finishes within OFFLINE_BATCH_SHARE_OF_WINDOW of the window while online takes its share."""
    arrivals = cfg.arrivals or f"gamma:{cfg.online_load * speed.requests_per_s:.4g}:{cfg.arrivals_cv:g}"
    budget_ms = OFFLINE_BATCH_SHARE_OF_WINDOW * cfg.duration_s * 1e3 * (1 - min(cfg.online_load, 0.9))
    output = cfg.offline_output_tokens
    if output is None:
        # A decode step of the offline batch costs about one online decode step (weights read once).
        output = int(min(OFFLINE_OUTPUT_MAX, max(8, 0.3 * budget_ms / speed.decode_ms_per_token)))
    prompt = cfg.offline_prompt_tokens
    if prompt is None:
        longest = int(0.7 * budget_ms / (cfg.offline_batch_seqs * speed.prefill_ms_per_token))
        high = min(OFFLINE_PROMPT_MAX[1], max(16, longest))
        prompt = (max(8, min(OFFLINE_PROMPT_MAX[0], high // 2)), high)
    return replace(cfg, arrivals=arrivals, offline_prompt_tokens=prompt, offline_output_tokens=output)


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _ms(values: list[float]) -> dict[str, float | None]:
    ms = [v * 1e3 for v in values]
    return {"n": len(ms), "p50": _pct(ms, 50), "p99": _pct(ms, 99), "max": max(ms) if ms else None}


def make_trace(cfg: NodeBenchConfig, vocab: int) -> tuple[list[tuple[float, dict]], list[dict]]:
    """The online trace (arrival time, request) and the offline backlog of a run."""
    rng = np.random.default_rng(cfg.seed)
    if cfg.arrivals is None:
        raise PolicyInputError("no online rate: size the config to the machine first (size_to_machine)")
    offline_prompt = cfg.offline_prompt_tokens or OFFLINE_PROMPT_MAX
    offline_output = cfg.offline_output_tokens or OFFLINE_OUTPUT_MAX
    times = parse_arrival_spec(cfg.arrivals).generate(rng, cfg.duration_s)
    online = []
    for i, t in enumerate(times):
        n = int(rng.integers(cfg.online_prompt_tokens[0], cfg.online_prompt_tokens[1] + 1))
        out = int(rng.integers(cfg.online_output_tokens[0], cfg.online_output_tokens[1] + 1))
        online.append((float(t), {"request_id": f"on-{i}", "prompt_token_ids": rng.integers(3, vocab, n).tolist(),
                                  "max_tokens": out}))
    offline = []
    for i in range(cfg.offline_backlog):
        n = int(rng.integers(offline_prompt[0], offline_prompt[1] + 1))
        offline.append(request_dict(f"off-{i}", rng.integers(3, vocab, n).tolist(), offline_output))
    return online, offline


def _make_pool(cfg: NodeBenchConfig, memory: str) -> SharedMemoryPool:
    pool_cfg = PoolConfig(cfg.num_handles, cfg.blocks_per_handle)
    if memory == "static":
        return StaticMemPool(pool_cfg, cfg.static_online_handles, reclaim_policy=GreedyReclaimPolicy())
    policy = GreedyReclaimPolicy() if memory == "valve" else FIFOReclaimPolicy()
    return SharedMemoryPool(pool_cfg, reservation=MIADReservation(cfg.miad, now_s=time.monotonic()),
                            reclaim_policy=policy)


def run_phase(cfg: NodeBenchConfig, phase: PhaseSpec, online_trace: list[tuple[float, dict]],
              backlog: list[dict]) -> dict[str, Any]:
    pool = _make_pool(cfg, phase.memory)
    gate = make_gate(phase.gate, cfg.gate)
    common = dict(num_handles=cfg.num_handles, blocks_per_handle=cfg.blocks_per_handle, block_size=cfg.block_size,
                  model=cfg.model, seed=cfg.seed, device=cfg.device, dtype=cfg.dtype)
    engines: list[EngineProcess] = []
    arena = None
    if cfg.shared_kv or cfg.device.startswith("cuda"):
        from backfill.memory.kv_arena import make_arena

        # One allocation for the node's whole pool; the engines attach to it (Valve §5).
        arena = make_arena(engine_kv_layout(EngineSpec("layout", "online", **common)), cfg.device)
        common["kv_arena"] = arena.descriptor().to_json()
    runtime = NodeRuntime(gate, pool, RuntimeConfig()).start()
    try:
        online = EngineProcess(EngineSpec("online", "online", max_batch_tokens=512, max_batch_seqs=32, **common),
                               runtime.socket_path)
        engines.append(online)
        offline = None
        if phase.offline:
            offline = EngineProcess(EngineSpec("offline", "offline", max_batch_tokens=cfg.offline_batch_tokens,
                                               max_batch_seqs=cfg.offline_batch_seqs, os_suspend=phase.os_suspend,
                                               **common), runtime.socket_path)
            engines.append(offline)
        for e in engines:       # the engines load at once
            e.launch()
        for e in engines:
            e.wait_ready(cfg.engine_start_timeout_s)
        if offline is not None:
            offline.send("add", backlog)
        # Warm-up: one online request (first-call costs), offline fills its memory.
        online.send("submit", request_dict("warmup", list(range(3, 67)), 4))
        time.sleep(cfg.warmup_s)
        offline_before = offline.counters() if offline is not None else None
        pool_before = asdict(pool.stats)
        reclaims_before = len(pool.stats.reclaim_latencies_s)
        acks_before, os_before = len(runtime.stats.ack_latencies_s), len(runtime.stats.os_pause_latencies_s)
        closes_before = len(gate.stats.close_delays_s)
        miad_before = pool.reservation.pressure_events if pool.reservation is not None else 0

        t0 = time.monotonic()
        cpu0 = time.process_time()
        # The pool once a second: whether offline fills it (then pressure reclaims) and how MIAD
        # moves its headroom and release interval.
        timeline: list[dict[str, Any]] = []
        for t, d in online_trace:
            while (delay := t0 + t - time.monotonic()) > 0:
                if not timeline or time.monotonic() - t0 - timeline[-1]["t_s"] >= 1.0:
                    timeline.append({"t_s": round(time.monotonic() - t0, 3), **runtime.memory_snapshot()})
                time.sleep(min(delay, 1.0))
            online.send("submit", {**d, "arrival_s": time.monotonic()})
        deadline = time.monotonic() + 120.0
        while len(online.done) < len(online_trace) + 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        window_s = time.monotonic() - t0
        runtime_cpu_s = time.process_time() - cpu0
        # Online is idle now; the gate reopens after its cooldown and offline answers again.
        offline_after = offline.counters(timeout_s=10.0) if offline is not None else None
        on_stats = online.stop()
        off_stats = offline.stop() if offline is not None else None
    finally:
        for e in engines:
            e.stop()
        runtime.stop()
        if arena is not None:
            arena.close()     # after every engine that attached to it is gone

    trace_ids = {d["request_id"] for _, d in online_trace}
    records = [r for r in online.done if r["request_id"] in trace_ids]
    ttft = [r["first_token_s"] - r["arrival_s"] for r in records]
    tpot = [(r["last_token_s"] - r["first_token_s"]) / (r["output_tokens"] - 1) for r in records
            if r["output_tokens"] > 1]
    result: dict[str, Any] = {
        "phase": asdict(phase), "window_s": window_s,
        "online": {"requests": len(online_trace), "completed": len(records), "ttft_ms": _ms(ttft),
                   "tpot_ms": _ms(tpot),
                   "allocated_handles": on_stats["allocated_handles"] if on_stats else None},
        # CPU the runtime (this process: gate, pool, IPC) took; it shares the cores with the engines.
        "runtime_cpu_s": runtime_cpu_s,
    }
    if offline is None:
        # Nothing to preempt: the gate still closes when online turns busy (it does not know whether
        # an offline engine is there), and counting those closes reported preemptions in a phase
        # with no offline work. A phase reports only what can happen in it.
        return result
    preempt = [gate.stats.preemptions(rid) for rid in sorted(trace_ids)]
    result["preemptions_per_online_request"] = {"mean": float(np.mean(preempt)) if preempt else None,
                                                "max": max(preempt, default=0), "n": len(preempt)}
    layer_s = [d / off_stats["num_layers"] for d in off_stats["step_durations_s"]]
    reclamations = pool.stats.reclamations - pool_before["reclamations"]
    delta = {k: offline_after[k] - offline_before[k] for k in
             ("tokens_out", "lost_tokens", "invalidations", "invalidated_requests", "recomputed_tokens",
              "aborted_steps", "wasted_tokens")}
    result.update({
        "pause": {
            "cooperative_ack_ms": _ms(runtime.stats.ack_latencies_s[acks_before:]),
            "os_suspend_ms": _ms(runtime.stats.os_pause_latencies_s[os_before:]),
            "iteration_close_delay_ms": _ms(gate.stats.close_delays_s[closes_before:]) if phase.gate == "iteration"
            else None,
            "offline_layer_ms": _ms(layer_s), "ack_timeouts": runtime.stats.ack_timeouts},
        "offline": {**delta, "tokens_per_s": delta["tokens_out"] / window_s,
                    "lost_tokens_per_reclamation": delta["lost_tokens"] / reclamations if reclamations else 0.0,
                    "pool_invalidated_tokens": pool.stats.invalidated_tokens - pool_before["invalidated_tokens"],
                    "submitted": off_stats["submitted"], "finished": off_stats["finished"],
                    "in_flight": off_stats["in_flight"], "backlog_left": off_stats["backlog"],
                    "nothing_lost": off_stats["finished"] + off_stats["in_flight"] + off_stats["backlog"]
                    == off_stats["submitted"]},
        "memory": {"reclamations": reclamations, "reclaimed_handles": pool.stats.reclaimed_handles
                   - pool_before["reclaimed_handles"], "reclamations_per_min": reclamations * 60.0 / window_s,
                   "reclaim_ms": _ms(pool.stats.reclaim_latencies_s[reclaims_before:]),
                   "miad_target_per_min": cfg.miad.target_events_per_min if phase.memory != "static" else None,
                   "miad_pressure_events": (pool.reservation.pressure_events - miad_before)
                   if pool.reservation is not None else None,
                   "miad_final_interval_s": pool.reservation.release_interval_s
                   if pool.reservation is not None else None,
                   "offline_handles_mean": float(np.mean([p["held"].get("offline", 0) for p in timeline]))
                   if timeline else None,
                   "timeline": timeline},
    })
    return result


def run_node_bench(config: NodeBenchConfig = NodeBenchConfig(), json_path: str | Path | None = None,
                   log=print) -> dict[str, Any]:
    """Run every phase of `config`; write the results JSON to json_path when given; return them."""
    sys.setswitchinterval(min(sys.getswitchinterval(), 0.001))
    vocab = engine_model_config(config.model).vocab_size
    started = time.monotonic()
    log("[node bench] measuring this machine: mean-sized online requests served one at a time "
        "(the online rate and the offline request sizes follow from it)")
    with Heartbeat(log, "[node bench] measuring this machine (engines starting, requests one at a time)"):
        speed = measure_machine(config, log)
    config = size_to_machine(config, speed)
    online_trace, backlog = make_trace(config, vocab)
    log(f"[node bench] this machine serves {speed.requests_per_s:.2f} online requests/s one at a time "
        f"(prefill {speed.prefill_ms_per_token:.1f} ms/token, decode {speed.decode_ms_per_token:.1f} ms/token); "
        f"online load {config.online_load:g} -> arrivals {config.arrivals}; offline prompts "
        f"{config.offline_prompt_tokens[0]}-{config.offline_prompt_tokens[1]} tokens, "
        f"{config.offline_output_tokens} output tokens")
    if len(online_trace) < MIN_SAMPLES_P99:
        need_s = config.duration_s * MIN_SAMPLES_P99 / max(1, len(online_trace))
        log(f"[node bench] note: {len(online_trace)} online requests per phase; P99 verdicts need "
            f"{MIN_SAMPLES_P99} (give --duration-s {math.ceil(need_s)} or more)")
    phases: dict[str, Any] = {}
    for name in config.phases:
        log(f"[node bench] phase {name} ({len(online_trace)} online requests over {config.duration_s:g} s) "
            f"at {time.monotonic() - started:.0f} s")
        with Heartbeat(log, f"[node bench] phase {name} (engines starting, then the trace)",
                       expected_s=config.warmup_s + config.duration_s):
            phases[name] = run_phase(config, PHASES[name], online_trace, backlog)
        r = phases[name]
        off = r.get("offline", {})
        log(f"[node bench]   {name}: online P99 TTFT {_f(r['online']['ttft_ms']['p99'], 0)} ms over "
            f"{r['online']['completed']} requests" + (f", offline {off['tokens_per_s']:.1f} tok/s" if off else ""))
        if json_path is not None:   # a run cut short keeps the phases it finished
            Path(json_path).write_text(json.dumps({"config": _jsonable(asdict(config)), "device": config.device,
                                                   "machine": asdict(speed), "phases": phases, "partial": True},
                                                  indent=2))
    results = {"config": _jsonable(asdict(config)), "torch_threads_per_process": 1, "device": config.device,
               "machine": asdict(speed), "wall_s": time.monotonic() - started, "phases": phases,
               "summary": summarize(phases, config), "warnings": machine_warnings(phases, speed, config)}
    if json_path is not None:
        Path(json_path).write_text(json.dumps(results, indent=2))
    log(format_table(results))
    return results


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=str))


def machine_warnings(phases: dict[str, Any], speed: MachineSpeed, cfg: NodeBenchConfig) -> list[str]:
    """One line per scenario this machine could not run meaningfully, with what to change."""
    out = []
    alone = phases.get("alone")
    if alone is not None:
        p99 = alone["online"]["ttft_ms"]["p99"]
        alone_ttft_ms = speed.prefill_ms_per_token * sum(cfg.online_prompt_tokens) / 2
        if p99 is not None and p99 > 10 * max(alone_ttft_ms, 1.0):
            out.append(f"online alone saturates this machine (alone P99 TTFT {p99:.0f} ms against "
                       f"{alone_ttft_ms:.0f} ms for one request): lower --online-load (now {cfg.online_load:g})")
    for name, r in phases.items():
        off = r.get("offline")
        if off is not None and off["tokens_out"] == 0:
            out.append(f"phase {name}: no offline token in {r['window_s']:.0f} s; give a longer --duration-s or a "
                       f"lower --online-load")
    return out


def _get(phases: dict[str, Any], name: str, *path: str) -> Any:
    node = phases.get(name)
    for key in path:
        if node is None:
            return None
        node = node.get(key)
    return node


def summarize(phases: dict[str, Any], cfg: NodeBenchConfig) -> dict[str, Any]:
    """The issue's targets, each a Verdict (bench/verdict.py): the quantity, the measured figure, the
    target, the sample count behind it and whether it is met; figures beside it for the reader."""
    out: dict[str, Any] = {}
    p99 = lambda name, *path: _get(phases, name, *path)  # noqa: E731

    if "valve" in phases:
        out["preemptions_per_request_valve"] = {
            **Verdict("valve: most preemptions of one online request", p99("valve", "preemptions_per_online_request",
                                                                           "max"), 1.0,
                      samples=p99("valve", "preemptions_per_online_request", "n") or 0, min_samples=MIN_SAMPLES_P99,
                      sample_unit="online requests").as_dict(),
            "mean": p99("valve", "preemptions_per_online_request", "mean")}
        layer_p99 = p99("valve", "pause", "offline_layer_ms", "p99")
        out["cooperative_pause_p99_ms"] = {
            **Verdict("valve: P99 cooperative pause (ack), ms, against one offline layer's P99",
                      p99("valve", "pause", "cooperative_ack_ms", "p99"),
                      layer_p99 if layer_p99 is not None else math.nan,
                      samples=p99("valve", "pause", "cooperative_ack_ms", "n") or 0, min_samples=MIN_SAMPLES_P99,
                      sample_unit="pauses").as_dict(),
            "one_layer_ms_p50": p99("valve", "pause", "offline_layer_ms", "p50")}
    if "timeslice" in phases:
        out["preemptions_per_request_timeslice"] = {"mean": p99("timeslice", "preemptions_per_online_request",
                                                                "mean")}
    if "valve-os" in phases:
        out["os_suspend_pause_p99_ms"] = Verdict(
            "valve-os: P99 SIGSTOP pause, ms", p99("valve-os", "pause", "os_suspend_ms", "p99"), 1.0,
            samples=p99("valve-os", "pause", "os_suspend_ms", "n") or 0, min_samples=MIN_SAMPLES_P99,
            sample_unit="pauses").as_dict()
    if "alone" in phases:
        for metric, target in (("ttft_ms", 1.10), ("tpot_ms", 1.05)):
            base = p99("alone", "online", metric, "p99")
            base_n = p99("alone", "online", metric, "n") or 0
            for name in phases:
                if name == "alone":
                    continue
                v = p99(name, "online", metric, "p99")
                ratio = v / base if v is not None and base else None
                n = min(base_n, p99(name, "online", metric, "n") or 0)
                out[f"{metric}_p99_ratio_{name}"] = Verdict(
                    f"{name}: online P99 {metric[:4].upper()} / alone's", ratio, target, samples=n,
                    min_samples=MIN_SAMPLES_P99, sample_unit="online requests (fewer of the two phases)").as_dict()
    if "valve" in phases and "fifo" in phases:
        sel, fifo = p99("valve", "offline", "lost_tokens"), p99("fifo", "offline", "lost_tokens")
        sel_per, fifo_per = (p99("valve", "offline", "lost_tokens_per_reclamation"),
                             p99("fifo", "offline", "lost_tokens_per_reclamation"))
        events = min(p99("valve", "memory", "reclamations") or 0, p99("fifo", "memory", "reclamations") or 0)
        out["selective_vs_fifo_lost_tokens"] = {
            **Verdict("selective reclamation: tokens lost, reduction against FIFO's", 1 - sel / fifo if fifo else None,
                      0.20, comparison=">=", samples=events, min_samples=MIN_EVENTS,
                      sample_unit="reclamations (fewer of the two phases)").as_dict(),
            "selective": sel, "fifo": fifo, "selective_per_reclamation": sel_per, "fifo_per_reclamation": fifo_per,
            "reduction_per_reclamation": 1 - sel_per / fifo_per if fifo_per else None}
    if "valve" in phases:
        window_s = p99("valve", "window_s") or 0.0
        out["reclamations_per_min_valve"] = Verdict(
            "valve: reclamations per minute (MIAD's target)", p99("valve", "memory", "reclamations_per_min"),
            cfg.miad.target_events_per_min, comparison="within", tolerance=0.25,
            samples=int(window_s // cfg.miad.rate_window_s), min_samples=2,
            sample_unit=f"MIAD rate windows of {cfg.miad.rate_window_s:g} s").as_dict()
    return out


def _f(x: Any, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def format_table(results: dict[str, Any]) -> str:
    head = ("phase", "ttft p99", "tpot p99", "preempt/req", "ack p99", "sigstop p99", "layer p50", "off tok/s",
            "lost tok", "reclaim/min", "reclaim p99", "no loss")
    rows = [head]
    for name, r in results["phases"].items():
        pause, off, mem = r.get("pause", {}), r.get("offline", {}), r.get("memory", {})
        rows.append((name, _f(r["online"]["ttft_ms"]["p99"]), _f(r["online"]["tpot_ms"]["p99"]),
                     _f(r.get("preemptions_per_online_request", {}).get("mean"), 2),
                     _f(pause.get("cooperative_ack_ms", {}).get("p99"), 2),
                     _f(pause.get("os_suspend_ms", {}).get("p99"), 3),
                     _f(pause.get("offline_layer_ms", {}).get("p50"), 2), _f(off.get("tokens_per_s")),
                     _f(off.get("lost_tokens")), _f(mem.get("reclamations_per_min")),
                     _f(mem.get("reclaim_ms", {}).get("p99"), 2), _no_loss(off, mem)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines.append("(latencies in ms; p99 over the phase's online requests; one torch thread per engine process; "
                 "no loss: n/a where nothing was reclaimed, so nothing could be lost)")
    lines.append("targets (met only from enough samples):")
    for key, v in results["summary"].items():
        if "met_text" in v:
            extras = {k: x for k, x in v.items() if k not in VERDICT_KEYS}
            lines.append(f"  {key}: {_describe(v)}" + ("" if not extras else " [" + ", ".join(
                f"{k}={_f(x, 3)}" for k, x in extras.items()) + "]"))
        else:
            lines.append(f"  {key}: " + ", ".join(f"{k}={_f(x, 3)}" for k, x in v.items()))
    lines.extend(f"warning: {w}" for w in results.get("warnings", ()))
    lines.append(closing(results))
    return "\n".join(lines)


def closing(results: dict[str, Any]) -> str:
    """The phase that harvested most offline tokens/s, and the targets read in a sentence."""
    harvests = sorted(((r["offline"]["tokens_per_s"], name) for name, r in results["phases"].items()
                       if r.get("offline", {}).get("tokens_per_s") is not None), reverse=True)
    lead = ""
    if harvests:
        rate, name = harvests[0]
        lead = (f"Most offline tokens/s: {name} ({rate:.1f}" + "".join(
            f"; {other} {r:.1f}" for r, other in harvests[1:]) + "). ")
    judged = [Verdict(**{k: v[k] for k in VERDICT_KEYS if k not in ("met", "met_text")})
              for v in results["summary"].values() if "met_text" in v]
    return lead + closing_sentence(judged)


def _no_loss(offline: dict[str, Any], memory: dict[str, Any]) -> str:
    """'yes' / 'no' only where memory was reclaimed: with no reclamation, keeping every offline
    request shows nothing about reclamation losing none."""
    if not offline or offline.get("nothing_lost") is None:
        return "-"
    if not memory.get("reclamations"):
        return "n/a"
    return _f(offline["nothing_lost"])


VERDICT_KEYS = ("quantity", "value", "target", "comparison", "tolerance", "samples", "min_samples", "sample_unit",
                "met", "met_text")


def _describe(v: dict[str, Any]) -> str:
    return Verdict(**{k: v[k] for k in VERDICT_KEYS if k not in ("met", "met_text")}).describe()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m backfill.bench.node_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--duration-s", type=float, default=NodeBenchConfig.duration_s)
    ap.add_argument("--phases", default=",".join(PHASES), help="comma-separated, from: " + ", ".join(PHASES))
    ap.add_argument("--model", default="default", help="default, tiny, or random:SHAPE (engine/shapes.py)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N: both engine processes on this device")
    ap.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: float32 on CPU, "
                    "bfloat16 on CUDA)")
    ap.add_argument("--shared-kv", action="store_true", help="CPU: the KV pool as one /dev/shm arena")
    ap.add_argument("--warmup-s", type=float, default=NodeBenchConfig.warmup_s)
    ap.add_argument("--online-load", type=float, default=NodeBenchConfig.online_load,
                    help="online arrivals as this share of what this machine serves one request at a time "
                         "(measured before the phases)")
    ap.add_argument("--arrivals", default=None, help="an explicit arrival spec instead, e.g. gamma:0.5:2")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    cfg = replace(NodeBenchConfig(), duration_s=args.duration_s, model=args.model, arrivals=args.arrivals,
                  online_load=args.online_load,
                  seed=args.seed, phases=tuple(p for p in args.phases.split(",") if p), device=args.device,
                  dtype=dtype, shared_kv=args.shared_kv, warmup_s=args.warmup_s)
    return run_node_bench(cfg, args.json)


if __name__ == "__main__":
    main()
