"""Soak a real `backfill serve` under steady online and batch load, watching for growth with uptime.

Starts `python -m backfill.server` on 127.0.0.1 (the default model, or the tiny random-weight one
with --tiny), then for --minutes keeps up: online chat completions at --online-rps (every other
one streamed), and one Batch API batch of --batch-lines lines in progress at all times (a new one
as soon as the last completes). Once a minute it samples the server's resident memory (VmRSS)
and the time a /metrics scrape takes (the median of 9), and it counts every 5xx answer. At the end
it writes JSON and prints a line per minute and a verdict: RSS and scrape time flat (the median of
the last five minutes within --flat-share of the first five's, from minute --from-minute on), no
5xx, and batch lines completed in that span.

    python scripts/soak.py --minutes 30 --json runs/soak/soak.json      # figures in docs/operations.md
    python scripts/soak.py --minutes 3 --tiny --json /tmp/soak.json     # a smoke run

Exit status 0 when the verdict holds.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from backfill.bench.server_process import free_port, stop, wait_healthy

SCRAPES_PER_SAMPLE = 9


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


class Load:
    """The online and batch clients; counts answers by status."""

    def __init__(self, url: str, online_rps: float, batch_lines: int) -> None:
        self.url, self.online_rps, self.batch_lines = url, online_rps, batch_lines
        self.statuses: Counter[int] = Counter()
        self.failures: Counter[str] = Counter()   # transport errors by type
        self.batches_completed = 0
        self.lines_completed = 0
        self.stopping = threading.Event()
        self._lock = threading.Lock()

    def count(self, status: int) -> None:
        with self._lock:
            self.statuses[status] += 1

    def online(self) -> None:
        body = {"messages": [{"role": "user", "content": "Say something about the sea."}], "max_tokens": 16}
        with httpx.Client(base_url=self.url, timeout=120) as http:
            sent = 0
            started = time.monotonic()
            while not self.stopping.is_set():
                stream = sent % 2 == 1
                try:
                    if stream:
                        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
                            for _ in response.iter_lines():
                                pass
                            self.count(response.status_code)
                    else:
                        self.count(http.post("/v1/chat/completions", json=body).status_code)
                except httpx.HTTPError as exc:
                    with self._lock:
                        self.failures[type(exc).__name__] += 1
                sent += 1
                # A steady rate: the next request at its slot, not after the last answer plus a gap.
                self.stopping.wait(max(0.0, started + sent / self.online_rps - time.monotonic()))

    def batches(self) -> None:
        line = {"method": "POST", "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": "Write a line of a poem."}], "max_tokens": 16}}
        content = "\n".join(json.dumps({**line, "custom_id": f"l{i}"}) for i in range(self.batch_lines)).encode()
        with httpx.Client(base_url=self.url, timeout=120) as http:
            while not self.stopping.is_set():
                try:
                    file = http.post("/v1/files", files={"file": ("in.jsonl", io.BytesIO(content))},
                                     data={"purpose": "batch"})
                    self.count(file.status_code)
                    batch = http.post("/v1/batches", json={"input_file_id": file.json()["id"],
                                                           "endpoint": "/v1/chat/completions",
                                                           "completion_window": "24h"})
                    self.count(batch.status_code)
                    while not self.stopping.wait(2.0):
                        state = http.get(f"/v1/batches/{batch.json()['id']}")
                        self.count(state.status_code)
                        if state.json()["status"] in ("completed", "failed", "cancelled", "expired"):
                            self.batches_completed += state.json()["status"] == "completed"
                            self.lines_completed += state.json()["request_counts"]["completed"]
                            break
                except (httpx.HTTPError, KeyError, ValueError) as exc:
                    with self._lock:
                        self.failures[type(exc).__name__] += 1
                    self.stopping.wait(1.0)


FLAT_SPAN = 5   # minutes whose median stands for the start and for the end of the judged span


def flat(values: list[float], share: float) -> tuple[bool, float]:
    """Whether the end is within share of the start (growth only counts), and the ratio: the median
    of the last FLAT_SPAN values against the median of the first FLAT_SPAN, so that one minute on a
    shared machine's busy second neither passes nor fails the run."""
    if not values:
        return False, float("nan")
    span = max(1, min(FLAT_SPAN, len(values) // 2))
    first, last = statistics.median(values[:span]), statistics.median(values[-span:])
    ratio = last / first if first > 0 else float("nan")
    return ratio <= 1 + share, ratio


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=int, default=30)
    parser.add_argument("--online-rps", type=float, default=1.0, help="online requests per second")
    parser.add_argument("--batch-lines", type=int, default=50, help="lines of each batch kept in progress")
    parser.add_argument("--from-minute", type=int, default=5, help="flatness is judged from this minute "
                        "(at most half the run) to the end: the first minutes warm caches up")
    parser.add_argument("--flat-share", type=float, default=0.10, help="allowed growth of RSS and scrape time")
    parser.add_argument("--tiny", action="store_true", help="the tiny random-weight model (a smoke run)")
    parser.add_argument("--json", default=None, help="write the samples and the verdict here")
    parser.add_argument("server_args", nargs="*", help="more `backfill serve` options (after --)")
    args = parser.parse_args(argv)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "backfill.server", "--host", "127.0.0.1", "--port", str(port),
                   "--db", str(Path(tmp) / "soak.db"), "--log-level", "warning",
                   *(["--tiny"] if args.tiny else []), *args.server_args]
        proc = subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            wait_healthy(url, proc, timeout_s=900)
            samples = soak(url, proc.pid, args)
        finally:
            stop(proc)

    judged = [s for s in samples if s["minute"] >= min(args.from_minute, max(1, args.minutes // 2))]
    rss_flat, rss_ratio = flat([s["rss_mb"] for s in judged], args.flat_share)
    scrape_flat, scrape_ratio = flat([s["scrape_ms"] for s in judged], args.flat_share)
    last = samples[-1]
    # The batch load must have been served too: a soak whose offline work starved proves nothing about it.
    lines_judged = last["batch_lines_completed"] - judged[0]["batch_lines_completed"]
    verdict = {"rss_flat": rss_flat, "rss_ratio": rss_ratio, "scrape_flat": scrape_flat,
               "scrape_ratio": scrape_ratio, "server_errors_5xx": last["server_errors_5xx"],
               "batch_lines_in_judged_span": lines_judged, "from_minute": judged[0]["minute"],
               "holds": rss_flat and scrape_flat and last["server_errors_5xx"] == 0 and lines_judged > 0}
    for s in samples:
        print(f"minute {s['minute']:3d}: RSS {s['rss_mb']:7.1f} MiB, /metrics {s['scrape_ms']:6.1f} ms, "
              f"{s['requests']} answers, {s['server_errors_5xx']} 5xx, {s['batch_lines_completed']} batch lines")
    print(f"from minute {verdict['from_minute']}: RSS x{rss_ratio:.3f}, scrape time x{scrape_ratio:.3f}, "
          f"{verdict['server_errors_5xx']} 5xx, {lines_judged} batch lines completed -> "
          f"{'holds' if verdict['holds'] else 'does NOT hold'}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"config": vars(args), "samples": samples, "verdict": verdict},
                                              indent=2))
    return 0 if verdict["holds"] else 1


def soak(url: str, pid: int, args: argparse.Namespace) -> list[dict]:
    load = Load(url, args.online_rps, args.batch_lines)
    workers = [threading.Thread(target=load.online, daemon=True), threading.Thread(target=load.batches, daemon=True)]
    for worker in workers:
        worker.start()
    samples = []
    started = time.monotonic()
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            for minute in range(1, args.minutes + 1):
                time.sleep(max(0.0, started + 60 * minute - time.monotonic()))
                times_ms = []
                for _ in range(SCRAPES_PER_SAMPLE):   # the median: one scrape on a busy machine is noise
                    t0 = time.perf_counter()
                    scrape = http.get("/metrics")
                    times_ms.append((time.perf_counter() - t0) * 1e3)
                    load.count(scrape.status_code)
                scrape_ms = statistics.median(times_ms)
                statuses = dict(load.statuses)
                samples.append({"minute": minute, "rss_mb": rss_mb(pid), "scrape_ms": scrape_ms,
                                "metrics_bytes": len(scrape.content), "requests": sum(statuses.values()),
                                "statuses": statuses, "transport_errors": dict(load.failures),
                                "server_errors_5xx": sum(n for code, n in statuses.items() if code >= 500),
                                "batches_completed": load.batches_completed,
                                "batch_lines_completed": load.lines_completed})
                print(f"minute {minute}: RSS {samples[-1]['rss_mb']:.1f} MiB, /metrics {scrape_ms:.1f} ms",
                      flush=True)
    finally:
        load.stopping.set()
        for worker in workers:
            worker.join(timeout=120)
    return samples


if __name__ == "__main__":
    sys.exit(main())
