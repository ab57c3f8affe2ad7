"""DISB A-E (REEF §6.2-6.3) and the preemption latency benchmark (§6.4) on the portable executor.

Modes run interleaved in rounds in one process, so a shared machine's noise falls on all alike.
Metrics follow REEF §6.2: each RT request's latency is normalised by its model's standalone time;
each client's throughput by its model's solo maximum (1 / standalone time), summed over clients.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from backfill.bench.arrivals import poisson_arrivals, uniform_arrivals
from backfill.bench.disb import DisbClient, DisbWorkload, load_disb
from backfill.progress import Heartbeat
from backfill.bench.lengths import parse_length_spec
from backfill.errors import RealtimeError
from backfill.realtime.idempotence import IdempotenceMap, analyze
from backfill.realtime.models import build_model
from backfill.realtime.config import ALL_MODELS, DISB_SCALES, MODE_CONFIGS, TINY_SCALES  # noqa: F401 (re-exported)
from backfill.realtime.task_scheduler import Request, RealtimeScheduler, TaskSchedulerConfig, ServedModel, profile

_FIXED = parse_length_spec("fixed:1")


def dnn_preset(letter: str, solo_s: dict[str, float], duration_s: float,
               all_models: tuple[str, ...] = ALL_MODELS, rt_load_scale: float = 1.0) -> DisbWorkload:
    """REEF Table 2 with DNN models: rates are shares of the RT model's solo maximum, times
    `rt_load_scale` (the same for every mode), which fits the RT load to a machine whose RT-only
    run saturates at Table 2's share (B's 100% is a queue at its critical load on a CPU core)."""
    _check_rt_load_scale(rt_load_scale)
    table = {"A": (["vgg19"], 0.5, "uniform", ["resnet152"]), "B": (["vgg19"], 1.0, "uniform", ["resnet152"]),
             "C": (["vgg19"], 0.5, "uniform", list(all_models)), "D": (list(all_models), 0.1, "uniform", list(all_models)),
             "E": (list(all_models), 0.1, "poisson", list(all_models))}
    key = letter.upper()
    if key not in table:
        raise RealtimeError(f"unknown DISB workload {letter!r}; known: A, B, C, D, E")
    rt, share, arrival, be = table[key]
    clients = [DisbClient(f"rt-{m}", "real-time", arrival, _FIXED, _FIXED, m, rate_per_s=share * rt_load_scale / solo_s[m])
               for m in rt]
    clients += [DisbClient(f"be-{m}", "best-effort", "closed-loop", _FIXED, _FIXED, m, concurrency=1) for m in be]
    return DisbWorkload(key, float(duration_s), tuple(clients))


def _check_rt_load_scale(rt_load_scale: float) -> None:
    if not 0 < rt_load_scale <= 1:
        raise RealtimeError(f"rt_load_scale must be in (0, 1], got {rt_load_scale}")


class DisbSource:
    """RT clients open loop (uniform / Poisson / trace), BE clients closed loop, on the perf_counter clock."""

    def __init__(self, workload: DisbWorkload, models: dict[str, ServedModel], t0: float, duration_s: float,
                 seed: int, with_be: bool) -> None:
        self.models = models
        events = []
        for i, c in enumerate(workload.clients):
            if c.priority != "real-time":
                continue
            if c.arrival == "uniform":
                times = uniform_arrivals(c.rate_per_s, duration_s=duration_s, offset_s=(i * 0.37 / c.rate_per_s) % (1 / c.rate_per_s))
            elif c.arrival == "poisson":
                times = poisson_arrivals(c.rate_per_s, np.random.default_rng([seed, i]), duration_s=duration_s)
            else:
                times = np.asarray([t for t in c.arrivals_s if t < duration_s])
            events += [(t0 + float(t), c.name, c.model) for t in times]
        self.rt = sorted(events)
        self.pending = [self._be(c.name, c.model, t0) for c in workload.clients
                        if c.priority == "best-effort" and with_be for _ in range(c.concurrency)]
        self.clients = {c.name: c.model for c in workload.clients}

    def _be(self, client: str, model: str, now_s: float) -> Request:
        return Request(client, model, False, self.models[model].model.example_input, now_s)

    def due(self, now_s: float) -> list[Request]:
        out, self.pending = self.pending, []
        while self.rt and self.rt[0][0] <= now_s:
            t, client, model = self.rt.pop(0)
            out.append(Request(client, model, True, self.models[model].model.example_input, t))
        return out

    def next_s(self) -> float:
        return self.rt[0][0] if self.rt else float("inf")

    def on_complete(self, request: Request, now_s: float) -> None:
        if not request.realtime:
            self.pending.append(self._be(request.client, request.model, now_s))


def load_models(names: set[str], scales: dict[str, float], metadata_dir: Path | None,
                device: str = "cpu") -> dict[str, ServedModel]:
    """Build, analyse (or load the saved idempotence map) and profile each model; on a CUDA
    device the model moves there after its analysis on the CPU (the same ops and buffers) and
    its standalone time is measured there."""
    out = {}
    for name in sorted(names):
        model = build_model(name, scales[name])
        imap = None
        path = metadata_dir / f"{name}-x{scales[name]:g}.json" if metadata_dir else None
        if path is not None and path.exists():
            try:
                imap = IdempotenceMap.load(path, model)
            except RealtimeError:
                imap = None
        if imap is None:
            imap = analyze(model)
            if path is not None:
                imap.save(path)
        out[name] = profile(model, imap)
        if device != "cpu":
            from backfill.realtime.cuda_scheduler import profile_on_device

            out[name] = profile_on_device(ServedModel(model.on_device(device), imap, out[name].op_s, out[name].solo_s))
    return out


@dataclass
class RealtimeRunResult:
    mode: str
    duration_s: float
    rt: list[tuple[str, float]]            # (model, latency_s)
    completed: dict[str, int]              # client -> requests completed
    preemptions: list[tuple[str, float, float]]  # (path, RT arrival -> BE stopped, preempt call -> stopped), s
    reexecuted_ops: int
    padded_ops: int


def mode_config(mode: str) -> TaskSchedulerConfig:
    """A mode name, optionally with REEF's in-flight capacity: "reef@16" is reef with 16 ops in flight."""
    name, _, cap = mode.partition("@")
    if name not in MODE_CONFIGS:
        raise RealtimeError(f"unknown mode {mode!r}; known: {', '.join(MODE_CONFIGS)} (reef modes take @CAPACITY)")
    config = MODE_CONFIGS[name]
    if cap:
        if not cap.isdigit() or config.mode != "reef":
            raise RealtimeError(f"{mode!r}: only reef modes take @CAPACITY, an integer")
        config = replace(config, inflight_capacity=int(cap))
    return config


def run_once(workload: DisbWorkload, mode: str, models: dict[str, ServedModel], duration_s: float,
             seed: int, device: str = "cpu") -> RealtimeRunResult:
    config = mode_config(mode)
    be = {c.name: c.model for c in workload.clients if c.priority == "best-effort"}
    if device == "cpu":
        scheduler = RealtimeScheduler(config, models, be)
    else:
        from backfill.realtime.cuda_scheduler import CudaScheduler

        scheduler = CudaScheduler(config, models, be)
    with scheduler as sched:
        t0 = time.perf_counter() + 0.05
        source = DisbSource(workload, models, t0, duration_s, seed, with_be=config.mode != "rt-only")
        sched.run(source, t0 + duration_s)
        done = [r for r in sched.completed if r.finish_s is not None and r.finish_s <= t0 + duration_s or r.realtime]
        completed: dict[str, int] = {}
        for r in done:
            completed[r.client] = completed.get(r.client, 0) + 1
        return RealtimeRunResult(mode, duration_s, [(r.model, r.latency_s) for r in done if r.realtime], completed,
                         [(p.path, p.from_arrival_s, p.from_signal_s) for p in sched.preemptions],
                         sum(r.reexecuted_ops for r in done), sched.padded_ops)


def summarize(results: list[RealtimeRunResult], workload: DisbWorkload, models: dict[str, ServedModel]) -> dict:
    """Per mode: normalised RT latency (P50/P99), RT P99 / RT-only's, normalised throughput."""
    client_model = {c.name: c.model for c in workload.clients}
    rows = {}
    for mode in dict.fromkeys(r.mode for r in results):
        rs = [r for r in results if r.mode == mode]
        norm = np.array([lat / models[m].solo_s for r in rs for m, lat in r.rt])
        seconds = sum(r.duration_s for r in rs)
        tput = sum(n * models[client_model[c]].solo_s for r in rs for c, n in r.completed.items()) / seconds
        pre = [p for r in rs for p in r.preemptions]
        rows[mode] = {"rt_requests": int(len(norm)),
                      "rt_p50_norm": float(np.percentile(norm, 50)) if len(norm) else None,
                      "rt_p99_norm": float(np.percentile(norm, 99)) if len(norm) else None,
                      "throughput_norm": tput, "preemptions": len(pre),
                      "preempt_us": {path: _latency_stats([p for p in pre if p[0] == path])
                                     for path in sorted({p[0] for p in pre})},
                      "reexecuted_ops": sum(r.reexecuted_ops for r in rs), "padded_ops": sum(r.padded_ops for r in rs)}
    base = rows.get("rt-only", {}).get("rt_p99_norm")
    seq = rows.get("seq", {}).get("throughput_norm")
    for row in rows.values():
        row["rt_p99_vs_rt_only"] = row["rt_p99_norm"] / base if base and row["rt_p99_norm"] else None
        row["throughput_vs_seq"] = row["throughput_norm"] / seq if seq else None
    return rows


def _timed_inference(served: ServedModel) -> float:
    cuda = served.model.example_input.device.type == "cuda"
    start = time.perf_counter()
    served.model.infer(served.model.example_input)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _latency_stats(pre: list[tuple[str, float, float]]) -> dict:
    arrival, signal = np.array([p[1] for p in pre]) * 1e6, np.array([p[2] for p in pre]) * 1e6
    return {"n": len(pre), "p50": float(np.percentile(arrival, 50)), "p99": float(np.percentile(arrival, 99)),
            "signal_p50": float(np.percentile(signal, 50)), "signal_p99": float(np.percentile(signal, 99))}


def run_disb(letters: list[str], modes: list[str], duration_s: float, rounds: int, seed: int = 0,
             scales: dict[str, float] | None = None, all_models: tuple[str, ...] = ALL_MODELS,
             workload_file: str | None = None, metadata_dir: Path | None = None, log=print,
             rt_load_scale: float = 1.0, device: str = "cpu") -> dict:
    for m in modes:
        mode_config(m)
    if device != "cpu":
        from backfill.realtime.cuda_scheduler import CUDA_MODES

        bad = [m for m in modes if mode_config(m).mode not in CUDA_MODES or mode_config(m).pad]
        if bad:
            raise RealtimeError(f"modes {bad} have no CUDA form; on {device} choose among {', '.join(CUDA_MODES)}")
        if not torch.cuda.is_available():
            raise RealtimeError(f"device {device!r}: CUDA is not available")
    _check_rt_load_scale(rt_load_scale)  # before the models load
    if rounds < 1 or duration_s <= 0:
        raise RealtimeError("rounds must be >= 1 and duration positive")
    torch.set_num_threads(1)
    scales = scales or DISB_SCALES
    custom = load_disb(workload_file) if workload_file else None
    needed = {c.model for c in custom.clients} if custom else (set(all_models) | {"vgg19", "resnet152"})
    unknown = needed - set(scales)
    if unknown:
        raise RealtimeError(f"DISB clients use models without a DNN definition: {sorted(unknown)}")
    log(f"DISB {' '.join(letters) if not custom else custom.name or 'custom'}: {len(modes)} modes x {rounds} "
        f"round(s), {duration_s:g} s a mode and workload (about {duration_s * len(modes):.0f} s a workload after "
        f"the models load: {len(needed)} models, each analysed for idempotence unless its map is saved)")
    with Heartbeat(log, "building the models and their idempotence maps"):
        models = load_models(needed, scales, metadata_dir, device)
    log("models (standalone ms): " + ", ".join(f"{n} {m.solo_s * 1e3:.1f} ({len(m.model)} ops)"
                                                for n, m in models.items()))
    report = {"models": {n: {"solo_ms": m.solo_s * 1e3, "ops": len(m.model), "scale": scales[n]}
                         for n, m in models.items()},
              "duration_s": duration_s, "rounds": rounds, "rt_load_scale": rt_load_scale, "device": device,
              "workloads": {}}
    for letter in ([custom.name or "custom"] if custom else letters):
        wl = custom or dnn_preset(letter, {n: m.solo_s for n, m in models.items()}, duration_s, all_models,
                                          rt_load_scale)
        results = []
        solo_runs: dict[str, list[float]] = {n: [] for n in models}
        for k in range(rounds):
            for n, m in models.items():  # standalone times re-measured beside the modes, round by round
                solo_runs[n] += [_timed_inference(m) for _ in range(3)]
            for mode in modes:
                log(f"   {wl.name} round {k + 1}/{rounds}: {mode} for {duration_s / rounds:g} s")
                with Heartbeat(log, f"{mode} (requests queued at the end still finish)"):
                    results.append(run_once(wl, mode, models, duration_s / rounds, seed + k, device))
        solo = {n: replace(m, solo_s=float(np.median(solo_runs[n]))) for n, m in models.items()}
        rows = summarize(results, wl, solo)
        report["workloads"][wl.name] = {"solo_ms": {n: m.solo_s * 1e3 for n, m in solo.items()}}
        report["workloads"][wl.name].update(clients=wl.to_json()["clients"], modes=rows)
        log(format_rows(wl.name, rows))
    return report


# REEF's targets on DISB (§6.3): RT latency close to RT-only's at no less BE throughput than SEQ.
RT_P99_VS_RT_ONLY_TARGET = 1.05
THROUGHPUT_VS_SEQ_TARGET = 1.0


def verdicts(rows: dict) -> list:
    """Each REEF mode's two targets against RT-only and SEQ of the same run, backed by its RT
    request count (throughput is a rate over the whole run: one sample per mode-round)."""
    from backfill.bench.verdict import MIN_SAMPLES_P99, Verdict

    out = []
    for mode, r in rows.items():
        if not mode.startswith("reef"):
            continue
        out.append(Verdict(f"{mode}: RT P99 / RT-only's", r["rt_p99_vs_rt_only"], RT_P99_VS_RT_ONLY_TARGET,
                           samples=r["rt_requests"], min_samples=MIN_SAMPLES_P99, sample_unit="RT requests"))
        out.append(Verdict(f"{mode}: BE throughput / SEQ's", r["throughput_vs_seq"], THROUGHPUT_VS_SEQ_TARGET,
                           samples=r["rt_requests"], min_samples=MIN_SAMPLES_P99, comparison=">=",
                           sample_unit="RT requests"))
    return out


def closing(name: str, rows: dict) -> str:
    """Which modes met both targets (or came closest), read in a sentence."""
    judged = verdicts(rows)
    both = [m for m in rows if m.startswith("reef")
            and all(v.met for v in judged if v.quantity.startswith(f"{m}:"))]
    if both:
        best = max(both, key=lambda m: rows[m]["throughput_vs_seq"] or 0.0)
        lead = (f"DISB {name}: {', '.join(both)} met both targets (RT P99 <= {RT_P99_VS_RT_ONLY_TARGET}x RT-only at "
                f">= {THROUGHPUT_VS_SEQ_TARGET}x SEQ's throughput); {best} at {rows[best]['rt_p99_vs_rt_only']:.2f}x "
                f"and {rows[best]['throughput_vs_seq']:.2f}x over {rows[best]['rt_requests']} RT requests.")
    else:
        lead = f"DISB {name}: no REEF mode met both targets this run."
    conc = rows.get("concurrent")
    if conc and conc["rt_p99_vs_rt_only"] is not None and conc["throughput_vs_seq"] is not None:
        lead += (f" concurrent (no priorities): {conc['rt_p99_vs_rt_only']:.2f}x RT-only at "
                 f"{conc['throughput_vs_seq']:.2f}x SEQ.")
    from backfill.bench.verdict import closing_sentence

    return lead + " " + closing_sentence(judged)


def format_rows(name: str, rows: dict) -> str:
    f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    lines = [f"DISB {name}: mode | RT n | RT P50 (x solo) | RT P99 (x solo) | P99 / RT-only | throughput (norm) | vs SEQ | preemptions (latency from RT arrival / from the preempt call)"]
    for mode, r in rows.items():
        pre = ", ".join(f"{p} {v['n']}: P50 {v['p50']:.0f}/{v['signal_p50']:.0f} us P99 {v['p99']:.0f}/{v['signal_p99']:.0f} us"
                        for p, v in r["preempt_us"].items())
        lines.append(f"  {mode:10s} | {r['rt_requests']:4d} | {f(r['rt_p50_norm'], '.2f')} | {f(r['rt_p99_norm'], '.2f')} | "
                     f"{f(r['rt_p99_vs_rt_only'], '.3f')} | {r['throughput_norm']:.3f} | {f(r['throughput_vs_seq'], '.2f')} | "
                     f"{pre or '-'}")
    lines.append(closing(name, rows))
    return "\n".join(lines)


def bench_preemption(model_names: list[str], paths: list[str], trials: int, scales: dict[str, float],
                     seed: int = 0, metadata_dir: Path | None = None, log=print) -> dict:
    """REEF §6.4 / Fig. 18: one BE client per model, preempted at random times, per path.

    Latency runs from the preemption request (the RT arrival) to no BE op executing.
    """
    torch.set_num_threads(1)
    models = load_models(set(model_names), scales, metadata_dir)
    rng = np.random.default_rng(seed)
    out = {}
    for name in model_names:
        served = models[name]
        row = {}
        for path in paths:
            config = TaskSchedulerConfig(mode="reef", preempt_path=path)
            lat, paths_seen, ok, lost_s = [], [], True, 0.0
            with RealtimeScheduler(config, models, {"be": name}) as sched:
                s = sched.streams["be"]
                ref = served.model.infer(served.model.example_input)
                for _ in range(trials):
                    req = Request("be", name, False, served.model.example_input, time.perf_counter())
                    sched.streams["be"].queue.append(req)
                    sched.service_be(_NoSource())
                    at = time.perf_counter() + float(rng.uniform(0.1, 0.9)) * served.solo_s
                    while time.perf_counter() < at and s.current is not None:  # normal mode until the RT arrival
                        sched.service_be(_NoSource())
                        time.sleep(0.0002)
                    trigger = Request("rt", name, True, served.model.example_input, time.perf_counter())
                    sched.preempt_all(trigger)
                    if sched.preemptions and sched.preemptions[-1].path != "idle":
                        lat.append(sched.preemptions[-1].from_arrival_s)
                        paths_seen.append(sched.preemptions[-1].path)
                    while s.current is not None:  # restore and finish; output must be bit-exact
                        sched.service_be(_NoSource())
                        time.sleep(0.0002)
                    ok &= bool(torch.equal(sched.completed[-1].output, ref))
                    lost_s += sched.completed[-1].reexecuted_s
                fork_ms = float(np.median(s.worker.fork_s) * 1e3)
            # What a kill costs BE: the killed op and the rest of its group, run again (profiled).
            lost_us = lost_s / max(1, len(lat)) * 1e6
            row[path] = {"n": len(lat), "p50_us": float(np.percentile(lat, 50) * 1e6) if lat else None,
                         "p99_us": float(np.percentile(lat, 99) * 1e6) if lat else None, "outputs_exact": ok,
                         "reexecuted_us_mean": lost_us, "spare_fork_ms_p50": fork_ms,
                         "stopped_by": {p: paths_seen.count(p) for p in sorted(set(paths_seen))}}
            log(f"{name:10s} {path:6s} n={len(lat):3d} P50 {row[path]['p50_us'] or 0:8.0f} us  "
                f"P99 {row[path]['p99_us'] or 0:8.0f} us  re-executed {lost_us:6.0f} us  spare fork {fork_ms:5.1f} ms  "
                f"outputs bit-exact: {ok}  {row[path]['stopped_by']}")
        out[name] = row
    return out


class _NoSource:
    def due(self, now_s: float) -> list[Request]:
        return []

    def next_s(self) -> float:
        return float("inf")

    def on_complete(self, request: Request, now_s: float) -> None:
        pass


def write_json(obj: dict, path: str | None) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
