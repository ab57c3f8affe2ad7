"""A consumer process for the kill -9 test: fills lent memory, then migrates out and back forever."""

import sys

import torch

from backfill.offload.client import ConsumerLender, CoordinatorClient
from backfill.memory.elastic import ElasticStore, Location

url = sys.argv[1]
lender = ConsumerLender(CoordinatorClient(url), "doomed-consumer", ttl_s=1.0, poll_every=1)
store = ElasticStore(lender=lender)
for i in range(6):
    store.put(f"w{i}", torch.full((64, 1024), float(i)), Location.LENT)
print("ready", flush=True)
while True:
    store.move(store.keys(), Location.HOST)
    store.move(store.keys(), Location.LENT)
    store.at_step_boundary()
