"""`backfill bench coserve`: the co-serving headline scenario, every mode back to back.

One gamma trace of online requests (CV 1 by default) at a fraction of online capacity, plus a
closed-loop backlog of offline requests, replayed against each mode in turn on the same model:

  online-only  the online trace alone (the latency baseline; SLOs are calibrated from it)
  fcfs         one queue, no classes
  priority     online first at iteration level, offline fills the rest (ConServe's vLLM++)
  coserve      ConServe: SLO budget, offline batching mode, layer-safepoint preemption

Online capacity is the rate at which one request at a time would keep the engine busy
(1 / solo service time, from the latency profile), so a load of 0.3 keeps the online-only
engine busy about 30% of the time. The SLOs given to the policies are online-only's own P99
TTFT and TPOT from the same run ("keep my latency where it is alone") unless set explicitly.

On a shared machine, speed drifts over minutes; a ratio between two modes run minutes apart
measures that drift too. --rounds R splits the run into R rounds, each a fresh trace of
duration/R seconds (seed + round) replayed against every mode in turn, and pools each mode's
rounds. The SLOs come from the first round's online-only run.

Every run but the first follows minutes of a busy engine, and a CPU serves the same trace slower
then than right after loading, so an unwarmed round 0 favours the baseline. A warm-up of offline
batching (--warmup-s, 30 s by default) puts the first run in the state of the others; its results
are discarded.

With --url, the same workload is sent to an OpenAI-compatible server instead (one mode,
named by --label), measured the same way: the trace alone, then with the backlog. --phase
online-only / coserved runs one of the two, the first writing --baseline-file and the second
reading it, so that the server can be restarted between them with SLOs from the first
(bench/http_baseline.py).
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

from backfill.bench.arrivals import gamma_arrivals
from backfill.bench.ceiling import offline_ceilings
from backfill.bench.cpu_hog import hog_after
from backfill.bench.driver import RunResult, run_workload
from backfill.progress import Heartbeat
from backfill.bench.inprocess_target import InProcessTarget
from backfill.bench.lengths import parse_length_spec
from backfill.bench.metrics import RequestRecord, compute_metrics
from backfill.bench.modes import BASELINE, POLICIES, ModeSpec, parse_modes
from backfill.bench.prompts import PromptSource
from backfill.bench.scenario import CoserveScenario
from backfill.bench.verdict import MIN_SAMPLES_P99
from backfill.bench.report import ModeResult, print_summary, write_report
from backfill.bench.workload import OfflineSpec, Workload, build_workload
from backfill.errors import InvalidRequestError, WorkloadError
from backfill.policy.latency_model import BatchShape, LatencyModel
from backfill.policy.interface import SchedulingPolicy
from backfill.policy.model_error import summarize
from backfill.types import SLO
from backfill.serving.config import ServingConfig
from backfill.serving.build import build_runner, build_scheduler, load_or_profile
from backfill.serving.async_engine import AsyncEngine
from backfill.serving.stats import SchedulerStats
from backfill.serving.torch_thread import run_on_torch_thread

MODES = POLICIES


def solo_service_s(latency: LatencyModel, prompt_tokens: float, output_tokens: float) -> float:
    """Time to serve one request alone: its prefill, then one decode step per further token."""
    prefill = latency.estimate_ms(BatchShape().plus(int(prompt_tokens), 0))
    decode = latency.estimate_ms(BatchShape().plus(1, int(prompt_tokens + output_tokens / 2)))
    return (prefill + (output_tokens - 1) * decode) / 1e3


def make_workload(scenario: CoserveScenario, tokenizer, latency: LatencyModel, *, with_offline: bool) -> Workload:
    prompt_len, output_len = parse_length_spec(scenario.prompt_len), parse_length_spec(scenario.output_len)
    rate = online_rate_per_s(scenario, latency)
    arrivals = gamma_arrivals(rate, scenario.cv, scenario.seed, duration_s=scenario.duration_s)
    if len(arrivals) == 0:
        one_s = scenario.online_load / rate
        raise WorkloadError(
            f"no online request in {scenario.duration_s:g} s: the step-latency profile says one online request "
            f"takes {one_s:.1f} s alone, so load {scenario.online_load:g} is {rate:.3f} requests/s. Give a longer "
            f"--duration (about {math.ceil(MIN_ONLINE_REQUESTS * one_s / scenario.online_load)} s for "
            f"{MIN_ONLINE_REQUESTS}), or, if the profile was measured on a busy machine, measure it again on a quiet "
            "one (`backfill profile`)")
    offline = None
    if with_offline:
        offline = OfflineSpec(scenario.offline_concurrency, scenario.offline_pool,
                              parse_length_spec(scenario.offline_prompt_len),
                              parse_length_spec(scenario.offline_output_len))
    workload = build_workload(PromptSource(tokenizer, seed=scenario.seed), arrivals, prompt_len, output_len,
                              scenario.seed, offline=offline, duration_s=scenario.duration_s,
                              name=f"gamma(rate={rate:.3f}/s, cv={scenario.cv})")
    return replace(workload, meta={**workload.meta, "online_rate_per_s": rate, "online_load": scenario.online_load})


# The offline requests in flight at once should all be through their prompts within this share of
# the time online leaves over in the window, so offline output streams (and is counted) inside it.
OFFLINE_PREFILL_SHARE = 0.25
# Fewer online requests than this in a window make no latency figure worth printing.
MIN_ONLINE_REQUESTS = 5


def mean_lengths(scenario: CoserveScenario) -> tuple[float, float, float, float]:
    """Mean online prompt and output, offline prompt and output tokens of the scenario's specs."""
    import numpy as np

    rng = np.random.default_rng(scenario.seed)
    return tuple(float(np.mean(parse_length_spec(spec).sample(rng, 2000))) for spec in (
        scenario.prompt_len, scenario.output_len, scenario.offline_prompt_len, scenario.offline_output_len))


def online_rate_per_s(scenario: CoserveScenario, latency: LatencyModel) -> float:
    """The online arrival rate make_workload gives: online_load of one request served alone."""
    prompt, output, _, _ = mean_lengths(scenario)
    return scenario.online_load / solo_service_s(latency, prompt, output)


def size_offline_to_machine(scenario: CoserveScenario, latency: LatencyModel) -> CoserveScenario:
    """The scenario with its offline prompts scaled down (never up) so that the offline_concurrency
    requests in flight are through their prompts within OFFLINE_PREFILL_SHARE of the time online
    leaves over in the window, at this machine's measured step costs (the latency profile); outputs
    shrink only where one request's decode would not fit in half that time."""
    _, _, prompt, output = mean_lengths(scenario)
    chunk = 256
    prefill_ms_per_token = latency.estimate_ms(BatchShape().plus(chunk, 0)) / chunk
    decode = BatchShape()
    for _ in range(scenario.offline_concurrency):
        decode = decode.plus(1, int(prompt + output / 2))
    offline_ms = scenario.duration_s * 1e3 * (1 - min(scenario.online_load, 0.9))
    prefill_scale = min(1.0, OFFLINE_PREFILL_SHARE * offline_ms
                        / (scenario.offline_concurrency * prompt * prefill_ms_per_token))
    output_scale = min(1.0, 0.5 * offline_ms / (output * latency.estimate_ms(decode)))
    if prefill_scale >= 1.0 and output_scale >= 1.0:
        return scenario
    p, o = max(32, round(prompt * prefill_scale)), max(16, round(output * output_scale))
    return replace(scenario, offline_prompt_len=f"uniform:{p // 2}:{p + p // 2}",
                   offline_output_len=f"uniform:{o // 2}:{o + o // 2}")


def warmup_workload(scenario: CoserveScenario, tokenizer) -> Workload:
    """The offline backlog alone for scenario.warmup_s seconds, from prompts no round uses."""
    seed = scenario.seed + 10_000
    offline = OfflineSpec(scenario.offline_concurrency, scenario.offline_pool,
                          parse_length_spec(scenario.offline_prompt_len), parse_length_spec(scenario.offline_output_len))
    return build_workload(PromptSource(tokenizer, seed=seed), [], parse_length_spec(scenario.prompt_len),
                          parse_length_spec(scenario.output_len), seed, offline=offline,
                          duration_s=scenario.warmup_s, name="warm-up")


@dataclass
class CoserveRoundResult:
    """One mode's share of one round: the driver's run and the engine's counters, among them its
    preemption records (times in s since the round's t0)."""

    run: RunResult
    engine: dict = field(default_factory=dict)


async def _run_round(engine: AsyncEngine, workload: Workload, progress: bool) -> CoserveRoundResult:
    target = InProcessTarget(engine)
    await engine.start()
    try:
        run = await run_workload(target, workload, progress=progress)
    finally:
        await engine.stop()
    stats = engine.stats
    counters = engine_counters(stats, stats.mode_busy_s, run.t0_monotonic_s, policy=engine.policy)
    engine.discard_unfinished()
    return CoserveRoundResult(run, counters)


def engine_counters(stats: SchedulerStats, mode_busy_s: dict[str, float], t0_s: float = 0.0,
                    policy: SchedulingPolicy | None = None) -> dict:
    """A round's scheduler counters for the report, preemption times in s since the round's t0; with
    a policy that logs its latency model's error, that error per step mode (signed, one per step)."""
    model_error = policy.model_error if policy is not None else None
    drift = policy.latency_drift if policy is not None else None
    return {"model_error": model_error.samples() if model_error is not None else {},
            # A list, so that rounds concatenate (pool_rounds summarises them).
            "latency_drift": [drift.report(t0_s)] if drift is not None else [],
            "steps": stats.steps, "aborted_steps": stats.aborted_steps, "resumed_steps": stats.resumed_steps,
            "wasted_tokens": stats.wasted_tokens, "wasted_forward_s": stats.wasted_forward_s,
            "preempted_requests": stats.preempted_requests, "checkpointed_tokens": stats.checkpointed_tokens,
            "restored_tokens": stats.restored_tokens, "recomputed_tokens": stats.recomputed_tokens,
            "output_tokens": dict(stats.output_tokens),
            "mode_busy_s": dict(mode_busy_s), "mode_offline_tokens": dict(stats.mode_offline_tokens),
            "preemptions": [e._asdict() | {"at_s": e.at_s - t0_s} for e in stats.preemption_events if e.at_s >= t0_s]}


def _shifted(record: RequestRecord, offset_s: float, prefix: str) -> RequestRecord:
    def shift(t: float | None) -> float | None:
        return None if t is None else t + offset_s

    return replace(record, request_id=prefix + record.request_id, scheduled_s=shift(record.scheduled_s),
                   send_s=shift(record.send_s), first_token_s=shift(record.first_token_s),
                   chunk_times_s=[t + offset_s for t in record.chunk_times_s], end_s=shift(record.end_s))


def _summed(counters: list[dict]) -> dict:
    out: dict = {}
    for c in counters:
        for key, value in c.items():
            if isinstance(value, dict):
                out[key] = _summed([out.get(key, {}), value])
            elif isinstance(value, list):
                out[key] = out.get(key, []) + value
            else:
                out[key] = out.get(key, 0) + value
    return out


def pool_rounds(rounds: list[CoserveRoundResult], slo: SLO | None) -> ModeResult:
    """One mode's rounds as one run: each round's times follow the previous round's end."""
    records, samples, preemptions, counters, drift_timeline = [], [], [], [], []
    offset_s = 0.0
    for k, part in enumerate(rounds):
        prefix = f"r{k}-" if len(rounds) > 1 else ""
        for report in part.engine.get("latency_drift", []):
            drift_timeline += [(round(t + offset_s, 3), f) for t, f in report["timeline"]]
        records += [_shifted(r, offset_s, prefix) for r in part.run.records]
        samples += [(t + offset_s, stats) for t, stats in part.run.samples]
        shifted = [e | {"at_s": e["at_s"] + offset_s} for e in part.engine.get("preemptions", [])]
        preemptions += [(e["at_s"], e["latency_ms"]) for e in shifted]
        counters.append({**part.engine, "preemptions": shifted})
        offset_s += part.run.duration_s
    metrics = compute_metrics(records, slo=slo, duration_s=offset_s, engine_samples=samples,
                              preemption_events=preemptions)
    engine_stats = _summed(counters) | {"send_lag_p99_ms": metrics.send_lag_ms.p99}
    # The report keeps each step mode's error summary, not every step's sample.
    engine_stats["model_error"] = {mode: s.to_dict() for mode, errors in engine_stats.get("model_error", {}).items()
                                   if (s := summarize(errors)) is not None}
    drifts = engine_stats.pop("latency_drift", [])
    if drifts:
        engine_stats["latency_drift"] = {"max_factor": max(d["max_factor"] for d in drifts),
                                         "end_factor": drifts[-1]["factor"], "steps": sum(d["steps"] for d in drifts),
                                         "flags": sum(d["flags"] for d in drifts), "timeline": drift_timeline}
    return ModeResult(metrics, records, {"engine": engine_stats, "rounds": len(rounds)})


def load_and_profile(serving: ServingConfig, log: Callable[[str], None] | None = None):
    """The model, its runner and latency profile, built on the torch thread the engine runs on; with
    log, a progress line every few seconds (compiling kernels and decode buckets says little itself)."""
    from backfill.engine.weights import load_model

    def build():
        loaded = load_model(serving.model)
        runner = build_runner(loaded.config, loaded.weights, serving)
        runner.wait_until_warm()   # the measured runs start warm, as a server reports ready only then
        return loaded, runner, load_or_profile(runner, serving, loaded.config.name)

    if log is None:
        return run_on_torch_thread(build)
    with Heartbeat(log, "loading the model, its kernels and its step-latency profile"):
        return run_on_torch_thread(build)


# One mode's share of one round: (mode, the round's scenario, the SLOs, round index) -> its result
# and what the report should say of the mode.
RunMode = Callable[[ModeSpec, CoserveScenario, SLO, int], tuple[CoserveRoundResult, dict]]


def run_in_rounds(scenario: CoserveScenario, modes: tuple[str, ...], run_mode: RunMode) -> dict[str, ModeResult]:
    """Each round's trace (seed + round, duration / rounds) through every mode in turn, the baseline
    first: online-only's first round sets the SLOs the others get, unless the scenario gives them.
    Each mode's rounds are pooled into one result, named by the mode's label."""
    slo = SLO(scenario.ttft_slo_ms or 1e6, scenario.tpot_slo_ms or 1e6)
    ordered = sorted(parse_modes(modes), key=lambda spec: spec.label != BASELINE)
    parts: dict[str, list[CoserveRoundResult]] = {spec.label: [] for spec in ordered}
    meta: dict[str, dict] = {}
    for k in range(scenario.rounds):
        round_scenario = replace(scenario, duration_s=scenario.duration_s / scenario.rounds, seed=scenario.seed + k)
        for spec in ordered:
            mode = spec.label
            part, about = run_mode(spec, round_scenario, slo, k)
            parts[mode].append(part)
            meta[mode] = {"policy": spec.policy, "overrides": dict(spec.overrides), "slo": asdict(slo),
                          "scenario": asdict(scenario), **about}
            if mode == BASELINE and k == 0:
                m = pool_rounds(parts[mode], None).metrics.online
                slo = SLO(scenario.ttft_slo_ms or m.ttft_ms.p99, scenario.tpot_slo_ms or m.tpot_ms.p99)
    results: dict[str, ModeResult] = {}
    for mode in parts:
        pooled = pool_rounds(parts[mode], slo if mode != BASELINE else None)
        results[mode] = ModeResult(pooled.metrics, pooled.records, {**pooled.config, **meta[mode]})
        print_summary(mode, pooled.metrics)
    return results


def run_coserve_bench(scenario: CoserveScenario = CoserveScenario(), serving: ServingConfig = ServingConfig(),
                      modes: tuple[str, ...] = MODES, out_dir: str | Path = "runs/coserve",
                      progress: bool = True, log=print, prepared=None) -> dict[str, ModeResult]:
    """Every mode on the scenario's rounds; `prepared` is load_and_profile's result, to run several
    scenarios on one loaded model."""
    parse_modes(modes)  # before the model loads
    loaded, runner, latency = prepared if prepared is not None else load_and_profile(serving, log)
    name, tokenizer = loaded.config.name, loaded.tokenizer
    if scenario.warmup_s > 0:
        log(f"== warm-up: {scenario.warmup_s:.0f} s of offline batching (not measured)")
        engine = AsyncEngine(build_scheduler(runner, replace(serving, policy="priority"), tokenizer, name, latency),
                             tokenizer, name)
        with Heartbeat(log, "warm-up", expected_s=scenario.warmup_s):
            asyncio.run(_run_round(engine, warmup_workload(scenario, tokenizer), progress=False))

    def run_mode(spec: ModeSpec, round_scenario: CoserveScenario, slo: SLO, k: int) -> tuple[CoserveRoundResult, dict]:
        workload = make_workload(round_scenario, tokenizer, latency, with_offline=spec.with_offline)
        cfg = spec.serving(serving, coserve=replace(serving.coserve, slo=slo))
        engine = AsyncEngine(build_scheduler(runner, cfg, tokenizer, name, latency), tokenizer, name,
                             cfg.arrival_gather_ms / 1e3)   # as backfill serve builds it
        label = f" (round {k + 1}/{scenario.rounds})" if scenario.rounds > 1 else ""
        log(f"== {spec.label}{label}: {workload.name}, {len(workload.requests)} online requests, "
            f"SLO TTFT {slo.ttft_ms:.0f} ms / TPOT {slo.tpot_ms:.1f} ms")
        with hog_after(round_scenario.slowdown_at_s, log):
            part = asyncio.run(_run_round(engine, workload, progress))
        return part, {"model": name, "dtype": serving.resolved_dtype, "workload": dict(workload.meta)}

    results = run_in_rounds(scenario, modes, run_mode)
    files = write_report(results, out_dir)
    log(f"report: {files.markdown}")
    return results


def run_http_bench(url: str, model: str, scenario: CoserveScenario, tokenizer, latency: LatencyModel, *,
                   label: str = "http", api_key: str | None = None, out_dir: str | Path = "runs/coserve-http",
                   with_offline: bool = True, offline_mark: str = "both", progress: bool = True,
                   write: bool = True, slo: SLO | None = None) -> ModeResult:
    """The same scenario against any OpenAI-compatible server; offline requests are marked as
    offline_mark says (bench/http_target.py OFFLINE_MARKS)."""
    from backfill.bench.http_target import HttpTarget

    workload = make_workload(scenario, tokenizer, latency, with_offline=with_offline)

    async def go() -> ModeResult:
        async with HttpTarget(url, model, api_key=api_key, prompt_as="token_ids", offline_mark=offline_mark) as target:
            run = await run_workload(target, workload, progress=progress)
        return ModeResult(compute_metrics(run.records, slo=slo, duration_s=run.duration_s, engine_samples=run.samples),
                          run.records, {"url": url, "scenario": asdict(scenario), "offline_mark": offline_mark,
                                        "with_offline": with_offline})

    result = asyncio.run(go())
    if write:
        write_report({label: result}, out_dir, baseline=None)
    print_summary(label, result.metrics)
    return result


def run_http_with_baseline(url: str, model: str, scenario: CoserveScenario, tokenizer, latency: LatencyModel, *,
                           label: str = "http", api_key: str | None = None, out_dir: str | Path = "runs/coserve-http",
                           offline_mark: str = "both", progress: bool = True) -> dict[str, ModeResult]:
    """The trace alone (label + " online-only"), then with the offline backlog (label), against the
    same server: ratios to the server's own online-only latency exist for any server. The second
    run's SLO attainment is counted against the first run's P99s, as in-process modes are."""
    base_label = f"{label} {BASELINE}"
    alone = run_http_bench(url, model, scenario, tokenizer, latency, label=base_label, api_key=api_key,
                           with_offline=False, offline_mark=offline_mark, progress=progress, write=False)
    online = alone.metrics.online
    return _coserved_against(url, model, scenario, tokenizer, latency, base_label, alone, online.ttft_ms.p99,
                             online.tpot_ms.p99, label=label, api_key=api_key, out_dir=out_dir,
                             offline_mark=offline_mark, progress=progress)


def _coserved_against(url: str, model: str, scenario: CoserveScenario, tokenizer, latency: LatencyModel,
                      base_label: str, alone: ModeResult, p99_ttft_ms: float | None, p99_tpot_ms: float | None, *,
                      label: str, api_key: str | None, out_dir: str | Path, offline_mark: str,
                      progress: bool) -> dict[str, ModeResult]:
    """The trace with the offline backlog, its SLO attainment counted against the online-only run's
    P99s (unless the scenario states SLOs), as in-process modes are; the report has both runs."""
    slo = SLO(scenario.ttft_slo_ms or p99_ttft_ms or 1e6, scenario.tpot_slo_ms or p99_tpot_ms or 1e6)
    both = run_http_bench(url, model, scenario, tokenizer, latency, label=label, api_key=api_key, slo=slo,
                          offline_mark=offline_mark, progress=progress, write=False)
    results = {base_label: alone, label: both}
    write_report(results, out_dir, baseline=base_label)
    return results


def run_http_online_only(url: str, model: str, scenario: CoserveScenario, tokenizer, latency: LatencyModel, *,
                         baseline_file: str | Path, label: str = "http", api_key: str | None = None,
                         out_dir: str | Path = "runs/coserve-http", offline_mark: str = "both",
                         progress: bool = True) -> dict[str, ModeResult]:
    """Phase one of run_http_with_baseline alone: the trace without the backlog, written to
    baseline_file (bench/http_baseline.py), whose P99s a strict server is then started with."""
    from backfill.bench.http_baseline import write_baseline

    base_label = f"{label} {BASELINE}"
    alone = run_http_bench(url, model, scenario, tokenizer, latency, label=base_label, api_key=api_key,
                           out_dir=out_dir, with_offline=False, offline_mark=offline_mark, progress=progress)
    path = write_baseline(baseline_file, base_label, alone, asdict(scenario), alone.metrics.duration_s)
    online = alone.metrics.online
    print(f"wrote {path}: P99 TTFT {online.ttft_ms.p99:.1f} ms, P99 TPOT {online.tpot_ms.p99:.2f} ms")
    return {base_label: alone}


def run_http_coserved(url: str, model: str, scenario: CoserveScenario, tokenizer, latency: LatencyModel, *,
                      baseline_file: str | Path, label: str = "http", api_key: str | None = None,
                      out_dir: str | Path = "runs/coserve-http", offline_mark: str = "both",
                      progress: bool = True) -> dict[str, ModeResult]:
    """Phase two: the trace with the offline backlog, its SLO attainment and ratios against the
    online-only run in baseline_file (which must have run the same scenario)."""
    from backfill.bench.http_baseline import read_baseline

    base_label, alone, doc = read_baseline(baseline_file, asdict(scenario))   # before minutes of load
    return _coserved_against(url, model, scenario, tokenizer, latency, base_label, alone, doc["p99_ttft_ms"],
                             doc["p99_tpot_ms"], label=label, api_key=api_key, out_dir=out_dir,
                             offline_mark=offline_mark, progress=progress)


def save_json(results: dict[str, ModeResult], path: str | Path) -> None:
    out = {mode: {"metrics": r.metrics.to_dict(), "config": dict(r.config)} for mode, r in results.items()}
    Path(path).write_text(json.dumps(out, indent=1, default=str))


def headline(results: dict[str, ModeResult]) -> str:
    """A compact table: online latency next to the offline throughput each mode harvested."""
    width = max([12, *map(len, results)])
    rows = [f"{'mode':<{width}}  P50/P99 TTFT ms    P50/P99 TPOT ms   online tok/s  offline tok/s  preempt P99 ms  "
            f"online n"]
    for mode, r in results.items():
        m = r.metrics
        lat = m.preemption_latency_ms.p99
        rows.append(f"{mode:<{width}} {_pair(m.online.ttft_ms):>17} {_pair(m.online.tpot_ms):>16} "
                    f"{m.online.tokens_per_s:>13.1f} {m.offline.tokens_per_s:>14.1f} "
                    f"{'-' if lat is None else f'{lat:.1f}':>15} {m.online.completed:>9}")
    few = min(r.metrics.online.completed for r in results.values()) if results else 0
    if few < MIN_SAMPLES_P99:
        rows.append(f"(P99s from {few} online requests are close to the maximum: {MIN_SAMPLES_P99} or more make a "
                    "P99; give a longer --duration)")
    # The ceiling: offline batches in all the time online work leaves (bench/ceiling.py).
    for mode, c in offline_ceilings(results).items():
        if c.ceiling_vs_priority is not None:
            rows.append(f"{mode}: offline ceiling {c.ceiling_tokens_per_s:.1f} tok/s = {c.ceiling_vs_priority:.3f}x "
                        f"priority (batches in all the time online work leaves); reached "
                        f"{c.measured_vs_priority:.3f}x")
        elif c.ceiling_tokens_per_s > 0:
            rows.append(f"{mode}: offline ceiling {c.ceiling_tokens_per_s:.1f} tok/s (batches in all the time "
                        f"online work leaves); reached {c.measured_tokens_per_s / c.ceiling_tokens_per_s:.0%} of it")
    rows += model_error_lines(results)
    rows += drift_lines(results)
    return "\n".join(rows)


def drift_lines(results: dict[str, ModeResult]) -> list[str]:
    """One line per mode whose policy corrected its latency model online (policy/drift.py)."""
    rows = []
    for mode, r in results.items():
        d = r.config.get("engine", {}).get("latency_drift")
        if d and d["steps"]:
            rows.append(f"{mode}: latency model corrected online: steps ran up to {d['max_factor']:.2f}x the "
                        f"profile's estimate (at the end {d['end_factor']:.2f}x; {d['steps']} steps), "
                        f"{d['flags']} persisting drift(s) flagged for re-profiling")
    return rows


def model_error_lines(results: dict[str, ModeResult]) -> list[str]:
    """One line per mode whose policy logged its latency model's error: median / P90 / bias per step mode."""
    rows = []
    for mode, r in results.items():
        by_mode = r.config.get("engine", {}).get("model_error") or {}
        if by_mode:
            parts = [f"{step_mode} {e['median']:.1%} / {e['p90']:.1%} / {e['bias']:+.1%} ({e['steps']} steps)"
                     for step_mode, e in sorted(by_mode.items())]
            rows.append(f"{mode}: latency model error median / P90 / bias: " + "; ".join(parts))
    return rows


def _pair(summary) -> str:
    if summary.p50 is None:
        return "-"
    return f"{summary.p50:.0f} / {summary.p99:.0f}"
