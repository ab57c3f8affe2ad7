"""In-process bursts with compiled decode's padded buckets off, then on (or in the order given), in one process.

Each part builds the engine `backfill serve` runs (bf16, compiled decode), waits for the buckets
to compile (none with "old"), and runs the bursts of python -m backfill.bench.concurrency_burst
--in-process; per level it also splits the model's forward time between steps that carry prompt
tokens and decode-only steps (the first level's split includes its unmeasured warm-up burst).

    python scripts/decode_buckets_ab.py --levels 32 64 --bursts 2 --order old new --json runs/buckets-ab.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import time

from backfill.bench.concurrency_burst import BurstShape, run_bursts
from backfill.bench.inprocess_target import InProcessTarget
from backfill.engine import compiled_decode as cd
from backfill.serving.build import build_engine
from backfill.serving.config import ServingConfig


def step_breakdown(steps, level: int) -> dict:
    """Steps and forward seconds of decode-only steps (at most `level` tokens) and of the rest."""
    agg = collections.defaultdict(lambda: [0, 0.0])
    for s in steps:
        key = "decode" if s.online_tokens + s.offline_tokens <= level else "prefill+decode"
        agg[key][0] += 1
        agg[key][1] += s.forward_ms
    return {k: {"steps": c, "forward_s": round(f / 1e3, 3)} for k, (c, f) in agg.items()}


def run_part(mode: str, args) -> dict:
    """One engine with the buckets ("new") or without ("old"), its bursts at every level."""
    real_compile_buckets = cd.CompiledDecode.compile_buckets
    if mode == "old":
        cd.CompiledDecode.compile_buckets = lambda self, background=True: None
    try:
        started = time.perf_counter()
        engine = build_engine(ServingConfig(dtype="bfloat16", compile_decode=True))
    finally:
        cd.CompiledDecode.compile_buckets = real_compile_buckets
    built = time.perf_counter() - started
    decode = engine.scheduler.runner.model.compiled_decode
    started = time.perf_counter()
    decode.wait_for_buckets()
    waited = time.perf_counter() - started
    print(f"[{mode}] build {built:.1f}s, buckets {sorted(decode.buckets)} ready {waited:.1f}s later", flush=True)
    stats = engine.scheduler.stats

    async def go() -> list[dict]:
        await engine.start()
        try:
            levels = []
            for i, level in enumerate(args.levels):
                first_step = len(stats.step_log)
                shape = BurstShape(output_tokens=args.out_tokens, bursts=args.bursts,
                                   warmup_requests=max(args.levels) if i == 0 else 0)
                result = await run_bursts(InProcessTarget(engine), engine.tokenizer, (level,), shape,
                                          log=lambda m: print(f"[{mode}] {m}", flush=True))
                breakdown = step_breakdown(list(stats.step_log)[first_step:], level)
                print(f"[{mode}]   {breakdown}", flush=True)
                levels.append({"level": level, **result[0].__dict__, "step_breakdown": breakdown})
            return levels
        finally:
            await engine.stop()

    return {"mode": mode, "build_s": built, "buckets_wait_s": waited, "levels": asyncio.run(go())}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--levels", nargs="+", type=int, default=[32, 64])
    p.add_argument("--bursts", type=int, default=2)
    p.add_argument("--out-tokens", type=int, default=64)
    p.add_argument("--order", nargs="+", choices=["old", "new"], default=["old", "new"])
    p.add_argument("--json")
    args = p.parse_args()
    out = {"order": args.order, "runs": [run_part(mode, args) for mode in args.order]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
