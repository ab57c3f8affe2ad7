"""The bench's four modes on a simulated clock, with the same policy objects and the fitted predictor.

A decode engine with continuous batching serves the online trace (prefills cost what the latency
profile says, decode steps what HARLI's stage-1 fit says); between two steps the co-location
policy plans finetuning units, each costing the profiled unit time, and the decode interval that
follows costs what stage 2 predicts for the split those units realise (times lognormal noise).
SeparateMode gives decode a fixed `separate_share_infer` of the machine (stage 1 at that share)
and finetuning the rest, scaled linearly from its full-machine rate (generous to it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from backfill.policy.harli import ColoState, HarliLatencyModel


@dataclass(frozen=True)
class SimCosts:
    latency: HarliLatencyModel
    unit_ms: float                 # one finetuning unit (a layer piece of a micro-batch)
    pieces_per_step: int
    samples_per_step: int
    prefill_ms: callable           # prompt tokens -> ms of its prefill step
    noise_cv: float = 0.05


@dataclass(frozen=True)
class SimRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


def online_requests(duration_s: float, online_load: float, seed: int, prefill_ms, decode_ms) -> list[SimRequest]:
    """The coserve benchmark's online trace (its gamma arrivals and length distributions), its rate
    set so that `online_load` of the time would go to one request after another alone: prefill_ms
    (prompt tokens -> ms) and decode_ms (context -> ms of a batch-1 step) cost one request."""
    from backfill.bench.arrivals import gamma_arrivals
    from backfill.bench.lengths import parse_length_spec
    from backfill.bench.scenario import CoserveScenario

    scenario = CoserveScenario(duration_s=duration_s, online_load=online_load, seed=seed, warmup_s=0.0)
    rng = np.random.default_rng(seed)
    prompt_len, output_len = parse_length_spec(scenario.prompt_len), parse_length_spec(scenario.output_len)
    mean_prompt, mean_output = float(np.mean(prompt_len.sample(rng, 2000))), float(np.mean(output_len.sample(rng, 2000)))
    service_s = (prefill_ms(mean_prompt) + mean_output * decode_ms(mean_prompt + mean_output / 2)) / 1e3
    arrivals = gamma_arrivals(online_load / service_s, scenario.cv, seed, duration_s=duration_s)
    prompts, outputs = prompt_len.sample(rng, len(arrivals)), output_len.sample(rng, len(arrivals))
    return [SimRequest(float(a), int(p), max(1, int(o))) for a, p, o in zip(arrivals, prompts, outputs)]


def simulate(policy, requests: list[SimRequest], costs: SimCosts, duration_s: float, tpot_target_ms: float,
             seed: int = 0, separate_share_infer: float | None = None) -> dict:
    rng = np.random.default_rng(seed)
    sigma = math.sqrt(math.log(1 + costs.noise_cv ** 2))

    def noisy(ms: float) -> float:
        return ms * float(rng.lognormal(-sigma ** 2 / 2, sigma))

    pending = sorted(requests, key=lambda r: r.arrival_s)
    running: list[dict] = []
    done: list[dict] = []
    t_ms, units, i = 0.0, 0, 0
    end_ms = duration_s * 1e3
    lat = costs.latency
    while t_ms < end_ms or running:
        arrived = []
        while i < len(pending) and pending[i].arrival_s * 1e3 <= t_ms:
            arrived.append(pending[i])
            i += 1
        n = 0
        if separate_share_infer is None:  # the policy sees the arrivals before their prefill runs
            seqlen = float(np.mean([s["ctx"] for s in running])) if running else 0.0
            state = ColoState(t_ms / 1e3, len(running), len(arrived), seqlen, tpot_target_ms, t_ms < end_ms,
                              costs.unit_ms)
            n = policy.plan(state).units
        for r in arrived:  # prefill, one request a step
            t_ms += noisy(costs.prefill_ms(r.prompt_tokens))
            running.append({"ctx": r.prompt_tokens + 1, "left": r.output_tokens - 1, "times": [t_ms]})
        if not running:
            if n:
                t_ms += noisy(n * costs.unit_ms)
                units += n
            elif i < len(pending):
                t_ms = max(t_ms, pending[i].arrival_s * 1e3)
            else:
                t_ms = max(t_ms, end_ms)
            continue
        bs, seqlen = len(running), float(np.mean([s["ctx"] for s in running]))
        if separate_share_infer is not None:
            interval = lat.solo_ms(bs, seqlen, separate_share_infer)
        else:
            solo = lat.solo_ms(bs, seqlen, 1.0)
            share_ft = n * costs.unit_ms / (n * costs.unit_ms + solo) if n else 0.0
            interval = lat.colo_ms(bs, seqlen, 1.0 - share_ft, share_ft)
            units += n
        t_ms += noisy(interval)
        running = decode_token(running, done, t_ms)
    p50_tpot_ms, p99_tpot_ms = tpot_percentiles_ms(done)
    gaps = [b - a for s in done for a, b in zip(s["times"], s["times"][1:])]
    p99_itl_ms = float(np.percentile(gaps, 99)) if gaps else None
    if separate_share_infer is not None:
        units = (1 - separate_share_infer) * t_ms / costs.unit_ms
    samples = units / costs.pieces_per_step * costs.samples_per_step
    return {"samples_per_s": samples / (t_ms / 1e3), "p99_tpot_ms": p99_tpot_ms,
            "p50_tpot_ms": p50_tpot_ms, "p99_itl_ms": p99_itl_ms, "completed": len(done)}


def decode_token(running: list[dict], done: list[dict], t_ms: float) -> list[dict]:
    """Every running request got one token at t_ms; the finished ones move to done, the rest are returned."""
    for s in running:
        s["ctx"] += 1
        s["left"] -= 1
        s["times"].append(t_ms)
    done += [s for s in running if s["left"] <= 0]
    return [s for s in running if s["left"] > 0]


def tpot_percentiles_ms(done: list[dict]) -> tuple[float, float]:
    """P50 and P99 of the finished requests' mean time per output token (0 when none has two tokens)."""
    tpots = [(s["times"][-1] - s["times"][0]) / (len(s["times"]) - 1) for s in done if len(s["times"]) > 1]
    if not tpots:
        return 0.0, 0.0
    return float(np.percentile(tpots, 50)), float(np.percentile(tpots, 99))


def qos_verdict(rounds: list[dict], p99_tpot_ms: float, target_ms: float) -> dict:
    """A mode's decode QoS verdict: its P99 TPOT (median over rounds) against the target, judged only
    when every round has enough finished online requests behind its P99."""
    from backfill.bench.verdict import MIN_SAMPLES_P99, Verdict

    return Verdict("decode P99 TPOT, ms", p99_tpot_ms, target_ms,
                   samples=min((int(r.get("completed", 0)) for r in rounds), default=0), min_samples=MIN_SAMPLES_P99,
                   sample_unit="online requests (fewest of a round)").as_dict()


def qos_text(row: dict) -> str:
    """met / MISSED / n/a (too few samples: N), as a table cell."""
    met = row["meets_qos"]
    return row["qos"]["met_text"] if met is None else ("met" if met else "MISSED")


def add_harli_ratios(table: dict) -> dict:
    """harli's finetune throughput over each baseline's, as x_<baseline> in harli's row."""
    if "harli" in table:
        for base in ("pause-only", "static", "separate"):
            if base in table and table[base]["samples_per_s"] > 0:
                table["harli"][f"x_{base}"] = table["harli"]["samples_per_s"] / table[base]["samples_per_s"]
    return table

