"""The bench's modes on the simulated SM-partitioned device: decode and finetuning at the same time.

A decode engine with continuous batching serves the online trace (backfill/bench/sim/finetune_sim.py's
generator: the coserve benchmark's gamma arrivals and lengths). At each decode step or arrival
the mode's policy object (backfill/policy/harli_sm.py) picks an SM split; the step then costs what
the simulated device says for that split (noisy), and the finetuning job advances by that time
over its step time at its share. With no decode running, finetuning runs at the policy's share
until the next arrival. Cutting finetuning's share makes the next inference step wait for the
kernel in flight on the SMs it takes back (SimulatedDevice.drain_ms).

Modes (HARLI §8.1): solo (the reference: the trace alone), separate (HARLI's SeparateMode: decode
on one GPU, finetuning on another, so per GPU half a device's finetuning and solo decode),
static (a fixed 60/40 SM split), pause-only (finetuning on every SM only while no decode runs)
and harli (§6.2 over the profiled predictor).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, replace

import numpy as np

from backfill.bench.sim.finetune_sim import (SimRequest, add_harli_ratios, decode_token, online_requests, qos_text,
                                             qos_verdict, tpot_percentiles_ms)
from backfill.bench.sim.sm_config import SmDeviceConfig, SmSimScenario
from backfill.bench.sim.sm_device import SimulatedDevice
from backfill.bench.sim.sm_device_profile import NoisyDevice, profile_device
from backfill.policy.harli import ColoState, HarliLatencyModel
from backfill.policy.harli_sm import make_sm_policy

MODES = ("separate", "static", "pause-only", "harli")
SOLO = "solo"


def simulate_sm(policy, requests: list[SimRequest], device: SimulatedDevice, duration_s: float,
                tpot_target_ms: float, seed: int = 0) -> dict:
    probe = NoisyDevice(device, np.random.default_rng(seed))
    pending = sorted(requests, key=lambda r: r.arrival_s)
    running: list[dict] = []
    done: list[dict] = []
    end_ms = duration_s * 1e3
    t_ms, i, steps_ft, prev_ft = 0.0, 0, 0.0, 0.0
    busy_ms, busy_ft_ms, drains = 0.0, 0.0, 0

    def advance(ms: float, share_ft: float, share_infer_busy: float) -> None:
        nonlocal t_ms, steps_ft
        useful = max(0.0, min(t_ms + ms, end_ms) - t_ms)  # finetuning counts inside the measured window only
        if share_ft > 0 and useful > 0:
            steps_ft += useful / device.ft_step_ms(share_ft, share_infer_busy)
        t_ms += ms

    def start(cost_ms: float, split, full_ms_at) -> float:
        """An inference op's time under `split`, after the SMs finetuning gives back drain."""
        nonlocal drains
        if prev_ft > split.share_ft and split.share_infer > 1 - prev_ft + 1e-9:
            drains += 1
            drain = device.drain_ms(prev_ft)
            held = 1 - prev_ft  # what inference has until the kernel ends
            old = full_ms_at(held) if held > 1e-9 else math.inf
            return drain + max(0.0, 1 - drain / old) * cost_ms
        return cost_ms

    while t_ms < end_ms or running:
        arrived = []
        while i < len(pending) and pending[i].arrival_s * 1e3 <= t_ms:
            arrived.append(pending[i])
            i += 1
        seqlen = float(np.mean([s["ctx"] for s in running])) if running else 0.0
        split = policy.plan(ColoState(t_ms / 1e3, len(running), len(arrived), seqlen, tpot_target_ms,
                                      t_ms < end_ms, 0.0))
        s_inf = split.share_infer if split.share_infer > 0 else 1.0
        s_ft = split.share_ft
        for r in arrived:  # prefill, one request a step, on the inference share
            cost = probe.noisy(device.prefill_ms(r.prompt_tokens, s_inf, s_ft))
            ms = start(cost, split, lambda h, n=r.prompt_tokens: device.prefill_ms(n, h))
            prev_ft = s_ft
            advance(ms, s_ft, s_inf)
            busy_ms += ms
            busy_ft_ms += ms * s_ft
            running.append({"ctx": r.prompt_tokens + 1, "left": r.output_tokens - 1, "times": [t_ms]})
        if not running:  # idle until the next arrival (or the end): finetuning at the policy's share
            if i >= len(pending) and t_ms >= end_ms:
                break
            nxt = pending[i].arrival_s * 1e3 if i < len(pending) else end_ms
            prev_ft = s_ft
            advance(max(0.0, nxt - t_ms), s_ft, 0.0)
            continue
        bs = len(running)
        seqlen = float(np.mean([s["ctx"] for s in running]))
        cost = probe.noisy(device.decode_ms(bs, seqlen, s_inf, s_ft))
        ms = start(cost, split, lambda h: device.decode_ms(bs, seqlen, h))
        prev_ft = s_ft
        advance(ms, s_ft, s_inf)
        busy_ms += ms
        busy_ft_ms += ms * s_ft
        running = decode_token(running, done, t_ms)
    p50_tpot_ms, p99_tpot_ms = tpot_percentiles_ms(done)
    return {"samples_per_s": steps_ft * device.units.samples / duration_s,
            "p99_tpot_ms": p99_tpot_ms, "p50_tpot_ms": p50_tpot_ms, "completed": len(done),
            "busy_share": busy_ms / max(t_ms, 1e-9), "ft_share_while_busy": busy_ft_ms / max(busy_ms, 1e-9),
            "drains": drains}


def run_load(device: SimulatedDevice, latency: HarliLatencyModel, scenario: SmSimScenario,
             modes: tuple[str, ...] = MODES, log=print) -> dict:
    """Every mode under `scenario.rounds` seeds of the trace; the target from the first seed's solo."""
    def decode_bs1(ctx: float) -> float:
        return device.decode_ms(1, ctx)

    rounds: dict[str, list[dict]] = {}
    target = None
    for k in range(scenario.rounds):
        requests = online_requests(scenario.duration_s, scenario.online_load, k, device.prefill_ms, decode_bs1)
        solo = simulate_sm(make_sm_policy(SOLO), requests, device, scenario.duration_s, math.inf, seed=k)
        rounds.setdefault(SOLO, []).append(solo)
        if target is None:
            target = scenario.tpot_target_x_solo * solo["p99_tpot_ms"]
        for mode in modes:
            if mode == "separate":  # decode alone on its GPU, finetuning alone on the other: per GPU, half
                r = dict(solo, samples_per_s=device.samples_per_s(1.0) / 2)
            else:
                policy = make_sm_policy(mode, latency, scenario.static_share_infer, scenario.headroom)
                r = simulate_sm(policy, requests, device, scenario.duration_s, target, seed=k)
            rounds.setdefault(mode, []).append(r)
        log(f"   load {scenario.online_load} seed {k}: " + ", ".join(
            f"{m} {rounds[m][-1]['samples_per_s']:.2f}/s {rounds[m][-1]['p99_tpot_ms']:.1f} ms" for m in (SOLO, *modes)))
    return {"online_load": scenario.online_load, "tpot_target_ms": target, "rounds": rounds,
            "table": table(rounds, target)}


def table(rounds: dict[str, list[dict]], target_ms: float) -> dict:
    out = {}
    for mode, rs in rounds.items():
        out[mode] = {"samples_per_s": statistics.median(r["samples_per_s"] for r in rs),
                     "p99_tpot_ms": statistics.median(r["p99_tpot_ms"] for r in rs),
                     "ft_share_while_busy": statistics.median(r["ft_share_while_busy"] for r in rs),
                     "busy_share": statistics.median(r["busy_share"] for r in rs)}
        out[mode]["qos"] = qos_verdict(rs, out[mode]["p99_tpot_ms"], target_ms)
        out[mode]["meets_qos"] = out[mode]["qos"]["met"]
    return add_harli_ratios(out)


def markdown(result: dict) -> str:
    lines = ["| load | mode | finetune samples/s | decode P99 TPOT ms | target ms | QoS | inference busy | "
             "ft SM share while busy |", "|---|---|---|---|---|---|---|---|"]
    for load in result["loads"]:
        t = load["table"]
        for mode, row in t.items():
            lines.append(f"| {load['online_load']} | {mode} | {row['samples_per_s']:.2f} | {row['p99_tpot_ms']:.2f} | "
                         f"{load['tpot_target_ms']:.2f} | {qos_text(row)} | "
                         f"{row['busy_share']:.0%} | {row['ft_share_while_busy']:.2f} |")
    lines.append("")
    for load in result["loads"]:
        h = load["table"].get("harli", {})
        lines.append(f"load {load['online_load']}: harli / pause-only {h.get('x_pause-only', 0):.2f}x, "
                     f"harli / static {h.get('x_static', 0):.2f}x, harli / separate {h.get('x_separate', 0):.2f}x")
    return "\n".join(lines)


SENSITIVITY = (("saturation_share", (0.3, 0.6)), ("ft_efficiency", (0.3, 0.6)), ("interference", (0.2, 0.6)))


def sensitivity(config: SmDeviceConfig, scenario: SmSimScenario, loads: tuple[float, ...], log=print) -> list[dict]:
    """harli against pause-only and static with one stated parameter changed at a time (re-profiled)."""
    rows = []
    variants = [("base", None)] + [(name, v) for name, values in SENSITIVITY for v in values]
    for name, value in variants:
        cfg = config if value is None else replace(config, **{name: value})
        device = SimulatedDevice.load(cfg)
        latency = profile_device(device)
        for load in loads:
            r = run_load(device, latency, replace(scenario, online_load=load), ("static", "pause-only", "harli"),
                         log=lambda *a: None)
            h = r["table"]["harli"]
            rows.append({"parameter": name, "value": getattr(cfg, name) if value is not None else None,
                         "online_load": load, "tpot_target_ms": r["tpot_target_ms"],
                         "harli_samples_per_s": h["samples_per_s"], "harli_p99_tpot_ms": h["p99_tpot_ms"],
                         "harli_meets_qos": h["meets_qos"], "harli_qos_text": qos_text(h), "x_pause_only": h.get("x_pause-only", 0.0),
                         "x_static": h.get("x_static", 0.0), "static_meets_qos": r["table"]["static"]["meets_qos"],
                         "static_qos_text": qos_text(r["table"]["static"])})
            log(f"   {name}={rows[-1]['value']} load {load}: harli/pause-only {rows[-1]['x_pause_only']:.2f}x, "
                f"harli/static {rows[-1]['x_static']:.2f}x, harli QoS {qos_text(h)}")
    return rows


def sensitivity_markdown(rows: list[dict]) -> str:
    lines = ["| parameter | value | load | harli samples/s | harli / pause-only | harli / static | harli QoS | "
             "static QoS |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        value = "stated" if r["value"] is None else f"{r['value']:g}"
        lines.append(f"| {r['parameter']} | {value} | {r['online_load']} | {r['harli_samples_per_s']:.2f} | "
                     f"{r['x_pause_only']:.2f}x | "
                     f"{r['x_static']:.2f}x | {r['harli_qos_text']} | {r['static_qos_text']} |")
    return "\n".join(lines)


def run(config: SmDeviceConfig, scenario: SmSimScenario, loads: tuple[float, ...], with_sensitivity: bool,
        modes: tuple[str, ...] = MODES, sensitivity_rounds: int = 3, log=print) -> dict:
    device = SimulatedDevice.load(config)
    latency = profile_device(device)
    log(f"simulated device: {device.describe()}")
    log(f"predictor fit on the simulated device: b1 {latency.b1:.3f}, k1 {latency.k1:.3f}, errors {latency.errors}")
    result = {"config": asdict(config), "scenario": asdict(scenario), "device": device.describe(),
              "predictor": {"solo": [asdict(f) for f in latency.solo], "b1": latency.b1, "k1": latency.k1,
                            "errors": latency.errors},
              "loads": [run_load(device, latency, replace(scenario, online_load=load), modes, log=log) for load in loads]}
    if with_sensitivity:
        result["sensitivity"] = sensitivity(config, replace(scenario, rounds=min(scenario.rounds, sensitivity_rounds)),
                                            loads, log=log)
    return result
