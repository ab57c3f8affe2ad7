"""A damaged or empty database ends in a clear refusal or a bounded failure, never in silent loss
or an inference loop (issue: pages overwritten with the header intact; a 0-byte file; a result
that cannot be written)."""

from __future__ import annotations

import logging
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from backfill.server.store import Store
from backfill.server.store_integrity import StoreIntegrityError
from server_helpers import REPO_ROOT, chat_line, free_port, live_server, openai_client, upload, wait_final

PAGE_BYTES = 4096   # SQLite's default page size


def filled_database(path: Path, num_files: int = 40) -> None:
    store = Store(path)
    for i in range(num_files):
        store.create_file("batch", f"{i}.jsonl", os.urandom(3000))
    store.close()   # checkpoints the WAL into the main file


def overwrite_middle_pages(path: Path) -> None:
    """Garbage over pages 3..19, leaving the 100-byte header and page 1 (the schema) intact."""
    data = bytearray(path.read_bytes())
    assert len(data) > 20 * PAGE_BYTES
    for page in range(3, 20):
        start = page * PAGE_BYTES
        data[start + 100:start + PAGE_BYTES - 100] = b"\xab" * (PAGE_BYTES - 200)
    path.write_bytes(bytes(data))


def test_overwritten_pages_are_refused_then_moved_aside_with_fresh(tmp_path, caplog):
    db = tmp_path / "s.db"
    filled_database(db)
    overwrite_middle_pages(db)
    with pytest.raises(StoreIntegrityError, match="is damaged .*--fresh-db"):
        Store(db)
    assert db.read_bytes()[:16] == b"SQLite format 3\x00"    # refusing touched nothing
    with caplog.at_level(logging.WARNING, logger="backfill.server.store_integrity"):
        store = Store(db, fresh=True)
    moved = [r.getMessage() for r in caplog.records if "moved the damaged database" in r.getMessage()]
    assert moved and str(db) in moved[0] and "s.db.damaged-" in moved[0]   # the operator is told where
    assert store.list_files(None, 10, None, "desc") == ([], False)
    store.close()
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("s.db.damaged-")]
    assert len(aside) == 1 and aside[0].stat().st_size > 20 * PAGE_BYTES   # kept, not deleted


def test_zero_byte_file_is_refused_not_taken_as_new(tmp_path):
    db = tmp_path / "s.db"
    db.write_bytes(b"")
    with pytest.raises(StoreIntegrityError, match="0-byte"):
        Store(db)
    assert db.stat().st_size == 0
    Store(db, fresh=True).close()
    assert db.stat().st_size > 0
    assert any(p.name.startswith("s.db.damaged-") for p in tmp_path.iterdir())


def test_missing_database_with_a_leftover_journal_is_refused(tmp_path):
    db = tmp_path / "s.db"
    db.with_name("s.db-wal").write_bytes(b"x" * 1000)
    with pytest.raises(StoreIntegrityError, match="missing but its journal"):
        Store(db)
    Store(tmp_path / "new.db").close()   # a first start (nothing there) is fine


@pytest.mark.parametrize("damage", ["pages", "empty"])
def test_server_process_refuses_to_start_with_a_message(tmp_path, damage):
    db = tmp_path / "s.db"
    if damage == "pages":
        filled_database(db)
        overwrite_middle_pages(db)
    else:
        db.write_bytes(b"")
    command = [sys.executable, "-m", "backfill.server", "--tiny", "--port", str(free_port()), "--db", str(db)]
    done = subprocess.run(command, cwd=REPO_ROOT, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "backfill: error:" in done.stderr and "--fresh-db" in done.stderr
    assert ("damaged" if damage == "pages" else "0-byte") in done.stderr


def refuse_inserts(server, condition: str) -> None:
    """Make the real database refuse result rows (as a failing disk would), from inside SQLite."""
    server.state.store._conn().execute(
        f"CREATE TRIGGER refuse BEFORE INSERT ON batch_results WHEN {condition} "
        "BEGIN SELECT RAISE(ABORT, 'disk I/O error (simulated by a trigger)'); END")


def offline_runs(server) -> int:
    return server.state.engine.scheduler.stats.finished["offline"]


def test_unstorable_result_marks_the_line_failed_after_bounded_retries(tmp_path):
    with live_server(tmp_path) as server:
        client = openai_client(server.url)
        refuse_inserts(server, "NEW.ok = 1")
        batch = client.batches.create(input_file_id=upload(client, [chat_line("a"), chat_line("b")]).id,
                                      endpoint="/v1/chat/completions", completion_window="24h")
        batch = wait_final(client, batch.id, timeout_s=30)
        assert batch.status == "completed"
        assert (batch.request_counts.completed, batch.request_counts.failed) == (0, 2)
        errors = client.files.content(batch.error_file_id).text
        assert errors.count("result_not_stored") == 2
        assert offline_runs(server) == 2    # each line ran once: nothing re-ran
        health = httpx.get(f"{server.url}/ready").json()
        assert health["store"]["status"] == "degraded" and "disk I/O error" in health["store"]["error"]


def test_store_refusing_everything_does_not_loop_inference(tmp_path):
    with live_server(tmp_path) as server:
        client = openai_client(server.url)
        refuse_inserts(server, "1")
        batch = client.batches.create(input_file_id=upload(client, [chat_line("a")]).id,
                                      endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 20
        while not server.state.worker.unwritable:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(1.5)   # three worker polls: a looping worker would have run the line again
        assert offline_runs(server) == 1
        assert client.batches.retrieve(batch.id).request_counts.completed == 0   # nothing was claimed done
        health = httpx.get(f"{server.url}/ready").json()
        assert health["store"]["unwritable_batch_lines"] == 1


def test_store_damaged_while_serving_is_503_store_error_and_ready_says_so(tmp_path):
    import io
    import sqlite3

    from server_helpers import assert_error

    with live_server(tmp_path) as server:
        client = openai_client(server.url)
        for _ in range(30):
            client.files.create(file=("a.jsonl", io.BytesIO(b'{"x": "' + b"y" * 3000 + b'"}')), purpose="batch")
        db = tmp_path / "server.db"
        checkpoint = sqlite3.connect(db)   # move the pages from the WAL into the file, then damage them
        checkpoint.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        checkpoint.close()
        with open(db, "r+b") as file:
            file.seek(4096 * 2)
            file.write(os.urandom(db.stat().st_size - 4096 * 3))
        with httpx.Client(base_url=server.url, timeout=60) as http:
            assert_error(http.get("/v1/files", params={"limit": 10000}), 503, code="store_error")
            health = http.get("/ready")
            assert health.status_code == 503 and health.json()["store"]["status"] == "error"
            assert http.get("/health").status_code == 200   # alive all the same
            # Online completions do not need the store: they go on.
            chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 2})
            assert chat.status_code == 200, chat.text


def test_damaged_file_content_is_an_error_never_the_damaged_bytes(tmp_path):
    """4 KB overwritten inside a page that holds a file's content: SQLite's structure check cannot
    see it (the server starts, /health is ok); the content's checksum does."""
    db = tmp_path / "server.db"
    content = b"".join(b'{"line": %d, "text": "%s"}\n' % (i, b"abcdefgh" * 8) for i in range(1000))
    store = Store(db)
    file_id = store.create_file("batch", "big.jsonl", content)["id"]
    store.close()   # checkpoints the WAL into the main file
    data = bytearray(db.read_bytes())
    page = data.index(content[40_000:40_200]) // PAGE_BYTES
    inside = slice(page * PAGE_BYTES + 4, (page + 1) * PAGE_BYTES)   # all but the overflow page's link
    assert bytes(data[inside]) in content, "the page holds the file's bytes only"
    data[inside] = b"\xab" * (PAGE_BYTES - 4)
    db.write_bytes(bytes(data))

    with live_server(tmp_path) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.get("/health").status_code == 200   # nothing a structure check finds
        assert http.get(f"/v1/files/{file_id}").json()["bytes"] == len(content)
        response = http.get(f"/v1/files/{file_id}/content")
        assert response.status_code == 500 and b"\xab" * 64 not in response.content
        error = response.json()["error"]
        assert error["code"] == "stored_content_damaged" and file_id in error["message"]
        metrics = http.get("/metrics").text
        assert "backfill_store_damaged_reads_total 1.0" in metrics, metrics


def test_damaged_batch_result_goes_to_the_error_file_not_the_output(tmp_path):
    db = tmp_path / "s.db"
    store = Store(db)
    file_id = store.create_file("batch", "in.jsonl", (chat_line("a") + "\n" + chat_line("b")).encode())["id"]
    batch_id = store.create_batch(file_id, "/v1/chat/completions", "24h", None)["id"]
    assert store.start_batch(batch_id, [(0, "a", "{}", ""), (1, "b", "{}", "")], [])
    store.record_result(batch_id, 0, "a", True, '{"custom_id": "a", "response": {"status_code": 200}}')
    store.record_result(batch_id, 1, "b", True, '{"custom_id": "b", "response": {"status_code": 200}}')
    with sqlite3.connect(db) as raw:   # the bytes of one stored result change on disk
        raw.execute("UPDATE batch_results SET record = replace(record, '200', '999') WHERE line = 1")
    store.finish_batch(batch_id, "completed")
    batch = store.get_batch(batch_id)
    output = store.file_content(batch["output_file_id"]).decode()
    errors = store.file_content(batch["error_file_id"]).decode()
    damaged_bytes = '"status_code": 999'   # the ids are random hex and may hold "999" themselves
    assert '"custom_id": "a"' in output and damaged_bytes not in output and '"b"' not in output
    assert "result_damaged" in errors and '"custom_id": "b"' in errors and damaged_bytes not in errors
    assert store.damaged_reads == 1
    store.close()


def test_rows_stored_before_checksums_are_reported_not_skipped_silently(tmp_path, caplog):
    db = tmp_path / "s.db"
    store = Store(db)
    file_id = store.create_file("batch", "in.jsonl", chat_line("a").encode())["id"]
    assert store.health()["unchecked_rows"] == 0
    store.close()
    with sqlite3.connect(db) as raw:   # as a database written before the checksums were kept
        raw.execute("UPDATE files SET sha256 = NULL WHERE id = ?", (file_id,))
    caplog.set_level(logging.WARNING, logger="backfill.server.store")
    store = Store(db)
    try:
        assert store.health()["unchecked_rows"] == 1
        (warning,) = [r.getMessage() for r in caplog.records if "before checksums" in r.getMessage()]
        assert "1 file stored before checksums" in warning and str(db) in warning
        assert store.file_content(file_id) == chat_line("a").encode()   # still served
    finally:
        store.close()
