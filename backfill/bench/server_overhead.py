"""`backfill bench server`: what the HTTP server adds to online latency, measured side by side.

The co-serving scenario runs twice with the same SLOs and seed: once against the in-process
AsyncEngine, then against `backfill serve` started as a subprocess on a free 127.0.0.1 port
(online requests streamed over /v1/completions, offline ones with service_tier=flex). The
report's ratios are HTTP over in-process.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx

from backfill.bench.coserve_bench import _run_round, load_and_profile, make_workload, pool_rounds, run_http_bench
from backfill.bench.scenario import CoserveScenario
from backfill.bench.report import ModeResult, print_summary, write_report
from backfill.errors import BackfillError
from backfill.options import as_flags, options_of
from backfill.policy.coserve import CoServeConfig
from backfill.serving.api import SLO
from backfill.serving.async_engine import AsyncEngine
from backfill.serving.build import build_scheduler
from backfill.serving.config import ServingConfig


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BackfillError(f"server exited with code {proc.returncode} before it was healthy")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise BackfillError(f"server at {url} not healthy after {timeout_s:.0f} s")


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

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "backfill.server", "--host", "127.0.0.1", "--port", str(port),
               "--policy", "coserve", "--dtype", serving.resolved_dtype, "--device", serving.device,
               "--kv-cache-gb", str(serving.kv_cache_gb), "--ttft-slo-ms", str(slo.ttft_ms),
               "--tpot-slo-ms", str(slo.tpot_ms), "--db", str(Path(tmp) / "server.db"),
               "--max-online-queue", "100000", "--admission-ttft-share", "inf", "--log-level", "warning",
               *as_flags(cfg, options_of(CoServeConfig, "coserve"))]
        if serving.model:
            cmd += ["--model", serving.model]
        proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            _wait_healthy(url, proc)
            model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
            results["http"] = run_http_bench(url, model, scenario, loaded.tokenizer, latency, label="http",
                                             out_dir=Path(out_dir) / "http-only", progress=progress)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    write_report(results, out_dir, baseline="in-process")
    return results
