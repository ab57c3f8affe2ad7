"""The one list of policies: each name builds the policy of that name, an unknown name is a typed
error, and the serving config, the node config and the coserve benchmark offer what it lists."""

from __future__ import annotations

import pytest

from backfill.bench.modes import POLICIES as BENCH_MODES
from backfill.engine.config import SafepointLayout
from backfill.errors import InvalidRequestError
from backfill.node.config import NODE_POLICIES
from backfill.policy import registry
from backfill.policy.config import CoServeConfig
from backfill.policy.interface import SchedulingPolicy
from backfill.policy.latency_model import LatencyModel
from backfill.serving.config import POLICIES as SERVING_POLICIES, ServingConfig

LATENCY = LatencyModel((1, 4096), (1.0, 41.0))
LAYOUT = SafepointLayout(num_layers=4, longest_stretch_share=0.5)


@pytest.mark.parametrize("name", registry.NAMES)
def test_each_name_builds_the_policy_of_that_name(name):
    policy = registry.make_policy(name, limits=None, latency=LATENCY, layout=LAYOUT, coserve=CoServeConfig())
    assert SchedulingPolicy in type(policy).__mro__ and policy.name == name  # it inherits the defaults
    assert registry.entry(name).needs_latency_model == (policy.latency is not None)


def test_a_policy_without_the_latency_model_it_needs_is_refused():
    with pytest.raises(InvalidRequestError, match="latency profile"):
        registry.make_policy("coserve", limits=None, latency=None, layout=LAYOUT, coserve=CoServeConfig())


def test_an_unknown_name_is_a_typed_error_naming_the_choices():
    with pytest.raises(InvalidRequestError, match="choose among coserve"):
        registry.entry("lottery")
    with pytest.raises(InvalidRequestError, match="policy must be one of"):
        ServingConfig(policy="lottery")


def test_every_list_of_policy_names_is_read_from_the_registry():
    assert SERVING_POLICIES == registry.NAMES
    assert set(NODE_POLICIES) == set(BENCH_MODES) == {e.name for e in registry.POLICIES if e.in_one_engine}
    assert BENCH_MODES[0] == registry.BASELINE


def test_the_default_abilities_of_a_policy_without_a_latency_model():
    policy = registry.make_policy("fcfs", limits=None, latency=None, layout=LAYOUT, coserve=CoServeConfig())
    assert policy.latency is None and policy.model_error is None and policy.slo is None
    assert policy.correction_for(64) == 1.0
    assert policy.observe_swap(None) is None


def test_each_policy_runs_its_own_batch_limits_unless_max_batch_tokens_is_given():
    assert registry.default_limits("coserve").max_batch_tokens == 512
    assert registry.default_limits("priority").max_batch_tokens == 2048
    assert ServingConfig().batch_limits == registry.default_limits("coserve")
    assert ServingConfig(policy="fcfs").batch_limits == registry.default_limits("fcfs")
    for name in ("coserve", "priority"):
        limits = ServingConfig(policy=name, max_batch_tokens=2048).batch_limits
        # The step cap and the longest prompt chunk both move; the policy keeps its sequence cap.
        assert (limits.max_batch_tokens, limits.prefill_chunk_tokens) == (2048, 2048)
        assert limits.max_batch_seqs == registry.default_limits(name).max_batch_seqs
        policy = registry.make_policy(name, limits=limits, latency=LATENCY, layout=LAYOUT, coserve=CoServeConfig())
        assert policy.limits == limits


def test_a_step_of_the_configured_size_takes_a_whole_prompt_that_the_default_chunks():
    from backfill.policy.interface import SchedulerState, SeqView
    from backfill.types import RequestClass

    prompts = [SeqView(f"s{i}", RequestClass.ONLINE, float(i), 700, 700, 0, 0, False) for i in range(3)]
    state = SchedulerState(10.0, tuple(prompts), 1000, 1000, 16, 2048)

    def step_tokens(cfg: ServingConfig) -> list[int]:
        policy = registry.make_policy(cfg.policy, limits=cfg.batch_limits, latency=LATENCY, layout=LAYOUT,
                                      coserve=CoServeConfig())
        return [s.num_tokens for s in policy.schedule(state).scheduled]

    assert step_tokens(ServingConfig(policy="online-only")) == [512]
    assert step_tokens(ServingConfig(policy="online-only", max_batch_tokens=2048)) == [700, 700, 648]


def test_max_batch_tokens_below_one_is_a_typed_error():
    with pytest.raises(InvalidRequestError, match="max_batch_tokens must be >= 1"):
        ServingConfig(max_batch_tokens=0)
