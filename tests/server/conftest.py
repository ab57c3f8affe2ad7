"""Fixtures of the server tests (helpers live in server_helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from server_helpers import ServerProcess


@pytest.fixture
def server_processes():
    """Start servers with start(db, ...); all are killed at the end of the test."""
    started: list[ServerProcess] = []

    def start(db: Path, *extra: str, port: int | None = None) -> ServerProcess:
        proc = ServerProcess(db, port, *extra)
        started.append(proc)
        return proc.wait_ready()

    yield start
    for proc in started:
        proc.stop()
