"""The AQUA burst benchmark (AQUA §9.3): a steady online load, then its rate multiplied for a
burst window, then steady again, on an engine whose KV memory holds only a few requests; FCFS
against CFS paging to host memory and CFS paging to memory a producer engine lent.

The producer is a real second engine process serving its own closed-loop load and lending a
shared-memory segment through a real coordinator process. Its throughput is the median over
one-second windows (`producer_meter`) of every mode and, alone, of an idle period before the
first mode and after each one (the consumer doing nothing). Losses, per round, then medians
over rounds (AQUA §9.3): lending (cfs-lent against cfs-host: the same consumer work, only where
the pages go differs, which is what lending costs a producer on its own accelerator), the same
with each mode first divided by the producer alone either side of it (the machine's drift
between the two modes taken out), and against the producer alone (on one CPU this also counts
the consumer's compute beside it).
Modes run in turn, in rounds, on one loaded model, so they meet the same machine; the request
records are saved, so runs made apart can be pooled (`--pool`).

Sized to the machine it runs on: the consumer's capacity is measured once the producer runs and
the processes are pinned (the conditions the modes meet), with one torch thread per core the
consumer is given; the run announces how long it will take, prints a progress line at least
every PROGRESS_EVERY_S, and cuts a mode that outlasts its trace by more than drain_cap_s (its
unfinished requests are counted), so it ends within what it announced.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np

from backfill.bench.arrivals import step_arrivals
from backfill.bench.driver import run_workload
from backfill.progress import Heartbeat
from backfill.bench.inprocess_target import InProcessTarget
from backfill.bench.lengths import parse_length_spec
from backfill.bench.metrics import RequestRecord, Summary, compute_metrics
from backfill.bench.prompts import PromptSource
from backfill.bench.server_process import free_port
from backfill.bench.verdict import MIN_SAMPLES_P99, Verdict, closing_sentence
from backfill.bench.workload import Workload, build_workload
from backfill.errors import OffloadError, WorkloadError
from backfill.bench import producer_meter
from backfill.memory.pager import KVPager, make_pager
from backfill.bench.core_pinning import pin_apart, thread_cpus
from backfill.policy.baselines import FCFSPolicy
from backfill.policy.cfs import CFSConfig, CFSPolicy
from backfill.serving.async_engine import AsyncEngine
from backfill.serving.scheduler import Scheduler
from backfill.serving.torch_thread import run_on_torch_thread

MODES = ("fcfs", "cfs-host", "cfs-lent")


@dataclass(frozen=True)
class BurstScenario:
    # None: steady_load x what this machine serves (measured first: measure_capacity), so that the
    # burst (burst_factor x steady) strains the KV memory rather than the compute of any machine.
    steady_rate_per_s: float | None = None
    burst_factor: float = 2.0
    steady_s: float = 15.0          # before the burst
    burst_s: float = 30.0           # AQUA: one minute; shorter on a 2-core CPU
    after_s: float = 15.0           # steady again (the queue drains)
    prompt_len: str = "uniform:32:64"     # short requests: a 2-core CPU serves enough of them a minute
    output_len: str = "fixed:32"
    kv_cache_gb: float = 0.0166     # a few requests' KV (24 blocks in fp32): the contention AQUA addresses
    slice_iterations: int = 5       # CFS's k
    rounds: int = 1
    seed: int = 0
    lend_mb: float = 512.0          # what the producer offers
    producer: bool = True           # run the producer engine process (cfs-lent needs it)
    producer_tiny: bool = False     # the producer on a tiny random model instead of the default model
    warmup_s: float = 8.0
    decode_attention: str = "auto"  # "sdpa": no C++ kernel build (see ServingConfig)
    threads: int | None = None      # torch threads of the consumer (1 on a crowded machine)
    producer_idle_s: float = 6.0    # the producer alone before the first mode and after each one (1 s windows)
    pin_cores: bool = True          # producer on its own core, as on its own accelerator (needs 2 cores)
    # With steady_rate_per_s None: a share of the measured capacity (what the scenario's KV memory
    # serves). Half, so that the 2x burst arrives at that capacity: the queue grows through the burst
    # and its KV outgrows the memory (AQUA §2), on a fast machine as on a slow one.
    steady_load: float = 0.5

    def __post_init__(self) -> None:
        if self.steady_rate_per_s is not None and not self.steady_rate_per_s > 0:
            raise WorkloadError(f"steady_rate_per_s must be positive, got {self.steady_rate_per_s}")
        if not 0 < self.steady_load <= 1:
            raise WorkloadError(f"steady_load is a share of this machine's capacity, in (0, 1]; got {self.steady_load}")
        for name in ("burst_factor", "burst_s", "kv_cache_gb", "lend_mb"):
            if not getattr(self, name) > 0:
                raise WorkloadError(f"{name} must be positive, got {getattr(self, name)}")
        if self.producer_idle_s < 0:
            raise WorkloadError(f"producer_idle_s must be >= 0, got {self.producer_idle_s}")
        if self.rounds < 1 or self.slice_iterations < 1:
            raise WorkloadError("rounds and slice_iterations must be >= 1")
        parse_length_spec(self.prompt_len)
        parse_length_spec(self.output_len)

    @property
    def duration_s(self) -> float:
        return self.steady_s + self.burst_s + self.after_s

    def arrivals(self, seed: int) -> np.ndarray:
        rate = self.steady_rate_per_s
        if rate is None:
            raise WorkloadError("no steady rate: measure the machine first (measure_capacity)")
        return step_arrivals([(0.0, rate), (self.steady_s, rate * self.burst_factor),
                              (self.steady_s + self.burst_s, rate)], self.duration_s, seed)


@dataclass
class ModeRound:
    records: list[RequestRecord]
    duration_s: float
    window: tuple[float, float]       # monotonic start and end, for the producer's throughput
    engine: dict = field(default_factory=dict)
    producer_alone_tokens_per_s: float | None = None   # median over the idle windows either side
    producer: dict = field(default_factory=dict)       # producer_meter.summarize of the mode's windows
    alone: dict = field(default_factory=dict)          # ... and of the idle windows either side
    windows: dict = field(default_factory=dict)        # {"mode": [...], "alone": [...]}: Window.compact rows


class Processes:
    """The coordinator and producer processes of a run, always stopped at its end."""

    def __init__(self, scenario: BurstScenario, log) -> None:
        self.scenario = scenario
        self.log = log
        self.procs: list[subprocess.Popen] = []
        self.url: str | None = None
        self.producer_rows: list[dict] = []
        self.producer_core: int | None = None
        self.consumer_core: int | None = None
        self.pinned = False
        self.tmp = tempfile.TemporaryDirectory(prefix="backfill-burst-")

    def start(self) -> None:
        import httpx

        env = dict(os.environ)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.procs.append(subprocess.Popen([sys.executable, "-m", "backfill.offload.coordinator", "--port", str(port),
                                            "--db", os.path.join(self.tmp.name, "coordinator.sqlite")], env=env))
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise OffloadError("the offload coordinator did not start") from None
                time.sleep(0.1)
        if not self.scenario.producer:
            return
        cmd = [sys.executable, "-m", "backfill.bench.producer", "--coordinator", self.url,
               "--lend-mb", str(self.scenario.lend_mb)] + (["--tiny"] if self.scenario.producer_tiny else [])
        producer = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        self.procs.append(producer)
        ready = json.loads(producer.stdout.readline() or "{}")
        if not ready.get("ready"):
            raise OffloadError("the producer engine did not start")
        if self.scenario.pin_cores:
            # Pinned once both processes run every thread they start early (the coordinator's
            # request worker among them); threads started later inherit the mask.
            self.pinned = pin_apart(producer.pid, self.procs[0].pid)
            if self.pinned:
                self.producer_core = sorted(os.sched_getaffinity(producer.pid))[0]
                self.consumer_core = sorted(os.sched_getaffinity(0))[0]
        self.log(f"producer engine: pid {producer.pid}, lends {self.scenario.lend_mb:.0f} MB ({ready['segment']})")
        threading.Thread(target=self._read_producer, args=(producer,), daemon=True).start()

    def _read_producer(self, producer: subprocess.Popen) -> None:
        for line in producer.stdout:
            row = json.loads(line)
            if "tokens" in row:
                if self.producer_core is not None:
                    row["core"] = producer_meter.core_times(self.producer_core)
                    row["neighbour"] = producer_meter.core_times(self.consumer_core)
                self.producer_rows.append(row)

    def producer_windows(self, window: tuple[float, float]) -> list[producer_meter.Window]:
        """The producer's one-second windows inside a monotonic time window."""
        return producer_meter.windows(list(self.producer_rows), *window)

    def thread_cpus(self) -> dict[str, list[list[int]]]:
        """The cores each thread of the coordinator and the producer may run on (the evidence
        that nothing of theirs runs where it should not)."""
        names = ("coordinator", "producer")
        return {name: thread_cpus(proc.pid) for name, proc in zip(names, self.procs) if proc.poll() is None}

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.tmp.cleanup()


def _scheduler(runner, mode: str, scenario: BurstScenario, url: str | None, tokenizer) -> Scheduler:
    from backfill.engine.tokenizer import IncrementalDetokenizer

    eos = tuple(tokenizer.stop_token_ids)
    if mode == "fcfs":
        return Scheduler(runner, FCFSPolicy(), eos_token_ids=eos,
                         detokenizer_factory=lambda: IncrementalDetokenizer(tokenizer))
    scheduler = Scheduler(runner, CFSPolicy(CFSConfig(slice_iterations=scenario.slice_iterations)),
                          eos_token_ids=eos, detokenizer_factory=lambda: IncrementalDetokenizer(tokenizer))
    scheduler.pager = make_pager(runner.kv.device, url if mode == "cfs-lent" else None,
                                 consumer="burst-consumer", poll_every=scenario.slice_iterations)
    return scheduler


CAPACITY_REQUESTS = 8
# Fewer requests than this in a run make no burst: the scenario is refused with what to change.
MIN_BURST_REQUESTS = 10
# The capacity measurement's bound: the requests finished by then are what it measures.
CAPACITY_MAX_S = 180.0
# A mode may run past its trace by this share of it (the queue a burst leaves), at least
# MIN_DRAIN_S; then what still runs is cancelled and counted unfinished.
DRAIN_SHARE = 0.5
MIN_DRAIN_S = 20.0
# Starting the coordinator and the producer engine (its model load) on a 2-core CPU.
PROCESSES_START_ESTIMATE_S = 30.0


# A sized scenario holds this many requests a mode (P99 ratios need MIN_SAMPLES_P99 completed), its
# phases lengthened in proportion up to MAX_TRACE_S when the measured rate gives fewer.
SIZED_REQUESTS = 30
MAX_TRACE_S = 150.0


def expected_requests(scenario: BurstScenario) -> float:
    """Requests the scenario's trace holds on average at its steady rate."""
    assert scenario.steady_rate_per_s is not None
    return scenario.steady_rate_per_s * (scenario.duration_s + (scenario.burst_factor - 1) * scenario.burst_s)


def lengthen_to_hold(scenario: BurstScenario, log=print) -> BurstScenario:
    """The scenario with its three phases lengthened in proportion so that it holds SIZED_REQUESTS
    (at most MAX_TRACE_S of trace); unchanged when it holds them already."""
    expected = expected_requests(scenario)
    if expected >= SIZED_REQUESTS or scenario.duration_s >= MAX_TRACE_S:
        return scenario
    factor = min(SIZED_REQUESTS / max(expected, 1e-9), MAX_TRACE_S / scenario.duration_s)
    longer = replace(scenario, steady_s=round(scenario.steady_s * factor, 1),
                     burst_s=round(scenario.burst_s * factor, 1), after_s=round(scenario.after_s * factor, 1))
    log(f"at this rate a {scenario.duration_s:g} s trace holds {expected:.1f} requests: lengthened to "
        f"{longer.steady_s:g} + {longer.burst_s:g} + {longer.after_s:g} s ({expected_requests(longer):.0f} requests; "
        f"P99 ratios need {MIN_SAMPLES_P99} completed in each mode)")
    return longer


def drain_cap_s(scenario: BurstScenario) -> float:
    """How long a mode may run past its trace before what still runs is cancelled."""
    return max(MIN_DRAIN_S, DRAIN_SHARE * scenario.duration_s)


def estimate_s(scenario: BurstScenario, modes: tuple[str, ...]) -> float:
    """The longest the run takes once the consumer is measured: warm-up, the producer alone before
    the first mode and after each, and every mode of every round at most its trace plus its drain."""
    idle = scenario.producer_idle_s * (1 + len(modes) * scenario.rounds) if scenario.producer else 0.0
    return scenario.warmup_s + idle + scenario.rounds * len(modes) * (scenario.duration_s + drain_cap_s(scenario))


def measure_capacity(runner, scenario: BurstScenario, prompts: PromptSource, plen, olen, tokenizer,
                     log=print) -> float:
    """Requests per second the consumer completes with CAPACITY_REQUESTS of them arriving at once,
    FCFS on the scenario's own memory (the batch it can hold), within CAPACITY_MAX_S."""
    workload = build_workload(prompts, np.zeros(CAPACITY_REQUESTS), plen, olen, scenario.seed + 2000,
                              name="capacity")
    scheduler = run_on_torch_thread(_scheduler, runner, "fcfs", scenario, None, tokenizer)
    with Heartbeat(log, "measuring the consumer", lambda: _status(scheduler, CAPACITY_REQUESTS)):
        records, _, (started, ended) = asyncio.run(_run(AsyncEngine(scheduler, tokenizer), workload,
                                                        max_duration_s=CAPACITY_MAX_S))
    done = [r for r in records if r.end_s is not None and r.error is None and not r.cancelled]
    if not done:
        raise WorkloadError(f"the consumer finished none of {CAPACITY_REQUESTS} requests in {CAPACITY_MAX_S:g} s: "
                            "this machine is too busy for the burst benchmark now (give --rate to skip the "
                            "measurement, or run it on a quieter machine)")
    return len(done) / max(max(r.end_s for r in done) - min(r.send_s or 0.0 for r in done), 1e-3)


def _status(scheduler: Scheduler, requests: int) -> str:
    stats = scheduler.stats
    return (f"{stats.finished['online']}/{requests} requests finished, {stats.output_tokens['online']} tokens, "
            f"{stats.preempted_requests} preemptions")


async def _run(engine: AsyncEngine, workload: Workload, max_duration_s: float | None = None
               ) -> tuple[list[RequestRecord], float, tuple[float, float]]:
    await engine.start()
    started = time.monotonic()
    try:
        run = await run_workload(InProcessTarget(engine), workload, progress=False, drain_offline=True,
                                 max_duration_s=max_duration_s)
    finally:
        await engine.stop()
    return run.records, run.duration_s, (started, time.monotonic())


def _pager_counters(pager: KVPager | None) -> dict:
    if pager is None:
        return {}
    s, store = pager.stats, pager.store.stats
    out = {"pages_out": s.pages_out, "pages_in": s.pages_in, "tokens_paged_out": s.tokens_out,
           "bytes_paged_out": s.bytes_out, "paging_s": s.paging_s, "peak_swap_bytes": s.peak_bytes,
           "fell_back_to_host": store.fell_back, "vacated": store.vacated}
    lender = pager.store.lender
    if lender is not None and hasattr(lender, "close"):
        lender.close()
    return out


def summarize(records: list[RequestRecord], duration_s: float, burst: tuple[float, float]) -> dict:
    metrics = compute_metrics(records, duration_s=duration_s)
    in_burst = [r for r in records if r.scheduled_s is not None and burst[0] <= r.scheduled_s < burst[1]]
    on = metrics.online
    return {"requests": on.requests, "completed": on.completed, "ttft_ms": asdict(on.ttft_ms),
            "tpot_ms": asdict(on.tpot_ms), "e2e_ms": asdict(on.e2e_ms),
            "burst_ttft_ms": asdict(Summary.of(r.ttft_ms for r in in_burst)),
            "output_tokens_per_s": on.tokens_per_s, "duration_s": duration_s}


def run_burst_bench(scenario: BurstScenario = BurstScenario(), modes: tuple[str, ...] = MODES,
                    log=print, checkpoint: Callable[[dict], None] | None = None) -> dict:
    """Every mode in every round; `checkpoint` gets the report so far after each mode (a run cut
    short keeps what it measured)."""
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise WorkloadError(f"unknown burst modes {unknown}; choose from {', '.join(MODES)}")
    if "cfs-lent" in modes and not scenario.producer:
        raise WorkloadError("cfs-lent needs the producer engine (drop --no-producer)")
    from backfill.engine.weights import load_model
    from backfill.serving.config import ServingConfig
    from backfill.serving.build import build_runner

    log(f"bench burst: {len(modes)} modes x {scenario.rounds} round(s), each a {scenario.duration_s:g} s trace "
        f"(at most {drain_cap_s(scenario):g} s more to drain); first the model, the producer and one measurement "
        f"of the consumer size it to this machine, then the estimate")
    with Heartbeat(log, "loading the model (a first run builds backfill's C++ kernels: minutes on a busy 2-core CPU)"):
        loaded = load_model(None)
        tokenizer = loaded.tokenizer
        runner = run_on_torch_thread(build_runner, loaded.config, loaded.weights,
                                     ServingConfig(policy="fcfs", kv_cache_gb=scenario.kv_cache_gb, device="cpu",
                                                   decode_attention=scenario.decode_attention,
                                                   threads=scenario.threads))
    log(f"model {loaded.config.name}: KV pool {runner.kv.num_blocks} blocks of {runner.kv.block_size} tokens "
        f"({runner.kv.nbytes / 2**20:.0f} MB)")
    prompts = PromptSource(tokenizer, seed=scenario.seed)
    plen, olen = parse_length_spec(scenario.prompt_len), parse_length_spec(scenario.output_len)
    processes = Processes(scenario, log)
    try:
        with Heartbeat(log, "starting the coordinator" + (" and the producer engine" if scenario.producer else "")):
            processes.start()
        if processes.pinned and scenario.threads is None:
            # One torch thread per core left to the consumer: more threads than cores make every
            # operator's threads wait on each other (docs/offload.md).
            threads = len(os.sched_getaffinity(0))
            run_on_torch_thread(_set_threads, threads)
            log(f"consumer pinned to {threads} core(s) beside the producer's: {threads} torch thread(s)")
        if scenario.steady_rate_per_s is None:
            log(f"measuring this machine: {CAPACITY_REQUESTS} requests at once on the consumer, beside the running "
                f"producer (the steady rate follows from it; at most {CAPACITY_MAX_S:g} s)")
            capacity = measure_capacity(runner, scenario, prompts, plen, olen, tokenizer, log)
            scenario = replace(scenario, steady_rate_per_s=round(scenario.steady_load * capacity, 3))
            log(f"this machine serves {capacity:.2f} requests/s: steady {scenario.steady_rate_per_s:g}/s "
                f"({scenario.steady_load:.0%}), burst {scenario.steady_rate_per_s * scenario.burst_factor:g}/s "
                f"for {scenario.burst_s:g} s (--rate sets it)")
            scenario = lengthen_to_hold(scenario, log)
            expected = expected_requests(scenario)
            if expected < MIN_BURST_REQUESTS:
                raise WorkloadError(
                    f"at {capacity:.3f} requests/s measured on this machine, even a {scenario.duration_s:g} s scenario "
                    f"holds {expected:.1f} requests (a burst needs {MIN_BURST_REQUESTS}): give shorter requests "
                    "(--output-len fixed:16) or run it on a quieter or faster machine")
        log(f"estimate: at most {estimate_s(scenario, modes):.0f} s from here ({scenario.warmup_s:g} s warm-up, "
            f"the producer alone {scenario.producer_idle_s:g} s before the first mode and after each, "
            f"{len(modes) * scenario.rounds} modes of at most {scenario.duration_s + drain_cap_s(scenario):g} s)")
        if scenario.warmup_s > 0:
            warm = build_workload(prompts, np.arange(0, scenario.warmup_s, 1 / scenario.steady_rate_per_s), plen, olen,
                                  scenario.seed + 1000, name="warm-up")
            scheduler = run_on_torch_thread(_scheduler, runner, "cfs-host", scenario, None, tokenizer)
            with Heartbeat(log, "warm-up", lambda: _status(scheduler, len(warm.requests))):
                asyncio.run(_run(AsyncEngine(scheduler, tokenizer), warm, max_duration_s=scenario.warmup_s
                                 + drain_cap_s(scenario)))
        parts: dict[str, list[ModeRound]] = {m: [] for m in modes}
        thread_cpus_at_start = processes.thread_cpus() if processes.pinned else {}
        alone_before = _producer_alone(processes, scenario, log)
        for k in range(scenario.rounds):
            seed = scenario.seed + k
            workload = build_workload(prompts, scenario.arrivals(seed), plen, olen, seed, name=f"burst-{k}")
            for mode in modes:
                scheduler = run_on_torch_thread(_scheduler, runner, mode, scenario, processes.url, tokenizer)
                log(f"== {mode} (round {k + 1}/{scenario.rounds}): {len(workload.requests)} requests over "
                    f"{scenario.duration_s:g} s")
                with Heartbeat(log, mode, lambda: _status(scheduler, len(workload.requests)),
                               expected_s=scenario.duration_s):
                    records, duration_s, window = asyncio.run(_run(
                        AsyncEngine(scheduler, tokenizer), workload,
                        max_duration_s=scenario.duration_s + drain_cap_s(scenario)))
                stats = scheduler.stats
                engine = {"preempted_requests": stats.preempted_requests, "recomputed_tokens": stats.recomputed_tokens,
                          "restored_tokens": stats.restored_tokens, "steps": stats.steps, "busy_s": stats.busy_s,
                          "unfinished_requests": len(workload.requests) - sum(
                              1 for r in records if r.end_s is not None and not r.cancelled and r.error is None),
                          **_pager_counters(scheduler.pager)}
                if isinstance(scheduler.policy, CFSPolicy):
                    engine["cfs_paging_share"] = scheduler.policy.paging_share
                    engine["cfs_fcfs_fallback_steps"] = scheduler.policy.fcfs_fallback_steps
                mode_windows = processes.producer_windows(window)
                producer = producer_meter.summarize(mode_windows)
                rate = producer["tokens_per_s"]
                engine["producer_tokens_per_s"] = rate
                if processes.pinned:
                    engine["thread_cpus"] = processes.thread_cpus()
                alone_after = _producer_alone(processes, scenario, log)
                alone = producer_meter.summarize(alone_before + alone_after)
                parts[mode].append(ModeRound(records, duration_s, window, engine, alone["tokens_per_s"],
                                             producer, alone,
                                             {"mode": [w.compact() for w in mode_windows],
                                              "alone": [w.compact() for w in alone_before + alone_after]}))
                alone_before = alone_after
                if checkpoint is not None:
                    checkpoint({**report(scenario, {m: r for m, r in parts.items() if r}),
                                "producer_pinned_apart": processes.pinned, "thread_cpus": thread_cpus_at_start,
                                "partial": True})
                p99 = summarize(records, duration_s, _burst(scenario))["ttft_ms"]["p99"]
                cut = (f", {engine['unfinished_requests']} unfinished (cut at "
                       f"{scenario.duration_s + drain_cap_s(scenario):g} s)" if engine["unfinished_requests"] else "")
                log(f"   p99 TTFT {'-' if p99 is None else f'{p99:.0f}'} ms{cut}, producer {_brief(producer)}")
    finally:
        processes.stop()
    out = report(scenario, parts)
    out["producer_pinned_apart"] = processes.pinned
    out["thread_cpus"] = thread_cpus_at_start
    return out


def _set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def _producer_alone(processes: Processes, scenario: BurstScenario, log) -> list[producer_meter.Window]:
    """The producer's windows over an idle period of the consumer (the baseline of its loss)."""
    if not scenario.producer or scenario.producer_idle_s <= 0:
        return []
    log(f"   the producer alone for {scenario.producer_idle_s:g} s (the consumer idle)")
    started = time.monotonic()
    if processes.pinned:
        # The consumer's core kept busy by a loop that touches no memory: other people's jobs
        # on this shared machine then stay off it, as while the consumer computes, and do not
        # contend for the producer's caches and memory only while it is "alone" (AQUA §9.3's
        # producer alone has no neighbour at all).
        with Heartbeat(log, "the producer alone"):
            while time.monotonic() - started < scenario.producer_idle_s:
                pass
    else:
        with Heartbeat(log, "the producer alone"):
            time.sleep(scenario.producer_idle_s)
    ws = processes.producer_windows((started, time.monotonic()))
    log(f"   producer alone: {_brief(producer_meter.summarize(ws))}")
    return ws


def _brief(s: dict) -> str:
    def fmt(key: str, scale: float = 1.0, digits: int = 1) -> str:
        return "-" if s.get(key) is None else f"{scale * s[key]:.{digits}f}"

    return (f"{fmt('tokens_per_s')} tok/s over {s['windows']} windows, step {fmt('step_ms', digits=2)} ms "
            f"(compute {fmt('run_ms_per_step', digits=2)}), waiting for its core {fmt('wait_share', 100)}%, "
            f"core to others {fmt('core_other_share', 100)}% (nice {fmt('nice_share', 100)}%, "
            f"steal {fmt('steal_share', 100)}%), nice jobs on the consumer's core {fmt('neighbour_nice_share', 100)}%")


def _burst(scenario: BurstScenario) -> tuple[float, float]:
    return scenario.steady_s, scenario.steady_s + scenario.burst_s


def report(scenario: BurstScenario, parts: dict[str, list[ModeRound]]) -> dict:
    modes = {}
    for mode, rounds in parts.items():
        records = [r for part in rounds for r in part.records]
        # Rounds pooled: every round replays the same scenario, so request times stay comparable.
        summary = summarize(records, max(p.duration_s for p in rounds), _burst(scenario))
        rates = [p.engine["producer_tokens_per_s"] for p in rounds if p.engine["producer_tokens_per_s"]]
        summary["producer_tokens_per_s"] = float(np.median(rates)) if rates else None
        losses = _present([producer_meter.loss(p.engine["producer_tokens_per_s"], p.producer_alone_tokens_per_s)
                           for p in rounds])
        summary["producer_loss_vs_alone_by_round"] = losses
        summary["producer_loss_vs_alone"] = float(np.median(losses)) if losses else None
        summary["engine"] = [p.engine for p in rounds]
        summary["rounds"] = [{"duration_s": p.duration_s, "window": list(p.window),
                              "producer_alone_tokens_per_s": p.producer_alone_tokens_per_s,
                              "producer": p.producer, "producer_alone": p.alone, "producer_windows": p.windows,
                              "records": [_compact(r) for r in p.records]} for p in rounds]
        modes[mode] = summary
    out = {"scenario": asdict(scenario), "modes": modes}
    lent_rounds, host_rounds = parts.get("cfs-lent", []), parts.get("cfs-host", [])
    lending = _present([producer_meter.loss(a.engine["producer_tokens_per_s"], b.engine["producer_tokens_per_s"])
                        for a, b in zip(lent_rounds, host_rounds)])
    if lending:
        # Paired within each round (the modes ran minutes apart at most), then the median.
        out["producer_lending_loss_by_round"] = lending
        out["producer_lending_loss"] = float(np.median(lending))
    # The same, each mode first taken relative to the producer alone either side of it, so a
    # machine that drifts between the two modes (other work arriving or leaving) cancels out.
    relative = _present([producer_meter.loss(_relative(a), _relative(b)) for a, b in zip(lent_rounds, host_rounds)])
    if relative:
        out["producer_lending_loss_vs_alone_by_round"] = relative
        out["producer_lending_loss_vs_alone"] = float(np.median(relative))
    if "fcfs" in modes:
        for mode in ("cfs-host", "cfs-lent"):
            if mode in modes and modes[mode]["ttft_ms"]["p99"] and modes["fcfs"]["ttft_ms"]["p99"]:
                modes[mode]["p99_ttft_vs_fcfs"] = modes[mode]["ttft_ms"]["p99"] / modes["fcfs"]["ttft_ms"]["p99"]
                modes[mode]["p99_tpot_vs_fcfs"] = modes[mode]["tpot_ms"]["p99"] / modes["fcfs"]["tpot_ms"]["p99"]
                modes[mode]["p50_e2e_vs_fcfs"] = modes[mode]["e2e_ms"]["p50"] / modes["fcfs"]["e2e_ms"]["p50"]
    return out


def _present(losses: list[float | None]) -> list[float]:
    """The rounds' losses where both rates were measured."""
    return [x for x in losses if x is not None]


def _relative(part: ModeRound) -> float | None:
    rate, alone = part.engine.get("producer_tokens_per_s"), part.producer_alone_tokens_per_s
    return rate / alone if rate and alone else None


def _compact(record: RequestRecord) -> dict:
    """A record without its per-chunk times (TTFT, TPOT and completion need none of them)."""
    out = record.to_json()
    out["chunk_times_s"], out["chunk_tokens"] = [], []
    return out


def pool(results: list[dict]) -> dict:
    """Runs of one scenario made apart (each its own rounds), reported as one: every round of
    every run, request records pooled, losses paired within their rounds as before."""
    if not results:
        raise WorkloadError("nothing to pool")
    ignore = {"seed", "rounds"}
    first = {k: v for k, v in results[0]["scenario"].items() if k not in ignore}
    parts: dict[str, list[ModeRound]] = {}
    for result in results:
        if {k: v for k, v in result["scenario"].items() if k not in ignore} != first:
            raise WorkloadError("pooled runs must share one scenario (seed and rounds aside)")
        for mode, m in result["modes"].items():
            if "rounds" not in m:
                raise WorkloadError(f"{mode}: this result has no request records to pool")
            for rnd, engine in zip(m["rounds"], m["engine"]):
                parts.setdefault(mode, []).append(ModeRound(
                    [RequestRecord.from_json(r) for r in rnd["records"]], rnd["duration_s"], tuple(rnd["window"]),
                    engine, rnd["producer_alone_tokens_per_s"], rnd.get("producer", {}), rnd.get("producer_alone", {}),
                    rnd.get("producer_windows", {})))
    scenario = BurstScenario(**{**first, "rounds": sum(len(r) for r in parts.values()) // max(len(parts), 1),
                                "seed": results[0]["scenario"]["seed"]})
    out = report(scenario, parts)
    out["pooled_runs"] = len(results)
    return out


def _num(x: float | None, spec: str, scale: float = 1.0) -> str:
    """x in the format spec; `-` in its width when nothing was measured."""
    return format("-", spec.split(".")[0]) if x is None else format(scale * x, spec)


def verdicts(result: dict) -> list[Verdict]:
    """AQUA §9.3's claim for each CFS mode: its P99 TTFT under the burst below FCFS's, judged from
    enough completed requests in both modes."""
    out = []
    fcfs = result["modes"].get("fcfs")
    for mode in ("cfs-host", "cfs-lent"):
        m = result["modes"].get(mode)
        if m is None or fcfs is None:
            continue
        n = min(m.get("completed", 0), fcfs.get("completed", 0))
        out.append(Verdict(f"{mode}: P99 TTFT / FCFS's", m.get("p99_ttft_vs_fcfs"), 1.0, samples=n,
                           min_samples=MIN_SAMPLES_P99, sample_unit="completed requests (fewer of the two modes)"))
    return out


def closing(result: dict) -> str:
    """Which mode had the lowest P99 TTFT, on how many requests, and the verdicts read in a sentence."""
    ranked = sorted(((m["ttft_ms"]["p99"], mode, m["completed"]) for mode, m in result["modes"].items()
                     if m["ttft_ms"]["p99"] is not None))
    if not ranked:
        return "No mode completed a request: no figure to read."
    p99, mode, n = ranked[0]
    others = ", ".join(f"{o} {q / 1e3:.2f} s (n={c})" for q, o, c in ranked[1:])
    unfinished = {mode: sum(e.get("unfinished_requests", 0) for e in m["engine"])
                  for mode, m in result["modes"].items()}
    cut = [f"{mode} left {k} unfinished" for mode, k in unfinished.items() if k]
    return (f"Lowest P99 TTFT under the burst: {mode}, {p99 / 1e3:.2f} s over {n} completed requests"
            + (f" (against {others})" if others else "") + ". " + closing_sentence(verdicts(result))
            + (f" Cut at the announced time: {', '.join(cut)}." if cut else ""))


def format_table(result: dict) -> str:
    rows = ["mode       p50/p99 TTFT ms   burst p99 TTFT  p50/p99 TPOT ms   p50/p99 E2E s   "
            "paged out  producer tok/s"]
    for mode, m in result["modes"].items():
        paged = sum(e.get("pages_out", 0) for e in m["engine"])
        prod = m["producer_tokens_per_s"]
        rows.append(f"{mode:<10} {_num(m['ttft_ms']['p50'], '>7.0f')}/{_num(m['ttft_ms']['p99'], '<8.0f')} "
                    f"{_num(m['burst_ttft_ms']['p99'], '>10.0f')}     {_num(m['tpot_ms']['p50'], '>6.1f')}/"
                    f"{_num(m['tpot_ms']['p99'], '<8.1f')} {_num(m['e2e_ms']['p50'], '>6.1f', 1e-3)}/"
                    f"{_num(m['e2e_ms']['p99'], '<7.1f', 1e-3)} {paged:>8}   "
                    f"{'-' if prod is None else f'{prod:.1f}'}")
    for mode, m in result["modes"].items():
        for k, rnd in enumerate(m["rounds"]):
            if rnd.get("producer", {}).get("windows"):
                rows.append(f"producer in {mode} (round {k + 1}): {_brief(rnd['producer'])}")
            if rnd.get("producer_alone", {}).get("windows"):
                rows.append(f"   alone either side: {_brief(rnd['producer_alone'])}")
    for mode in ("cfs-host", "cfs-lent"):
        m = result["modes"].get(mode, {})
        if "p99_ttft_vs_fcfs" in m:
            n = min(m.get("completed", 0), result["modes"]["fcfs"].get("completed", 0))
            if n < MIN_SAMPLES_P99:
                rows.append(f"{mode} against FCFS: n/a (too few samples: {n} completed requests, P99 ratios need "
                            f"{MIN_SAMPLES_P99})")
                continue
            rows.append(f"{mode}: P99 TTFT {m['p99_ttft_vs_fcfs']:.3f}x FCFS's (1/{1 / m['p99_ttft_vs_fcfs']:.1f}), "
                        f"P99 TPOT {m['p99_tpot_vs_fcfs']:.2f}x, P50 completion {m['p50_e2e_vs_fcfs']:.2f}x "
                        f"(n={n} requests each)")
    if "producer_lending_loss" in result:
        by_round = ", ".join(f"{100 * x:.1f}" for x in result["producer_lending_loss_by_round"])
        loss = result["producer_lending_loss"]
        rows.append(f"producer loss from lending (cfs-lent vs cfs-host, paired per round, median): "
                    f"{100 * loss:.1f}% (rounds: {by_round})"
                    + (" -- below zero: lending cost the producer nothing this run could measure" if loss < 0
                       else ""))
    if "producer_lending_loss_vs_alone" in result:
        by_round = ", ".join(f"{100 * x:.1f}" for x in result["producer_lending_loss_vs_alone_by_round"])
        rows.append(f"the same, each mode relative to the producer alone either side of it: "
                    f"{100 * result['producer_lending_loss_vs_alone']:.1f}% (rounds: {by_round})")
    for mode, m in result["modes"].items():
        if m.get("producer_loss_vs_alone") is not None:
            by_round = ", ".join(f"{100 * x:.1f}" for x in m["producer_loss_vs_alone_by_round"])
            rows.append(f"producer loss during {mode} vs the producer alone (median): "
                        f"{100 * m['producer_loss_vs_alone']:.1f}% (rounds: {by_round})")
    rows += ["  " + v.describe() for v in verdicts(result)]
    rows.append(closing(result))
    return "\n".join(rows)


def save(result: dict, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1, default=str))
