"""`bench coserve --rounds`: each round is a real run on the tiny engine; the pooled result is
one run whose rounds follow each other in time."""

import asyncio
from dataclasses import replace

import pytest

from backfill.bench.coserve_bench import _run_round, make_workload, pool_rounds, warmup_workload
from backfill.bench.scenario import CoserveScenario
from backfill.engine.byte_tokenizer import ByteTokenizer
from backfill.errors import InvalidRequestError
from backfill.policy.latency_model import LatencyModel
from backfill.types import SLO
from backfill.serving.config import ServingConfig
from backfill.serving.build import build_tiny_engine

SCENARIO = CoserveScenario(duration_s=2.0, online_load=0.3, prompt_len="uniform:8:16", output_len="uniform:2:4",
                           offline_prompt_len="uniform:8:16", offline_output_len="uniform:4:8",
                           offline_concurrency=2, offline_pool=50, rounds=2)
# What the workload builder believes a step costs: sets the online rate (a few requests a second).
LATENCY = LatencyModel((1, 4096), (40.0, 80.0))


def test_rounds_are_real_runs_pooled_back_to_back():
    rounds = []
    for k in range(SCENARIO.rounds):  # a fresh engine per round, as the benchmark does
        engine = build_tiny_engine(ServingConfig(policy="coserve", kv_cache_gb=0.01))
        tokenizer = ByteTokenizer(engine.scheduler.runner.config.vocab_size)
        scenario = replace(SCENARIO, duration_s=SCENARIO.duration_s / SCENARIO.rounds, seed=k)
        workload = make_workload(scenario, tokenizer, LATENCY, with_offline=True)
        rounds.append(asyncio.run(_run_round(engine, workload, progress=False)))
        assert not engine.scheduler.has_work()  # the round drained the engine
    pooled = pool_rounds(rounds, SLO(1000, 100))
    first, second = (r.run for r in rounds)
    assert pooled.metrics.duration_s == pytest.approx(first.duration_s + second.duration_s)
    assert pooled.config["rounds"] == 2
    # Record ids stay unique and the second round's times come after the first round's end.
    assert len({r.request_id for r in pooled.records}) == len(first.records) + len(second.records)
    later = [r for r in pooled.records if r.request_id.startswith("r1-")]
    assert later and all(r.send_s >= first.duration_s for r in later if r.send_s is not None)
    online_done = sum(1 for part in (first, second) for r in part.records if r.ok and r.request_class.value == "online")
    assert pooled.metrics.online.completed == online_done > 0
    # Engine counters add up over rounds.
    steps = [r.engine["steps"] for r in rounds]
    assert pooled.config["engine"]["steps"] == sum(steps)
    assert pooled.config["engine"]["output_tokens"]["offline"] == sum(r.engine["output_tokens"]["offline"]
                                                                      for r in rounds)


def test_rounds_must_be_positive():
    with pytest.raises(InvalidRequestError, match="rounds"):
        CoserveScenario(rounds=0)


def test_warm_up_runs_offline_work_alone_for_its_duration():
    engine = build_tiny_engine(ServingConfig(policy="priority", kv_cache_gb=0.01))
    tokenizer = ByteTokenizer(engine.scheduler.runner.config.vocab_size)
    workload = warmup_workload(replace(SCENARIO, warmup_s=1.0), tokenizer)
    result = asyncio.run(_run_round(engine, workload, progress=False))
    assert not workload.requests and workload.offline_backlogs  # no online trace, only the backlog
    assert all(r.request_class.value == "offline" for r in result.run.records)
    assert result.engine["output_tokens"]["offline"] > 0 and result.engine["output_tokens"]["online"] == 0
    assert 1.0 <= result.run.duration_s < 5.0
    assert not engine.scheduler.has_work()


def test_warm_up_must_not_be_negative():
    with pytest.raises(InvalidRequestError, match="warmup_s"):
        CoserveScenario(warmup_s=-1.0)
