"""`backfill bench finetune`: HARLI against its baselines under the co-serving benchmark's online trace.

Modes, run interleaved round by round on the same model and the same trace (bench/coserve.py's
gamma trace, online only):

  separate    HARLI's SeparateMode: finetuning alone on its own share of the machine, a process
              of its own with `--ft-threads` threads while the engine keeps the other threads
  static      StaticMode: a fixed time split, inference at 60% whatever the load
  pause-only  finetuning only while no decode runs
  harli       HARLI's QoS scheduler (policy/harli.py) with the fitted two-stage predictor
  partitioned HARLI on compute partitions (engine/compute_partition.py; on a CPU, cores):
              decode on the engine's thread and finetuning on a thread of its own, each pinned to
              its cores, at the same time; the SM-share scheduler (policy/harli_sm.py) re-plans
              the split at every decode step over the splits the partitions realise, with the
              two-stage predictor profiled on those partitions before the first round

Each round first runs the trace alone (solo, no finetuning): unless --tpot-target-ms is given, the
decode QoS target is --tpot-target-x-solo times the first round's solo P99 TPOT, so the target is
a measured decode figure of this machine in this run (HARLI §8.1 sets 40 ms over its own decode).

Finetune throughput counts samples by step progress (a step in flight counts by the share of its
layer pieces done). Decode QoS is the online requests' P99 TPOT against --tpot-target-ms.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from backfill.policy.harli import ColocationPolicy, ColoPlan, ColoState

if TYPE_CHECKING:
    import argparse

    from backfill.finetune.config import FinetuneConfig
    from backfill.serving.config import ServingConfig

MODES = ("separate", "static", "pause-only", "harli", "partitioned")
SOLO = "solo"  # the reference: the online trace with no finetuning


# The predictor docs/finetune-colocation.md reports as run 4 under load, shipped so that `bench finetune --sim`
# runs on a fresh clone; a profile measured here (`backfill finetune profile`) takes precedence.
SHIPPED_PROFILE_MACHINE = "a 2-core AMD EPYC with AVX-512 BF16, 2026-11-27 (docs/finetune-colocation.md, run 4)"


def shipped_latency(model_name: str):
    """The shipped HARLI predictor for this model, or None where backfill ships none."""
    from backfill.policy.harli import HarliLatencyModel

    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model_name)
    shipped = resources.files("backfill.bench") / "data" / f"harli-{safe}.json"
    if not shipped.is_file():
        return None
    with resources.as_file(shipped) as path:
        return HarliLatencyModel.load(path)


def run_bench_finetune(args: argparse.Namespace, serving: ServingConfig, config: FinetuneConfig) -> int:
    """The bench's modes in rounds; serving: the engine's config (policy fcfs), config: the job's
    FinetuneConfig (never ending within a mode). args: the command's other flags (bench finetune)."""
    import torch

    from backfill.bench.scenario import CoserveScenario
    from backfill.bench.coserve_bench import load_and_profile, make_workload
    from backfill.errors import InvalidRequestError
    from backfill.finetune.colocate import harli_profile_path, load_saved_latency
    from backfill.finetune.profile import synthetic_training_file

    # The simulated clock has no cores to partition (`sim finetune` simulates the device form).
    simulated = tuple(m for m in MODES if m != "partitioned")
    modes = tuple(m for m in args.modes.split(",") if m) if args.modes else (simulated if args.sim else MODES)
    if unknown := [m for m in modes if m not in MODES]:
        raise InvalidRequestError(f"unknown modes {unknown}; choose among {', '.join(MODES)}")
    if args.sim and "partitioned" in modes:
        raise InvalidRequestError("--sim runs no partitioned mode (it needs real cores): choose among "
                                  f"{', '.join(simulated)}, or `backfill sim finetune` for SM partitions")
    if args.sim:  # the model's tokenizer and saved profiles only: nothing runs on the model
        from backfill.engine.weights import load_model

        loaded = load_model(serving.model)
        latency = load_saved_latency(loaded.config.name)
        if latency is None:
            latency = shipped_latency(loaded.config.name)
            if latency is None:
                raise InvalidRequestError(
                    f"no HARLI latency profile for {loaded.config.name} at {harli_profile_path(loaded.config.name)}: "
                    "run `backfill finetune profile` with the same model options first (minutes; it prints its "
                    "progress)")
            print(f"no HARLI profile measured on this machine: simulating with the one shipped with backfill "
                  f"(measured on {SHIPPED_PROFILE_MACHINE}); `backfill finetune profile` fits this machine's",
                  flush=True)
        return _run_sim(args, modes, loaded, latency, config)
    loaded, runner, step_latency = load_and_profile(serving)
    latency = load_saved_latency(loaded.config.name)
    if "harli" in modes and latency is None:
        raise InvalidRequestError("no HARLI latency profile: run `backfill finetune profile` first")
    tmp = Path(tempfile.mkdtemp(prefix="bench-finetune-"))
    data = synthetic_training_file(tmp / "train.jsonl", loaded.tokenizer, num=64)
    threads = torch.get_num_threads()
    results: dict[str, list[dict]] = {}
    partitioned = _Partitioned.build(args, runner, loaded, data, config, tmp) if "partitioned" in modes else None
    for k in range(args.rounds):
        scenario = CoserveScenario(duration_s=args.duration, online_load=args.online_load, seed=k, warmup_s=0.0)
        workload = make_workload(scenario, loaded.tokenizer, step_latency, with_offline=False)
        for mode in (SOLO, *modes):
            print(f"== round {k + 1}/{args.rounds} {mode}: {len(workload.requests)} online requests", flush=True)
            r = _run_mode(mode, args, runner, loaded, workload, data, config, latency, tmp / f"{mode}-{k}", threads,
                          partitioned)
            results.setdefault(mode, []).append(r)
            if mode == SOLO and args.tpot_target_ms is None:
                args.tpot_target_ms = args.tpot_target_x_solo * r["p99_tpot_ms"]
                print(f"   decode QoS target: {args.tpot_target_x_solo} x solo P99 TPOT = "
                      f"{args.tpot_target_ms:.1f} ms", flush=True)
            print(f"   finetune {r['samples_per_s']:.3f} samples/s, P99 TPOT {r['p99_tpot_ms']:.1f} ms, "
                  f"P99 ITL {r['p99_itl_ms']:.1f} ms", flush=True)
    table = _table(results, args.tpot_target_ms)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    extra = partitioned.describe() if partitioned else {}
    (out / "result.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items() if k != "func"},
                                                 "rounds": results, "table": table, **extra}, indent=1))
    print(_markdown(table, args))
    if partitioned:
        print(partitioned.headroom_text(args.tpot_target_x_solo))
    print(f"wrote {out / 'result.json'}")
    return 0


class _Partitioned:
    """The partitioned mode's partitions and its predictor, profiled once on them before the rounds."""

    def __init__(self, partitions, latency) -> None:
        self.partitions, self.latency = partitions, latency

    @classmethod
    def build(cls, args, runner, loaded, data: Path, config, tmp: Path) -> "_Partitioned":
        from backfill.engine.partitions import make_partitions
        from backfill.finetune.job import FinetuneJob
        from backfill.finetune.profile import profile_partitions
        from backfill.serving.torch_thread import run_on_torch_thread

        partitions = make_partitions(runner.device.type)
        job = FinetuneJob(runner.model, loaded.tokenizer, data, config, tmp / "partition-profile")

        def profile():
            while job.steps_done == 0:
                job.run_unit()
            return profile_partitions(runner, job, partitions, model_name=loaded.config.name)

        made = cls(partitions, run_on_torch_thread(profile))
        print(made.headroom_text(args.tpot_target_x_solo), flush=True)
        return made

    # Decodes the headroom is priced at: the profile's batches, at its longer context.
    HEADROOM_SHAPES = ((1, 256), (4, 256))

    def split_costs(self) -> list[dict]:
        from backfill.policy.harli_sm import split_costs

        splits = tuple(f for f in self.partitions.ft_shares() if 0 < f < 1)
        return [{"batch": batch, "seqlen": seqlen, **cost.__dict__}
                for batch, seqlen in self.HEADROOM_SHAPES
                for cost in split_costs(self.latency, splits, batch, seqlen)]

    def headroom_text(self, allowance_x: float) -> str:
        """Each split's predicted decode step against the whole device's, and whether the QoS
        allowance (the target's multiple of solo) admits it: none admitted, partitioning can at
        best match pause-only on this machine."""
        costs = self.split_costs()
        lines = [f"   {self.partitions.form} partitions: decode beside finetuning, predicted (QoS allows "
                 f"{allowance_x:.2f}x solo)"]
        lines += [f"     decode share {c['share_infer']:.2f}, batch {c['batch']}, context {c['seqlen']}: "
                  f"{c['decode_ms']:.1f} ms = {c['x_whole_device']:.2f}x the whole device" for c in costs]
        if costs and all(c["x_whole_device"] > allowance_x for c in costs):
            lines.append("     no split keeps decode within the allowance: the planner pauses finetuning "
                         "whenever decode runs, as pause-only does")
        return "\n".join(lines)

    def policy(self):
        from backfill.policy.harli_sm import HarliSmPolicy

        return HarliSmPolicy(self.latency, ft_shares=self.partitions.ft_shares())

    def describe(self) -> dict:
        lat = self.latency
        return {"partitions": {"form": self.partitions.form, "ft_shares": list(self.partitions.ft_shares()),
                               "cores": list(getattr(self.partitions, "cores", []))},
                "partition_predictor": {"solo": [f.__dict__ for f in lat.solo], "b1": lat.b1, "k1": lat.k1,
                                        "errors": lat.errors},
                "split_costs": self.split_costs()}


def _run_mode(mode, args, runner, loaded, workload, data: Path, config, latency, job_dir: Path, threads: int,
              partitioned: "_Partitioned | None" = None) -> dict:
    from backfill.bench.inprocess_target import InProcessTarget
    from backfill.bench.metrics import compute_metrics
    from backfill.bench.driver import run_workload
    from backfill.finetune.colocate import attach_finetune, attach_finetune_partitioned
    from backfill.finetune.job import FinetuneJob
    from backfill.policy.harli import make_colo_policy
    from backfill.serving.config import ServingConfig
    from backfill.serving.build import build_scheduler
    from backfill.serving.async_engine import AsyncEngine
    from backfill.serving.torch_thread import run_on_torch_thread
    import torch

    name, tokenizer = loaded.config.name, loaded.tokenizer
    engine = AsyncEngine(build_scheduler(runner, ServingConfig(policy="fcfs"), tokenizer, name), tokenizer, name)
    if mode == "separate":
        run_on_torch_thread(torch.set_num_threads, max(1, threads - args.ft_threads))
        proc, events = _start_separate(args, data, config, job_dir)
    elif mode != SOLO:
        job = FinetuneJob(runner.model, tokenizer, data, config, job_dir)
        while job.steps_done == 0:  # one step, not measured: every piece kind timed for the policy's estimates
            run_on_torch_thread(job.run_unit)

    async def go():
        await engine.start()
        handle = None
        try:
            if mode == "partitioned":
                handle = attach_finetune_partitioned(engine, job, partitioned.policy(), partitioned.partitions,
                                                     tpot_target_ms=args.tpot_target_ms)
            elif mode not in ("separate", SOLO):
                policy = make_colo_policy(mode, latency, args.static_share_infer)
                handle = attach_finetune(engine, job, policy, tpot_target_ms=args.tpot_target_ms)
            started_progress = job.progress_steps if handle else 0.0
            started = time.monotonic()
            # A mode runs for --duration seconds: its progress shows.
            run = await run_workload(InProcessTarget(engine), workload, progress=True)
            elapsed = time.monotonic() - started
            done = (job.progress_steps - started_progress) if handle else None
            if handle:
                handle.cancel()
                await handle.wait()
            return run, elapsed, done, handle
        finally:
            await engine.stop()

    try:
        run, elapsed, steps, handle = asyncio.run(go())
    finally:
        if mode == "separate":
            steps_separate = _stop_separate(proc, events)
            run_on_torch_thread(torch.set_num_threads, threads)
    if mode == "separate":
        steps, elapsed_ft = steps_separate
        samples_per_s = steps * config.batch_size / elapsed_ft if elapsed_ft > 0 else 0.0
    elif mode == SOLO:
        samples_per_s = 0.0
    else:
        samples_per_s = steps * config.batch_size / elapsed
    metrics = compute_metrics(run.records, duration_s=run.duration_s)
    online = metrics.online
    out = {"samples_per_s": samples_per_s, "p99_tpot_ms": online.tpot_ms.p99 or 0.0,
           "p50_tpot_ms": online.tpot_ms.p50 or 0.0, "p99_itl_ms": online.itl_ms.p99 or 0.0,
           "completed": online.completed, "failed": online.failed, "elapsed_s": elapsed}
    if handle is not None:
        s = handle.stats
        out.update(units=s.units, units_during_decode=s.units_during_decode, paused_gaps=s.paused_gaps,
                   unit_ms=s.unit_ms, abandoned_steps=s.abandoned_steps, reasons=s.reasons)
        if mode == "partitioned":
            out["splits"] = dict(s.splits)
    return out


def _start_separate(args, data: Path, config, job_dir: Path):
    """The finetuning job in a process of its own with --ft-threads threads (HARLI's SeparateMode)."""
    cmd = [sys.executable, "-m", "backfill.cli", "finetune", "run", "--training-file", str(data), "--out", str(job_dir),
           "--threads", str(args.ft_threads), "--steps", str(config.max_steps), "--checkpoint-every",
           str(config.checkpoint_every_steps), "--batch-size", str(config.batch_size), "--micro-batch-size",
           str(config.micro_batch_size), "--max-seq-len", str(config.max_seq_len), "--rank", str(config.rank),
           "--layers-per-unit", str(config.layers_per_unit),
           "--loss-rows-per-unit", str(config.loss_rows_per_unit)]
    if getattr(args, "model", None):
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))
    events = job_dir / "events.jsonl"
    deadline = time.monotonic() + 300
    while not events.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)  # loading and the first step are not measured
    return proc, events


def _stop_separate(proc, events: Path) -> tuple[float, float]:
    """Steps and seconds between the first and last step the process finished while measured."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    times = [json.loads(line)["time"] for line in events.read_text().splitlines() if line.strip()] if events.exists() else []
    if len(times) < 2:
        return 0.0, 0.0
    return float(len(times) - 1), times[-1] - times[0]


def _table(results: dict[str, list[dict]], target_ms: float) -> dict:
    from backfill.bench.sim.finetune_sim import add_harli_ratios, qos_verdict

    table = {}
    for mode, rounds in results.items():
        table[mode] = {"samples_per_s": statistics.median(r["samples_per_s"] for r in rounds),
                       "p99_tpot_ms": statistics.median(r["p99_tpot_ms"] for r in rounds),
                       "p99_itl_ms": _median_or_none([r.get("p99_itl_ms") for r in rounds]),
                       "rounds_samples_per_s": [r["samples_per_s"] for r in rounds],
                       "rounds_p99_tpot_ms": [r["p99_tpot_ms"] for r in rounds]}
        table[mode]["qos"] = qos_verdict(rounds, table[mode]["p99_tpot_ms"], target_ms)
        table[mode]["meets_qos"] = table[mode]["qos"]["met"]
    if "partitioned" in table:
        for base in ("pause-only", "static", "separate", "harli"):
            if base in table and table[base]["samples_per_s"] > 0:
                table["partitioned"][f"x_{base}"] = table["partitioned"]["samples_per_s"] / table[base]["samples_per_s"]
    return add_harli_ratios(table)


def _median_or_none(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def closing(table: dict, rounds: int) -> str:
    """Which mode finetuned fastest within the decode QoS target, and the verdicts read in a sentence."""
    from backfill.bench.verdict import Verdict, closing_sentence

    judged = {mode: row for mode, row in table.items() if mode != SOLO}
    verdicts = [Verdict(**{**{k: row["qos"][k] for k in ("value", "target", "samples", "min_samples", "comparison",
                                                          "tolerance", "sample_unit")},
                           "quantity": f"{mode}: decode P99 TPOT, ms"}) for mode, row in judged.items()]
    within = sorted(((row["samples_per_s"], mode) for mode, row in judged.items() if row["meets_qos"] is True),
                    reverse=True)
    if within:
        rate, mode = within[0]
        lead = (f"Fastest finetuning within the decode target ({table[mode]['qos']['target']:.1f} ms P99 TPOT): "
                f"{mode}, {rate:.3f} samples/s (medians over {rounds} round(s)). ")
    elif any(row["meets_qos"] is None for row in judged.values()):
        lead = "No mode can be called fastest within the decode target: some P99s rest on too few requests. "
    else:
        lead = "No mode met the decode target. "
    return lead + closing_sentence(verdicts)


def _markdown(table: dict, args) -> str:
    from backfill.bench.sim.finetune_sim import qos_text

    lines = [f"| mode | finetune samples/s | decode P99 TPOT ms (target {args.tpot_target_ms:.0f}) | P99 ITL ms | QoS |",
             "|---|---|---|---|---|"]
    for mode, row in table.items():
        itl = "-" if row["p99_itl_ms"] is None else f"{row['p99_itl_ms']:.1f}"
        lines.append(f"| {mode} | {row['samples_per_s']:.3f} | {row['p99_tpot_ms']:.1f} | {itl} | {qos_text(row)} |")
    for mode in ("harli", "partitioned"):
        if mode in table:
            ratios = ", ".join(f"{k[2:]} {v:.2f}x" for k, v in table[mode].items() if k.startswith("x_"))
            lines.append(f"\n{mode}'s finetune throughput against: {ratios} (medians over {args.rounds} rounds)")
    lines.append("\n" + closing(table, args.rounds))
    return "\n".join(lines)


def _run_sim(args, modes, loaded, latency, config) -> int:
    """The coserve benchmark's online trace (its gamma arrivals and length distributions) with its rate
    set from the fitted costs, through every mode's policy object on a simulated clock."""
    import numpy as np

    from backfill.bench.sim.finetune_sim import SimCosts, online_requests, simulate
    from backfill.policy.harli import make_colo_policy

    from backfill.finetune.data import load_training_file
    from backfill.finetune.profile import synthetic_training_file

    layers = loaded.config.num_layers
    with tempfile.TemporaryDirectory() as tmp:  # the real bench's data: how many head slices a micro-batch has
        samples = load_training_file(synthetic_training_file(Path(tmp) / "t.jsonl", loaded.tokenizer, num=64),
                                     loaded.tokenizer, config.max_seq_len)
    targets = config.micro_batch_size * float(np.mean([s.num_targets for s in samples]))
    head_slices = max(1, math.ceil(targets / config.loss_rows_per_unit))
    micro_batches = -(-config.batch_size // config.micro_batch_size)
    pieces = micro_batches * (2 * layers + head_slices) + 1
    t = latency.unit_ms or {"forward": 20.0, "head": 20.0, "backward": 20.0, "update": 20.0}
    # The mean unit over a step's pieces: each layer forward and backward, the head's slices per
    # micro-batch, the update.
    unit_ms = (micro_batches * (layers * (t["forward"] + t["backward"]) + head_slices * t["head"]) + t["update"]) / pieces
    forward_ms = t["forward"]
    # A prefill of n tokens costs about a forward of the model over them (profiled pieces: a layer of
    # max_seq_len tokens, at most 128 in the profile).
    prefill = lambda n: forward_ms * layers * n / 128  # noqa: E731
    costs = SimCosts(latency, unit_ms * config.layers_per_unit, pieces, config.batch_size, prefill, args.sim_noise_cv)
    decode_ms = lambda ctx: latency.solo_ms(1, ctx, 1.0)  # noqa: E731
    duration_s = sim_duration_s(args.duration, args.rounds, lambda d, k: len(online_requests(
        d, args.online_load, k, prefill, decode_ms)))
    if duration_s != args.duration:
        print(f"simulating {duration_s:g} s of trace a mode instead of --duration {args.duration:g}: every round "
              f"then has {SIM_MIN_REQUESTS}+ online requests behind its P99 (a simulation runs as long as it needs)",
              flush=True)
        args.duration = duration_s
    print(f"simulated modes: {SOLO} (the reference) and {', '.join(modes)}, {args.rounds} round(s)", flush=True)
    results: dict[str, list[dict]] = {}
    for k in range(args.rounds):
        requests = online_requests(args.duration, args.online_load, k, prefill, decode_ms)
        for mode in (SOLO, *modes):
            if mode == "separate":
                r = simulate(None, requests, costs, args.duration, args.tpot_target_ms, seed=k,
                             separate_share_infer=args.static_share_infer)
            else:
                policy = _NoFinetune() if mode == SOLO else make_colo_policy(mode, latency, args.static_share_infer)
                r = simulate(policy, requests, costs, args.duration, args.tpot_target_ms or 1e9, seed=k)
            results.setdefault(mode, []).append(r)
            if mode == SOLO and args.tpot_target_ms is None:
                args.tpot_target_ms = args.tpot_target_x_solo * r["p99_tpot_ms"]
    table = _table(results, args.tpot_target_ms)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sim-result.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items() if k != "func"},
                                                     "unit_ms": unit_ms, "rounds": results, "table": table}, indent=1))
    print("simulated (policy objects on a simulated clock, costs from the fitted predictor):")
    print(_markdown(table, args))
    print(f"wrote {out / 'sim-result.json'}")
    return 0


# A simulated round holds at least this many online requests: the P99 verdicts' minimum with a
# margin (a P99 of exactly 20 is close to their maximum).
SIM_MIN_REQUESTS = 40


def sim_duration_s(duration_s: float, rounds: int, requests_in) -> float:
    """The simulated trace length a mode needs so that every round holds SIM_MIN_REQUESTS online
    requests (requests_in(duration_s, round) counts them): duration_s, or longer in steps of 1.5x."""
    if not duration_s > 0:
        raise ValueError(f"duration_s must be positive, got {duration_s}")
    for _ in range(40):
        if min(requests_in(duration_s, k) for k in range(rounds)) >= SIM_MIN_REQUESTS:
            return duration_s
        duration_s = math.ceil(duration_s * 1.5)
    raise ValueError(f"no trace up to {duration_s:g} s holds {SIM_MIN_REQUESTS} online requests")


class _NoFinetune(ColocationPolicy):
    """The solo reference's policy: never a unit."""

    name = SOLO

    def plan(self, state: ColoState) -> ColoPlan:
        return ColoPlan(0, 0.0, float("inf"), "solo")
