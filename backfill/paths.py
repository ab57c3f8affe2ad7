"""Where backfill keeps what it computes once per machine: unpacked weights, kernel choices,
latency profiles and the server's databases."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """backfill's cache directory ($BACKFILL_CACHE_DIR, else ~/.cache/backfill)."""
    return Path(os.environ.get("BACKFILL_CACHE_DIR", Path.home() / ".cache" / "backfill"))
