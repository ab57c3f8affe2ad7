"""The device check split into parts that each fit one device call, sized for their verdicts.

A GPU is lent now and then, for one command of at most PER_CALL_LIMIT_S at a time. One call that
runs everything (scripts/gpu_check.sh OUT) leaves each part too little time for a verdict: a P99
from 16 online requests is their maximum. `scripts/gpu_check.sh --part NAME OUT` runs one part
sized for its verdict instead: at least MIN_ONLINE_REQUESTS online requests for a P99, windows of at
least MIN_WINDOW_S, enough reclamations; each writes OUT/NAME/part.json with the git commit it ran.

The sizes are planned here, on the CPU, from the H200 step-latency profile shipped with backfill
(bench/data/h200-llama3-8b): the online arrival rate a load gives is the one `bench coserve` will
use on that device. A part whose verdict needs more than one call says so (`--list`), and is not
run: it needs a longer call, or its own scenario split over several.

    python -m backfill.bench.gpu_parts --list            # every part: its size, estimate, fit
    python -m backfill.bench.gpu_parts --command NAME    # the part's command (OUT/NAME is $P)
    python -m backfill.bench.gpu_parts --record DIR NAME OUTCOME SECONDS RC   # DIR/part.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

PER_CALL_LIMIT_S = 600
# What one call leaves a part: the limit less the start, the copy back and a margin.
PART_CAP_S = 560
MIN_ONLINE_REQUESTS = 100   # a P99 from fewer is close to the maximum
MIN_WINDOW_S = 60.0
MIN_RECLAMATIONS = 20
# Loading the 8B shape with random weights and measuring its profile on the H200 (the last run's log).
MODEL_START_S = 90.0
H200_PROFILE = Path(__file__).parent / "data" / "h200-llama3-8b" / "profile-corrected.json"
MODEL_8B = "--random-weights --shape llama3-8b"
GPU_SETTING = "coserve:slo_margin_max=0.95,bank_reserve_prefills=0.25"


@dataclass(frozen=True)
class GpuCheckPart:
    name: str
    what: str
    command: str            # $PY: the interpreter, $P: the part's output folder
    estimate_s: float
    samples: str            # what its verdict rests on

    @property
    def fits(self) -> bool:
        return self.estimate_s <= PART_CAP_S


def online_requests(load: float, duration_s: float) -> int:
    """Online requests `bench coserve` sends at this load in duration_s on the H200 (its profile)."""
    from backfill.bench.coserve_bench import online_rate_per_s
    from backfill.bench.scenario import CoserveScenario
    from backfill.policy.latency_model import LatencyModel

    scenario = CoserveScenario(duration_s=duration_s, online_load=load)
    return int(online_rate_per_s(scenario, LatencyModel.load(H200_PROFILE)) * duration_s)


def coserve_duration_s(load: float) -> float:
    """The shortest window (a multiple of 10 s, at least MIN_WINDOW_S) with MIN_ONLINE_REQUESTS online requests."""
    duration = MIN_WINDOW_S
    while online_requests(load, duration) < MIN_ONLINE_REQUESTS:
        duration += 10.0
    return duration


def coserve_part(load: float) -> GpuCheckPart:
    duration = coserve_duration_s(load)
    # The defaults and the GPU setting of docs/coserving.md side by side.
    modes = ("online-only", "priority", "coserve", GPU_SETTING)
    command = (f"$PY -m backfill.cli bench coserve {MODEL_8B} --dtype bfloat16 --device cuda --kv-cache-gb 24 "
               f"--duration {duration:.0f} --rounds 1 --warmup-s 10 --online-load {load} --ttft-slo-ms 200 "
               f"--tpot-slo-ms 15 --modes {' '.join(modes)} --out $P --json $P/coserve.json")
    return GpuCheckPart(f"coserve-{load}", f"co-serving at SLOs 200 / 15 ms, online load {load}: online-only, priority, "
                                   "coserve with its defaults and the GPU setting (Llama-3-8B shape, bf16)", command,
                MODEL_START_S + 10 + len(modes) * (duration + 5),
                f"{online_requests(load, duration)} online requests a mode in {duration:.0f} s")


def parts() -> list[GpuCheckPart]:
    return [
        GpuCheckPart("engine", "engine decode at batch 1/8/32/64 against the weight-read floor, kernels, graphs, mixed steps",
             f"$PY -m backfill.cli bench engine {MODEL_8B} --device cuda --dtypes bfloat16 --no-hf --mixed-graphs "
             "--batches 1 8 32 64 --cuda-kernels torch triton --json $P/engine-bench.json", 130.0,
             "timed steps at each batch (a throughput, no P99)"),
        coserve_part(0.3), coserve_part(0.6), coserve_part(0.1),
        GpuCheckPart("harli", "HARLI: decode beside LoRA finetuning on green-context SM partitions vs pause-only, at the "
                      "decode QoS", "$PY -m backfill.bench.harli_device --out $P --device cuda --seconds 60",
             MODEL_START_S + 4 * 65, "60 s per measured run, decode steps at every 1 s period"),
        GpuCheckPart("reef", "REEF: DISB A-E, RT P99 against RT-only on prioritized streams",
             "$PY -m backfill.bench.reef_device --out $P --device cuda --duration 60 --rounds 2 --budget-s 400",
             30 + 5 * 75, "60 s per workload, split over 2 rounds of each mode"),
        GpuCheckPart("node-burst", "Valve: online + offline engine processes on one GPU (alone / valve / fifo); AQUA: 2x "
                           "burst, CFS vs FCFS paging",
             "NODE_BURST_TOTAL_S=540 NODE_BURST_NODE_S=60 NODE_BURST_BURST_S=30 bash scripts/gpu_check_node_burst.sh $P",
             60 + 3 * 70 + 30 + 120,
             f"60 s per node phase; reclamations are counted by the part (at least {MIN_RECLAMATIONS} for a "
             "no-loss verdict)"),
    ]


def part_named(name: str) -> GpuCheckPart:
    for part in parts():
        if part.name == name:
            return part
    raise SystemExit(f"no device-check part {name!r}; parts: {', '.join(p.name for p in parts())}")


def git_commit(root: Path) -> str:
    try:
        done = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else "unknown"


def record(part_dir: Path, name: str, outcome: str, seconds: int, rc: int, root: Path | None = None) -> dict:
    """Write part_dir/part.json: which part ran, at which commit, how it ended, what it was sized for."""
    root = Path(__file__).resolve().parents[2] if root is None else root
    try:
        part = asdict(part_named(name))
    except SystemExit:
        part = {"name": name}
    entry = {"part": name, "commit": git_commit(root), "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
             "outcome": outcome, "seconds": seconds, "rc": rc, "cap_s": PART_CAP_S, "plan": part}
    part_dir.mkdir(parents=True, exist_ok=True)
    (part_dir / "part.json").write_text(json.dumps(entry, indent=1) + "\n")
    return entry


def listing() -> str:
    lines = [f"device-check parts, one call each (at most {PART_CAP_S} s of a {PER_CALL_LIMIT_S} s call):"]
    for p in parts():
        fit = "fits" if p.fits else f"CANNOT FIT one call: needs about {p.estimate_s:.0f} s"
        lines.append(f"- {p.name}: {p.what}; about {p.estimate_s:.0f} s, {fit}; verdict on: {p.samples}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backfill.bench.gpu_parts", description=__doc__.split("\n")[0])
    ap.add_argument("--list", action="store_true", help="every part: its size, time estimate and whether it fits")
    ap.add_argument("--command", metavar="NAME", help="print the part's command; exit 3 if it cannot fit one call")
    ap.add_argument("--record", nargs=5, metavar=("DIR", "NAME", "OUTCOME", "SECONDS", "RC"),
                    help="write DIR/part.json with the git commit")
    args = ap.parse_args(argv)
    if args.record:
        d, name, outcome, seconds, rc = args.record
        print(json.dumps(record(Path(d), name, outcome, int(seconds), int(rc))))
        return 0
    if args.command:
        part = part_named(args.command)
        if not part.fits:
            print(f"part {part.name} cannot fit one call: about {part.estimate_s:.0f} s for {part.samples}, "
                  f"against {PART_CAP_S} s", file=sys.stderr)
            return 3
        print(part.command)
        return 0
    print(listing())
    return 0


if __name__ == "__main__":
    sys.exit(main())
