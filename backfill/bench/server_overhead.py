"""`backfill bench server`: what the HTTP server adds to online latency, measured side by side.

The co-serving scenario runs twice with the same SLOs and seed: once against the in-process
AsyncEngine, then against `backfill serve` started as a subprocess on a free 127.0.0.1 port
(online requests streamed over /v1/completions, offline ones with service_tier=flex). The
report's ratios are HTTP over in-process.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

from backfill.bench.coserve_bench import _run_round, load_and_profile, make_workload, pool_rounds, run_http_bench
from backfill.bench.scenario import CoserveScenario
from backfill.bench.http_target import served_model
from backfill.bench.report import ModeResult, print_summary, write_report
from backfill.bench.server_process import served
from backfill.options import as_flags, options_of
from backfill.policy.config import CoServeConfig
from backfill.types import SLO
from backfill.serving.async_engine import AsyncEngine
from backfill.serving.build import build_scheduler
from backfill.serving.config import ServingConfig


def run_server_overhead_bench(scenario: CoserveScenario, serving: ServingConfig, slo: SLO,
                              out_dir: str | Path = "runs/server", progress: bool = True) -> dict[str, ModeResult]:
    loaded, runner, latency = load_and_profile(serving)
    cfg = replace(serving, policy="coserve", coserve=replace(serving.coserve, slo=slo))
    engine = AsyncEngine(build_scheduler(runner, cfg, loaded.tokenizer, loaded.config.name, latency),
                         loaded.tokenizer, loaded.config.name)
    workload = make_workload(scenario, loaded.tokenizer, latency, with_offline=True)
    results = {"in-process": pool_rounds([asyncio.run(_run_round(engine, workload, progress))], slo)}
    print_summary("in-process", results["in-process"].metrics)
    del engine, runner

    server_args = ["--policy", "coserve", "--dtype", serving.resolved_dtype, "--device", serving.device,
                   "--kv-cache-gb", str(serving.kv_cache_gb), "--ttft-slo-ms", str(slo.ttft_ms),
                   "--tpot-slo-ms", str(slo.tpot_ms), "--max-online-queue", "100000",
                   "--admission-ttft-share", "inf", "--log-level", "warning",
                   *as_flags(cfg, options_of(CoServeConfig, "coserve"))]
    if serving.model:
        server_args += ["--model", serving.model]
    with served(server_args) as url:
        model = served_model(url)
        results["http"] = run_http_bench(url, model, scenario, loaded.tokenizer, latency, label="http",
                                         out_dir=Path(out_dir) / "http-only", progress=progress)
    write_report(results, out_dir, baseline="in-process")
    return results
