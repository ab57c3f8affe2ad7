"""The offload coordinator's routes (AQUA §6), declared as the server declares its own
(backfill/server/routes_*.py): one `add_X_routes(router, store)` per resource. Every route runs
in one transaction of the store (offload/coordinator_store.py)."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, FastAPI, HTTPException

from backfill.memory.regions import first_fit
from backfill.offload.coordinator_store import (AllocateIn, AllocationOut, CoordinatorStore, LeaseIn, LeaseOut,
                                                OfferIn, OfferOut, lease_out, offer_out)


def add_health_routes(app: FastAPI, store: CoordinatorStore) -> None:
    """GET /healthz and GET /v1/state: alive, and what the tables hold."""

    @app.get("/healthz")
    def healthz() -> dict:
        return {"ok": True}

    @app.get("/v1/state")
    def state() -> dict:
        with store.tx() as db:
            count = lambda table: db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]  # noqa: E731
            allocated = db.execute("SELECT COALESCE(SUM(nbytes), 0) FROM allocations").fetchone()[0]
            return {"offers": count("offers"), "leases": count("leases"), "allocations": count("allocations"),
                    "allocated_bytes": allocated}


def add_offer_routes(v1: APIRouter, store: CoordinatorStore) -> None:
    """A producer's side: offer memory, keep the offer alive, reclaim it, offer it again, withdraw it."""

    @v1.post("/offers", response_model=OfferOut)
    def offer(body: OfferIn) -> OfferOut:
        offer_id = uuid.uuid4().hex
        with store.tx() as db:
            db.execute("INSERT INTO offers VALUES (?, ?, ?, ?, 0, ?, ?)", (
                offer_id, body.producer, body.segment, body.nbytes, body.ttl_s, store.clock() + body.ttl_s))
            return offer_out(db, offer_id)

    @v1.get("/offers/{offer_id}", response_model=OfferOut)
    def get_offer(offer_id: str) -> OfferOut:
        with store.tx() as db:
            return offer_out(db, offer_id)

    @v1.post("/offers/{offer_id}/heartbeat", response_model=OfferOut)
    def heartbeat(offer_id: str) -> OfferOut:
        with store.tx() as db:
            offer_out(db, offer_id)
            db.execute("UPDATE offers SET expires_at = ? + ttl_s WHERE offer_id = ?", (store.clock(), offer_id))
            return offer_out(db, offer_id)

    @v1.post("/offers/{offer_id}/reclaim", response_model=OfferOut)
    def reclaim(offer_id: str) -> OfferOut:
        """The producer wants its memory back: no new allocations; consumers vacate at their next poll."""
        with store.tx() as db:
            offer_out(db, offer_id)
            db.execute("UPDATE offers SET reclaiming = 1 WHERE offer_id = ?", (offer_id,))
            return offer_out(db, offer_id)

    @v1.delete("/offers/{offer_id}/reclaim", response_model=OfferOut)
    def reoffer(offer_id: str) -> OfferOut:
        """The producer is steady again: its memory may be allocated again."""
        with store.tx() as db:
            offer_out(db, offer_id)
            db.execute("UPDATE offers SET reclaiming = 0 WHERE offer_id = ?", (offer_id,))
            return offer_out(db, offer_id)

    @v1.delete("/offers/{offer_id}")
    def withdraw(offer_id: str) -> dict:
        with store.tx() as db:
            if offer_out(db, offer_id).allocated_bytes:
                raise HTTPException(409, f"offer {offer_id} still has allocations: reclaim it and wait")
            db.execute("DELETE FROM offers WHERE offer_id = ?", (offer_id,))
        return {"withdrawn": offer_id}


def add_lease_routes(v1: APIRouter, store: CoordinatorStore) -> None:
    """A consumer's lease: take one, renew it (the poll that says what to vacate), release it."""

    @v1.post("/leases", response_model=LeaseOut)
    def lease(body: LeaseIn) -> LeaseOut:
        lease_id = uuid.uuid4().hex
        with store.tx() as db:
            db.execute("INSERT INTO leases VALUES (?, ?, ?, ?)",
                       (lease_id, body.consumer, body.ttl_s, store.clock() + body.ttl_s))
            return lease_out(db, lease_id)

    @v1.post("/leases/{lease_id}/renew", response_model=LeaseOut)
    def renew(lease_id: str) -> LeaseOut:
        """A consumer's poll: the lease extended, its allocations with what to vacate."""
        with store.tx() as db:
            lease_out(db, lease_id)
            db.execute("UPDATE leases SET expires_at = ? + ttl_s WHERE lease_id = ?", (store.clock(), lease_id))
            return lease_out(db, lease_id)

    @v1.delete("/leases/{lease_id}")
    def release(lease_id: str) -> dict:
        with store.tx() as db:
            lease_out(db, lease_id)
            freed = db.execute("DELETE FROM allocations WHERE lease_id = ?", (lease_id,)).rowcount
            db.execute("DELETE FROM leases WHERE lease_id = ?", (lease_id,))
        return {"released": lease_id, "allocations_freed": freed}


def add_allocation_routes(v1: APIRouter, store: CoordinatorStore) -> None:
    """Allocations under a lease: placed first fit in the open offers, freed one by one."""

    @v1.post("/allocations", response_model=AllocationOut)
    def allocate(body: AllocateIn) -> AllocationOut:
        """First fit over open offers, fullest first (keeps whole offers free for reclaiming)."""
        with store.tx() as db:
            lease_out(db, body.lease_id)
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

    @v1.delete("/allocations/{allocation_id}")
    def free(allocation_id: str) -> dict:
        with store.tx() as db:
            if not db.execute("DELETE FROM allocations WHERE allocation_id = ?", (allocation_id,)).rowcount:
                raise HTTPException(404, f"no allocation {allocation_id} (freed, or its lease expired)")
        return {"freed": allocation_id}
