"""The SQLite store: exactly-once results, atomic batch transitions, persistence, one owner."""

from __future__ import annotations

import json
import sqlite3
import threading

import pytest

from backfill.errors import ServerConfigError
from backfill.server.store import SCHEMA, LineFailure, Store


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "s.db")
    yield s
    s.close()


def started_batch(store: Store, n: int = 3) -> str:
    file = store.create_file("batch", "in.jsonl", b"{}")
    batch = store.create_batch(file["id"], "/v1/completions", "24h", {"k": "v"})
    lines = [(i, f"c{i}", json.dumps({"prompt": str(i)}), "") for i in range(n)]
    assert store.start_batch(batch["id"], lines, [LineFailure(n, "bad", '{"error": 1}')])
    return batch["id"]


def test_wal_mode_and_schema(store):
    conn = store._conn()
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA synchronous").fetchone()[0] == 2   # FULL


def test_start_batch_counts_failures_and_moves_to_in_progress(store):
    batch_id = started_batch(store)
    batch = store.get_batch(batch_id)
    assert batch["status"] == "in_progress" and batch["request_counts"] == {"total": 4, "completed": 0, "failed": 1}
    assert batch["metadata"] == {"k": "v"}
    assert not store.start_batch(batch_id, [], [])   # only once
    assert [line.line for line in store.pending_lines(10, set())] == [0, 1, 2]
    assert [line.line for line in store.pending_lines(10, {(batch_id, 1)})] == [0, 2]
    assert len(store.pending_lines(1, set())) == 1


def test_lines_run_by_prefix_key_within_a_batch_and_batches_in_order(store):
    file = store.create_file("batch", "in.jsonl", b"{}")
    first = store.create_batch(file["id"], "/v1/completions", "24h", None)["id"]
    second = store.create_batch(file["id"], "/v1/completions", "24h", None)["id"]
    assert store.start_batch(second, [(0, "x", "{}", "aa")], [])
    keys = ["bb", "aa", "bb", "aa", ""]
    assert store.start_batch(first, [(i, f"c{i}", "{}", key) for i, key in enumerate(keys)], [])
    order = [(line.batch_id, line.line) for line in store.pending_lines(10, set())]
    assert order == [(first, 4), (first, 1), (first, 3), (first, 0), (first, 2), (second, 0)]


def test_a_database_from_before_prefix_keys_gains_the_column(tmp_path):
    db = tmp_path / "old.db"
    with sqlite3.connect(db) as raw:
        raw.executescript(SCHEMA.replace("    prefix_key TEXT NOT NULL DEFAULT '',\n", ""))
        raw.execute("INSERT INTO batches (id, seq, endpoint, input_file_id, completion_window, status, created_at) "
                    "VALUES ('b', 1, '/v1/completions', 'f', '24h', 'in_progress', 0)")
        raw.executemany("INSERT INTO batch_lines (batch_id, line, custom_id, body) VALUES ('b', ?, ?, '{}')",
                        [(1, "one"), (0, "zero")])
        assert "prefix_key" not in {row[1] for row in raw.execute("PRAGMA table_info(batch_lines)")}
    reopened = Store(db)
    try:
        assert [line.line for line in reopened.pending_lines(10, set())] == [0, 1]   # file order, as before
    finally:
        reopened.close()


def test_record_result_is_exactly_once(store):
    batch_id = started_batch(store)
    assert store.record_result(batch_id, 0, "c0", True, '{"r": 1}', 5, 7)
    assert not store.record_result(batch_id, 0, "c0", True, '{"r": 2}', 5, 7)
    batch = store.get_batch(batch_id)
    assert batch["request_counts"] == {"total": 4, "completed": 1, "failed": 1}
    assert batch["usage"]["input_tokens"] == 5 and batch["usage"]["output_tokens"] == 7
    assert store.running_batches() == [(batch_id, "in_progress", batch["expires_at"], 2)]
    assert [line.line for line in store.pending_lines(10, set())] == [1, 2]


def test_a_batch_sums_its_lines_cached_tokens(store):
    batch_id = started_batch(store)
    store.record_result(batch_id, 0, "c0", True, "{}", 1040, 64, 1024)
    store.record_result(batch_id, 1, "c1", True, "{}", 1030, 64, 1008)
    usage = store.get_batch(batch_id)["usage"]
    assert usage["input_tokens"] == 2070 and usage["input_tokens_details"]["cached_tokens"] == 2032


def test_a_database_from_before_cached_tokens_gains_the_column(tmp_path):
    path = tmp_path / "old.db"
    store = Store(path)
    batch_id = started_batch(store)
    store.close()
    conn = sqlite3.connect(path)   # the batches table as it was before the column existed
    conn.execute("ALTER TABLE batches DROP COLUMN cached_tokens")
    conn.commit()
    conn.close()
    store = Store(path)
    try:
        assert store.get_batch(batch_id)["usage"]["input_tokens_details"]["cached_tokens"] == 0
        assert store.record_result(batch_id, 0, "c0", True, "{}", 10, 2, 8)
        assert store.get_batch(batch_id)["usage"]["input_tokens_details"]["cached_tokens"] == 8
    finally:
        store.close()


def test_concurrent_writers_record_each_line_once(tmp_path):
    store = Store(tmp_path / "c.db")
    batch_id = started_batch(store, n=40)
    wins: list[bool] = []

    def writer() -> None:
        for line in range(40):
            wins.append(store.record_result(batch_id, line, f"c{line}", True, "{}"))

    threads = [threading.Thread(target=writer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(wins) == 40 and len(wins) == 160
    assert store.get_batch(batch_id)["request_counts"]["completed"] == 40
    store.close()


def test_finish_batch_writes_files_in_line_order(store):
    batch_id = started_batch(store)
    for line in (2, 0, 1):
        store.record_result(batch_id, line, f"c{line}", line != 1, json.dumps({"line": line}))
    store.mark_finalizing(batch_id)
    assert store.get_batch(batch_id)["status"] == "finalizing"
    store.finish_batch(batch_id, "completed")
    batch = store.get_batch(batch_id)
    assert batch["status"] == "completed" and batch["completed_at"]
    output = store.file_content(batch["output_file_id"]).decode().splitlines()
    assert [json.loads(r)["line"] for r in output] == [0, 2]
    errors = store.file_content(batch["error_file_id"]).decode().splitlines()
    assert errors == ['{"line": 1}', '{"error": 1}']   # file order: line 1, then the bad line 3
    assert store.get_file(batch["output_file_id"])["purpose"] == "batch_output"
    store.finish_batch(batch_id, "cancelled")       # a final batch stays as it is
    assert store.get_batch(batch_id)["status"] == "completed"


def test_cancel_only_active_batches(store):
    batch_id = started_batch(store)
    assert store.request_cancel(batch_id) == "cancelling"
    assert store.get_batch(batch_id)["cancelling_at"]
    assert store.request_cancel(batch_id) == "cancelling"
    assert store.pending_lines(10, set()) == []      # cancelling batches start no new lines
    store.finish_batch(batch_id, "cancelled")
    assert store.request_cancel(batch_id) == "cancelled"
    assert store.request_cancel("batch_missing") is None


def test_state_survives_reopen(tmp_path):
    store = Store(tmp_path / "p.db")
    batch_id = started_batch(store)
    store.record_result(batch_id, 1, "c1", True, "{}")
    store.close()
    reopened = Store(tmp_path / "p.db")
    assert reopened.get_batch(batch_id)["request_counts"]["completed"] == 1
    assert [line.line for line in reopened.pending_lines(10, set())] == [0, 2]
    reopened.close()


def test_lists_paginate_newest_first(store):
    ids = [store.create_file("batch", f"{i}.jsonl", b"x")["id"] for i in range(3)]
    files, more = store.list_files("batch", 2, None, "desc")
    assert [f["id"] for f in files] == ids[::-1][:2] and more
    files, more = store.list_files(None, 2, ids[1], "desc")
    assert [f["id"] for f in files] == ids[:1] and not more
    files, _ = store.list_files(None, 5, ids[0], "asc")
    assert [f["id"] for f in files] == ids[1:]
    assert store.list_files("batch_output", 5, None, "desc") == ([], False)


def test_one_server_per_database(tmp_path):
    first = Store(tmp_path / "x.db")
    with pytest.raises(ServerConfigError, match="in use"):
        Store(tmp_path / "x.db")
    first.close()
    Store(tmp_path / "x.db").close()


def test_unusable_database_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(ServerConfigError, match="is damaged .*not a database"):
        Store(bad)
    Store(bad.with_name("ok.db")).close()
