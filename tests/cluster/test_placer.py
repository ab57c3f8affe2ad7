"""AQUA-PLACER (AQUA §5): the integer program against brute force, and the in-server stable matching."""

import itertools

import numpy as np
import pytest

from backfill.cluster.placer import (InfeasiblePlacementError, ModelSpec, PlacementProblem, brute_force, random_problem, solve,
                                     stable_match)
from backfill.cluster import placer
from backfill.errors import ClusterInputError


def small_instances(count=40, seed=7):
    rng = np.random.default_rng(seed)
    for i in range(count):
        servers, gpus = int(rng.integers(1, 4)), int(rng.integers(1, 5))
        n_models = int(rng.integers(1, min(6, servers * gpus) + 1))
        yield random_problem(rng, servers, gpus, n_models, max_shards=gpus,
                             n_kinds=None if i % 2 else int(rng.integers(1, 4)))


def test_milp_is_optimal_on_every_small_instance():
    rows = []
    for problem in small_instances():
        try:
            best, _ = brute_force(problem)
        except InfeasiblePlacementError:   # shards that fit in total but not server by server
            with pytest.raises(InfeasiblePlacementError):
                solve(problem)
            continue
        result = solve(problem)
        assert result.proven_optimal
        assert result.objective == pytest.approx(best, abs=1e-6)
        assert problem.feasible([result.server_of[m.name] for m in problem.models])
        rows.append((problem.servers, len(problem.models), best))
    assert len(rows) >= 30


def solves_like_brute_force(problem: PlacementProblem) -> bool:
    """solve() proves brute force's optimum; False (nothing checked) where brute force finds none."""
    try:
        best, _ = brute_force(problem)
    except InfeasiblePlacementError:
        return False
    result = solve(problem)
    assert result.proven_optimal and result.objective == pytest.approx(best, abs=1e-6)
    return True


def test_per_server_program_is_optimal_too(monkeypatch):
    """The fallback when a server can be filled in too many ways: the same optima."""
    monkeypatch.setattr(placer, "MAX_PATTERNS", 0)
    checked = 0
    for problem in itertools.islice(small_instances(), 20):
        checked += solves_like_brute_force(problem)
    assert checked >= 12


def test_patterns_and_per_server_program_agree_beyond_brute_force(monkeypatch):
    """Instances too big to enumerate (4 servers x 4 GPUs, 12 models): both forms prove the same optimum."""
    rng = np.random.default_rng(3)
    problems = [random_problem(rng, 4, 4, 12, n_kinds=4) for _ in range(4)]
    by_patterns = [solve(p) for p in problems]
    monkeypatch.setattr(placer, "MAX_PATTERNS", 0)
    per_server = [solve(p) for p in problems]
    for a, b in zip(by_patterns, per_server):
        assert a.proven_optimal and b.proven_optimal
        assert a.objective == pytest.approx(b.objective, abs=1e-6)


def test_server_patterns_fill_one_server_within_its_gpus():
    kinds = [(1, 5.0), (2, -3.0), (4, 10.0)]
    patterns = placer.server_patterns(kinds, [3, 2, 1], 4)
    shards = patterns @ np.array([1, 2, 4])
    assert (shards <= 4).all() and (patterns <= [3, 2, 1]).all()
    assert len({tuple(p) for p in patterns}) == len(patterns)
    # every way, counted by hand: (a, b, 0) with a + 2b <= 4, a <= 3, b <= 2 is 8 ways; (0, 0, 1) one more
    assert len(patterns) == 9
    assert placer.server_patterns(kinds, [3, 2, 1], 0).tolist() == [[0, 0, 0]]


def test_shards_stay_together_and_gpu_limit_holds():
    problem = PlacementProblem(2, 4, 80.0, (ModelSpec("big", 4, -30.0), ModelSpec("p1", 1, 40.0),
                                            ModelSpec("p2", 1, 40.0), ModelSpec("p3", 1, 35.0)))
    result = solve(problem)
    big = result.server_of["big"]
    assert sum(1 for m in problem.models for _ in range(m.shards) if result.server_of[m.name] == big) <= 4
    # the TP-4 consumer fills its server: its shards pair with no producer, the producers sit apart
    assert all(result.server_of[p] != big for p in ("p1", "p2", "p3"))


def test_stable_matching_has_no_blocking_pair():
    models = [ModelSpec("c2", 2, -30.0), ModelSpec("c1", 1, -10.0), ModelSpec("pa", 1, 35.0),
              ModelSpec("pb", 1, 12.0), ModelSpec("pc", 1, 50.0)]
    pairs = stable_match(0, models)
    assert len(pairs) == 3 and len({p.producer for p in pairs}) == 3
    spare = {("pa", 0): 35.0, ("pb", 0): 12.0, ("pc", 0): 50.0}
    need = {("c2", 0): 30.0, ("c2", 1): 30.0, ("c1", 0): 10.0}
    partner_of_c = {p.consumer: p.producer for p in pairs}
    partner_of_p = {p.producer: p.consumer for p in pairs}

    def producer_rank(p, c):
        return (0, -need[c]) if need[c] <= spare[p] else (1, need[c])

    for c, p in itertools.product(need, spare):
        consumer_prefers = spare[p] > spare[partner_of_c[c]]
        producer_prefers = p not in partner_of_p or producer_rank(p, c) < producer_rank(p, partner_of_p[p])
        assert not (consumer_prefers and producer_prefers), (c, p)


def test_bad_problems_are_typed_errors():
    with pytest.raises(ClusterInputError):
        PlacementProblem(1, 2, 80.0, (ModelSpec("wide", 4, -10.0),))
    with pytest.raises(ClusterInputError):
        PlacementProblem(1, 2, 80.0, (ModelSpec("a", 2, -10.0), ModelSpec("b", 1, 5.0)))
    with pytest.raises(ClusterInputError):
        ModelSpec("x", 0, 1.0)


def test_memory_off_the_grid_is_still_optimal():
    rng = np.random.default_rng(11)
    for _ in range(5):
        models = tuple(ModelSpec(f"m{i}", int(rng.choice([1, 1, 2])), float(rng.uniform(-30, 30)) + 1e-3)
                       for i in range(5))
        problem = PlacementProblem(3, 3, 80.0, models)
        solves_like_brute_force(problem)
