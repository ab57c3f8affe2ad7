"""AQUA-PLACER (AQUA §5): place models on multi-GPU servers so memory consumers sit next to producers.

Step 1, an integer program (scipy.optimize.milp, HiGHS): x[m, s] = 1 when model m is on server s.
    (1) each model on exactly one server;
    (2) all tensor-parallel shards of a model on that server: one variable per model carries all
        its shards, so Eq. 2's x[p_j, s] == x[p_j+1, s] holds by construction;
    (3) at most G shards (one per GPU) per server: sum_m shards_m x[m, s] <= G;
    (4) mem_s = sum_m shards_m R_m x[m, s]  (R_m per shard: > 0 a producer's spare memory,
        < 0 a consumer's need);
    (5) eq_s = sum_m shards_m sign(R_m) x[m, s]  (producer +1, consumer -1 per shard);
    objective (6): minimise max_s mem_s + G_mem x max_s eq_s, through two epigraph variables.
Servers are identical, so the program also fixes their order (model m only on servers 0..m),
which removes S! symmetric copies of every solution without cutting any.

Solved exactly by server patterns first (a Dantzig-Wolfe view of the same program): servers are
identical, so a placement is how many servers hold each way of filling one server with replicas.
For a bound E on max eq_s and M on max mem_s, only patterns within both may be used, and whether
S of them cover every replica is a small integer program whose relaxation is far tighter than
the per-server one. E rises from its average bound; for each E a binary search finds the least
feasible M among the patterns' own mem values; the search stops once G_mem x E plus the average
bound on mem_s cannot beat the best found. Too many patterns, or a check that runs out of time:
the per-server program above, with whatever time is left.

Step 2, within each server: consumer shards propose to producer GPUs (Gale-Shapley). A consumer
prefers the producer with the most spare memory; a producer prefers a consumer whose need fits in
its spare memory, the largest such first, then the smallest of those that do not fit. One producer
serves at most one consumer (AQUA: sharing one would oversubscribe its NVLink bandwidth).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from backfill.errors import ClusterError, ClusterInputError


@dataclass(frozen=True)
class ModelSpec:
    name: str
    shards: int                  # tensor-parallel degree: GPUs it occupies on one server
    memory_gb_per_shard: float   # R_m: > 0 spare memory it lends (producer), < 0 memory it needs (consumer)

    def __post_init__(self) -> None:
        if not self.name:
            raise ClusterInputError("a model needs a non-empty name")
        if not isinstance(self.shards, int) or self.shards < 1:
            raise ClusterInputError(f"model {self.name!r}: shards must be an integer >= 1, got {self.shards!r}")
        if not np.isfinite(self.memory_gb_per_shard):
            raise ClusterInputError(f"model {self.name!r}: memory_gb_per_shard must be finite")

    @property
    def sign(self) -> int:
        return int(np.sign(self.memory_gb_per_shard))


@dataclass(frozen=True)
class PlacementProblem:
    servers: int                 # S
    gpus_per_server: int         # G
    gpu_memory_gb: float         # G_mem: makes eq_s commensurate with mem_s in the objective
    models: tuple[ModelSpec, ...]

    def __post_init__(self) -> None:
        if self.servers < 1 or self.gpus_per_server < 1 or not self.gpu_memory_gb > 0:
            raise ClusterInputError("servers and gpus_per_server must be >= 1 and gpu_memory_gb > 0")
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ClusterInputError("model names must be unique")
        too_wide = [m.name for m in self.models if m.shards > self.gpus_per_server]
        if too_wide:
            raise ClusterInputError(f"models with more shards than a server has GPUs ({self.gpus_per_server}): "
                                    f"{', '.join(too_wide)}")
        if sum(m.shards for m in self.models) > self.servers * self.gpus_per_server:
            raise ClusterInputError(f"{sum(m.shards for m in self.models)} shards do not fit on "
                                    f"{self.servers * self.gpus_per_server} GPUs")

    def objective(self, server_of: list[int] | tuple[int, ...]) -> float:
        """Eq. 6 for an assignment of each model to a server (no feasibility check)."""
        mem = np.zeros(self.servers)
        eq = np.zeros(self.servers)
        for model, s in zip(self.models, server_of):
            mem[s] += model.shards * model.memory_gb_per_shard
            eq[s] += model.shards * model.sign
        return float(mem.max() + self.gpu_memory_gb * eq.max())

    def feasible(self, server_of: list[int] | tuple[int, ...]) -> bool:
        used = np.zeros(self.servers, dtype=int)
        for model, s in zip(self.models, server_of):
            used[s] += model.shards
        return bool((used <= self.gpus_per_server).all())


@dataclass(frozen=True)
class Pairing:
    server: int
    consumer: tuple[str, int]    # (model, shard)
    producer: tuple[str, int]


@dataclass(frozen=True)
class PlacementResult:
    server_of: dict[str, int]
    objective: float
    pairings: tuple[Pairing, ...]
    solve_s: float
    proven_optimal: bool   # False: HiGHS hit the time limit; objective is its best, gap its distance to the bound
    gap: float             # HiGHS's relative MIP gap at the end (0 when proven optimal)


MEMORY_GRID_GB = 0.1   # memory requirements given to 0.1 GB make mem_s an integer count of these


def _on_grid(kind_keys: list[tuple[int, float]], grid_gb: float) -> bool:
    return all(abs(gb / grid_gb - round(gb / grid_gb)) < 1e-9 for _, gb in kind_keys)


class InfeasiblePlacementError(ClusterError):
    """The integer program has no solution (or HiGHS stopped before finding one)."""


def _kinds(problem: PlacementProblem) -> dict[tuple[int, float], list[int]]:
    """Replicas of one model kind (same shards and R_m) are interchangeable: kind -> model indices."""
    kinds: dict[tuple[int, float], list[int]] = {}
    for m, model in enumerate(problem.models):
        kinds.setdefault((model.shards, model.memory_gb_per_shard), []).append(m)
    return kinds


def _result(problem: PlacementProblem, kinds: dict[tuple[int, float], list[int]], counts: np.ndarray,
            started: float, proven_optimal: bool, gap: float) -> PlacementResult:
    """The placement from replica counts per kind and server (counts[t, s])."""
    assignment = [0] * len(problem.models)
    for t, key in enumerate(kinds):
        replicas = iter(kinds[key])
        for s in range(counts.shape[1]):
            for _ in range(counts[t, s]):
                assignment[next(replicas)] = s
    server_of = {model.name: s for model, s in zip(problem.models, assignment)}
    pairings = tuple(p for s in range(problem.servers) for p in stable_match(
        s, [model for model, a in zip(problem.models, assignment) if a == s]))
    return PlacementResult(server_of, problem.objective(assignment), pairings, time.perf_counter() - started,
                           proven_optimal=proven_optimal, gap=0.0 if proven_optimal else gap)


MAX_PATTERNS = 50_000   # more ways to fill one server than this: the per-server program instead
PATTERN_SHARE = 0.6     # of the time limit for the pattern search; the per-server program gets the rest


def server_patterns(kind_keys: list[tuple[int, float]], replicas: list[int], gpus: int) -> np.ndarray | None:
    """Every way to fill one server (rows: replicas of each kind, their shards within its GPUs),
    the empty server included; None when there are more than MAX_PATTERNS."""
    patterns: list[tuple[int, ...]] = []

    def extend(t: int, prefix: tuple[int, ...], gpus_left: int) -> bool:
        if t == len(kind_keys):
            patterns.append(prefix)
            return len(patterns) <= MAX_PATTERNS
        shards = kind_keys[t][0]
        return all(extend(t + 1, prefix + (n,), gpus_left - n * shards)
                   for n in range(min(replicas[t], gpus_left // shards) + 1))

    if not extend(0, (), gpus):
        return None
    return np.array(patterns, dtype=int).reshape(len(patterns), len(kind_keys))


def _cover(patterns: np.ndarray, replicas: np.ndarray, servers: int, time_limit_s: float) -> np.ndarray | None | bool:
    """How many servers take each pattern so that S servers hold every replica: the counts, None
    when no choice of these patterns does, False when HiGHS ran out of time before deciding."""
    n = len(patterns)
    if n == 0:
        return None
    matrix = np.vstack([patterns.T, np.ones((1, n))])
    target = np.append(replicas, servers).astype(float)
    res = milp(np.zeros(n), constraints=LinearConstraint(matrix, target, target), integrality=np.ones(n),
               bounds=Bounds(0, servers), options={"time_limit": max(time_limit_s, 0.01)})
    if res.status == 0:
        return np.rint(res.x).astype(int)
    if res.status == 2:
        return None
    return False


def _solve_by_patterns(problem: PlacementProblem, kinds: dict[tuple[int, float], list[int]],
                       deadline: float) -> tuple[np.ndarray, float] | None | bool:
    """The optimum by server patterns: (counts[t, s], objective); None when no placement exists,
    False when it cannot decide (too many patterns, or out of time)."""
    kind_keys = list(kinds)
    replicas = np.array([len(kinds[key]) for key in kind_keys])
    patterns = server_patterns(kind_keys, list(replicas), problem.gpus_per_server)
    if patterns is None:
        return False
    # mem in R's grid units when there is one, so that equal loads compare equal
    grid = _on_grid(kind_keys, MEMORY_GRID_GB)
    unit_gb = MEMORY_GRID_GB if grid else 1.0
    mem_per_replica = np.array([k[0] * k[1] / unit_gb for k in kind_keys])
    if grid:
        mem_per_replica = np.rint(mem_per_replica)
    eq_per_replica = np.array([k[0] * int(np.sign(k[1])) for k in kind_keys])
    mem, eq = patterns @ mem_per_replica, patterns @ eq_per_replica
    servers = problem.servers
    mem_floor = replicas @ mem_per_replica / servers           # max_s mem_s >= the average, and so for eq
    if grid:
        mem_floor = float(np.ceil(mem_floor - 1e-9))
    eq_floor = int(np.ceil(replicas @ eq_per_replica / servers - 1e-9))
    best: tuple[np.ndarray, float] | None = None
    for eq_bound in range(max(eq_floor, int(eq.min())), int(eq.max()) + 1):
        eq_cost = problem.gpu_memory_gb * eq_bound
        if best is not None and unit_gb * mem_floor + eq_cost >= best[1] - 1e-9:
            break
        allowed = eq <= eq_bound
        levels = np.unique(mem[allowed & (mem >= mem_floor - 1e-9)])
        if best is not None:
            levels = levels[unit_gb * levels + eq_cost < best[1] - 1e-9]
        lo, hi, found = 0, len(levels) - 1, None
        while lo <= hi:                      # the least mem level whose patterns cover every replica
            mid = (lo + hi) // 2 if found is not None else hi
            chosen = np.flatnonzero(allowed & (mem <= levels[mid] + 1e-9))
            counts = _cover(patterns[chosen], replicas, servers, deadline - time.perf_counter())
            if counts is False:
                return False
            if counts is None:
                if found is None:
                    break                    # not even the highest level: nothing better at this eq bound
                lo = mid + 1
            else:
                found = (chosen, counts)
                hi = mid - 1
        if found is not None:
            chosen, counts = found
            per_server = np.repeat(patterns[chosen], counts, axis=0)      # one row per server
            best = (per_server.T, float(unit_gb * (per_server @ mem_per_replica).max()
                                        + problem.gpu_memory_gb * (per_server @ eq_per_replica).max()))
    return best


def solve(problem: PlacementProblem, time_limit_s: float = 30.0) -> PlacementResult:
    """The optimal placement: by server patterns, else the per-server program (counting the
    replicas of a kind per server, y[t, s] integer, instead of naming each one: the same optimum,
    without the symmetric copies that a variable per replica would make HiGHS explore)."""
    started = time.perf_counter()
    kinds = _kinds(problem)
    by_patterns = _solve_by_patterns(problem, kinds, started + PATTERN_SHARE * time_limit_s)
    if by_patterns is None:
        raise InfeasiblePlacementError(f"no placement of {len(problem.models)} models on {problem.servers} servers x "
                                       f"{problem.gpus_per_server} GPUs")
    if by_patterns is not False:
        return _result(problem, kinds, by_patterns[0], started, proven_optimal=True, gap=0.0)
    return _solve_per_server(problem, kinds, started, max(time_limit_s - (time.perf_counter() - started), 0.05))


def _solve_per_server(problem: PlacementProblem, kinds: dict[tuple[int, float], list[int]], started: float,
                      time_limit_s: float) -> PlacementResult:
    kind_keys = list(kinds)
    n_kinds, n_servers = len(kind_keys), problem.servers
    n_y = n_kinds * n_servers
    z_mem, z_eq = n_y, n_y + 1            # epigraph variables: max_s mem_s and max_s eq_s
    unit_gb = MEMORY_GRID_GB if _on_grid(kind_keys, MEMORY_GRID_GB) else 1.0   # z_mem counts these

    def y(t: int, s: int) -> int:
        return t * n_servers + s

    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    lower: list[float] = []
    upper: list[float] = []
    row = 0
    for t, key in enumerate(kind_keys):                          # (1): every replica placed once
        for s in range(n_servers):
            rows.append(row); cols.append(y(t, s)); vals.append(1.0)
        lower.append(float(len(kinds[key]))); upper.append(float(len(kinds[key]))); row += 1
    for s in range(n_servers):                                   # (3), (4) <= z_mem, (5) <= z_eq
        for t, (shards, gb) in enumerate(kind_keys):
            rows += [row, row + 1, row + 2]
            cols += [y(t, s)] * 3
            vals += [float(shards), shards * gb / unit_gb, float(shards * np.sign(gb))]
        rows += [row + 1, row + 2]; cols += [z_mem, z_eq]; vals += [-1.0, -1.0]
        lower += [-np.inf] * 3; upper += [float(problem.gpus_per_server), 0.0, 0.0]
        row += 3
    for s in range(n_servers - 1):                               # identical servers: GPUs used non-increasing
        for t, (shards, _) in enumerate(kind_keys):
            rows += [row, row]; cols += [y(t, s), y(t, s + 1)]; vals += [float(shards), -float(shards)]
        lower.append(0.0); upper.append(np.inf); row += 1
    matrix = coo_array((vals, (rows, cols)), shape=(row, n_y + 2)).tocsr()
    cost = np.zeros(n_y + 2)
    cost[z_mem], cost[z_eq] = unit_gb, problem.gpu_memory_gb
    upper_v = np.array([float(len(kinds[key])) for key in kind_keys for _ in range(n_servers)] + [np.inf, np.inf])
    lower_v = np.zeros(n_y + 2)
    lower_v[z_mem] = lower_v[z_eq] = -np.inf
    # eq_s is a whole number, and so is mem_s in the units of R's grid when there is one: integral
    # epigraph variables let HiGHS round the relaxation's bound up, which closes most of the gap.
    integrality = np.ones(n_y + 2)
    integrality[z_mem] = 1 if _on_grid(kind_keys, MEMORY_GRID_GB) else 0
    res = milp(cost, constraints=LinearConstraint(matrix, lower, upper), integrality=integrality,
               bounds=Bounds(lower_v, upper_v), options={"time_limit": time_limit_s})
    if res.x is None:
        raise InfeasiblePlacementError(f"no placement of {len(problem.models)} models on {n_servers} servers x "
                                       f"{problem.gpus_per_server} GPUs: {res.message}")
    counts = np.rint(res.x[:n_y]).astype(int).reshape(n_kinds, n_servers)
    return _result(problem, kinds, counts, started, proven_optimal=res.status == 0,
                   gap=float(getattr(res, "mip_gap", 0.0) or 0.0))


def stable_match(server: int, models: list[ModelSpec]) -> list[Pairing]:
    """Producer GPUs to consumer shards on one server, consumer-proposing deferred acceptance."""
    producers = [((m.name, i), m.memory_gb_per_shard) for m in models if m.sign > 0 for i in range(m.shards)]
    consumers = [((m.name, i), -m.memory_gb_per_shard) for m in models if m.sign < 0 for i in range(m.shards)]
    if not producers or not consumers:
        return []
    spare = {p: gb for p, gb in producers}
    need = {c: gb for c, gb in consumers}
    proposals = {c: sorted(spare, key=lambda p: (-spare[p], p)) for c in need}

    def rank(p: tuple[str, int], c: tuple[str, int]) -> tuple:
        fits = need[c] <= spare[p]
        return (0, -need[c], c) if fits else (1, need[c], c)

    engaged: dict[tuple[str, int], tuple[str, int]] = {}     # producer -> consumer
    free = [c for c, _ in consumers]
    next_choice = {c: 0 for c in need}
    while free:
        c = free.pop(0)
        if next_choice[c] >= len(proposals[c]):
            continue                                          # more consumers than producers
        p = proposals[c][next_choice[c]]
        next_choice[c] += 1
        current = engaged.get(p)
        if current is None:
            engaged[p] = c
        elif rank(p, c) < rank(p, current):
            engaged[p] = c
            free.append(current)
        else:
            free.append(c)
    return [Pairing(server, c, p) for p, c in sorted(engaged.items(), key=lambda kv: kv[1])]


def brute_force(problem: PlacementProblem) -> tuple[float, tuple[int, ...]]:
    """The optimum by enumerating every assignment (small instances only)."""
    best: tuple[float, tuple[int, ...]] | None = None
    for server_of in itertools.product(range(problem.servers), repeat=len(problem.models)):
        if problem.feasible(server_of):
            value = problem.objective(server_of)
            if best is None or value < best[0] - 1e-9:
                best = (value, server_of)
    if best is None:
        raise InfeasiblePlacementError("no feasible assignment")
    return best


def random_problem(rng: np.random.Generator, servers: int, gpus_per_server: int, n_models: int,
                   gpu_memory_gb: float = 80.0, max_shards: int = 4, n_kinds: int | None = None) -> PlacementProblem:
    """Producers and consumers whose shards fit the cluster (tests and the benchmark). With n_kinds,
    the models are replicas of that many kinds (a catalogue, as fleets deploy); else all differ."""
    catalogue: list[tuple[int, float]] = []
    if n_kinds is not None:
        for _ in range(n_kinds):
            shards = max(1, min(int(rng.choice([1, 1, 2, 4, 8])), max_shards, gpus_per_server))
            catalogue.append((shards, round(float(rng.uniform(5, 40)) * (1 if rng.random() < 0.5 else -1), 1)))
    models: list[ModelSpec] = []
    capacity = servers * gpus_per_server
    for i in range(n_models):
        left = capacity - sum(m.shards for m in models) - (n_models - i - 1)
        if catalogue:
            fitting = [k for k in catalogue if k[0] <= left] or [min(catalogue)]
            shards, gb = fitting[int(rng.integers(len(fitting)))]
            if shards > left:
                break
        else:
            shards = max(1, min(int(rng.choice([1, 1, 1, 2, 2, 4, 8])), max_shards, gpus_per_server, left))
            gb = round(float(rng.uniform(5, 40)) * (1 if rng.random() < 0.5 else -1), 1)
        models.append(ModelSpec(f"m{i}", shards, gb))
    return PlacementProblem(servers, gpus_per_server, gpu_memory_gb, tuple(models))
