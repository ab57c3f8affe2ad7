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

from backfill.bench.concurrency_burst import run_bursts, BurstShape
from backfill.bench.inprocess_target import InProcessTarget
from backfill.engine import compiled_decode as cd
from backfill.serving.build import build_engine
from backfill.serving.config import ServingConfig
p = argparse.ArgumentParser()
p.add_argument("--levels", nargs="+", type=int, default=[32, 64])
p.add_argument("--bursts", type=int, default=2)
p.add_argument("--out-tokens", type=int, default=64)
p.add_argument("--order", nargs="+", default=["old", "new"])
p.add_argument("--json")
a = p.parse_args()
real_compile_buckets = cd.CompiledDecode.compile_buckets
out = {"order": a.order, "runs": []}
def summarize(steps, lvl):
    agg = collections.defaultdict(lambda: [0, 0.0])
    for s in steps:
        tok = s.online_tokens + s.offline_tokens
        key = "decode" if tok <= lvl else "prefill+decode"
        agg[key][0] += 1; agg[key][1] += s.forward_ms
    return {k: {"steps": c, "forward_s": round(f / 1e3, 3)} for k, (c, f) in agg.items()}
for mode in a.order:
    cd.CompiledDecode.compile_buckets = real_compile_buckets if mode == "new" else (lambda self, background=True: None)
    t0 = time.perf_counter()
    engine = build_engine(ServingConfig(dtype="bfloat16", compile_decode=True))
    built = time.perf_counter() - t0
    decode = engine.scheduler.runner.model.compiled_decode
    t1 = time.perf_counter(); decode.wait_for_buckets(); waited = time.perf_counter() - t1
    print(f"[{mode}] build {built:.1f}s, buckets {sorted(decode.buckets)} ready {waited:.1f}s later", flush=True)
    stats = engine.scheduler.stats
    async def go():
        await engine.start()
        try:
            res = []
            for i, lvl in enumerate(a.levels):
                n0 = len(stats.step_log)
                r = await run_bursts(InProcessTarget(engine), engine.tokenizer, (lvl,),
                                     BurstShape(output_tokens=a.out_tokens, bursts=a.bursts,
                                                warmup_requests=max(a.levels) if i == 0 else 0),
                                     log=lambda m: print(f"[{mode}] {m}", flush=True))
                steps = list(stats.step_log)[n0:]
                s = summarize(steps[-len(steps) // 1:], lvl)
                print(f"[{mode}]   {s}", flush=True)
                res.append({"level": lvl, **r[0].__dict__, "step_breakdown": s})
            return res
        finally:
            await engine.stop()
    out["runs"].append({"mode": mode, "build_s": built, "buckets_wait_s": waited, "levels": asyncio.run(go())})
    del engine
if a.json:
    json.dump(out, open(a.json, "w"), indent=1)
