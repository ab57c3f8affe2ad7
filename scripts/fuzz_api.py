"""Property-based fuzzing of the whole HTTP API from its OpenAPI document.

Starts `python -m backfill.server` on 127.0.0.1 (the tiny random-weight model by default, or the
default model with --real-model), reads /openapi.json, and sends requests generated from it to
every operation (schemathesis's generators over hypothesis): bodies from each operation's
request-body schema, path parameters as generated text or ids the server handed out, query
parameters from their schemas.
A response 5xx or one that does not come back within --timeout-s (a hang) is a finding; at the
end the server must still answer /health.

    python scripts/fuzz_api.py --requests 1000            # figures in docs/server.md
    python scripts/fuzz_api.py --requests 100 --json out.json

Exit status 0 when there were no 5xx, no hangs, and the server is alive after.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Findings:
    statuses: Counter = field(default_factory=Counter)     # (method path, status) -> count
    server_errors: list[str] = field(default_factory=list)
    hangs: list[str] = field(default_factory=list)
    ids: dict[str, list[str]] = field(default_factory=lambda: {"file_id": [], "batch_id": [], "job_id": []})

    @property
    def total(self) -> int:
        return sum(self.statuses.values())

    def summary(self) -> dict:
        by_status = Counter()
        by_operation = Counter()
        for (operation, status), count in self.statuses.items():
            by_status[str(status)] += count
            by_operation[operation] += count
        return {"requests": self.total, "responses_5xx": len(self.server_errors), "hangs": len(self.hangs),
                "by_status": dict(sorted(by_status.items())), "by_operation": dict(sorted(by_operation.items())),
                "examples_5xx": self.server_errors[:5], "examples_hangs": self.hangs[:5]}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(db: Path, port: int, real_model: bool, log_path: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "backfill.server", "--port", str(port), "--db", str(db),
               "--log-level", "warning", "--max-model-len", "128" if not real_model else "512"]
    if not real_model:
        command.append("--tiny")
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    log = open(log_path, "wb")
    return subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server did not become healthy")


PATH_ID_KINDS = {"file_id": "file", "batch_id": "batch", "job_id": "fine_tuning.job"}


def send(case, url: str, findings: Findings, timeout_s: float, known_id_pick: int | None) -> None:
    """Send one generated request; known_id_pick swaps a path parameter for an id the server made."""
    for name in list(case.path_parameters or {}):
        known = findings.ids.get(name, [])
        if known and known_id_pick is not None:
            case.path_parameters[name] = known[known_id_pick % len(known)]
    operation = f"{case.method.upper()} {case.operation.path}"
    try:
        response = case.call(base_url=url, timeout=timeout_s)
    except requests.Timeout:
        findings.hangs.append(f"{operation}: no response within {timeout_s:g} s ({case.as_curl_command()[:300]})")
        findings.statuses[(operation, "hang")] += 1
        return
    except requests.ConnectionError as exc:   # the server closed the connection without answering
        findings.server_errors.append(f"{operation}: connection failed: {exc} ({case.as_curl_command()[:300]})")
        findings.statuses[(operation, "connection_failed")] += 1
        return
    findings.statuses[(operation, response.status_code)] += 1
    if response.status_code >= 500:
        findings.server_errors.append(f"{operation} -> {response.status_code} {response.text[:300]} "
                                      f"({case.as_curl_command()[:500]})")
    elif response.status_code == 200 and case.method.upper() == "POST":
        try:
            made = response.json()
        except ValueError:
            return
        for name, kind in PATH_ID_KINDS.items():
            if isinstance(made, dict) and made.get("object") == kind:
                findings.ids[name].append(made["id"])


def fuzz(url: str, num_requests: int, timeout_s: float) -> Findings:
    """At least num_requests requests, spread over every operation of the server's OpenAPI document."""
    findings = Findings()
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    per_round = max(1, num_requests // (len(operations) * 4))
    while findings.total < num_requests:
        for operation in operations:
            @settings(max_examples=per_round, deadline=None, database=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(), pick=st.none() | st.integers(0, 1000))
            def run(case, pick) -> None:
                send(case, url, findings, timeout_s, pick)

            run()
            if findings.total >= num_requests:
                break
    return findings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000, help="requests to send, at least")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="a response slower than this is a hang")
    parser.add_argument("--real-model", action="store_true", help="the default model instead of the tiny one")
    parser.add_argument("--url", default=None, help="fuzz a server already running there instead of starting one")
    parser.add_argument("--json", default=None, help="write the summary here too")
    args = parser.parse_args(argv)
    started = time.monotonic()
    proc = None
    with tempfile.TemporaryDirectory() as tmp:
        url = args.url
        if url is None:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            proc = start_server(Path(tmp) / "fuzz.db", port, args.real_model, Path(tmp) / "server.log")
        try:
            if proc is not None:
                try:
                    wait_healthy(url, proc, 900)
                except RuntimeError:
                    print((Path(tmp) / "server.log").read_text(errors="replace")[-3000:], file=sys.stderr)
                    raise
            findings = fuzz(url, args.requests, args.timeout_s)
            try:
                alive = httpx.get(f"{url}/health", timeout=30).status_code == 200
            except httpx.HTTPError:
                alive = False
            summary = {**findings.summary(), "server_alive_after": alive,
                       "wall_s": round(time.monotonic() - started, 1)}
            if proc is not None and proc.poll() is not None:
                summary["server_alive_after"] = False
            if proc is not None and not summary["server_alive_after"]:
                summary["server_log_tail"] = (Path(tmp) / "server.log").read_text(errors="replace")[-3000:]
        finally:
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    ok = summary["responses_5xx"] == 0 and summary["hangs"] == 0 and summary["server_alive_after"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
