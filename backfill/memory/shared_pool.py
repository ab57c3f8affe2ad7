"""The device's KV memory shared by several engines as coarse handles (Valve §3, §5).

Handle h is the fixed group of KV blocks [h * blocks_per_handle, (h + 1) * blocks_per_handle).
Engines allocate and release whole handles; each engine maps its own KV blocks onto the handles
it holds. One online engine and any number of offline engines.

    online     allocates from its pre-granted headroom first, then from free handles, and only
               then reclaims handles from offline engines. The headroom is sized by a MIAD
               reservation policy (policy/miad.py, given by the caller); handles the online engine releases go back
               to the headroom before they go back to the free list.
    offline    allocates from free handles only; never reclaims anything.

Reclamation protocol (Valve §5, sub-layer reclamation): pause offline compute first (so no
in-flight step touches the pages), choose the handles (the caller's policy: policy/reclaim.py), take them, then tell
each affected offline owner which block ids and requests became invalid so it recomputes them;
finally lift the pause (the runtime's compute gate decides whether offline actually resumes).

StaticMemPool is the baseline with a fixed online partition: offline only gets what lies
outside it, and an online burst beyond the partition kills every offline request at once.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Protocol

from backfill.errors import DoubleFreeError, MemoryPoolError, OverAllocationError, PolicyInputError, UnknownOwnerError
from backfill.memory.reclaim_interface import HandleView, ReclaimPolicy


class EngineRole(str, enum.Enum):
    ONLINE = "online"
    OFFLINE = "offline"


@dataclass(frozen=True)
class PoolConfig:
    num_handles: int
    blocks_per_handle: int

    def __post_init__(self) -> None:
        if not (isinstance(self.num_handles, int) and isinstance(self.blocks_per_handle, int)
                and self.num_handles >= 1 and self.blocks_per_handle >= 1):
            raise PolicyInputError(f"need num_handles >= 1 and blocks_per_handle >= 1, "
                                   f"got {self.num_handles}, {self.blocks_per_handle}")


@dataclass(frozen=True)
class Invalidation:
    """What one offline owner lost in one reclamation."""

    owner_id: str
    handle_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    request_ids: frozenset[str]
    cost_tokens: int


class ComputeControl(Protocol):
    def pause_offline(self) -> None:
        """Return once no offline engine is computing."""

    def unpause_offline(self) -> None:
        """The pool no longer needs offline paused (the compute gate decides what happens next)."""


@dataclass
class PoolStats:
    reclamations: int = 0          # reclamation events (each one pauses offline once)
    reclaimed_handles: int = 0
    invalidated_requests: int = 0
    invalidated_tokens: int = 0
    # Reclamation latency: pause offline, choose, take, notify, unpause (Valve §5), seconds each.
    reclaim_latencies_s: list[float] = field(default_factory=list)


@dataclass
class _Owner:
    role: EngineRole
    max_handles: int
    on_invalidate: Callable[[Invalidation], None] | None
    handles: set[int] = field(default_factory=set)
    # Offline only: the occupancy the engine last reported.
    request_blocks: dict[str, tuple[int, ...]] = field(default_factory=dict)
    request_tokens: dict[str, int] = field(default_factory=dict)


class HeadroomReservation(Protocol):
    """How much headroom the online engine keeps pre-granted (Valve §5: policy/miad.py's MIAD)."""

    @property
    def headroom_handles(self) -> int: ...

    @property
    def pressure_events(self) -> int: ...

    def observe(self, now_s: float, used_handles: int, granted_handles: int, *,
                headroom_missed: bool = False) -> int: ...

    def advance(self, now_s: float) -> int: ...


class SharedMemoryPool:
    def __init__(self, config: PoolConfig, *, reclaim_policy: ReclaimPolicy,
                 reservation: HeadroomReservation | None = None, compute: ComputeControl | None = None) -> None:
        self.config = config
        self.reservation = reservation
        self.reclaim_policy = reclaim_policy
        self.compute = compute
        self.stats = PoolStats()
        self._owners: dict[str, _Owner] = {}
        self._online_id: str | None = None
        self._free: list[int] = list(range(config.num_handles - 1, -1, -1))  # pop() gives low ids first
        self._reserved: list[int] = []          # online headroom: granted to online, not in use
        self._alloc_order: dict[int, int] = {}
        self._order = itertools.count()

    # --- owners ---------------------------------------------------------------------------

    def register(self, owner_id: str, role: EngineRole, *, max_handles: int | None = None,
                 on_invalidate: Callable[[Invalidation], None] | None = None, now_s: float = 0.0) -> None:
        if owner_id in self._owners:
            raise MemoryPoolError(f"owner {owner_id!r} is already registered")
        try:
            role = EngineRole(role)
        except ValueError:
            raise PolicyInputError(f"role must be 'online' or 'offline', got {role!r}") from None
        if role is EngineRole.ONLINE and self._online_id is not None:
            raise MemoryPoolError(f"online owner {self._online_id!r} already registered; one per pool")
        cap = self.config.num_handles if max_handles is None else max_handles
        if not isinstance(cap, int) or not 0 <= cap <= self.config.num_handles:
            raise PolicyInputError(f"max_handles must be in [0, {self.config.num_handles}], got {max_handles!r}")
        self._owners[owner_id] = _Owner(role, cap, on_invalidate)
        if role is EngineRole.ONLINE:
            self._online_id = owner_id
            self._sync_headroom(now_s)

    def unregister(self, owner_id: str) -> None:
        owner = self._owner(owner_id)
        self._give_back(owner.handles)
        owner.handles.clear()
        if owner.role is EngineRole.ONLINE:
            self._give_back(self._reserved)
            self._reserved.clear()
            self._online_id = None
        del self._owners[owner_id]

    # --- allocation -------------------------------------------------------------------------

    def allocate(self, owner_id: str, n_handles: int, now_s: float = 0.0) -> tuple[int, ...]:
        owner = self._owner(owner_id)
        if not isinstance(n_handles, int) or n_handles < 0:
            raise PolicyInputError(f"n_handles must be a non-negative int, got {n_handles!r}")
        if len(owner.handles) + n_handles > owner.max_handles:
            raise OverAllocationError(f"{owner_id!r} holds {len(owner.handles)} handles, asked for "
                                      f"{n_handles} more, its grant is {owner.max_handles}")
        if owner.role is EngineRole.OFFLINE:
            if n_handles > len(self._free):
                raise OverAllocationError(f"{owner_id!r} asked for {n_handles} handles, {len(self._free)} free")
            return self._grant(owner, [self._free.pop() for _ in range(n_handles)])
        offline_held = sum(len(o.handles) for o in self._owners.values() if o.role is EngineRole.OFFLINE)
        if n_handles > len(self._reserved) + len(self._free) + offline_held:
            raise OverAllocationError(f"online asked for {n_handles} handles; the whole pool cannot supply them")
        headroom_missed = n_handles > len(self._reserved)
        got = [self._reserved.pop() for _ in range(min(n_handles, len(self._reserved)))]
        got += [self._free.pop() for _ in range(min(n_handles - len(got), len(self._free)))]
        short = n_handles - len(got)
        # MIAD sees the use this allocation leads to; the request and the headroom top-up then
        # share a single reclamation, so one burst costs offline at most one pause.
        used_after = len(owner.handles) + n_handles
        events_before = self._pressure_events()
        target = min(self._headroom_target(now_s, used_after, observe=True, headroom_missed=headroom_missed),
                     max(0, owner.max_handles - used_after))
        # Valve §5: the reservation drives the reclamation rate toward MIAD's target, so the
        # headroom is refilled by reclaiming only on a new pressure event or when this request
        # reclaims anyway; otherwise it refills from handles as they are freed. (Without MIAD,
        # e.g. StaticMem, the partition is always kept whole.)
        refill_now = short > 0 or self.reservation is None or self._pressure_events() > events_before
        missing = short + (max(0, target - len(self._reserved)) if refill_now else 0)
        if missing > len(self._free):
            self._reclaim(self._reclaim_count(missing - len(self._free)), now_s)
        got += [self._free.pop() for _ in range(short)]
        granted = self._grant(owner, got)
        self._fit_headroom(target)
        return granted

    def release(self, owner_id: str, handle_ids: Iterable[int], now_s: float = 0.0) -> None:
        owner = self._owner(owner_id)
        ids = list(handle_ids)
        if len(set(ids)) != len(ids):
            raise DoubleFreeError(f"{owner_id!r} released the same handle twice in one call: {ids}")
        for h in ids:
            if h not in owner.handles:
                raise DoubleFreeError(f"{owner_id!r} released handle {h} it does not hold")
        for h in ids:
            owner.handles.discard(h)
            self._alloc_order.pop(h, None)
        if owner.role is EngineRole.ONLINE:
            # Released online memory first refills the headroom; the sync trims any excess.
            self._reserved.extend(ids)
            self._sync_headroom(now_s)
        else:
            self._drop_occupancy(owner, set(ids))
            self._give_back(ids)
            # A headroom left short (refills wait for freed handles) takes them before offline.
            self._sync_headroom(now_s, observe=False)

    def tick(self, now_s: float) -> None:
        """Let time pass: MIAD shrinks the headroom, freed handles become available to offline."""
        if self.reservation is not None and self._online_id is not None:
            self.reservation.advance(now_s)
        self._sync_headroom(now_s, observe=False)

    def report_blocks(self, owner_id: str, request_blocks: Mapping[str, Iterable[int]],
                      request_tokens: Mapping[str, int]) -> None:
        """Offline occupancy: which requests have KV blocks where, and their token counts."""
        owner = self._owner(owner_id)
        if owner.role is not EngineRole.OFFLINE:
            raise MemoryPoolError(f"{owner_id!r} is online; only offline owners report blocks")
        blocks = {rid: tuple(int(b) for b in ids) for rid, ids in request_blocks.items()}
        for rid, ids in blocks.items():
            if rid not in request_tokens:
                raise PolicyInputError(f"request {rid!r} has blocks but no token count")
            for b in ids:
                if not 0 <= b < self.num_blocks or self.handle_of_block(b) not in owner.handles:
                    raise MemoryPoolError(f"{owner_id!r} reports block {b} outside the handles it holds")
        owner.request_blocks = blocks
        owner.request_tokens = {rid: int(request_tokens[rid]) for rid in blocks}

    # --- views ------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.config.num_handles * self.config.blocks_per_handle

    @property
    def free_handles(self) -> int:
        return len(self._free)

    @property
    def reserved_handles(self) -> int:
        return len(self._reserved)

    def handles_of(self, owner_id: str) -> tuple[int, ...]:
        return tuple(sorted(self._owner(owner_id).handles))

    def blocks_of_handle(self, handle_id: int) -> range:
        if not 0 <= handle_id < self.config.num_handles:
            raise PolicyInputError(f"no handle {handle_id}")
        bph = self.config.blocks_per_handle
        return range(handle_id * bph, (handle_id + 1) * bph)

    def handle_of_block(self, block_id: int) -> int:
        return block_id // self.config.blocks_per_handle

    def reported_requests(self, owner_id: str) -> dict[str, int]:
        """Offline requests (with token counts) the owner last reported, minus invalidated ones."""
        return dict(self._owner(owner_id).request_tokens)

    def owners(self) -> dict[str, EngineRole]:
        return {oid: o.role for oid, o in self._owners.items()}

    # --- reclamation ---------------------------------------------------------------------------

    def _reclaim_count(self, short: int) -> int:
        return short

    def _reclaim(self, n_handles: int, now_s: float) -> list[Invalidation]:
        started = time.perf_counter()
        offline = {oid: o for oid, o in self._owners.items() if o.role is EngineRole.OFFLINE}
        # Valve §5: stop offline compute before touching its pages.
        if self.compute is not None:
            self.compute.pause_offline()
        try:
            views: list[HandleView] = []
            tokens: dict[tuple[str, str], int] = {}
            owner_of: dict[int, str] = {}
            for oid, o in offline.items():
                # Request keys are (owner, request id): two engines may use the same ids.
                tokens.update({(oid, rid): t for rid, t in o.request_tokens.items()})
                for h in o.handles:
                    on_h = {}
                    for rid, ids in o.request_blocks.items():
                        here = tuple(b for b in ids if self.handle_of_block(b) == h)
                        if here:
                            on_h[(oid, rid)] = here
                    views.append(HandleView(h, self._alloc_order[h], on_h))
                    owner_of[h] = oid
            plan = self.reclaim_policy.choose(views, tokens, min(n_handles, len(views)))
            notices = self._take(plan.handle_ids, owner_of, tokens)
        finally:
            if self.compute is not None:
                self.compute.unpause_offline()
        self.stats.reclaim_latencies_s.append(time.perf_counter() - started)
        return notices

    def _take(self, handle_ids: tuple[int, ...], owner_of: dict[int, str],
              tokens: dict[tuple[str, str], int]) -> list[Invalidation]:
        self.stats.reclamations += 1
        self.stats.reclaimed_handles += len(handle_ids)
        notices = []
        for oid in sorted({owner_of[h] for h in handle_ids}):
            owner = self._owners[oid]
            taken = {h for h in handle_ids if owner_of[h] == oid}
            hit = {rid for rid, ids in owner.request_blocks.items()
                   if any(self.handle_of_block(b) in taken for b in ids)}
            blocks = sorted(b for rid in hit for b in owner.request_blocks[rid] if self.handle_of_block(b) in taken)
            cost = sum(tokens[(oid, rid)] for rid in hit)
            owner.handles -= taken
            for h in taken:
                self._alloc_order.pop(h, None)
            # The engine discards invalidated requests entirely (they go back to waiting).
            for rid in hit:
                owner.request_blocks.pop(rid, None)
                owner.request_tokens.pop(rid, None)
            self._give_back(taken)
            self.stats.invalidated_requests += len(hit)
            self.stats.invalidated_tokens += cost
            notice = Invalidation(oid, tuple(sorted(taken)), tuple(blocks), frozenset(hit), cost)
            notices.append(notice)
            if owner.on_invalidate is not None:
                owner.on_invalidate(notice)
        return notices

    # --- headroom ----------------------------------------------------------------------------

    def _headroom_target(self, now_s: float, used: int, observe: bool, headroom_missed: bool = False) -> int:
        if self.reservation is None:
            return 0
        if not observe:
            return self.reservation.headroom_handles
        return self.reservation.observe(now_s, used, used + len(self._reserved), headroom_missed=headroom_missed)

    def _pressure_events(self) -> int:
        return 0 if self.reservation is None else self.reservation.pressure_events

    def _sync_headroom(self, now_s: float, *, observe: bool = True) -> None:
        """Re-size the headroom from free handles only (never reclaims)."""
        if self._online_id is None:
            return
        online = self._owners[self._online_id]
        used = len(online.handles)
        self._fit_headroom(min(self._headroom_target(now_s, used, observe), max(0, online.max_handles - used)))

    def _fit_headroom(self, target: int) -> None:
        while len(self._reserved) > target:
            self._give_back([self._reserved.pop()])
        while len(self._reserved) < target and self._free:
            self._reserved.append(self._free.pop())

    # --- helpers -----------------------------------------------------------------------------

    def _grant(self, owner: _Owner, handles: list[int]) -> tuple[int, ...]:
        for h in handles:
            owner.handles.add(h)
            self._alloc_order[h] = next(self._order)
        return tuple(handles)

    def _give_back(self, handles: Iterable[int]) -> None:
        self._free.extend(handles)
        self._free.sort(reverse=True)

    def _drop_occupancy(self, owner: _Owner, released: set[int]) -> None:
        for rid in [r for r, ids in owner.request_blocks.items()
                    if any(self.handle_of_block(b) in released for b in ids)]:
            del owner.request_blocks[rid]
            owner.request_tokens.pop(rid, None)

    def _owner(self, owner_id: str) -> _Owner:
        try:
            return self._owners[owner_id]
        except KeyError:
            raise UnknownOwnerError(f"unknown owner {owner_id!r}") from None


class StaticMemPool(SharedMemoryPool):
    """Valve §7.2 StaticMem baseline: a fixed online partition, always fully pre-granted."""

    def __init__(self, config: PoolConfig, online_handles: int, *, reclaim_policy: ReclaimPolicy,
                 compute: ComputeControl | None = None) -> None:
        if not isinstance(online_handles, int) or not 0 <= online_handles <= config.num_handles:
            raise PolicyInputError(f"online_handles must be in [0, {config.num_handles}], got {online_handles!r}")
        self.online_handles = online_handles
        super().__init__(config, reclaim_policy=reclaim_policy, reservation=None, compute=compute)

    def _headroom_target(self, now_s: float, used: int, observe: bool, headroom_missed: bool = False) -> int:
        return max(0, self.online_handles - used)

    def _reclaim_count(self, short: int) -> int:
        # An online burst beyond the partition kills all offline work (every offline handle).
        return sum(len(o.handles) for o in self._owners.values() if o.role is EngineRole.OFFLINE)
