"""The benchmark's node topology: one engine per process (online or offline) under a node runtime,
driven by `backfill bench node` (bench/node_bench.py) and the device burst (bench/device_burst.py)."""
