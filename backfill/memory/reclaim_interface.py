"""What the shared pool (memory/shared_pool.py) shows a reclamation policy and what it takes back:
a snapshot of each offline-owned handle, the plan, and the policy's interface (Valve §5). The
policies themselves (Valve Algorithm 1 and the FIFO baseline) are in policy/reclaim.py; the
caller that builds a pool chooses one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Mapping, Protocol, Sequence


@dataclass(frozen=True)
class HandleView:
    """A snapshot of one offline-owned handle."""

    handle_id: int
    alloc_order: int                                   # smaller = allocated earlier (FIFO key)
    # request key -> ids of that request's KV blocks that live on this handle. Keys are request
    # ids, or (owner, request id) pairs when several engines share the pool.
    request_blocks: Mapping[Hashable, tuple[int, ...]] = field(default_factory=dict)

    @property
    def request_ids(self) -> frozenset[Hashable]:
        return frozenset(rid for rid, blocks in self.request_blocks.items() if blocks)


@dataclass(frozen=True)
class ReclaimPlan:
    handle_ids: tuple[int, ...]                        # in the order they were chosen
    invalidated_request_ids: frozenset[Hashable]
    invalidated_block_ids: tuple[int, ...]             # every request block on the chosen handles
    cost_tokens: int                                   # tokens to recompute


class ReclaimPolicy(Protocol):
    """Chooses which n_handles of the offline-owned handles the pool takes back."""

    name: str

    def choose(self, handles: Sequence[HandleView], request_tokens: Mapping[Hashable, int],
               n_handles: int) -> ReclaimPlan: ...
