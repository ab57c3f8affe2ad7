"""`backfill sim coserve`: the co-serving benchmark's scenario, replayed on the simulated runner.

The same workload as `backfill bench coserve` (backfill/bench/coserve_bench.py: one gamma trace per
round at a share of online capacity, a closed-loop offline backlog, the modes back to back, SLOs
from online-only's first round) goes through the real Scheduler and policies, with each step
costed by a StepCost on a virtual clock (backfill/bench/sim/runner.py). A 240-second scenario takes
about a minute instead of 16, the same seed gives the same figures, and the machine can be one we
do not have. The results pool and report exactly as the benchmark's, so the two can be compared
row by row.

What a simulation cannot show: the host's own time (Python between steps, unless
step_overhead_ms puts a number on it), host copies of checkpoints, and a noisy machine beyond the
lognormal noise_cv gives each step.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace
from pathlib import Path

from backfill.bench.coserve_bench import MODES, CoserveRoundResult, engine_counters, make_workload, run_in_rounds
from backfill.bench.scenario import CoserveScenario
from backfill.bench.driver import RunResult
from backfill.bench.metrics import RequestRecord
from backfill.bench.modes import ModeSpec
from backfill.bench.report import ModeResult, write_report
from backfill.bench.workload import BenchRequest, Workload
from backfill.engine.byte_tokenizer import ByteTokenizer
from backfill.engine.config import ModelConfig
from backfill.engine.kv_pool import KVBlockPool
from backfill.sampling_params import SamplingParams
from backfill.engine.weights import read_model_config
from backfill.errors import BackfillError, InvalidRequestError
from backfill.policy.latency_model import LatencyModel
from backfill.types import SLO, GenerationRequest, RequestClass
from backfill.serving.config import ServingConfig
from backfill.serving.build import build_scheduler, default_profile_path
from backfill.serving.scheduler import Scheduler
from backfill.bench.sim.runner import SimulatedRunner, StepCost, VirtualClock


@dataclass(frozen=True)
class SimMachine:
    """The simulated machine: what its steps cost, and what the runner adds around them."""

    cost: StepCost
    num_kv_blocks: int
    block_size: int = 16
    step_overhead_ms: float = 0.0   # host time per step the cost table leaves out
    noise_cv: float = 0.0           # lognormal spread of each step's time (mean 1)
    slowdown_factor: float = 2.0    # steps cost this much more from the scenario's slowdown_at_s on

    def __post_init__(self) -> None:
        if self.num_kv_blocks < 1 or self.block_size < 1:
            raise InvalidRequestError("the simulated machine needs num_kv_blocks >= 1 and block_size >= 1")
        if not self.step_overhead_ms >= 0 or not self.noise_cv >= 0:
            raise InvalidRequestError("step_overhead_ms and noise_cv must be >= 0")
        if not self.slowdown_factor > 0:
            raise InvalidRequestError("slowdown_factor must be > 0")


@dataclass(frozen=True)
class _SlowedFrom:
    """A machine whose steps cost `factor` times more from at_s on (a noisy neighbour)."""

    cost: StepCost
    clock: VirtualClock
    at_s: float
    factor: float

    def estimate_ms(self, shape) -> float:
        return self.cost.estimate_ms(shape) * (self.factor if self.clock() >= self.at_s else 1.0)


class _Replay:
    """One mode's run of one workload on a fresh scheduler: open-loop arrivals, a closed-loop backlog."""

    def __init__(self, workload: Workload, make_scheduler, machine: SimMachine, real_config: ModelConfig,
                 seed: int, slowdown_at_s: float | None = None) -> None:
        self.clock = VirtualClock()
        cost = machine.cost
        if slowdown_at_s is not None:
            cost = _SlowedFrom(cost, self.clock, slowdown_at_s, machine.slowdown_factor)
        self.runner = SimulatedRunner(real_config, machine.num_kv_blocks, cost, self.clock,
                                      block_size=machine.block_size, on_time=self._deliver,
                                      step_overhead_ms=machine.step_overhead_ms, noise_cv=machine.noise_cv,
                                      seed=seed)
        self.scheduler: Scheduler = make_scheduler(self.runner)
        self.scheduler.clock = self.clock
        self.workload = workload
        self.records: dict[str, RequestRecord] = {}
        self._due = [(r.arrival_s, i, r) for i, r in enumerate(workload.requests)]
        heapq.heapify(self._due)
        self._backlogs = [(b, iter(b.requests)) for b in workload.offline_backlogs]
        self._open_online = 0
        self._outstanding: dict[str, int] = {}  # client -> requests sent and not finished
        self.mode_busy_s: dict[str, float] = {}

    def _submit(self, request: BenchRequest, now_s: float) -> None:
        self.records[request.request_id] = RequestRecord(
            request.request_id, request.request_class, request.client, scheduled_s=request.arrival_s, send_s=now_s,
            prompt_tokens=request.prompt_tokens)
        self._outstanding[request.client] = self._outstanding.get(request.client, 0) + 1
        if request.request_class is RequestClass.ONLINE:
            self._open_online += 1
        sampling = SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=request.ignore_eos)
        self.scheduler.add(GenerationRequest(list(request.prompt_token_ids), sampling, request.request_class,
                                             request.request_id, arrival_time=now_s))

    def _deliver(self, now_s: float) -> None:
        while self._due and self._due[0][0] <= now_s:
            arrival_s, _, request = heapq.heappop(self._due)
            self._submit(request, arrival_s)

    def _refill(self, now_s: float) -> None:
        """Keep each backlog's requests outstanding until the run's duration has passed."""
        if self.workload.duration_s is not None and now_s >= self.workload.duration_s:
            return
        for backlog, pool in self._backlogs:
            for _ in range(backlog.concurrency - self._outstanding.get(backlog.client, 0)):
                request = next(pool, None)
                if request is None:
                    break
                self._submit(request, now_s)

    def _done(self) -> bool:
        ended = self.workload.duration_s is None or self.clock() >= self.workload.duration_s
        return ended and not self._due and self._open_online == 0

    def run(self) -> CoserveRoundResult:
        self._refill(0.0)
        while not self._done():
            self._deliver(self.clock())
            if not self.scheduler.has_work():
                if not self._due:
                    break
                self.clock.advance_to(self._due[0][0])
                continue
            before = self.clock()
            events = self.scheduler.step()
            mode = self.scheduler.stats.last_step_mode
            self.mode_busy_s[mode] = self.mode_busy_s.get(mode, 0.0) + self.clock() - before
            for event in events:
                self._record(event)
            self._refill(self.clock())
            if self.clock() == before and not events:  # nothing could run: wait for the next arrival
                self.clock.advance_to(self._due[0][0] if self._due else self.clock() + 1e-3)
        end_s = self.clock()
        for record in self.records.values():
            if record.end_s is None:
                record.cancelled = True  # offline work in flight when the run ended
        return CoserveRoundResult(RunResult(sorted(self.records.values(), key=lambda r: r.send_s), duration_s=end_s),
                           engine_counters(self.scheduler.stats, self.mode_busy_s, policy=self.scheduler.policy))

    def _record(self, event) -> None:
        record = self.records[event.request_id]
        if event.token_ids:
            if record.first_token_s is None:
                record.first_token_s = event.time
            record.chunk_times_s.append(event.time)
            record.chunk_tokens.append(len(event.token_ids))
            record.output_tokens += len(event.token_ids)
        if event.finished:
            record.end_s = event.time
            self._outstanding[record.client] -= 1
            if record.request_class is RequestClass.ONLINE:
                self._open_online -= 1

def simulate_coserve(scenario: CoserveScenario, machine: SimMachine, latency: LatencyModel, real_config: ModelConfig,
                     serving: ServingConfig = ServingConfig(), modes: tuple[str, ...] = MODES,
                     out_dir: str | Path | None = None, log=print) -> dict[str, ModeResult]:
    """Every mode on the scenario's rounds, as `backfill bench coserve` runs them; `latency` is the
    profile the policies plan with (what the machine's steps cost is `machine.cost`)."""
    tokenizer = ByteTokenizer()

    def run_mode(spec: ModeSpec, round_scenario: CoserveScenario, slo: SLO, k: int) -> tuple[CoserveRoundResult, dict]:
        # Load is a share of the simulated machine's capacity, as the benchmark's is of the real one's.
        workload = make_workload(round_scenario, tokenizer, machine.cost, with_offline=spec.with_offline)
        cfg = spec.serving(serving, coserve=replace(serving.coserve, slo=slo), block_size=machine.block_size)

        def make_scheduler(runner):
            return build_scheduler(runner, cfg, None, real_config.name, latency)

        part = _Replay(workload, make_scheduler, machine, real_config, seed=k,
                       slowdown_at_s=round_scenario.slowdown_at_s).run()
        return part, {"model": real_config.name, "simulated": True, "workload": dict(workload.meta)}

    results = run_in_rounds(scenario, modes, run_mode)
    if out_dir is not None:
        files = write_report(results, out_dir)
        log(f"report: {files.markdown}")
    return results


def load_inputs(serving: ServingConfig, profile: str | Path | None = None, machine: str | Path | None = None,
                step_overhead_ms: float = 0.0, noise_cv: float = 0.0,
                slowdown_factor: float = 2.0) -> tuple[ModelConfig, LatencyModel, SimMachine]:
    """The model's shape, the profile the policies plan with (by default the one `backfill profile`
    saved for these options) and the machine (by default the profile itself, with the KV pool the
    serving config sizes). Without mixed-step graphs (serving.mixed_graphs or cuda_graphs off), both
    price steps with prompt chunks as eager ones, as an engine without them runs them."""
    config = read_model_config(serving.model)
    path = Path(profile) if profile else default_profile_path(config.name, serving)
    if not path.is_file():
        raise BackfillError(f"no latency profile at {path}: run `backfill profile` with the same model options, "
                            "or pass --profile")
    latency = LatencyModel.load(path)
    cost = LatencyModel.load(machine) if machine else latency
    if not (serving.cuda_graphs and serving.mixed_graphs):
        latency, cost = latency.without_mixed_graphs(), cost.without_mixed_graphs()
    blocks = KVBlockPool.blocks_in_memory(config, int(serving.kv_cache_gb * 2**30), serving.block_size,
                                          serving.torch_dtype)
    return config, latency, SimMachine(cost, blocks, serving.block_size, step_overhead_ms, noise_cv, slowdown_factor)
