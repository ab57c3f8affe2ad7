"""The offload coordinator over real HTTP on 127.0.0.1, with real producer and consumer processes
(AQUA §6): reclaim seen within N iterations, kill -9 of the coordinator and of a consumer mid-migration."""

import os
import random
import subprocess
import sys
import threading
import time

import pytest
import torch

from backfill.errors import CoordinatorError, LeaseExpiredError
from backfill.offload.client import ConsumerLender, CoordinatorClient, ProducerAgent
from backfill.memory.elastic import ElasticStore, Location

from conftest import ROOT

TTL_S = 1.0


def fill(store: ElasticStore, prefix: str, n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    expected = {}
    for i in range(n):
        data = torch.randn(int(torch.randint(10, 4000, (1,), generator=g)), generator=g)
        expected[f"{prefix}{i}"] = data.clone()
        store.put(f"{prefix}{i}", data, Location.LENT)
    return expected


def assert_same(store: ElasticStore, expected: dict[str, torch.Tensor]) -> None:
    for key, want in expected.items():
        assert torch.equal(store.read(key), want), key


def test_lend_allocate_free_over_http(coordinator):
    client = CoordinatorClient(coordinator.url)
    producer = ProducerAgent(client, 1 << 20, "producer-a", ttl_s=TTL_S)
    lender = ConsumerLender(client, "consumer-a", ttl_s=TTL_S, poll_every=1)
    store = ElasticStore(lender=lender)
    try:
        data = torch.arange(1000, dtype=torch.float32)
        assert store.put("x", data) is Location.LENT
        region = store._tensors["x"].region
        # The bytes are in the producer's segment, seen through its own mapping.
        lent = producer.segment.bytes[region.offset:region.offset + data.numel() * 4].view(torch.float32)
        assert torch.equal(lent, data)
        assert client.get_offer(producer.offer_id)["allocated_bytes"] >= 4000
        store.free("x")
        assert client.get_offer(producer.offer_id)["allocated_bytes"] == 0
        # Bigger than any offer: host memory.
        assert store.put("big", torch.zeros(1 << 19)) is Location.HOST
    finally:
        lender.close()
        producer.close()
        client.close()


def test_reclaim_seen_within_n_iterations_then_back(coordinator):
    client = CoordinatorClient(coordinator.url)
    producer = ProducerAgent(client, 4 << 20, "producer-b", ttl_s=5, steady_rate_per_s=2.0)
    poll_every = 3
    store = ElasticStore(lender=ConsumerLender(client, "consumer-b", ttl_s=5, poll_every=poll_every))
    try:
        expected = fill(store, "kv", 10, seed=1)
        assert store.bytes_in(Location.HOST) == 0
        producer.observe_load(1.9)
        assert not producer.reclaiming
        producer.observe_load(3.0)  # the producer's load rose: it asks for its memory back
        assert producer.reclaiming
        iterations = 0
        while store.bytes_in(Location.LENT):
            store.at_step_boundary()
            iterations += 1
            assert iterations <= poll_every
        assert producer.wait_reclaimed(2.0)
        assert_same(store, expected)
        assert store.put("new", torch.ones(8)) is Location.HOST  # nothing is lent while reclaiming
        producer.observe_load(2.0)  # steady again
        for _ in range(poll_every):
            store.at_step_boundary()
        assert store.bytes_in(Location.HOST) == 0
        assert_same(store, expected)
    finally:
        store.lender.close()
        producer.close()
        client.close()


def test_concurrent_producers_and_consumers(coordinator):
    producers = [ProducerAgent(CoordinatorClient(coordinator.url), 512 << 10, f"p{i}", ttl_s=5) for i in range(2)]
    errors: list[BaseException] = []
    stop = threading.Event()

    def consumer(index: int) -> None:
        try:
            client = CoordinatorClient(coordinator.url)
            store = ElasticStore(lender=ConsumerLender(client, f"c{index}", ttl_s=5, poll_every=2))
            rng = random.Random(index)
            expected = fill(store, f"c{index}-", 8, seed=index)
            for step in range(40):
                key = rng.choice(sorted(expected))
                op = rng.random()
                if op < 0.4:
                    store.move([key], rng.choice(list(Location)))
                elif op < 0.6:
                    store.move(sorted(expected), Location.LENT)
                elif op < 0.8:
                    data = torch.randn(rng.randint(1, 3000))
                    store.put(key, data)
                    expected[key] = data.clone()
                store.at_step_boundary()
                assert_same(store, expected)
            for key in list(expected):
                store.free(key)
            store.lender.close()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    def churn() -> None:  # producers reclaim and offer again while consumers work
        rng = random.Random(99)
        while not stop.is_set():
            producer = rng.choice(producers)
            producer.reclaim() if not producer.reclaiming else producer.reoffer()
            for p in producers:
                p.heartbeat()
            time.sleep(0.05)

    threads = [threading.Thread(target=consumer, args=(i,)) for i in range(4)]
    churner = threading.Thread(target=churn)
    for t in threads + [churner]:
        t.start()
    for t in threads:
        t.join(60)
    stop.set()
    churner.join()
    assert not errors, errors
    state = producers[0].client.state()
    assert state["allocations"] == 0 and state["leases"] == 0
    for producer in producers:
        producer.close()


def test_kill9_coordinator_mid_migration(coordinator):
    client = CoordinatorClient(coordinator.url, timeout_s=0.5)
    producer = ProducerAgent(client, 4 << 20, "producer-k", ttl_s=TTL_S)
    store = ElasticStore(lender=ConsumerLender(client, "consumer-k", ttl_s=TTL_S, poll_every=1))
    expected = fill(store, "kv", 12, seed=3)
    lock = threading.Lock()
    stop = threading.Event()

    def migrate() -> None:
        while not stop.is_set():
            with lock:
                store.move(store.keys(), Location.HOST)
                store.move(store.keys(), Location.LENT)

    mover = threading.Thread(target=migrate)
    mover.start()
    time.sleep(0.3)
    coordinator.kill9()
    time.sleep(0.2)
    stop.set()
    mover.join()
    store.at_step_boundary()  # the poll fails: fall back to host memory
    assert store.bytes_in(Location.LENT) == 0
    assert_same(store, expected)
    # Restarted on the same SQLite file: it remembers the lease, which expires; nothing leaks.
    coordinator.start()
    fresh = CoordinatorClient(coordinator.url)
    time.sleep(TTL_S + 0.2)
    state = fresh.state()
    assert state["leases"] == 0 and state["allocations"] == 0
    with pytest.raises(LeaseExpiredError):
        fresh.renew(store.lender.lease_id)
    producer.segment.unlink()
    fresh.close()


def test_kill9_consumer_mid_migration(coordinator, tmp_path):
    client = CoordinatorClient(coordinator.url)
    producer = ProducerAgent(client, 8 << 20, "producer-c", ttl_s=30)
    survivor = ElasticStore(lender=ConsumerLender(client, "survivor", ttl_s=30, poll_every=1))
    expected = fill(survivor, "s", 6, seed=4)
    env = dict(os.environ, PYTHONPATH=ROOT)
    worker = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "consumer_worker.py"),
                               coordinator.url], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert worker.stdout.readline().strip() == "ready"
        time.sleep(0.3)  # migrating out and back
        worker.kill()
        worker.wait()
        assert_same(survivor, expected)
        time.sleep(TTL_S + 0.2)
        state = client.state()
        assert state["leases"] == 1  # the survivor's; the dead consumer's lease expired with its memory
        held = client.get_offer(producer.offer_id)["allocated_bytes"]
        assert held == sum(region.nbytes for region in survivor._regions.values())
        # The producer takes everything back: the survivor vacates, the memory is free.
        producer.reclaim()
        survivor.at_step_boundary()
        assert producer.wait_reclaimed(2.0)
        assert_same(survivor, expected)
    finally:
        if worker.poll() is None:
            worker.kill()
        survivor.lender.close()
        producer.close()
        client.close()


def test_http_errors(coordinator):
    client = CoordinatorClient(coordinator.url)
    with pytest.raises(LeaseExpiredError):
        client.renew("no-such-lease")
    with pytest.raises(LeaseExpiredError):
        client.reclaim("no-such-offer")
    with pytest.raises(CoordinatorError):
        client.offer("p", "/dev/shm/x", -5, 1.0)  # 422: a negative size
    lease = client.lease("c", 5)
    assert client.allocate(lease["lease_id"], 100) is None  # no offers: 507, fall back to host
    client.close()
    with pytest.raises(CoordinatorError):
        CoordinatorClient("http://127.0.0.1:9", timeout_s=0.2).state()


def test_chunked_lending_makes_no_call_per_page_and_still_vacates(coordinator):
    client = CoordinatorClient(coordinator.url)
    producer = ProducerAgent(client, 4 << 20, "producer-chunks", ttl_s=5)
    lender = ConsumerLender(client, "consumer-chunks", ttl_s=5, poll_every=2, chunk_bytes=1 << 20)
    store = ElasticStore(lender=lender)
    try:
        expected = fill(store, "kv", 12, seed=5)          # up to 16 KB each: one 1 MB chunk
        assert client.state()["allocations"] == 1 and store.bytes_in(Location.HOST) == 0
        store.free("kv0")
        del expected["kv0"]
        assert client.state()["allocations"] == 1         # the chunk stays: swap space is kept
        producer.reclaim()
        for _ in range(2):
            store.at_step_boundary()
        assert store.bytes_in(Location.LENT) == 0 and producer.wait_reclaimed(2.0)
        assert_same(store, expected)
    finally:
        lender.close()
        producer.close()
        client.close()
