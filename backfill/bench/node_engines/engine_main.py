"""The entry of an engine process
(`python -m backfill.bench.node_engines.engine_main FD SOCKET_PATH SPEC_JSON`, spawned by
engine_proc.EngineProcess): runs the online or the offline engine of its spec."""

from __future__ import annotations

import json
import sys
from multiprocessing.connection import Connection

from backfill.bench.node_engines.engine_proc import EngineSpec


def run_engine(spec: EngineSpec, socket_path: str, conn) -> None:
    # Arrivals and invalidations reach the engine thread within a millisecond.
    sys.setswitchinterval(0.001)
    if spec.role == "online":
        from backfill.bench.node_engines.online_engine import run_online_engine
        run_online_engine(spec, socket_path, conn)
    else:
        from backfill.bench.node_engines.offline_engine import run_offline_engine
        run_offline_engine(spec, socket_path, conn)


def main(argv: list[str]) -> None:
    """Child entry: engine_main FD SOCKET_PATH SPEC_JSON."""
    fd, socket_path, spec_json = argv
    run_engine(EngineSpec(**json.loads(spec_json)), socket_path, Connection(int(fd)))


if __name__ == "__main__":
    main(sys.argv[1:])
