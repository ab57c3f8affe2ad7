"""Does a lone decode step slow down when the CPU is kept busy? Lone compiled decodes at two duty cycles.

The same decode step (one sequence, bf16, compiled) is timed in blocks that alternate between
two paces: back to back (the chip busy all the time, as under co-serving, where offline batches
fill every gap), and with an idle sleep after each step so the engine is busy about 30% of the
time (as online-only at the bench's load). Blocks alternate so that a drifting machine affects
both paces alike.

    .venv/bin/python scripts/duty_cycle_probe.py [--blocks 6] [--steps 40] [--busy-share 0.3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from backfill.engine.step import SeqChunk
from backfill.engine.weights import load_model
from backfill.serving.config import ServingConfig
from backfill.serving.build import build_runner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=6, help="blocks per pace")
    parser.add_argument("--steps", type=int, default=40, help="decode steps per block")
    parser.add_argument("--busy-share", type=float, default=0.3, help="the paced blocks' share of busy time")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    loaded = load_model(None)
    runner = build_runner(loaded.config, loaded.weights,
                          ServingConfig(dtype="bfloat16", kv_cache_gb=0.5, compile_decode=True))
    kv = runner.kv
    context = 200
    table = kv.allocate(kv.blocks_needed(context + args.steps + 1))
    runner.execute([SeqChunk("s", [5] * context, 0, table, want_logits=False)])

    def block(idle_share: float) -> list[float]:
        times = []
        for i in range(args.steps):
            out = runner.execute([SeqChunk("s", [5], context + i, table)])
            times.append(out.duration_s * 1e3)
            if idle_share > 0:
                time.sleep(out.duration_s * idle_share / (1 - idle_share))
        return times

    block(0.0)  # warm-up
    paces = {"back to back": 0.0, f"busy {args.busy_share:.0%}": 1.0 - args.busy_share}
    steps: dict[str, list[float]] = {name: [] for name in paces}
    for _ in range(args.blocks):
        for name, idle in paces.items():
            times = block(idle)
            steps[name].extend(times[5:])  # the first steps of a block still feel the other pace
    result = {name: statistics.median(ms) for name, ms in steps.items()}
    for name, ms in result.items():
        print(f"{name}: median lone decode {ms:.2f} ms over {len(steps[name])} steps")
    busy, paced = result["back to back"], result[f"busy {args.busy_share:.0%}"]
    print(f"back to back / paced: {busy / paced:.3f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"median_ms": result, "ratio": busy / paced, "steps": args.steps,
                                         "blocks": args.blocks, "busy_share": args.busy_share}, indent=1))


if __name__ == "__main__":
    main()
