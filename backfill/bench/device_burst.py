"""The AQUA burst on one GPU (AQUA §9.3, device form): an engine whose KV memory holds only a few
requests meets a steady load, then twice the rate, then steady again; FCFS against CFS paging to
pinned host memory and CFS paging to device memory a neighbour process lends through CUDA IPC.
Then the gather / scatter transfer rate of KV pages, set against the link's peak read from the
device.

    python -m backfill.bench.device_burst --json burst.json [--shape smollm2-135m] [--device cuda]

No tokenizer, server or coordinator: requests are token ids replayed straight into the
scheduler at their arrival times (greedy, fixed output length), the lender is local (the
neighbour is a process that lends device memory and carries no load of its own, so the
producer's throughput loss of burst.py is not measured here). The steady rate is set from the
engine's own measured capacity (0.6 of it), so the burst (2x) overloads any GPU the same way.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from backfill.bench.arrivals import step_arrivals
from backfill.errors import WorkloadError

MODES = ("fcfs", "cfs-host", "cfs-lent")


@dataclass(frozen=True)
class DeviceBurstConfig:
    shape: str = "smollm2-135m"         # engine/shapes.py, or "tiny" (ModelConfig.tiny(), tests)
    device: str = "cuda"
    dtype: str = "bfloat16"
    kv_blocks: int = 64                 # x block_size tokens: a few requests' KV (AQUA's contention)
    block_size: int = 16
    prompt_tokens: tuple[int, int] = (64, 192)
    output_tokens: int = 96
    load_of_capacity: float = 0.6       # steady rate / measured capacity
    steady_rate_per_s: float | None = None   # a fixed steady rate instead (no capacity measurement)
    burst_factor: float = 2.0
    steady_s: float = 3.0
    burst_s: float = 6.0
    after_s: float = 3.0
    slice_iterations: int = 5           # CFS's k
    lend_mb: float = 256.0
    modes: tuple[str, ...] = MODES
    transfer_blocks: tuple[int, ...] = (16, 64, 256)
    transfer_repeats: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = [m for m in self.modes if m not in MODES]
        if unknown:
            raise WorkloadError(f"unknown burst modes {unknown}; choose from {', '.join(MODES)}")
        if not (0 < self.load_of_capacity and self.burst_factor > 0 and self.burst_s > 0):
            raise WorkloadError("load_of_capacity, burst_factor and burst_s must be positive")


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _ms(values: list[float]) -> dict[str, Any]:
    ms = [v * 1e3 for v in values]
    return {"n": len(ms), "p50": _pct(ms, 50), "p99": _pct(ms, 99), "max": max(ms) if ms else None}


def _requests(cfg: DeviceBurstConfig, vocab: int, n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    return [(rng.integers(3, vocab, int(rng.integers(cfg.prompt_tokens[0], cfg.prompt_tokens[1] + 1))).tolist(),
             cfg.output_tokens) for _ in range(n)]


def replay(scheduler, arrivals: list[float], requests: list[tuple[list[int], int]], prefix: str) -> list[dict]:
    """Each request added at its arrival time; the scheduler stepped until all finish. Records
    per request: arrival, first and last token times (seconds from the start)."""
    from backfill.bench.node_engines.engine_proc import make_request

    t0 = time.monotonic()
    records = [{"arrival_s": a, "first_s": None, "last_s": None, "tokens": 0} for a in arrivals]
    index = {f"{prefix}-{i}": i for i in range(len(arrivals))}
    added = 0
    while added < len(arrivals) or scheduler.has_work():
        now = time.monotonic() - t0
        while added < len(arrivals) and arrivals[added] <= now:
            ids, out = requests[added]
            scheduler.add(make_request({"request_id": f"{prefix}-{added}", "prompt_token_ids": ids, "max_tokens": out,
                                        "arrival_s": t0 + arrivals[added]}, "online"))
            added += 1
        if not scheduler.has_work():
            time.sleep(min(0.001, max(0.0, arrivals[added] - now)) if added < len(arrivals) else 0.001)
            continue
        for ev in scheduler.step():
            if not ev.token_ids:
                continue
            r = records[index[ev.request_id]]
            t = time.monotonic() - t0
            r["first_s"] = t if r["first_s"] is None else r["first_s"]
            r["last_s"] = t
            r["tokens"] += len(ev.token_ids)
    return records


def summarize(records: list[dict], burst: tuple[float, float]) -> dict[str, Any]:
    done = [r for r in records if r["first_s"] is not None]
    ttft = [r["first_s"] - r["arrival_s"] for r in done]
    in_burst = [r["first_s"] - r["arrival_s"] for r in done if burst[0] <= r["arrival_s"] < burst[1]]
    tpot = [(r["last_s"] - r["first_s"]) / (r["tokens"] - 1) for r in done if r["tokens"] > 1]
    return {"requests": len(records), "completed": len(done), "ttft_ms": _ms(ttft), "burst_ttft_ms": _ms(in_burst),
            "tpot_ms": _ms(tpot)}


class Neighbour:
    """A process that lends memory, on CUDA its device memory through CUDA IPC (memory/cuda_ipc.py),
    on CPU a /dev/shm segment, and holds it until stopped; always stopped by stop()."""

    def __init__(self, nbytes: int, device: str) -> None:
        code = ("import sys\n"
                "from backfill.memory.elastic import make_segment\n"
                f"seg = make_segment({int(nbytes)}, {device!r})\n"
                "print(seg.path, flush=True)\n"
                "sys.stdin.read()\n"
                "seg.unlink()\n")
        self.nbytes = nbytes
        self.path = ""
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)

    def wait_ready(self) -> "Neighbour":
        """Block until the neighbour named its memory (it starts while the engine loads)."""
        self.path = (self.proc.stdout.readline() or "").strip()
        if not self.path:
            raise WorkloadError("the neighbour process did not lend its memory")
        return self

    def stop(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(timeout=10)


def _scheduler(runner, mode: str, cfg: DeviceBurstConfig, neighbour: Neighbour | None):
    import torch

    from backfill.memory.elastic import ElasticStore, LocalLender, Location
    from backfill.memory.pager import KVPager, make_pager
    from backfill.policy.baselines import FCFSPolicy
    from backfill.policy.cfs import CFSConfig, CFSPolicy
    from backfill.serving.scheduler import Scheduler

    if mode == "fcfs":
        return Scheduler(runner, FCFSPolicy())
    scheduler = Scheduler(runner, CFSPolicy(CFSConfig(slice_iterations=cfg.slice_iterations)))
    if mode == "cfs-lent":
        assert neighbour is not None
        lender = LocalLender(neighbour)     # path (its IPC name) and nbytes, as a ShmSegment
        scheduler.pager = KVPager(ElasticStore(device=torch.device(cfg.device), lender=lender, prefer=Location.LENT))
    else:
        scheduler.pager = make_pager(cfg.device)
    return scheduler


def _pager(scheduler) -> dict[str, Any]:
    pager = scheduler.pager
    if pager is None:
        return {}
    s = pager.stats
    return {"pages_out": s.pages_out, "pages_in": s.pages_in, "bytes_paged_out": s.bytes_out,
            "paging_s": s.paging_s, "fell_back_to_host": pager.store.stats.fell_back,
            "lent_bytes": pager.store.bytes_in(pager.store.prefer)}


def run_device_burst(cfg: DeviceBurstConfig = DeviceBurstConfig(), log=print,
                     checkpoint=None) -> dict[str, Any]:
    import torch

    from backfill.bench.link import read_link_peak
    from backfill.engine.config import ModelConfig
    from backfill.engine.kv_pool import KVBlockPool
    from backfill.engine.runner import ModelRunner
    from backfill.engine.shapes import shape_config
    from backfill.engine.weights import random_model
    from backfill.memory.elastic import map_segment
    from backfill.bench.transfer_bench import figures_json, measure_transfers
    from backfill.serving.build import build_eager_model

    started = time.monotonic()
    dtype = getattr(torch, cfg.dtype)
    config = ModelConfig.tiny() if cfg.shape == "tiny" else shape_config(cfg.shape)
    neighbour = None
    try:
        if "cfs-lent" in cfg.modes or cfg.transfer_blocks:
            neighbour = Neighbour(int(cfg.lend_mb * 2**20), cfg.device)
        model = build_eager_model(config, random_model(config, cfg.seed), cfg.dtype, cfg.device)
        runner = ModelRunner(model, KVBlockPool(config, cfg.kv_blocks, cfg.block_size, model.dtype, cfg.device))
        out: dict[str, Any] = {"config": json.loads(json.dumps(asdict(cfg))), "model": config.name,
                               "kv_bytes": runner.kv.nbytes, "link": read_link_peak(_index(cfg.device)).as_dict(),
                               "modes": {}, "partial": True, "skipped": []}
        if cfg.device.startswith("cuda"):
            out["gpu"] = torch.cuda.get_device_name(cfg.device)
        modes = list(cfg.modes)
        if neighbour is not None:
            try:
                neighbour.wait_ready()
            except WorkloadError as exc:
                neighbour.stop()
                neighbour = None
                modes = [m for m in modes if m != "cfs-lent"]
                out["skipped"].append(f"cfs-lent and transfers to lent memory ({exc}); 'lent' transfers "
                                      f"went to a /dev/shm segment instead")
        # Transfers first: seconds, and a run cut short still has them.
        if cfg.transfer_blocks:
            figures = measure_transfers(config, blocks=cfg.transfer_blocks, repeats=cfg.transfer_repeats,
                                        device=cfg.device, dtype=dtype,
                                        lent=map_segment(neighbour.path) if neighbour is not None else None,
                                        methods=("gathered",))
            peak = out["link"]["pcie_gb_per_s"]
            out["transfers"] = [{**f, "of_link_peak": f["gb_per_s"] / peak if peak and f["destination"] == "host"
                                 else None} for f in figures_json(figures)]
            log(f"[device burst] transfers measured; link peak {peak} GB/s ({out['link']['source']})")
            if checkpoint is not None:
                checkpoint(out)
        # Capacity: a batch of requests through the small pool, as fast as the engine goes.
        # Distinct arrival times: FCFS evicts later arrivals for earlier ones, and equal times
        # would leave no one to evict once partial prefills fill the pool.
        cal = _requests(cfg, config.vocab_size, 8, cfg.seed + 99)
        at_once = [i * 1e-6 for i in range(len(cal))]
        replay(_scheduler(runner, "fcfs", cfg, None), at_once, cal, "warm")
        capacity = None
        if cfg.steady_rate_per_s is None:
            t = time.monotonic()
            replay(_scheduler(runner, "fcfs", cfg, None), at_once, cal, "cal")
            capacity = len(cal) / (time.monotonic() - t)
        rate = cfg.steady_rate_per_s or cfg.load_of_capacity * capacity
        duration = cfg.steady_s + cfg.burst_s + cfg.after_s
        arrivals = step_arrivals([(0.0, rate), (cfg.steady_s, rate * cfg.burst_factor),
                                  (cfg.steady_s + cfg.burst_s, rate)], duration, cfg.seed).tolist()
        if not arrivals:    # a capacity so low that the trace is empty: say so, measure nothing
            out["skipped"].append(f"modes: no request arrives at {rate:.3f} req/s in {duration:g} s")
            modes = []
        requests = _requests(cfg, config.vocab_size, len(arrivals), cfg.seed)
        burst = (cfg.steady_s, cfg.steady_s + cfg.burst_s)
        out.update({"capacity_requests_per_s": capacity, "steady_rate_per_s": rate, "requests": len(arrivals)})
        log(f"[device burst] {config.name} on {cfg.device}: capacity {capacity or 0:.2f} req/s, steady {rate:.2f}, "
            f"burst {rate * cfg.burst_factor:.2f} req/s, {len(arrivals)} requests")
        for mode in modes:
            scheduler = _scheduler(runner, mode, cfg, neighbour)
            t = time.monotonic()
            records = replay(scheduler, arrivals, requests, mode)
            out["modes"][mode] = {**summarize(records, burst), "wall_s": time.monotonic() - t,
                                  "preempted_requests": scheduler.stats.preempted_requests, **_pager(scheduler)}
            p99 = out["modes"][mode]["ttft_ms"]["p99"]
            log(f"   {mode}: p99 TTFT {'-' if p99 is None else f'{p99:.0f}'} ms")
            if checkpoint is not None:
                checkpoint(out)
        fcfs, cfs = out["modes"].get("fcfs"), out["modes"].get("cfs-host")
        if fcfs and cfs and cfs["ttft_ms"]["p99"]:
            out["p99_ttft_fcfs_over_cfs_host"] = fcfs["ttft_ms"]["p99"] / cfs["ttft_ms"]["p99"]
    finally:
        if neighbour is not None:
            neighbour.stop()
    out["wall_s"] = time.monotonic() - started
    out["partial"] = False
    return out


def _index(device: str) -> int:
    return int(device.split(":")[1]) if ":" in device else 0


def format_table(result: dict[str, Any]) -> str:
    lines = [f"model {result.get('model')} on {result.get('gpu', result['config']['device'])}; link "
             f"{result['link'].get('pcie_gb_per_s')} GB/s per direction (PCIe gen {result['link'].get('pcie_gen')} "
             f"x{result['link'].get('pcie_width')}, {result['link'].get('source')})",
             f"{'mode':>9} {'done':>7} {'ttft p50':>9} {'ttft p99':>9} {'burst p99':>10} {'tpot p99':>9} "
             f"{'pages out':>9} {'paged MB':>9}"]
    for mode, m in result["modes"].items():
        def f(x, d=1):
            return "-" if x is None else f"{x:.{d}f}"
        lines.append(f"{mode:>9} {m['completed']:>3}/{m['requests']:<3} {f(m['ttft_ms']['p50']):>9} "
                     f"{f(m['ttft_ms']['p99']):>9} {f(m['burst_ttft_ms']['p99']):>10} {f(m['tpot_ms']['p99']):>9} "
                     f"{m.get('pages_out', 0):>9} {m.get('bytes_paged_out', 0) / 2**20:>9.1f}")
    if "p99_ttft_fcfs_over_cfs_host" in result:
        lines.append(f"p99 TTFT FCFS / CFS-host: {result['p99_ttft_fcfs_over_cfs_host']:.2f}x")
    for t in result.get("transfers", []):
        share = f" = {t['of_link_peak']:.0%} of the link peak" if t.get("of_link_peak") else ""
        lines.append(f"transfer {t['destination']:>4} {t['direction']:>3} {t['blocks']:>4} blocks "
                     f"({t['bytes'] / 2**20:.1f} MB): {t['gb_per_s']:.1f} GB/s{share}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m backfill.bench.device_burst", description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here (after every mode too)")
    ap.add_argument("--shape", default=DeviceBurstConfig.shape)
    ap.add_argument("--device", default=DeviceBurstConfig.device)
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--kv-blocks", type=int, default=DeviceBurstConfig.kv_blocks)
    ap.add_argument("--burst-s", type=float, default=DeviceBurstConfig.burst_s)
    ap.add_argument("--steady-s", type=float, default=DeviceBurstConfig.steady_s)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--lend-mb", type=float, default=DeviceBurstConfig.lend_mb)
    ap.add_argument("--output-tokens", type=int, default=DeviceBurstConfig.output_tokens)
    ap.add_argument("--transfer-blocks", default="16,64,256")
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    cfg = replace(DeviceBurstConfig(), shape=args.shape, device=args.device,
                  dtype=args.dtype or ("bfloat16" if cuda else "float32"), kv_blocks=args.kv_blocks,
                  burst_s=args.burst_s, steady_s=args.steady_s, after_s=args.steady_s,
                  modes=tuple(m for m in args.modes.split(",") if m), lend_mb=args.lend_mb,
                  output_tokens=args.output_tokens,
                  transfer_blocks=tuple(int(b) for b in args.transfer_blocks.split(",") if b))

    def save(result: dict[str, Any]) -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))

    result = run_device_burst(cfg, checkpoint=save)
    save(result)
    print(format_table(result))
    return result


if __name__ == "__main__":
    main()
