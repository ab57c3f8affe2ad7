"""Decode step time of one online request: the scheduler stepped directly vs. inside AsyncEngine.

Shows the cost of running torch on a second thread (a second OpenMP pool, see
backfill/serving/torch_thread.py). --split builds the model on the main thread and runs the
engine loop on another, as the engine did before the torch thread existed.

    .venv/bin/python scripts/thread_probe.py [--split] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time

from backfill.bench.engine_bench import _prompt
from backfill.engine.sampling_params import SamplingParams
from backfill.engine.weights import load_model
from backfill.serving import scheduler as scheduler_module
from backfill.serving.api import GenerationRequest, RequestClass
from backfill.serving.build import ServingConfig, build_runner, build_scheduler
from backfill.serving.engine import AsyncEngine
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
    build = lambda: (lambda m: (m, build_runner(m.config, m.weights, cfg)))(load_model(None))  # noqa: E731
    if args.split:
        loaded, runner = build()
    else:
        loaded, runner = run_on_torch_thread(build)

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
        if args.split:
            await _start_on_own_thread(eng)
        else:
            await eng.start()
        STEP_MS.clear()
        async for _ in eng.submit(request()):
            pass
        await eng.stop()
        return statistics.median(STEP_MS[2:])

    for _ in range(args.rounds):
        d = direct() if args.split else run_on_torch_thread(direct)
        print(f"scheduler stepped directly: {d:.1f} ms   inside AsyncEngine: {asyncio.run(engine()):.1f} ms")


async def _start_on_own_thread(engine: AsyncEngine) -> None:
    from concurrent.futures import Future

    engine._loop = asyncio.get_running_loop()
    future: Future = Future()

    def run() -> None:
        engine._run()
        future.set_result(None)

    threading.Thread(target=run, daemon=True).start()
    engine._loop_future = future


if __name__ == "__main__":
    main()
