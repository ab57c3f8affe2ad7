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
