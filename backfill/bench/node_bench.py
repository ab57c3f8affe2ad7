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
from backfill.errors import PolicyInputError
from backfill.node.engine_proc import EngineProcess, EngineSpec, engine_kv_layout, engine_model_config, request_dict
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
    arrivals: str = "gamma:0.5:2"            # bursty: cv 2
    online_prompt_tokens: tuple[int, int] = (64, 128)
    online_output_tokens: tuple[int, int] = (16, 32)
    offline_prompt_tokens: tuple[int, int] = (128, 256)
    offline_output_tokens: int = 64
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
        parse_arrival_spec(self.arrivals)
        # A bad model, device or dtype fails here, before any process starts.
        EngineSpec("check", "online", self.num_handles, self.blocks_per_handle, model=self.model,
                   device=self.device, dtype=self.dtype)


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _ms(values: list[float]) -> dict[str, float | None]:
    ms = [v * 1e3 for v in values]
    return {"n": len(ms), "p50": _pct(ms, 50), "p99": _pct(ms, 99), "max": max(ms) if ms else None}


def make_trace(cfg: NodeBenchConfig, vocab: int) -> tuple[list[tuple[float, dict]], list[dict]]:
    """The online trace (arrival time, request) and the offline backlog of a run."""
    rng = np.random.default_rng(cfg.seed)
    times = parse_arrival_spec(cfg.arrivals).generate(rng, cfg.duration_s)
    online = []
    for i, t in enumerate(times):
        n = int(rng.integers(cfg.online_prompt_tokens[0], cfg.online_prompt_tokens[1] + 1))
        out = int(rng.integers(cfg.online_output_tokens[0], cfg.online_output_tokens[1] + 1))
        online.append((float(t), {"request_id": f"on-{i}", "prompt_token_ids": rng.integers(3, vocab, n).tolist(),
                                  "max_tokens": out}))
    offline = []
    for i in range(cfg.offline_backlog):
        n = int(rng.integers(cfg.offline_prompt_tokens[0], cfg.offline_prompt_tokens[1] + 1))
        offline.append(request_dict(f"off-{i}", rng.integers(3, vocab, n).tolist(), cfg.offline_output_tokens))
    return online, offline


def _make_pool(cfg: NodeBenchConfig, memory: str) -> SharedMemoryPool:
    pool_cfg = PoolConfig(cfg.num_handles, cfg.blocks_per_handle)
    if memory == "static":
        return StaticMemPool(pool_cfg, cfg.static_online_handles)
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
    preempt = [gate.stats.preemptions(rid) for rid in sorted(trace_ids)]
    result: dict[str, Any] = {
        "phase": asdict(phase), "window_s": window_s,
        "online": {"requests": len(online_trace), "completed": len(records), "ttft_ms": _ms(ttft),
                   "tpot_ms": _ms(tpot),
                   "allocated_handles": on_stats["allocated_handles"] if on_stats else None},
        "preemptions_per_online_request": {"mean": float(np.mean(preempt)) if preempt else None,
                                           "max": max(preempt, default=0)},
        # CPU the runtime (this process: gate, pool, IPC) took; it shares the cores with the engines.
        "runtime_cpu_s": runtime_cpu_s,
    }
    if offline is None:
        return result
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
    online_trace, backlog = make_trace(config, vocab)
    started = time.monotonic()
    phases: dict[str, Any] = {}
    for name in config.phases:
        log(f"[node bench] phase {name} ({len(online_trace)} online requests over {config.duration_s:g} s)")
        phases[name] = run_phase(config, PHASES[name], online_trace, backlog)
        if json_path is not None:   # a run cut short keeps the phases it finished
            Path(json_path).write_text(json.dumps({"config": _jsonable(asdict(config)), "device": config.device,
                                                   "phases": phases, "partial": True}, indent=2))
    results = {"config": _jsonable(asdict(config)), "torch_threads_per_process": 1, "device": config.device,
               "wall_s": time.monotonic() - started, "phases": phases, "summary": summarize(phases, config)}
    if json_path is not None:
        Path(json_path).write_text(json.dumps(results, indent=2))
    log(format_table(results))
    return results


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=str))


def summarize(phases: dict[str, Any], cfg: NodeBenchConfig) -> dict[str, Any]:
    """The issue's targets, each with the measured figure and whether it is met."""
    out: dict[str, Any] = {}

    def p99(name: str, *path: str) -> float | None:
        node = phases.get(name)
        for key in path:
            if node is None:
                return None
            node = node.get(key)
        return node

    if "valve" in phases:
        out["preemptions_per_request_valve"] = {"mean": p99("valve", "preemptions_per_online_request", "mean"),
                                                "max": p99("valve", "preemptions_per_online_request", "max"),
                                                "target_max": 1.0}
        out["preemptions_per_request_valve"]["met"] = out["preemptions_per_request_valve"]["max"] <= 1
        coop = p99("valve", "pause", "cooperative_ack_ms", "p99")
        layer = p99("valve", "pause", "offline_layer_ms", "p50")
        layer_p99 = p99("valve", "pause", "offline_layer_ms", "p99")
        out["cooperative_pause_p99_ms"] = {"value": coop, "one_layer_ms_p50": layer, "one_layer_ms_p99": layer_p99,
                                           "met": coop is not None and layer_p99 is not None and coop <= layer_p99}
    if "timeslice" in phases:
        out["preemptions_per_request_timeslice"] = {"mean": p99("timeslice", "preemptions_per_online_request",
                                                                "mean")}
    if "valve-os" in phases:
        v = p99("valve-os", "pause", "os_suspend_ms", "p99")
        out["os_suspend_pause_p99_ms"] = {"value": v, "target": 1.0, "met": v is not None and v <= 1.0}
    if "alone" in phases:
        for metric, target in (("ttft_ms", 1.10), ("tpot_ms", 1.05)):
            base = p99("alone", "online", metric, "p99")
            for name in phases:
                if name == "alone" or base is None:
                    continue
                v = p99(name, "online", metric, "p99")
                ratio = v / base if v is not None else None
                out[f"{metric}_p99_ratio_{name}"] = {"value": ratio, "target": target,
                                                     "met": ratio is not None and ratio <= target}
    if "valve" in phases and "fifo" in phases:
        sel, fifo = p99("valve", "offline", "lost_tokens"), p99("fifo", "offline", "lost_tokens")
        sel_per, fifo_per = (p99("valve", "offline", "lost_tokens_per_reclamation"),
                             p99("fifo", "offline", "lost_tokens_per_reclamation"))
        out["selective_vs_fifo_lost_tokens"] = {
            "selective": sel, "fifo": fifo, "selective_per_reclamation": sel_per, "fifo_per_reclamation": fifo_per,
            "reduction": 1 - sel / fifo if fifo else None,
            "reduction_per_reclamation": 1 - sel_per / fifo_per if fifo_per else None,
            "target_reduction": 0.20, "met": bool(fifo) and 1 - sel / fifo >= 0.20}
    if "valve" in phases:
        rate = p99("valve", "memory", "reclamations_per_min")
        target = cfg.miad.target_events_per_min
        out["reclamations_per_min_valve"] = {"value": rate, "target": target,
                                             "met": rate is not None and abs(rate - target) <= 0.25 * target}
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
                     _f(r["preemptions_per_online_request"]["mean"], 2),
                     _f(pause.get("cooperative_ack_ms", {}).get("p99"), 2),
                     _f(pause.get("os_suspend_ms", {}).get("p99"), 3),
                     _f(pause.get("offline_layer_ms", {}).get("p50"), 2), _f(off.get("tokens_per_s")),
                     _f(off.get("lost_tokens")), _f(mem.get("reclamations_per_min")),
                     _f(mem.get("reclaim_ms", {}).get("p99"), 2), _f(off.get("nothing_lost"))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines.append("(latencies in ms; p99 over the phase's online requests; one torch thread per engine process)")
    for key, v in results["summary"].items():
        lines.append(f"{key}: " + ", ".join(f"{k}={_f(x, 3)}" for k, x in v.items()))
    return "\n".join(lines)


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
    ap.add_argument("--arrivals", default=NodeBenchConfig.arrivals)
    ap.add_argument("--seed", type=int, default=0)
    return ap


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    cfg = replace(NodeBenchConfig(), duration_s=args.duration_s, model=args.model, arrivals=args.arrivals,
                  seed=args.seed, phases=tuple(p for p in args.phases.split(",") if p), device=args.device,
                  dtype=dtype, shared_kv=args.shared_kv, warmup_s=args.warmup_s)
    return run_node_bench(cfg, args.json)


if __name__ == "__main__":
    main()
