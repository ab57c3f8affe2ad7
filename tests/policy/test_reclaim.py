import itertools
import random

import pytest

from backfill.errors import PolicyInputError
from backfill.memory.reclaim_interface import HandleView
from backfill.policy.reclaim import FIFOReclaimPolicy, GreedyReclaimPolicy, plan_for

greedy, fifo = GreedyReclaimPolicy(), FIFOReclaimPolicy()


def random_case(rng: random.Random, max_spread: int):
    """Handles 0..H-1 in a random allocation order; each request puts one block on each of
    1..max_spread random handles."""
    n_handles, n_requests = rng.randint(2, 7), rng.randint(1, 8)
    tokens = {f"r{i}": rng.randint(1, 200) for i in range(n_requests)}
    on_handle: dict[int, dict[str, list[int]]] = {h: {} for h in range(n_handles)}
    block = 0
    for rid in tokens:
        for h in rng.sample(range(n_handles), rng.randint(1, min(n_handles, max_spread))):
            on_handle[h].setdefault(rid, []).append(block)
            block += 1
    order = rng.sample(range(n_handles), n_handles)
    views = [HandleView(h, order[h], {r: tuple(b) for r, b in on_handle[h].items()}) for h in range(n_handles)]
    return views, tokens, rng.randint(1, n_handles)


def brute_force_cost(views, tokens, n):
    return min(plan_for(views, tokens, [v.handle_id for v in combo]).cost_tokens
               for combo in itertools.combinations(views, n))


def test_greedy_prefers_handles_shared_by_fewer_tokens():
    views = [HandleView(0, 0, {"a": (0,), "b": (1,)}),      # oldest, but hits 2 requests
             HandleView(1, 1, {"c": (4,)}),
             HandleView(2, 2, {})]                          # empty: free to take
    tokens = {"a": 100, "b": 50, "c": 30}
    plan = greedy.choose(views, tokens, 2)
    assert plan.handle_ids == (2, 1)
    assert plan.invalidated_request_ids == {"c"} and plan.invalidated_block_ids == (4,)
    assert plan.cost_tokens == 30
    baseline = fifo.choose(views, tokens, 2)
    assert baseline.handle_ids == (0, 1) and baseline.cost_tokens == 180


def test_a_request_spanning_chosen_handles_is_counted_once():
    views = [HandleView(0, 0, {"a": (0, 1)}), HandleView(1, 1, {"a": (2,)}), HandleView(2, 2, {"b": (3,)})]
    tokens = {"a": 40, "b": 30}
    plan = greedy.choose(views, tokens, 2)
    # First pick: b (30) beats a (40); then the other a-handles cost 40 each.
    assert plan.cost_tokens == 70
    both_a = plan_for(views, tokens, [0, 1])
    assert both_a.cost_tokens == 40 and both_a.invalidated_block_ids == (0, 1, 2)


def test_greedy_is_optimal_when_no_request_spans_two_handles():
    # Costs are then additive per handle, and taking the n cheapest is optimal.
    rng = random.Random(1)
    for _ in range(500):
        views, tokens, n = random_case(rng, max_spread=1)
        assert greedy.choose(views, tokens, n).cost_tokens == brute_force_cost(views, tokens, n)


def test_greedy_is_optimal_for_a_single_handle():
    rng = random.Random(2)
    for _ in range(300):
        views, tokens, _ = random_case(rng, max_spread=3)
        assert greedy.choose(views, tokens, 1).cost_tokens == brute_force_cost(views, tokens, 1)


def test_greedy_against_brute_force_and_fifo_when_requests_span_handles():
    # General case (minimum-cost k-union): each greedy pick costs at most the optimum, so
    # OPT <= greedy <= n x OPT. Measured here: greedy is optimal in ~94% of cases, worst ratio
    # ~2, it loses to FIFO in ~1% of cases, and costs ~25% fewer tokens than FIFO overall
    # (Valve §7.2 reports 22.9-40.1% less throughput loss than FIFO).
    rng = random.Random(3)
    cases, optimal, lost_to_fifo, greedy_total, fifo_total = 800, 0, 0, 0, 0
    for _ in range(cases):
        views, tokens, n = random_case(rng, max_spread=3)
        g = greedy.choose(views, tokens, n).cost_tokens
        f = fifo.choose(views, tokens, n).cost_tokens
        best = brute_force_cost(views, tokens, n)
        assert best <= g <= n * best
        optimal += g == best
        lost_to_fifo += g > f
        greedy_total, fifo_total = greedy_total + g, fifo_total + f
    assert optimal / cases >= 0.9
    assert lost_to_fifo / cases <= 0.03
    assert greedy_total <= 0.85 * fifo_total


def test_greedy_can_lose_to_fifo_and_to_the_optimum():
    # One request spread over the two oldest handles: jointly they cost 100, but greedy sees
    # 100 per handle and first takes the 99-token handle.
    views = [HandleView(0, 0, {"big": (0,)}), HandleView(1, 1, {"big": (1,)}), HandleView(2, 2, {"x": (2,)})]
    tokens = {"big": 100, "x": 99}
    assert greedy.choose(views, tokens, 2).cost_tokens == 199
    assert fifo.choose(views, tokens, 2).cost_tokens == 100 == brute_force_cost(views, tokens, 2)


def test_zero_handles_and_errors():
    views = [HandleView(0, 0, {"a": (0,)})]
    plan = greedy.choose(views, {"a": 5}, 0)
    assert plan.handle_ids == () and plan.cost_tokens == 0
    with pytest.raises(PolicyInputError, match="only 1"):
        greedy.choose(views, {"a": 5}, 2)
    with pytest.raises(PolicyInputError, match="token count"):
        fifo.choose(views, {}, 1)
    with pytest.raises(PolicyInputError, match="non-negative"):
        greedy.choose(views, {"a": 5}, -1)
    with pytest.raises(PolicyInputError, match="twice"):
        greedy.choose(views + views, {"a": 5}, 1)
    with pytest.raises(PolicyInputError, match="not among"):
        plan_for(views, {"a": 5}, [7])
