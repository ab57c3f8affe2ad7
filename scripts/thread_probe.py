"""Decode step time of one online request: the scheduler stepped directly vs. inside AsyncEngine.

Shows the cost of running torch on a second thread (a second OpenMP pool, see
backfill/serving/torch_thread.py). --split builds the model on the main thread, so the engine
loop runs on another, as it did before the torch thread existed.

    .venv/bin/python scripts/thread_probe.py [--split] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from backfill.bench.engine_bench import _prompt
from backfill.sampling_params import SamplingParams
from backfill.engine.weights import load_model
from backfill.serving import scheduler as scheduler_module
from backfill.types import GenerationRequest, RequestClass
from backfill.serving.config import ServingConfig
from backfill.serving.build import build_runner, build_scheduler
from backfill.serving.async_engine import AsyncEngine
from backfill.serving.torch_thread import run_on_torch_thread

STEP_MS: list[float] = []


def _timed_run_plan(original):
    def run_plan(self, plan):
        start = time.perf_counter()
        try:
            return original(self, plan)
        finally:
            STEP_MS.append((time.perf_counter() - start) * 1e3)
    return run_plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", action="store_true", help="build on the main thread, run on another")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    scheduler_module.Scheduler._run_plan = _timed_run_plan(scheduler_module.Scheduler._run_plan)
    cfg = ServingConfig(dtype="bfloat16", kv_cache_gb=0.5, policy="online-only")

    def build():
        loaded = load_model(None)
        return loaded, build_runner(loaded.config, loaded.weights, cfg)

    loaded, runner = build() if args.split else run_on_torch_thread(build)

    def request() -> GenerationRequest:
        return GenerationRequest(_prompt(150, 3, loaded.config.vocab_size),
                                 SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True), RequestClass.ONLINE)

    def direct() -> float:
        scheduler = build_scheduler(runner, cfg, loaded.tokenizer, loaded.config.name)
        scheduler.add(request())
        STEP_MS.clear()
        while scheduler.has_work():
            scheduler.step()
        return statistics.median(STEP_MS[2:])

    async def engine() -> float:
        eng = AsyncEngine(build_scheduler(runner, cfg, loaded.tokenizer, loaded.config.name), loaded.tokenizer)
        await eng.start()
        STEP_MS.clear()
        async for _ in eng.submit(request()):
            pass
        await eng.stop()
        return statistics.median(STEP_MS[2:])

    for _ in range(args.rounds):
        d = direct() if args.split else run_on_torch_thread(direct)
        print(f"scheduler stepped directly: {d:.1f} ms   inside AsyncEngine: {asyncio.run(engine()):.1f} ms")


if __name__ == "__main__":
    main()
