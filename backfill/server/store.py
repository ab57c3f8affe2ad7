"""Durable state of the Batch API in SQLite: files, batches, their lines and finished results.

Crash safety rests on three facts:
  * WAL mode with synchronous=FULL: a committed transaction survives kill -9 (and power loss).
  * Creating a batch's lines, recording a line's result (and marking the line done, and bumping the
    batch's counters), and finishing a batch (writing its output files) are each one transaction.
  * batch_results has one row per (batch, line) at most (primary key), so a line re-run after a
    crash cannot produce a second result: the first committed one wins.
A line whose result is not committed is simply pending, so whatever was in flight at a crash
runs again on restart.

Every file's content and every line's result carries its SHA-256, checked on each read: a page
damaged on disk that SQLite's structure check cannot see (the bytes of a BLOB) is refused
(DamagedContentError; counted in damaged_reads), never served. Rows written before the
checksums existed (NULL) are read unchecked.

One server process owns a database at a time (an exclusive lock on PATH.lock, released by the
OS even after kill -9): two workers on one database would run every line twice.

Each thread gets its own connection (sqlite3 objects are not shared across threads); writers
serialise on SQLite's lock (BEGIN IMMEDIATE, with a busy timeout).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import sqlite3
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from backfill.errors import ServerConfigError
from backfill.server import store_integrity
from backfill.server.store_integrity import DamagedContentError, StoreIntegrityError, sha256_hex

log = logging.getLogger(__name__)
ROW_NAMES = {"files": "file", "batch_results": "batch result"}   # a checksummed table's row, in words

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    content BLOB NOT NULL,
    sha256 TEXT
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,
    metadata TEXT,
    errors TEXT,
    output_file_id TEXT,
    error_file_id TEXT,
    total INTEGER NOT NULL DEFAULT 0,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0,
    cached_tokens INTEGER NOT NULL DEFAULT 0,
    created_at INTEGER NOT NULL,
    expires_at INTEGER,
    in_progress_at INTEGER,
    finalizing_at INTEGER,
    completed_at INTEGER,
    failed_at INTEGER,
    expired_at INTEGER,
    cancelling_at INTEGER,
    cancelled_at INTEGER
);
CREATE INDEX IF NOT EXISTS batches_status ON batches (status, seq);
CREATE TABLE IF NOT EXISTS batch_lines (
    batch_id TEXT NOT NULL,
    line INTEGER NOT NULL,
    custom_id TEXT NOT NULL,
    body TEXT NOT NULL,
    done INTEGER NOT NULL DEFAULT 0,
    prefix_key TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (batch_id, line)
);
CREATE TABLE IF NOT EXISTS batch_results (
    batch_id TEXT NOT NULL,
    line INTEGER NOT NULL,
    custom_id TEXT NOT NULL,
    ok INTEGER NOT NULL,
    record TEXT NOT NULL,
    sha256 TEXT,
    PRIMARY KEY (batch_id, line)
);
"""

ACTIVE_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")
_TIMESTAMPS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
               "cancelling_at", "cancelled_at")
BATCH_WINDOW_S = 24 * 3600


@dataclass(frozen=True)
class PendingLine:
    batch_id: str
    line: int
    custom_id: str
    body: str
    endpoint: str


@dataclass(frozen=True)
class LineFailure:
    """A line that fails before it reaches the engine (bad JSON, bad shape, bad body)."""

    line: int
    custom_id: str
    record: str


class Store:
    def __init__(self, path: str | Path, exclusive: bool = True, fresh: bool = False) -> None:
        """Open (or create) the database; StoreIntegrityError if it is damaged or empty where a
        database was expected, unless fresh (then the damaged file is moved aside, not deleted)."""
        self.path = Path(path).expanduser()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ServerConfigError(f"cannot create the directory of the database {self.path}: {exc}") from None
        self._lock_fd: int | None = self._take_lock() if exclusive else None
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self.last_error: str | None = None   # the last failed read or write, for /health
        self.damaged_reads = 0   # reads refused because their checksum did not match (a metric)
        self.unchecked_rows = 0  # rows stored before checksums were kept (read unchecked; /ready says how many)
        try:
            store_integrity.preflight(self.path, fresh)
            try:
                self._open()
            except StoreIntegrityError:
                if not fresh:
                    raise
                self._close_connections()
                store_integrity.move_aside(self.path)
                self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        try:
            conn = self._conn()
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        except sqlite3.DatabaseError as exc:
            raise StoreIntegrityError(store_integrity.damaged_message(self.path, str(exc))) from None
        store_integrity.check(conn, self.path)
        try:
            conn.executescript(SCHEMA)
            store_integrity.add_checksum_columns(conn)
            _add_cached_tokens_column(conn)
            _add_prefix_key_column(conn)
            unchecked = store_integrity.unchecked_rows(conn)
        except sqlite3.DatabaseError as exc:
            raise StoreIntegrityError(store_integrity.damaged_message(self.path, str(exc))) from None
        self.unchecked_rows = sum(unchecked.values())
        if self.unchecked_rows:
            log.warning("%s: %s stored before checksums were kept: they are served unchecked (damage to "
                        "their bytes cannot be detected); /ready reports them as store.unchecked_rows",
                        self.path, " and ".join(f"{n} {ROW_NAMES[table]}{'s' * (n != 1)}"
                                                for table, n in unchecked.items() if n))
        if str(mode).lower() != "wal":
            raise ServerConfigError(f"{self.path}: SQLite refused WAL mode (got {mode})")

    def health(self) -> dict:
        """A cheap live probe of the database (one read), for /health."""
        try:
            self._conn().execute("SELECT COUNT(*) FROM batches WHERE status = 'in_progress'").fetchone()
        except sqlite3.Error as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            return {"status": "error", "path": str(self.path), "error": self.last_error}
        if self.last_error is not None:
            return {"status": "degraded", "path": str(self.path), "error": self.last_error,
                    "unchecked_rows": self.unchecked_rows}
        return {"status": "ok", "path": str(self.path), "unchecked_rows": self.unchecked_rows}

    def _take_lock(self) -> int:
        lock_path = self.path.with_name(self.path.name + ".lock")
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ServerConfigError(f"cannot create the lock file {lock_path}: {exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise ServerConfigError(f"the database {self.path} is in use by another backfill server "
                                    "(use a different --db or --port)") from None
        return fd

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, isolation_level=None, timeout=30.0, check_same_thread=False)
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("PRAGMA foreign_keys=ON")
            self._local.conn = conn
            with self._lock:
                self._connections.append(conn)
        return conn

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException as exc:
            if isinstance(exc, sqlite3.DatabaseError):
                self.last_error = f"{type(exc).__name__}: {exc}"
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        try:
            conn.execute("COMMIT")
        except sqlite3.DatabaseError as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def _close_connections(self) -> None:
        with self._lock:
            connections, self._connections = self._connections, []
        for conn in connections:
            conn.close()
        self._local = threading.local()

    def close(self) -> None:
        self._close_connections()
        if self._lock_fd is not None:
            os.close(self._lock_fd)   # closing the descriptor releases the flock
            self._lock_fd = None

    # --- files -----------------------------------------------------------------------------------

    def create_file(self, purpose: str, filename: str, content: bytes) -> dict:
        file_id = f"file-{uuid.uuid4().hex}"
        with self._write() as conn:
            _insert_file(conn, file_id, purpose, filename, content)
        return self.get_file(file_id)

    def get_file(self, file_id: str) -> dict | None:
        row = self._conn().execute("SELECT id, purpose, filename, bytes, created_at FROM files WHERE id = ?",
                                   (file_id,)).fetchone()
        return _file_object(row) if row else None

    def file_content(self, file_id: str) -> bytes | None:
        """The file's bytes, checked against their checksum; DamagedContentError if they changed on disk."""
        row = self._conn().execute("SELECT content, sha256 FROM files WHERE id = ?", (file_id,)).fetchone()
        if row is None:
            return None
        content = bytes(row["content"])
        if row["sha256"] is not None and sha256_hex(content) != row["sha256"]:
            self.damaged_reads += 1
            raise DamagedContentError(f"the stored content of file {file_id} is damaged (its SHA-256 does not "
                                      f"match the one recorded when it was written); it is not served. Restore "
                                      f"the database {self.path} from a backup, or upload the file again")
        return content

    def list_files(self, purpose: str | None, limit: int, after: str | None, order: str) -> tuple[list[dict], bool]:
        clauses, args = [], []
        if purpose is not None:
            clauses.append("purpose = ?")
            args.append(purpose)
        if after is not None:
            clauses.append(f"seq {'>' if order == 'asc' else '<'} (SELECT seq FROM files WHERE id = ?)")
            args.append(after)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        rows = self._conn().execute(
            f"SELECT id, purpose, filename, bytes, created_at FROM files {where} "
            f"ORDER BY seq {'ASC' if order == 'asc' else 'DESC'} LIMIT ?", (*args, limit + 1)).fetchall()
        return [_file_object(r) for r in rows[:limit]], len(rows) > limit

    def delete_file(self, file_id: str) -> bool:
        with self._write() as conn:
            return conn.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount > 0

    # --- batches ---------------------------------------------------------------------------------

    def create_batch(self, input_file_id: str, endpoint: str, completion_window: str,
                     metadata: dict[str, str] | None) -> dict:
        batch_id = f"batch_{uuid.uuid4().hex}"
        now = int(time.time())
        with self._write() as conn:
            conn.execute("INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, metadata, "
                         "created_at, expires_at) VALUES (?, ?, ?, ?, 'validating', ?, ?, ?)",
                         (batch_id, endpoint, input_file_id, completion_window,
                          json.dumps(metadata) if metadata is not None else None, now, now + BATCH_WINDOW_S))
        return self.get_batch(batch_id)

    def get_batch(self, batch_id: str) -> dict | None:
        row = self._conn().execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return _batch_object(row) if row else None

    def list_batches(self, limit: int, after: str | None) -> tuple[list[dict], bool]:
        if after is None:
            rows = self._conn().execute("SELECT * FROM batches ORDER BY seq DESC LIMIT ?", (limit + 1,)).fetchall()
        else:
            rows = self._conn().execute(
                "SELECT * FROM batches WHERE seq < (SELECT seq FROM batches WHERE id = ?) ORDER BY seq DESC LIMIT ?",
                (after, limit + 1)).fetchall()
        return [_batch_object(r) for r in rows[:limit]], len(rows) > limit

    def batch_ids(self, *statuses: str) -> list[str]:
        marks = ",".join("?" * len(statuses))
        rows = self._conn().execute(f"SELECT id FROM batches WHERE status IN ({marks}) ORDER BY seq",
                                    statuses).fetchall()
        return [r["id"] for r in rows]

    def batch_row(self, batch_id: str) -> sqlite3.Row | None:
        return self._conn().execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()

    def backlog(self) -> tuple[int, dict[str, int]]:
        """(batch lines waiting to run, batches by status), for the metrics."""
        conn = self._conn()
        waiting = conn.execute("SELECT COUNT(*) FROM batch_lines l JOIN batches b ON b.id = l.batch_id "
                               "WHERE l.done = 0 AND b.status = 'in_progress'").fetchone()[0]
        by_status = dict(conn.execute("SELECT status, COUNT(*) FROM batches GROUP BY status").fetchall())
        return waiting, by_status

    def request_cancel(self, batch_id: str) -> str | None:
        """Move an active batch to cancelling; returns the status it is in afterwards (None: unknown)."""
        with self._write() as conn:
            row = conn.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None:
                return None
            if row["status"] in ("validating", "in_progress"):
                conn.execute("UPDATE batches SET status = 'cancelling', cancelling_at = ? WHERE id = ?",
                             (int(time.time()), batch_id))
                return "cancelling"
            return row["status"]

    def start_batch(self, batch_id: str, lines: list[tuple[int, str, str, str]], failures: list[LineFailure]) -> bool:
        """validating -> in_progress with all lines stored, in one transaction (False if no longer validating).
        Each line: (line number, custom_id, body, prefix key: lines run in its order, see pending_lines)."""
        with self._write() as conn:
            row = conn.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None or row["status"] != "validating":
                return False
            conn.executemany("INSERT INTO batch_lines (batch_id, line, custom_id, body, prefix_key) "
                             "VALUES (?, ?, ?, ?, ?)",
                             [(batch_id, line, custom_id, body, key) for line, custom_id, body, key in lines])
            conn.executemany("INSERT INTO batch_results (batch_id, line, custom_id, ok, record, sha256) "
                             "VALUES (?, ?, ?, 0, ?, ?)",
                             [(batch_id, f.line, f.custom_id, f.record, sha256_hex(f.record.encode()))
                              for f in failures])
            conn.execute("UPDATE batches SET status = 'in_progress', in_progress_at = ?, total = ?, failed = ? "
                         "WHERE id = ?", (int(time.time()), len(lines) + len(failures), len(failures), batch_id))
            return True

    def fail_batch(self, batch_id: str, errors: list[dict]) -> None:
        with self._write() as conn:
            conn.execute("UPDATE batches SET status = 'failed', failed_at = ?, errors = ? WHERE id = ? "
                         "AND status IN ('validating', 'cancelling')",
                         (int(time.time()), json.dumps({"object": "list", "data": errors}), batch_id))

    def pending_lines(self, limit: int, skip: set[tuple[str, int]]) -> list[PendingLine]:
        """Unfinished lines of in-progress batches, oldest batch first, leaving out those in skip; within
        a batch by prefix key, then line (HyGen: lines sharing a prompt prefix run together, while the
        engine holds it cached)."""
        rows = self._conn().execute(
            "SELECT l.batch_id, l.line, l.custom_id, l.body, b.endpoint FROM batches b "
            "JOIN batch_lines l ON l.batch_id = b.id AND l.done = 0 "
            "WHERE b.status = 'in_progress' ORDER BY b.seq, l.prefix_key, l.line LIMIT ?",
            (limit + len(skip),)).fetchall()
        lines = [PendingLine(r["batch_id"], r["line"], r["custom_id"], r["body"], r["endpoint"]) for r in rows
                 if (r["batch_id"], r["line"]) not in skip]
        return lines[:limit]

    def running_batches(self) -> list[tuple[str, str, int | None, int]]:
        """(id, status, expires_at, lines not done) of every in_progress or finalizing batch."""
        rows = self._conn().execute(
            "SELECT b.id, b.status, b.expires_at, (SELECT COUNT(*) FROM batch_lines l WHERE l.batch_id = b.id "
            "AND l.done = 0) AS pending FROM batches b WHERE b.status IN ('in_progress', 'finalizing') "
            "ORDER BY b.seq").fetchall()
        return [(r["id"], r["status"], r["expires_at"], r["pending"]) for r in rows]

    def record_result(self, batch_id: str, line: int, custom_id: str, ok: bool, record: str,
                      input_tokens: int = 0, output_tokens: int = 0, cached_tokens: int = 0) -> bool:
        """Store one line's result and mark the line done, atomically; False if it already had one."""
        with self._write() as conn:
            inserted = conn.execute(
                "INSERT INTO batch_results (batch_id, line, custom_id, ok, record, sha256) VALUES (?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (batch_id, line) DO NOTHING",
                (batch_id, line, custom_id, int(ok), record, sha256_hex(record.encode()))).rowcount
            if not inserted:
                return False
            conn.execute("UPDATE batch_lines SET done = 1 WHERE batch_id = ? AND line = ?", (batch_id, line))
            column = "completed" if ok else "failed"
            conn.execute(f"UPDATE batches SET {column} = {column} + 1, input_tokens = input_tokens + ?, "
                         "output_tokens = output_tokens + ?, cached_tokens = cached_tokens + ? WHERE id = ?",
                         (input_tokens, output_tokens, cached_tokens, batch_id))
            return True

    def mark_finalizing(self, batch_id: str) -> None:
        with self._write() as conn:
            conn.execute("UPDATE batches SET status = 'finalizing', finalizing_at = ? WHERE id = ? "
                         "AND status = 'in_progress'", (int(time.time()), batch_id))

    def finish_batch(self, batch_id: str, status: str) -> None:
        """Write the output and error files and move to a final status, in one transaction."""
        stamp = {"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at"}[status]
        with self._write() as conn:
            row = conn.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None or row["status"] not in ACTIVE_STATUSES:
                return
            file_ids = {}
            results = conn.execute("SELECT line, custom_id, ok, record, sha256 FROM batch_results "
                                   "WHERE batch_id = ? ORDER BY line", (batch_id,)).fetchall()
            by_kind: dict[int, list[str]] = {1: [], 0: []}
            for r in results:
                if r["sha256"] is not None and sha256_hex(r["record"].encode()) != r["sha256"]:
                    # A result damaged on disk goes to the error file as an error, never as output.
                    self.damaged_reads += 1
                    by_kind[0].append(json.dumps({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": r["custom_id"],
                                                  "response": None, "error": {
                                                      "code": "result_damaged",
                                                      "message": f"the stored result of line {r['line']} is "
                                                                 "damaged (checksum mismatch) and was not served"}}))
                else:
                    by_kind[r["ok"]].append(r["record"])
            for ok, name in ((1, "output"), (0, "error")):
                records = by_kind[ok]
                if records:
                    file_ids[name] = f"file-{uuid.uuid4().hex}"
                    _insert_file(conn, file_ids[name], "batch_output", f"{batch_id}_{name}.jsonl",
                                 ("\n".join(records) + "\n").encode())
            conn.execute(f"UPDATE batches SET status = ?, {stamp} = ?, output_file_id = ?, error_file_id = ? "
                         "WHERE id = ?", (status, int(time.time()), file_ids.get("output"), file_ids.get("error"),
                                          batch_id))


def _insert_file(conn: sqlite3.Connection, file_id: str, purpose: str, filename: str, content: bytes) -> None:
    conn.execute("INSERT INTO files (id, purpose, filename, bytes, created_at, content, sha256) "
                 "VALUES (?, ?, ?, ?, ?, ?, ?)",
                 (file_id, purpose, filename, len(content), int(time.time()), content, sha256_hex(content)))


def _add_cached_tokens_column(conn: sqlite3.Connection) -> None:
    """A database made before batches counted their cached prompt tokens gains the column (0 so far)."""
    if "cached_tokens" not in {row[1] for row in conn.execute("PRAGMA table_info(batches)")}:
        conn.execute("ALTER TABLE batches ADD COLUMN cached_tokens INTEGER NOT NULL DEFAULT 0")


def _add_prefix_key_column(conn: sqlite3.Connection) -> None:
    """A database made before lines ran in prefix order gains the column ('' : its lines keep file order).
    The index pending_lines walks replaces the one by line, which would only cost every write."""
    if "prefix_key" not in {row[1] for row in conn.execute("PRAGMA table_info(batch_lines)")}:
        conn.execute("ALTER TABLE batch_lines ADD COLUMN prefix_key TEXT NOT NULL DEFAULT ''")
    conn.execute("CREATE INDEX IF NOT EXISTS batch_lines_prefix_order ON batch_lines (batch_id, done, prefix_key, line)")
    conn.execute("DROP INDEX IF EXISTS batch_lines_pending")


def _file_object(row: sqlite3.Row) -> dict:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed",
            "status_details": None, "expires_at": None}


def _batch_object(row: sqlite3.Row) -> dict:
    obj = {"id": row["id"], "object": "batch", "endpoint": row["endpoint"], "errors": None,
           "input_file_id": row["input_file_id"], "completion_window": row["completion_window"],
           "status": row["status"], "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"],
           "created_at": row["created_at"], "expires_at": row["expires_at"],
           "request_counts": {"total": row["total"], "completed": row["completed"], "failed": row["failed"]},
           "usage": {"input_tokens": row["input_tokens"], "input_tokens_details": {"cached_tokens": row["cached_tokens"]},
                     "output_tokens": row["output_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": row["input_tokens"] + row["output_tokens"]},
           "metadata": json.loads(row["metadata"]) if row["metadata"] else None}
    for name in _TIMESTAMPS:
        obj[name] = row[name]
    if row["errors"]:
        obj["errors"] = json.loads(row["errors"])
    return obj
