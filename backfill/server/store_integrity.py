"""Refuse to serve from a database that has rotted, instead of losing its files and batches quietly.

Two ways a store goes bad without SQLite saying so on open:
  * pages overwritten with the header intact: SQLite opens it, and queries fail (or return
    garbage) only when they touch the damaged pages, so `PRAGMA quick_check` runs before serving;
  * a 0-byte file (a truncated copy, a full disk, a bad restore): SQLite silently takes it as a
    new empty database, and every earlier file and batch would vanish without a word.
Both are refused with StoreIntegrityError unless the operator asks for a fresh start, and even
then the damaged file is moved aside (PATH.damaged-<time>), never deleted, and a warning says where.

A third, damage inside the bytes of a file's content or a result, keeps the b-tree intact and
passes quick_check; the store keeps a SHA-256 of each and refuses a read that no longer matches
(DamagedContentError).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sqlite3
import time
from pathlib import Path

from backfill.errors import BackfillError, ServerConfigError

log = logging.getLogger(__name__)

_SIDE_FILES = ("-wal", "-shm")
QUICK_CHECK_MAX_ERRORS = 5   # enough to say what is wrong without reading a damaged file to its end


class StoreIntegrityError(ServerConfigError):
    """The server database is damaged or missing its contents; the server refuses to start on it."""


class DamagedContentError(BackfillError):
    """Stored bytes (a file's content) no longer match the checksum recorded when they were written."""


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# Tables whose rows carry a checksum; a database made before the checksums gets the column
# (NULL: that row is read unchecked).
CHECKSUMMED_TABLES = ("files", "batch_results")


def add_checksum_columns(conn: sqlite3.Connection) -> None:
    for table in CHECKSUMMED_TABLES:
        columns = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
        if "sha256" not in columns:
            conn.execute(f"ALTER TABLE {table} ADD COLUMN sha256 TEXT")


def unchecked_rows(conn: sqlite3.Connection) -> dict[str, int]:
    """Rows stored before checksums were kept (sha256 NULL), per table: read unchecked, so reported."""
    return {table: conn.execute(f"SELECT COUNT(*) FROM {table} WHERE sha256 IS NULL").fetchone()[0]
            for table in CHECKSUMMED_TABLES}


def preflight(path: Path, fresh: bool) -> None:
    """Before SQLite opens path: refuse an empty or orphaned database (or move it aside if fresh)."""
    problem = _empty_problem(path)
    if problem is None:
        return
    if not fresh:
        raise StoreIntegrityError(f"{problem}; refusing to start on it, which would silently replace every "
                                  "earlier file and batch with an empty database. Restore it from a backup, "
                                  "or pass --fresh-db to move it aside and start with an empty one")
    move_aside(path)


def _empty_problem(path: Path) -> str | None:
    if path.exists():
        if path.is_file() and path.stat().st_size == 0:
            return f"the database {path} is an empty (0-byte) file"
        return None
    orphans = [path.with_name(path.name + s) for s in _SIDE_FILES if path.with_name(path.name + s).exists()]
    if any(p.stat().st_size > 0 for p in orphans):
        return f"the database {path} is missing but its journal {orphans[0].name} is not"
    return None


def check(conn: sqlite3.Connection, path: Path) -> None:
    """PRAGMA quick_check: StoreIntegrityError naming the first problems, if any."""
    try:
        rows = [str(r[0]).replace("\n", "; ") for r in
                conn.execute(f"PRAGMA quick_check({QUICK_CHECK_MAX_ERRORS})").fetchall()]
    except sqlite3.DatabaseError as exc:
        rows = [str(exc)]
    if rows != ["ok"]:
        raise StoreIntegrityError(damaged_message(path, "; ".join(rows)))


def damaged_message(path: Path, detail: str) -> str:
    return (f"the database {path} is damaged ({detail}); refusing to start on it. Restore it from a backup "
            "(or salvage it with `sqlite3 DB .recover`), or pass --fresh-db to move it aside and start "
            "with an empty one")


def move_aside(path: Path) -> Path:
    """Rename the database and its journal files to PATH.damaged-<unix time>[-wal|-shm]."""
    target = path.with_name(f"{path.name}.damaged-{int(time.time())}")
    for suffix in ("", *_SIDE_FILES):
        source = path.with_name(path.name + suffix)
        if source.exists():
            try:
                os.replace(source, target.with_name(target.name + suffix))
            except OSError as exc:
                raise StoreIntegrityError(f"cannot move the damaged database {source} aside: {exc}") from None
            log.warning("--fresh-db: moved the damaged database %s aside to %s (nothing deleted); starting "
                        "with an empty one", source, target.with_name(target.name + suffix))
    return target
