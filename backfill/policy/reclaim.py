"""Which offline memory handles to reclaim (Valve §5, "Selective handle reclamation", Algorithm 1).

KV blocks are not laid out contiguously per request, so one handle can carry blocks of several
offline requests and one request can span several handles. Reclaiming a handle invalidates every
request with a block on it; the framework then recomputes those requests from their tokens.

    GreedyReclaimPolicy  Valve Algorithm 1: repeatedly take the handle with the least marginal
                         token cost, i.e. the tokens of the requests it would newly invalidate
                         (a request already invalidated by an earlier pick costs nothing again).
    FIFOReclaimPolicy    baseline: oldest-allocated handles first.

What greedy guarantees (checked in tests/policy/test_reclaim.py): it is optimal when no request
spans two candidate handles (costs are then additive) and when one handle is asked for; in
general (a minimum-cost k-union problem) each greedy pick costs at most the optimum, so greedy
<= n_handles x optimum, and it can lose to FIFO when a request spread over several old handles
makes their joint cost lower than their individual costs suggest.
"""

from __future__ import annotations

from typing import Hashable, Iterable, Mapping, Sequence

from backfill.errors import PolicyInputError
from backfill.memory.reclaim_interface import HandleView, ReclaimPlan


def plan_for(handles: Sequence[HandleView], request_tokens: Mapping[Hashable, int],
             chosen: Iterable[int]) -> ReclaimPlan:
    """The plan (invalidations and cost) of reclaiming exactly the `chosen` handles."""
    by_id = {h.handle_id: h for h in handles}
    order = tuple(chosen)
    requests: set[Hashable] = set()
    blocks: list[int] = []
    for hid in order:
        if hid not in by_id:
            raise PolicyInputError(f"handle {hid} is not among the candidates")
        for rid, ids in by_id[hid].request_blocks.items():
            if ids:
                requests.add(rid)
                blocks.extend(ids)
    return ReclaimPlan(order, frozenset(requests), tuple(sorted(blocks)),
                       sum(request_tokens[rid] for rid in requests))


def _validate(handles: Sequence[HandleView], request_tokens: Mapping[Hashable, int], n_handles: int) -> None:
    if not isinstance(n_handles, int) or n_handles < 0:
        raise PolicyInputError(f"n_handles must be a non-negative int, got {n_handles!r}")
    if n_handles > len(handles):
        raise PolicyInputError(f"asked to reclaim {n_handles} handles, only {len(handles)} are offline-owned")
    seen: set[int] = set()
    for h in handles:
        if h.handle_id in seen:
            raise PolicyInputError(f"handle {h.handle_id} listed twice")
        seen.add(h.handle_id)
        for rid in h.request_ids:
            tokens = request_tokens.get(rid)
            if not isinstance(tokens, int) or tokens < 0:
                raise PolicyInputError(f"request {rid!r} on handle {h.handle_id} has no valid token count")


class GreedyReclaimPolicy:
    """Valve Algorithm 1: least marginal token cost first."""

    name = "greedy"

    def choose(self, handles: Sequence[HandleView], request_tokens: Mapping[Hashable, int],
               n_handles: int) -> ReclaimPlan:
        _validate(handles, request_tokens, n_handles)
        remaining = {h.handle_id: h for h in handles}
        invalidated: set[Hashable] = set()
        chosen: list[int] = []
        for _ in range(n_handles):
            def key(h: HandleView) -> tuple[int, int, int]:
                marginal = sum(request_tokens[rid] for rid in h.request_ids - invalidated)
                # Ties: fewer newly hit requests, then the older handle (deterministic).
                return marginal, len(h.request_ids - invalidated), h.alloc_order
            best = min(remaining.values(), key=key)
            chosen.append(best.handle_id)
            invalidated |= best.request_ids
            del remaining[best.handle_id]
        return plan_for(handles, request_tokens, chosen)


class FIFOReclaimPolicy:
    """Baseline: reclaim the handles that were allocated first."""

    name = "fifo"

    def choose(self, handles: Sequence[HandleView], request_tokens: Mapping[Hashable, int],
               n_handles: int) -> ReclaimPlan:
        _validate(handles, request_tokens, n_handles)
        oldest = sorted(handles, key=lambda h: (h.alloc_order, h.handle_id))[:n_handles]
        return plan_for(handles, request_tokens, [h.handle_id for h in oldest])
