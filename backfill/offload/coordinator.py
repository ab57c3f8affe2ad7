"""The offload coordinator (AQUA §6): producers offer memory, consumers lease and allocate it,
producers reclaim it. A FastAPI service whose state lives in SQLite, so a restarted
coordinator knows every offer, lease and allocation it granted.

Safety rests on leases: a consumer renews its lease every few iterations and learns there
which regions to vacate; one that cannot renew moves everything to host memory. An expired
lease's allocations are freed, so a killed consumer leaks nothing, and a producer may reuse
reclaimed memory once its offer shows no bytes allocated.

Run: python -m backfill.offload.coordinator --port 8700 --db runs/offload.sqlite
"""

from __future__ import annotations

import argparse
import sqlite3
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field

from backfill.memory.regions import first_fit

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


def _offer(db: sqlite3.Connection, offer_id: str) -> OfferOut:
    row = db.execute("SELECT offer_id, producer, segment, capacity, reclaiming, expires_at FROM offers "
                     "WHERE offer_id = ?", (offer_id,)).fetchone()
    if row is None:
        raise HTTPException(404, f"no offer {offer_id} (expired or withdrawn)")
    allocated = db.execute("SELECT COALESCE(SUM(nbytes), 0) FROM allocations WHERE offer_id = ?",
                           (offer_id,)).fetchone()[0]
    return OfferOut(offer_id=row[0], producer=row[1], segment=row[2], capacity=row[3], allocated_bytes=allocated,
                    reclaiming=bool(row[4]), expires_at=row[5])


def _lease(db: sqlite3.Connection, lease_id: str) -> LeaseOut:
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


def create_app(db_path: str, clock=time.time) -> FastAPI:
    store = CoordinatorStore(db_path, clock)
    app = FastAPI(title="backfill offload coordinator")
    app.state.store = store

    @app.get("/healthz")
    def healthz() -> dict:
        return {"ok": True}

    @app.post("/v1/offers", response_model=OfferOut)
    def offer(body: OfferIn) -> OfferOut:
        offer_id = uuid.uuid4().hex
        with store.tx() as db:
            db.execute("INSERT INTO offers VALUES (?, ?, ?, ?, 0, ?, ?)", (
                offer_id, body.producer, body.segment, body.nbytes, body.ttl_s, store.clock() + body.ttl_s))
            return _offer(db, offer_id)

    @app.get("/v1/offers/{offer_id}", response_model=OfferOut)
    def get_offer(offer_id: str) -> OfferOut:
        with store.tx() as db:
            return _offer(db, offer_id)

    @app.post("/v1/offers/{offer_id}/heartbeat", response_model=OfferOut)
    def heartbeat(offer_id: str) -> OfferOut:
        with store.tx() as db:
            _offer(db, offer_id)
            db.execute("UPDATE offers SET expires_at = ? + ttl_s WHERE offer_id = ?", (store.clock(), offer_id))
            return _offer(db, offer_id)

    @app.post("/v1/offers/{offer_id}/reclaim", response_model=OfferOut)
    def reclaim(offer_id: str) -> OfferOut:
        """The producer wants its memory back: no new allocations; consumers vacate at their next poll."""
        with store.tx() as db:
            _offer(db, offer_id)
            db.execute("UPDATE offers SET reclaiming = 1 WHERE offer_id = ?", (offer_id,))
            return _offer(db, offer_id)

    @app.delete("/v1/offers/{offer_id}/reclaim", response_model=OfferOut)
    def reoffer(offer_id: str) -> OfferOut:
        """The producer is steady again: its memory may be allocated again."""
        with store.tx() as db:
            _offer(db, offer_id)
            db.execute("UPDATE offers SET reclaiming = 0 WHERE offer_id = ?", (offer_id,))
            return _offer(db, offer_id)

    @app.delete("/v1/offers/{offer_id}")
    def withdraw(offer_id: str) -> dict:
        with store.tx() as db:
            if _offer(db, offer_id).allocated_bytes:
                raise HTTPException(409, f"offer {offer_id} still has allocations: reclaim it and wait")
            db.execute("DELETE FROM offers WHERE offer_id = ?", (offer_id,))
        return {"withdrawn": offer_id}

    @app.post("/v1/leases", response_model=LeaseOut)
    def lease(body: LeaseIn) -> LeaseOut:
        lease_id = uuid.uuid4().hex
        with store.tx() as db:
            db.execute("INSERT INTO leases VALUES (?, ?, ?, ?)",
                       (lease_id, body.consumer, body.ttl_s, store.clock() + body.ttl_s))
            return _lease(db, lease_id)

    @app.post("/v1/leases/{lease_id}/renew", response_model=LeaseOut)
    def renew(lease_id: str) -> LeaseOut:
        """A consumer's poll: the lease extended, its allocations with what to vacate."""
        with store.tx() as db:
            _lease(db, lease_id)
            db.execute("UPDATE leases SET expires_at = ? + ttl_s WHERE lease_id = ?", (store.clock(), lease_id))
            return _lease(db, lease_id)

    @app.delete("/v1/leases/{lease_id}")
    def release(lease_id: str) -> dict:
        with store.tx() as db:
            _lease(db, lease_id)
            freed = db.execute("DELETE FROM allocations WHERE lease_id = ?", (lease_id,)).rowcount
            db.execute("DELETE FROM leases WHERE lease_id = ?", (lease_id,))
        return {"released": lease_id, "allocations_freed": freed}

    @app.post("/v1/allocations", response_model=AllocationOut)
    def allocate(body: AllocateIn) -> AllocationOut:
        """First fit over open offers, fullest first (keeps whole offers free for reclaiming)."""
        with store.tx() as db:
            _lease(db, body.lease_id)
            offers = db.execute("SELECT o.offer_id, o.segment, o.capacity FROM offers o LEFT JOIN allocations a "
                                "USING (offer_id) WHERE o.reclaiming = 0 GROUP BY o.offer_id "
                                "ORDER BY o.capacity - COALESCE(SUM(a.nbytes), 0)").fetchall()
            for offer_id, segment, capacity in offers:
                taken = db.execute("SELECT offset, nbytes FROM allocations WHERE offer_id = ?", (offer_id,)).fetchall()
                offset = first_fit(taken, capacity, body.nbytes)
                if offset is not None:
                    allocation_id = uuid.uuid4().hex
                    db.execute("INSERT INTO allocations VALUES (?, ?, ?, ?, ?)",
                               (allocation_id, body.lease_id, offer_id, offset, body.nbytes))
                    return AllocationOut(allocation_id=allocation_id, lease_id=body.lease_id, offer_id=offer_id,
                                         segment=segment, offset=offset, nbytes=body.nbytes)
        raise HTTPException(507, f"no offer has {body.nbytes} contiguous free bytes")

    @app.delete("/v1/allocations/{allocation_id}")
    def free(allocation_id: str) -> dict:
        with store.tx() as db:
            if not db.execute("DELETE FROM allocations WHERE allocation_id = ?", (allocation_id,)).rowcount:
                raise HTTPException(404, f"no allocation {allocation_id} (freed, or its lease expired)")
        return {"freed": allocation_id}

    @app.get("/v1/state")
    def state() -> dict:
        with store.tx() as db:
            count = lambda table: db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]  # noqa: E731
            allocated = db.execute("SELECT COALESCE(SUM(nbytes), 0) FROM allocations").fetchone()[0]
            return {"offers": count("offers"), "leases": count("leases"), "allocations": count("allocations"),
                    "allocated_bytes": allocated}

    return app


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8700)
    p.add_argument("--db", default="runs/offload-coordinator.sqlite", help="SQLite file holding the state")


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    Path(args.db).parent.mkdir(parents=True, exist_ok=True)
    uvicorn.run(create_app(args.db), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    serve(parser.parse_args())
