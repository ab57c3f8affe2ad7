"""The server as a real process: kill -9 mid-batch loses nothing and duplicates nothing; SIGTERM
drains (in-flight online requests finish, batch progress is committed) and exits 0; bad options
fail fast with a clear message."""

from __future__ import annotations

import json
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter

import httpx

from server_helpers import REPO_ROOT, chat_line, openai_client, upload

NUM_LINES = 160
# Each line decodes exactly 48 tokens (ignore_eos), greedy: slow enough to kill mid-way.
LINE_BODY = {"max_tokens": 48, "ignore_eos": True, "temperature": 0}


def submit_batch(client) -> str:
    lines = [chat_line(f"line-{i:03d}", f"request number {i}", **LINE_BODY) for i in range(NUM_LINES)]
    return client.batches.create(input_file_id=upload(client, lines).id, endpoint="/v1/chat/completions",
                                 completion_window="24h").id


def wait_for(client, batch_id: str, done, timeout_s: float = 180.0):
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if done(batch):
            return batch
        assert time.monotonic() < deadline, f"timed out: {batch.status} {batch.request_counts}"
        time.sleep(0.02)


def db_counts(db, batch_id: str) -> tuple[int, int, int]:
    """(results, lines marked done, lines) straight from the SQLite file."""
    conn = sqlite3.connect(db)
    try:
        results = conn.execute("SELECT COUNT(*) FROM batch_results WHERE batch_id = ?", (batch_id,)).fetchone()[0]
        done = conn.execute("SELECT COUNT(*) FROM batch_lines WHERE batch_id = ? AND done = 1",
                            (batch_id,)).fetchone()[0]
        lines = conn.execute("SELECT COUNT(*) FROM batch_lines WHERE batch_id = ?", (batch_id,)).fetchone()[0]
    finally:
        conn.close()
    return results, done, lines


def assert_exactly_once(client, batch) -> None:
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == \
        (NUM_LINES, NUM_LINES, 0)
    records = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    counts = Counter(r["custom_id"] for r in records)
    assert counts == Counter({f"line-{i:03d}": 1 for i in range(NUM_LINES)})
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 48 for r in records)


def test_kill9_mid_batch_then_restart_finishes_every_line_once(tmp_path, server_processes):
    db = tmp_path / "kill.db"
    first = server_processes(db, "--max-offline-in-flight", "8")
    client = openai_client(first.url)
    batch_id = submit_batch(client)
    wait_for(client, batch_id, lambda b: b.request_counts.completed >= 8)
    first.signal(signal.SIGKILL)
    first.proc.wait(timeout=30)
    results, done, lines = db_counts(db, batch_id)
    assert 8 <= results == done < lines == NUM_LINES, "the kill must land mid-batch"

    second = server_processes(db, "--max-offline-in-flight", "8")
    client = openai_client(second.url)
    batch = wait_for(client, batch_id, lambda b: b.status in ("completed", "failed"))
    assert_exactly_once(client, batch)
    assert db_counts(db, batch_id) == (NUM_LINES, NUM_LINES, NUM_LINES)


def test_sigterm_drains_online_requests_and_keeps_batch_progress(tmp_path, server_processes):
    db = tmp_path / "term.db"
    first = server_processes(db, "--max-offline-in-flight", "4", "--drain-timeout-s", "40")
    client = openai_client(first.url)
    batch_id = submit_batch(client)
    wait_for(client, batch_id, lambda b: b.request_counts.completed >= 4)

    streamed: list[str] = []
    finish: list[str] = []

    def stream_online() -> None:
        body = {"prompt": "drain me", "max_tokens": 120, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{first.url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:   # cut by the drain deadline
                        finish.append(chunk["error"]["code"])
                        continue
                    choice = chunk["choices"][0]
                    streamed.append(choice["text"])
                    if choice["finish_reason"]:
                        finish.append(choice["finish_reason"])

    reader = threading.Thread(target=stream_online)
    reader.start()
    while not streamed:
        time.sleep(0.005)
    first.signal(signal.SIGTERM)
    assert first.proc.wait(timeout=60) == 0, first.log()
    reader.join(timeout=30)
    assert finish == ["length"], "the in-flight online request must finish during the drain"

    results, done, lines = db_counts(db, batch_id)
    assert 4 <= results == done <= lines == NUM_LINES
    second = server_processes(db, "--max-offline-in-flight", "8")
    client = openai_client(second.url)
    assert client.batches.retrieve(batch_id).request_counts.completed >= results
    assert_exactly_once(client, wait_for(client, batch_id, lambda b: b.status in ("completed", "failed")))


def test_bad_options_fail_fast_with_a_message(tmp_path):
    config = tmp_path / "server.toml"
    config.write_text('port = 8123\nmax-online-queue = "many"\n')
    cases = [(["--port", "0"], "port"), (["--config", str(config)], "max-online-queue"),
             (["--policy", "magic"], "policy"), (["--max-body-mb", "-1"], "max_body_mb"),
             (["--model", str(tmp_path / "missing.gguf")], "does not exist")]
    for args, needle in cases:
        done = subprocess.run([sys.executable, "-m", "backfill.server", *args, "--db", str(tmp_path / "x.db")],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, (args, done.stderr)
        assert done.stderr.startswith("backfill: error:") and needle in done.stderr, (args, done.stderr)
        assert "Traceback" not in done.stderr


def test_second_server_on_the_same_database_is_refused(tmp_path, server_processes):
    db = tmp_path / "shared.db"
    first = server_processes(db)
    done = subprocess.run([sys.executable, "-m", "backfill.server", "--tiny", "--db", str(db)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "in use by another backfill server" in done.stderr
    assert httpx.get(f"{first.url}/health").status_code == 200   # the first server keeps serving


def test_port_in_use_exits_nonzero(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "backfill.server", "--tiny", "--port", str(port),
                               "--db", str(tmp_path / "p.db")], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=120)
    assert done.returncode != 0 and "address already in use" in done.stderr.lower()
