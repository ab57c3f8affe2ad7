"""The offload coordinator's state (AQUA §6): its SQLite tables, the store that reaps what
expired at every transaction, and the request and response bodies of its routes
(offload/coordinator_routes.py)."""

from __future__ import annotations

import sqlite3
import threading
import time
from contextlib import contextmanager

from fastapi import HTTPException
from pydantic import BaseModel, Field

SCHEMA = """
CREATE TABLE IF NOT EXISTS offers (
    offer_id TEXT PRIMARY KEY, producer TEXT NOT NULL, segment TEXT NOT NULL, capacity INTEGER NOT NULL,
    reclaiming INTEGER NOT NULL DEFAULT 0, ttl_s REAL NOT NULL, expires_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
    lease_id TEXT PRIMARY KEY, consumer TEXT NOT NULL, ttl_s REAL NOT NULL, expires_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS allocations (
    allocation_id TEXT PRIMARY KEY, lease_id TEXT NOT NULL, offer_id TEXT NOT NULL,
    offset INTEGER NOT NULL, nbytes INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS allocations_by_offer ON allocations (offer_id);
CREATE INDEX IF NOT EXISTS allocations_by_lease ON allocations (lease_id);
"""


class OfferIn(BaseModel):
    producer: str = Field(min_length=1)
    segment: str = Field(min_length=1)     # path of the shared-memory file lent
    nbytes: int = Field(gt=0)
    ttl_s: float = Field(default=10.0, gt=0)


class OfferOut(BaseModel):
    offer_id: str
    producer: str
    segment: str
    capacity: int
    allocated_bytes: int
    reclaiming: bool
    expires_at: float


class LeaseIn(BaseModel):
    consumer: str = Field(min_length=1)
    ttl_s: float = Field(default=10.0, gt=0)


class AllocationOut(BaseModel):
    allocation_id: str
    lease_id: str
    offer_id: str
    segment: str
    offset: int
    nbytes: int
    vacate: bool = False      # its producer reclaimed it (or its offer expired): move out


class LeaseOut(BaseModel):
    lease_id: str
    consumer: str
    expires_at: float
    allocations: list[AllocationOut] = []
    lendable_bytes: int = 0   # free bytes in offers open for allocation now


class AllocateIn(BaseModel):
    lease_id: str
    nbytes: int = Field(gt=0)


class CoordinatorStore:
    """The coordinator's tables; one connection behind a lock (SQLite serializes writers anyway)."""

    def __init__(self, path: str, clock=time.time) -> None:
        self.clock = clock
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        self.lock = threading.Lock()

    @contextmanager
    def tx(self):
        with self.lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                self._reap(self.clock())
                yield self.db
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")

    def _reap(self, now: float) -> None:
        """Expired leases lose their allocations; an expired offer is reclaimed, and dropped once
        nothing is allocated in it."""
        self.db.execute("DELETE FROM allocations WHERE lease_id IN (SELECT lease_id FROM leases WHERE expires_at < ?)",
                        (now,))
        self.db.execute("DELETE FROM leases WHERE expires_at < ?", (now,))
        self.db.execute("UPDATE offers SET reclaiming = 1 WHERE expires_at < ?", (now,))
        self.db.execute("DELETE FROM offers WHERE expires_at < ? AND offer_id NOT IN "
                        "(SELECT offer_id FROM allocations)", (now,))


def offer_out(db: sqlite3.Connection, offer_id: str) -> OfferOut:
    row = db.execute("SELECT offer_id, producer, segment, capacity, reclaiming, expires_at FROM offers "
                     "WHERE offer_id = ?", (offer_id,)).fetchone()
    if row is None:
        raise HTTPException(404, f"no offer {offer_id} (expired or withdrawn)")
    allocated = db.execute("SELECT COALESCE(SUM(nbytes), 0) FROM allocations WHERE offer_id = ?",
                           (offer_id,)).fetchone()[0]
    return OfferOut(offer_id=row[0], producer=row[1], segment=row[2], capacity=row[3], allocated_bytes=allocated,
                    reclaiming=bool(row[4]), expires_at=row[5])


def lease_out(db: sqlite3.Connection, lease_id: str) -> LeaseOut:
    row = db.execute("SELECT lease_id, consumer, expires_at FROM leases WHERE lease_id = ?", (lease_id,)).fetchone()
    if row is None:
        raise HTTPException(404, f"no lease {lease_id} (expired or released)")
    allocations = [AllocationOut(allocation_id=a[0], lease_id=a[1], offer_id=a[2], segment=a[3], offset=a[4],
                                 nbytes=a[5], vacate=bool(a[6]))
                   for a in db.execute("SELECT a.allocation_id, a.lease_id, a.offer_id, o.segment, a.offset, "
                                       "a.nbytes, o.reclaiming FROM allocations a JOIN offers o USING (offer_id) "
                                       "WHERE a.lease_id = ?", (lease_id,))]
    lendable = sum(capacity - allocated for capacity, allocated in db.execute(
        "SELECT o.capacity, COALESCE(SUM(a.nbytes), 0) FROM offers o LEFT JOIN allocations a USING (offer_id) "
        "WHERE o.reclaiming = 0 GROUP BY o.offer_id"))
    return LeaseOut(lease_id=row[0], consumer=row[1], expires_at=row[2], allocations=allocations,
                    lendable_bytes=lendable)
