"""The coordinator's client library (AQUA §6 "southbound interface"): the HTTP calls, a
consumer's lender for elastic tensors, and a producer's agent that offers and reclaims memory.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import httpx

from backfill.errors import CoordinatorError, LeaseExpiredError
from backfill.memory.elastic import make_segment
from backfill.memory.regions import LentRegion, first_fit


class CoordinatorClient:
    def __init__(self, url: str, *, timeout_s: float = 2.0) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kwargs) -> dict:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise CoordinatorError(f"coordinator at {self.url} unreachable: {exc}") from exc
        if response.status_code == 404:
            raise LeaseExpiredError(response.json().get("detail", response.text))
        if response.status_code >= 400:
            raise CoordinatorError(f"{method} {path}: {response.status_code} {response.text}")
        return response.json()

    # producers
    def offer(self, producer: str, segment: str, nbytes: int, ttl_s: float) -> dict:
        return self._call("POST", "/v1/offers", json={"producer": producer, "segment": segment, "nbytes": nbytes,
                                                       "ttl_s": ttl_s})

    def get_offer(self, offer_id: str) -> dict:
        return self._call("GET", f"/v1/offers/{offer_id}")

    def heartbeat(self, offer_id: str) -> dict:
        return self._call("POST", f"/v1/offers/{offer_id}/heartbeat")

    def reclaim(self, offer_id: str) -> dict:
        return self._call("POST", f"/v1/offers/{offer_id}/reclaim")

    def reoffer(self, offer_id: str) -> dict:
        return self._call("DELETE", f"/v1/offers/{offer_id}/reclaim")

    def withdraw(self, offer_id: str) -> dict:
        return self._call("DELETE", f"/v1/offers/{offer_id}")

    # consumers
    def lease(self, consumer: str, ttl_s: float) -> dict:
        return self._call("POST", "/v1/leases", json={"consumer": consumer, "ttl_s": ttl_s})

    def renew(self, lease_id: str) -> dict:
        return self._call("POST", f"/v1/leases/{lease_id}/renew")

    def release(self, lease_id: str) -> dict:
        return self._call("DELETE", f"/v1/leases/{lease_id}")

    def allocate(self, lease_id: str, nbytes: int) -> dict | None:
        """None when no offer has room (HTTP 507)."""
        try:
            return self._call("POST", "/v1/allocations", json={"lease_id": lease_id, "nbytes": nbytes})
        except LeaseExpiredError:
            raise
        except CoordinatorError as exc:
            if " 507 " in str(exc):
                return None
            raise

    def free(self, allocation_id: str) -> dict:
        return self._call("DELETE", f"/v1/allocations/{allocation_id}")

    def state(self) -> dict:
        return self._call("GET", "/v1/state")


@dataclass
class _Chunk:
    """One coordinator allocation, carved locally into the regions elastic tensors use."""

    segment: str
    offset: int
    nbytes: int
    taken: dict[str, tuple[int, int]] = field(default_factory=dict)   # region id -> (offset, nbytes) inside


class ConsumerLender:
    """A consumer's lent memory through the coordinator (the Lender of an ElasticStore).

    Polls once every `poll_every` step boundaries (AQUA §6: the check is infrequent). When the
    coordinator cannot be reached or the lease is gone, every lent region is to be vacated and
    no new one is asked for until a poll succeeds again: the consumer falls back to host memory
    before its lease can expire (poll_every x step time must stay well under ttl_s).

    chunk_bytes > 0: memory is taken from the coordinator in chunks of that size and carved
    locally (swap space allocated once, as AQUA's engines do), so paging makes no HTTP call;
    empty chunks are kept until their producer reclaims them or the lease ends. 0: one
    coordinator allocation per region, returned when the region is freed.
    """

    def __init__(self, client: CoordinatorClient, consumer: str = "", *, ttl_s: float = 10.0,
                 poll_every: int = 5, chunk_bytes: int = 0) -> None:
        self.client = client
        self.consumer = consumer or f"consumer-{uuid.uuid4().hex[:8]}"
        self.ttl_s = ttl_s
        self.poll_every = max(1, poll_every)
        self.chunk_bytes = chunk_bytes
        self.lease_id: str | None = None
        self.healthy = False
        self.lendable_bytes = 0
        self.polls = 0
        self._chunks: dict[str, _Chunk] = {}
        self._region_chunk: dict[str, str] = {}
        self._vacate: set[str] = set()          # chunk ids to move out of
        self._boundaries = 0
        self._poll()

    def _poll(self) -> None:
        self.polls += 1
        try:
            if self.lease_id is None:
                lease = self.client.lease(self.consumer, self.ttl_s)
                self.lease_id = lease["lease_id"]
            else:
                lease = self.client.renew(self.lease_id)
        except LeaseExpiredError:
            self.lease_id, self.healthy, self.lendable_bytes = None, False, 0
            self._vacate = set(self._chunks)
            return
        except CoordinatorError:
            self.healthy, self.lendable_bytes = False, 0
            self._vacate = set(self._chunks)
            return
        self.healthy = True
        self.lendable_bytes = lease["lendable_bytes"]
        known = {a["allocation_id"] for a in lease["allocations"]}
        # Vacate what the producer reclaims, and anything the coordinator no longer knows of.
        self._vacate = {a["allocation_id"] for a in lease["allocations"] if a["vacate"]} | (set(self._chunks) - known)

    def allocate(self, nbytes: int) -> LentRegion | None:
        if not self.healthy or self.lease_id is None:
            return None
        for chunk_id, chunk in self._chunks.items():
            if chunk_id not in self._vacate:
                offset = first_fit(list(chunk.taken.values()), chunk.nbytes, nbytes)
                if offset is not None:
                    return self._carve(chunk_id, offset, nbytes)
        if self.lendable_bytes <= 0:
            return None
        try:
            got = self.client.allocate(self.lease_id, max(nbytes, self.chunk_bytes))
            if got is None and self.chunk_bytes > nbytes:
                got = self.client.allocate(self.lease_id, nbytes)
        except CoordinatorError:
            self.healthy = False
            return None
        if got is None:
            self.lendable_bytes = 0  # full: not again before the next poll
            return None
        self._chunks[got["allocation_id"]] = _Chunk(got["segment"], got["offset"], got["nbytes"])
        return self._carve(got["allocation_id"], 0, nbytes)

    def _carve(self, chunk_id: str, offset: int, nbytes: int) -> LentRegion:
        chunk = self._chunks[chunk_id]
        region_id = uuid.uuid4().hex
        chunk.taken[region_id] = (offset, nbytes)
        self._region_chunk[region_id] = chunk_id
        return LentRegion(region_id, chunk.segment, chunk.offset + offset, nbytes)

    def free(self, region: LentRegion) -> None:
        chunk_id = self._region_chunk.pop(region.region_id, None)
        if chunk_id is None:
            return
        chunk = self._chunks[chunk_id]
        chunk.taken.pop(region.region_id, None)
        if not chunk.taken and (self.chunk_bytes == 0 or chunk_id in self._vacate or not self.healthy):
            self._release(chunk_id)

    def _release(self, chunk_id: str) -> None:
        self._chunks.pop(chunk_id, None)
        self._vacate.discard(chunk_id)
        if self.healthy:
            try:
                self.client.free(chunk_id)
            except CoordinatorError:
                pass  # gone with its lease, or the coordinator is down: expiry frees it

    def to_vacate(self) -> set[str]:
        self._boundaries += 1
        if self._boundaries % self.poll_every == 0:
            self._poll()
            for chunk_id in [c for c in self._vacate if c in self._chunks and not self._chunks[c].taken]:
                self._release(chunk_id)
        return {region_id for region_id, chunk_id in self._region_chunk.items() if chunk_id in self._vacate}

    def can_lend(self) -> bool:
        return self.healthy and (self.lendable_bytes > 0 or any(c not in self._vacate for c in self._chunks))

    @property
    def bytes_held(self) -> int:
        return sum(c.nbytes for c in self._chunks.values())

    def close(self) -> None:
        if self.lease_id is not None:
            try:
                self.client.release(self.lease_id)
            except CoordinatorError:
                pass
            self.lease_id = None
        self._chunks.clear()
        self._region_chunk.clear()


class ProducerAgent:
    """A producer's side (AQUA §6 "northbound"): offers a shared-memory segment, reclaims it when
    its own load rises above its profiled steady rate, offers it again when the load is back."""

    def __init__(self, client: CoordinatorClient, nbytes: int, producer: str = "", *, ttl_s: float = 10.0,
                 steady_rate_per_s: float | None = None, rise: float = 1.2, device: str = "cpu") -> None:
        """device cuda[:N]: lend device memory of this process (CUDA IPC) instead of a /dev/shm segment."""
        self.client = client
        self.producer = producer or f"producer-{uuid.uuid4().hex[:8]}"
        self.segment = make_segment(nbytes, device)
        self.ttl_s = ttl_s
        self.steady_rate_per_s = steady_rate_per_s
        self.rise = rise
        self.offer_id = client.offer(self.producer, self.segment.path, nbytes, ttl_s)["offer_id"]
        self.reclaiming = False

    def heartbeat(self) -> dict:
        return self.client.heartbeat(self.offer_id)

    def observe_load(self, rate_per_s: float) -> None:
        """Reclaim when the load rises past rise x the steady rate; offer again once back to it."""
        if self.steady_rate_per_s is None:
            return
        if not self.reclaiming and rate_per_s > self.rise * self.steady_rate_per_s:
            self.reclaim()
        elif self.reclaiming and rate_per_s <= self.steady_rate_per_s:
            self.reoffer()

    def reclaim(self) -> dict:
        self.reclaiming = True
        return self.client.reclaim(self.offer_id)

    def reoffer(self) -> dict:
        self.reclaiming = False
        return self.client.reoffer(self.offer_id)

    def wait_reclaimed(self, timeout_s: float, interval_s: float = 0.05) -> bool:
        """True once no consumer holds any of the memory (vacated, or their leases expired)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.client.get_offer(self.offer_id)["allocated_bytes"] == 0:
                return True
            time.sleep(interval_s)
        return False

    def close(self) -> None:
        try:
            self.client.reclaim(self.offer_id)
            self.client.withdraw(self.offer_id)
        except CoordinatorError:
            pass
        self.segment.unlink()
