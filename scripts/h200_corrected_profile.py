"""Derive the corrected H200 latency profile from the measurements in docs/results/h200-llama3-8b/.

`backfill profile` on that device (profile-bf16.json, an older profiler that kept the fastest of a
few runs and a running maximum) carried single slow points across its tables: one value for every
eager step from 8 to 512 tokens, one for every decode batch from 3 to 64 sequences (docs/simulator.md
has the figures). The engine bench on the same device (engine-bench.json) measured those steps:

- decode table (CUDA graphs): the bench's TPOT at 1 / 8 / 32 / 64 sequences less their context's
  attention (the profile's ms_per_kctx at the bench's mean context), at the graph buckets
  (backfill/engine/cuda_graphs.py BATCH_BUCKETS) with buckets the bench skipped interpolated, and
  padded: n sequences cost their bucket's step, so the table steps at each bucket's end;
- token table (eager steps, with a prompt chunk): the profile's 1 to 4 token points (they agree
  with the bench's eager decode of one sequence), the bench's eager decodes of 8 / 32 / 64
  sequences less their context, its 512-token prefill and the profile's 1024-token point,
  interpolated between and made non-decreasing;
- mixed table (steps with a prompt chunk replayed from the mixed-step graphs, which the device has
  not run yet): the eager step's cost less the launch time graphs remove, where both were measured
  at the same size: token table (n) - (eager decode (n) - graph decode (n)) at the bench's 1 / 8 /
  32 / 64, each less its context, then padded to the graph buckets as the decode table is. A mixed
  step of n tokens runs the graph of an n-row decode (every prompt token a row of the decode
  attention), so where the token table is the eager decode (8 to 64) this is the graph decode;
  past 64 tokens nothing graphs and nothing is derived;
- ms_per_kctx and ms_per_mpair as the profile measured them.

Usage: python scripts/h200_corrected_profile.py [SRC_DIR] [OUT_JSON]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from backfill.engine.cuda_graphs import BATCH_BUCKETS
from backfill.policy.latency_model import LatencyModel
from backfill.serving.profiler import _monotone

ROOT = Path(__file__).resolve().parents[1]


def corrected(profile: dict, bench: dict) -> LatencyModel:
    run = bench["runs"]["bfloat16"]
    ctx_mean = bench["prompt_tokens"] + bench["new_tokens"] / 2  # the bench decodes from 128 to 160
    kctx = profile["ms_per_kctx"]

    def less_context(rows: list[dict]) -> dict[int, float]:
        return {r["batch"]: r["tpot_ms"] - kctx * r["batch"] * ctx_mean / 1e3 for r in rows}

    graph = less_context(run["decode"])
    batches = sorted(graph)
    bucket_ms = {b: float(np.interp(b, batches, [graph[x] for x in batches])) for b in BATCH_BUCKETS}
    decode_grid, decode_ms = [], []
    previous = 0
    for b in BATCH_BUCKETS:  # n in (previous, b] runs on bucket b's graph
        for n in sorted({previous + 1, b}):
            decode_grid.append(n)
            decode_ms.append(bucket_ms[b])
        previous = b

    eager = less_context(run["decode_without_cuda_graphs"])
    points = {n: ms for n, ms in zip(profile["token_grid"], profile["step_ms"]) if n <= 4}
    points |= {n: ms for n, ms in eager.items() if n > 4}
    points[run["prefill"]["prompt_tokens"]] = run["prefill"]["ms"]
    points[1024] = profile["step_ms"][profile["token_grid"].index(1024)]
    grid = tuple(profile["token_grid"])
    known = sorted(points)
    step_ms = [float(np.interp(n, known, [points[k] for k in known])) for n in grid]

    def eager_step(n: int) -> float:
        return float(np.interp(n, grid, step_ms))

    mixed = {b: eager_step(b) - (eager[b] - graph[b]) for b in batches}
    mixed_bucket = {b: float(np.interp(b, batches, [mixed[x] for x in batches])) for b in BATCH_BUCKETS}
    mixed_grid, mixed_ms = [], []
    previous = 0
    for b in BATCH_BUCKETS:
        for n in sorted({previous + 1, b}):
            mixed_grid.append(n)
            mixed_ms.append(mixed_bucket[b])
        previous = b
    return LatencyModel(grid, _monotone(step_ms), kctx, profile["ms_per_mpair"], "cuda",
                        profile.get("model_name", ""), tuple(decode_grid), _monotone(decode_ms),
                        tuple(mixed_grid), _monotone(mixed_ms))


def main() -> int:
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs/results/h200-llama3-8b"
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else src / "profile-corrected.json"
    model = corrected(json.loads((src / "profile-bf16.json").read_text()),
                      json.loads((src / "engine-bench.json").read_text()))
    model.save(out)
    print(f"token table (ms): {dict(zip(model.token_grid, (round(x, 2) for x in model.step_ms)))}")
    print(f"decode table (ms): {dict(zip(model.decode_grid, (round(x, 2) for x in model.decode_ms)))}")
    print(f"mixed table (ms): {dict(zip(model.mixed_grid, (round(x, 2) for x in model.mixed_ms)))}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
