"""Ranges of lent memory: the region a consumer is granted and the first-fit placement of one.

Kept free of torch so the coordinator process starts in a fraction of a second.
"""

from __future__ import annotations

from typing import NamedTuple

ALIGN_BYTES = 64  # every region and every tensor inside one starts on a cache line


class LentRegion(NamedTuple):
    """A range of a producer's segment granted to this consumer."""

    region_id: str
    segment: str     # path of the shared-memory file
    offset: int
    nbytes: int


def align(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def first_fit(taken: list[tuple[int, int]], capacity: int, nbytes: int) -> int | None:
    """The lowest aligned offset where nbytes fit between the (offset, nbytes) ranges taken."""
    cursor = 0
    for offset, size in sorted(taken):
        if offset - cursor >= nbytes:
            return cursor
        cursor = max(cursor, align(offset + size))
    return cursor if capacity - cursor >= nbytes else None
