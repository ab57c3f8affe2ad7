#!/usr/bin/env python3
"""Check that every panel of backfill's Grafana dashboard and of vLLM's published one returns data.

Starts `backfill serve` on 127.0.0.1 under load (online requests, flex requests and a batch),
starts Prometheus (Debian: apt-get install prometheus) on 127.0.0.1 scraping it every second,
waits, then sends every panel's query of deploy/grafana/dashboards/backfill.json and vllm.json
(vLLM's, verbatim) to Prometheus' HTTP API, with Grafana's variables filled in as Grafana would
($__rate_interval, the instance and model chosen). Exits 0 when each query returns at least one
series and every value is a finite number; 1 otherwise (and says which).

    python scripts/check_dashboard_queries.py                 # the tiny test model: fast
    python scripts/check_dashboard_queries.py --serve-args "--model /path/model.gguf"
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
DASHBOARDS = (ROOT / "deploy" / "grafana" / "dashboards" / "backfill.json",
              ROOT / "deploy" / "grafana" / "dashboards" / "vllm.json")
RATE_INTERVAL = "1m"   # what Grafana's $__rate_interval is for a 1 s scrape over a 15-minute view


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(check, timeout_s: float, what: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what}: the process exited with {proc.returncode}")
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{what}: not up after {timeout_s:.0f} s")


def panel_queries(path: Path) -> list[tuple[str, str, str]]:
    """(panel title, legend, PromQL) of every target of every panel."""
    dashboard = json.loads(path.read_text())
    return [(f"{path.stem}: {panel['title']}", target.get("legendFormat", ""), target["expr"])
            for panel in dashboard["panels"] for target in panel.get("targets", [])]


def fill_variables(expr: str, model_name: str) -> str:
    """The query as Grafana sends it: every instance (regex), the served model, $__rate_interval."""
    return (expr.replace("$__rate_interval", RATE_INTERVAL).replace('=~"$instance"', '=~".*"')
            .replace('=~"$model_name"', '=~".*"').replace("$model_name", model_name))


def load(url: str, stop: threading.Event) -> None:
    """Online requests and flex (offline-class) requests back to back, and one batch of lines."""
    lines = "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"messages": [{"role": "user", "content": f"line {i}"}], "max_tokens": 32,
                                         "ignore_eos": True}}) + "\n" for i in range(400))
    with httpx.Client(base_url=url, timeout=120) as http:
        upload = http.post("/v1/files", files={"file": ("lines.jsonl", io.BytesIO(lines.encode()))},
                           data={"purpose": "batch"})
        upload.raise_for_status()
        http.post("/v1/batches", json={"input_file_id": upload.json()["id"], "endpoint": "/v1/chat/completions",
                                       "completion_window": "24h"}).raise_for_status()

    def client(body: dict, pause_s: float) -> None:
        with httpx.Client(base_url=url, timeout=120) as http:
            while not stop.is_set():
                http.post("/v1/completions", json=body)
                stop.wait(pause_s)

    bodies = [({"prompt": "hello " * 16, "max_tokens": 16, "ignore_eos": True}, 0.2)] * 2 + \
             [({"prompt": "summarise " * 8, "max_tokens": 48, "ignore_eos": True, "service_tier": "flex"}, 0.0)]
    threads = [threading.Thread(target=client, args=args, daemon=True) for args in bodies]
    for thread in threads:
        thread.start()


def check(prometheus_url: str, queries: list[tuple[str, str, str]]) -> list[str]:
    """The failures: queries with no series, or with a value that is not a finite number."""
    failures = []
    with httpx.Client(base_url=prometheus_url, timeout=30) as http:
        for title, legend, expr in queries:
            answer = http.get("/api/v1/query", params={"query": expr}).json()
            result = answer.get("data", {}).get("result", [])
            values = [float(series["value"][1]) for series in result]
            ok = answer.get("status") == "success" and values and all(math.isfinite(v) for v in values)
            shown = ", ".join(f"{v:.4g}" for v in values[:4]) + (" ..." if len(values) > 4 else "")
            print(f"{'ok  ' if ok else 'FAIL'} {title} [{legend}]: {len(values)} series ({shown})")
            if not ok:
                failures.append(f"{title} [{legend}]: {expr} -> {answer.get('error') or result}")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve-args", default="--tiny", help="arguments of `backfill serve` beside its "
                        "host, port and database (default: the tiny test model)")
    parser.add_argument("--prometheus", default=shutil.which("prometheus") or "prometheus",
                        help="the Prometheus binary")
    parser.add_argument("--load-s", type=float, default=45.0, help="seconds of load scraped before the queries")
    args = parser.parse_args(argv)
    if shutil.which(args.prometheus) is None:
        print(f"no Prometheus binary {args.prometheus!r} (Debian: apt-get install prometheus)", file=sys.stderr)
        return 2
    queries = [query for path in DASHBOARDS for query in panel_queries(path)]
    work = Path(tempfile.mkdtemp(prefix="backfill-dashboard-check-"))
    serve_port, prometheus_port = free_port(), free_port()
    serve_url, prometheus_url = f"http://127.0.0.1:{serve_port}", f"http://127.0.0.1:{prometheus_port}"
    (work / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"scrape_configs:\n  - job_name: backfill\n    static_configs:\n      - targets: ['127.0.0.1:{serve_port}']\n")
    stop = threading.Event()
    processes: list[subprocess.Popen] = []
    try:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        with open(work / "serve.log", "wb") as serve_log, open(work / "prometheus.log", "wb") as prometheus_log:
            serve = subprocess.Popen([sys.executable, "-m", "backfill.cli", "serve", "--host", "127.0.0.1", "--port",
                                      str(serve_port), "--db", str(work / "serve.db"), "--log-level", "warning",
                                      *shlex.split(args.serve_args)], cwd=ROOT, env=env, stdout=serve_log,
                                     stderr=subprocess.STDOUT)
            processes.append(serve)
            wait_until(lambda: httpx.get(f"{serve_url}/ready", timeout=2).status_code == 200, 900,
                       "backfill serve", serve)
            prometheus = subprocess.Popen([args.prometheus, f"--config.file={work / 'prometheus.yml'}",
                                           f"--storage.tsdb.path={work / 'tsdb'}",
                                           f"--web.listen-address=127.0.0.1:{prometheus_port}"],
                                          stdout=prometheus_log, stderr=subprocess.STDOUT)
            processes.append(prometheus)
            wait_until(lambda: httpx.get(f"{prometheus_url}/-/ready", timeout=2).status_code == 200, 120,
                       "prometheus", prometheus)
            print(f"backfill serve on {serve_url}, Prometheus on {prometheus_url}; {args.load_s:g} s of load ...")
            model_name = httpx.get(f"{serve_url}/v1/models", timeout=10).json()["data"][0]["id"]
            queries = [(title, legend, fill_variables(expr, model_name)) for title, legend, expr in queries]
            load(serve_url, stop)
            time.sleep(args.load_s)
            failures = check(prometheus_url, queries)
    finally:
        stop.set()
        for proc in reversed(processes):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in processes:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    print(f"{len(queries) - len(failures)}/{len(queries)} panel queries returned data")
    if failures:
        print("\n".join(["failed:", *failures]), file=sys.stderr)
        print(f"logs in {work}", file=sys.stderr)
        return 1
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
