"""Median step times of the default model's runner, as `backfill serve` builds it, at the sizes a
burst runs: decode steps of 1, 64, 32 and 8 sequences (contexts of 130-190 tokens, as a burst's
128-token prompts and 64-token answers make) and a prompt step of 4 x 128 tokens. About a minute.

To compare two commits on a noisy host, unpack each and run them in turns, many times:

    git archive REV backfill pyproject.toml | tar -x -C /tmp/rev
    PYTHONPATH=/tmp/rev python scripts/step_times.py --json rev-1.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from backfill.engine.step import SeqChunk
from backfill.engine.weights import load_model
from backfill.progress import Heartbeat
from backfill.serving.build import build_runner
from backfill.serving.config import ServingConfig


def decode_ms(runner, sequences: int, steps: int, context: int = 130) -> float:
    kv = runner.kv
    tables = [list(kv.allocate(kv.blocks_needed(context + 70))) for _ in range(sequences)]

    def step(k: int) -> list[SeqChunk]:
        return [SeqChunk(i, [5], context + k % 30 + i % 30, table) for i, table in enumerate(tables)]

    try:
        for k in range(3):
            runner.execute(step(k))
        times = []
        for k in range(steps):
            started = time.perf_counter()
            runner.execute(step(k))
            times.append((time.perf_counter() - started) * 1e3)
    finally:
        for table in tables:
            kv.free(table)
    return statistics.median(times)


def prompt_ms(runner, sequences: int, length: int, steps: int) -> float:
    kv, times = runner.kv, []
    for k in range(steps + 1):  # the first is a warm-up
        tables = [list(kv.allocate(kv.blocks_needed(length))) for _ in range(sequences)]
        chunks = [SeqChunk(i, [3 + (k * 7919 + i * 104729 + t) % 40000 for t in range(length)], 0, table)
                  for i, table in enumerate(tables)]
        started = time.perf_counter()
        runner.execute(chunks)
        if k:
            times.append((time.perf_counter() - started) * 1e3)
        for table in tables:
            kv.free(table)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--dtype", default="auto", help="the model's dtype, as `backfill serve --dtype` (auto)")
    args = parser.parse_args()
    log = lambda line: print(line, flush=True)  # noqa: E731
    with Heartbeat(log, "building the model and its compiled steps"):
        loaded = load_model()
        runner = build_runner(loaded.config, loaded.weights, ServingConfig(dtype=args.dtype, compile_decode=True))
        runner.wait_until_warm()
    steps = {"decode1_ms": lambda: decode_ms(runner, 1, 60), "decode64_ms": lambda: decode_ms(runner, 64, 40),
             "decode32_ms": lambda: decode_ms(runner, 32, 40), "decode8_ms": lambda: decode_ms(runner, 8, 40),
             "prompt4x128_ms": lambda: prompt_ms(runner, 4, 128, 6)}
    figures = {}
    for name, measure in steps.items():
        with Heartbeat(log, f"timing {name[:-3]}"):
            figures[name] = measure()
    print(" ".join(f"{name} {value:.1f}" for name, value in figures.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**figures, "dtype": args.dtype, "threads": torch.get_num_threads(),
                       "machine": platform.machine()}, f, indent=1)


if __name__ == "__main__":
    main()
