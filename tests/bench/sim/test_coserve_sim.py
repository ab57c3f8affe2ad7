"""The co-serving scenario simulated: the benchmark's workload and report on the simulated runner."""

import json
from dataclasses import replace

import pytest

from backfill.bench.ceiling import offline_ceilings
from backfill.bench.scenario import CoserveScenario
from backfill.cli import main
from backfill.engine.config import ModelConfig
from backfill.errors import BackfillError, InvalidRequestError
from backfill.policy.latency_model import LatencyModel
from backfill.serving.config import ServingConfig
from backfill.bench.sim.coserve_sim import SimMachine, load_inputs, simulate_coserve

REAL = ModelConfig.tiny(num_layers=8, max_position_embeddings=2048)
# CPU-like: a 20 ms floor up to 8 tokens, then +0.5 ms per token; decode attention 1 ms per 1k context.
CPU_LIKE = LatencyModel((1, 8, 1024), (20.0, 20.0, 528.0), ms_per_kctx=1.0)
SCENARIO = CoserveScenario(duration_s=30.0, prompt_len="uniform:32:96", output_len="uniform:8:24",
                           offline_prompt_len="uniform:64:128", offline_output_len="uniform:16:48",
                           offline_concurrency=8, offline_pool=400, warmup_s=0.0)
MODES = ("online-only", "priority", "coserve")


def simulate(**kwargs):
    args = dict(scenario=SCENARIO, machine=SimMachine(CPU_LIKE, 512), latency=CPU_LIKE, real_config=REAL,
                serving=ServingConfig(), modes=MODES, out_dir=None, log=lambda *a: None)
    return simulate_coserve(**(args | kwargs))


@pytest.fixture(scope="module")
def results():
    return simulate()


def test_every_online_request_is_served_and_no_offline_request_is_lost(results):
    for mode, result in results.items():
        online = [r for r in result.records if r.request_class.value == "online"]
        offline = [r for r in result.records if r.request_class.value == "offline"]
        assert online and all(r.ok and r.output_tokens > 0 for r in online), mode
        # Offline requests either finished with all their tokens or were in flight at the end.
        assert all(r.ok or r.cancelled for r in offline), mode
        assert result.config["engine"]["recomputed_tokens"] == 0
    assert results["online-only"].metrics.offline.tokens_per_s == 0
    assert results["coserve"].metrics.offline.tokens_per_s > 0 and results["priority"].metrics.offline.tokens_per_s > 0


def test_coserve_preempts_offline_batches_and_keeps_online_latency_where_priority_does_not(results):
    co, prio, alone = (results[m].metrics for m in ("coserve", "priority", "online-only"))
    engine = results["coserve"].config["engine"]
    assert engine["aborted_steps"] > 0 and co.preemptions == len(engine["preemptions"])
    # A stretch between two safepoints of the biggest offline step is well under the 8 ms target.
    assert 0 < co.preemption_latency_ms.max <= 8.0
    assert co.online.ttft_ms.p99 < prio.online.ttft_ms.p99
    assert co.online.ttft_ms.p99 <= 1.5 * alone.online.ttft_ms.p99
    # The policies were given online-only's own P99 latency as their SLOs.
    slo = results["coserve"].config["slo"]
    assert slo == {"ttft_ms": alone.online.ttft_ms.p99, "tpot_ms": alone.online.tpot_ms.p99}
    assert results["coserve"].config["simulated"] is True


def test_the_same_inputs_give_the_same_figures(results):
    again = simulate(modes=("online-only", "coserve"))
    assert again["coserve"].metrics.to_dict() == results["coserve"].metrics.to_dict()


def test_a_slower_machine_than_the_profile_is_what_steps_cost(results):
    slower = LatencyModel(CPU_LIKE.token_grid, tuple(2 * ms for ms in CPU_LIKE.step_ms), ms_per_kctx=2.0)
    slow = simulate(machine=SimMachine(slower, 512), modes=("online-only",))
    # The load is a share of the simulated machine's capacity: half the arrival rate, same busy share.
    fast_rate = results["online-only"].config["workload"]["online_rate_per_s"]
    assert slow["online-only"].config["workload"]["online_rate_per_s"] == pytest.approx(fast_rate / 2, rel=0.01)
    assert slow["online-only"].metrics.online.ttft_ms.p50 > 1.5 * results["online-only"].metrics.online.ttft_ms.p50


def test_bad_input_is_refused(tmp_path):
    with pytest.raises(InvalidRequestError, match="unknown mode"):
        simulate(modes=("coserve", "fastest"))
    with pytest.raises(InvalidRequestError):
        SimMachine(CPU_LIKE, 0)
    with pytest.raises(InvalidRequestError):
        SimMachine(CPU_LIKE, 16, step_overhead_ms=-1.0)
    with pytest.raises(BackfillError, match="no latency profile"):
        load_inputs(ServingConfig(), profile=tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(BackfillError, match="latency profile"):
        load_inputs(ServingConfig(), profile=tmp_path / "bad.json")


def test_cli_simulates_the_default_model_from_a_profile_and_writes_the_report(tmp_path, capsys):
    profile = tmp_path / "profile.json"
    CPU_LIKE.save(profile)
    out, result_json = tmp_path / "report", tmp_path / "sim.json"
    code = main(["sim", "coserve", "--profile", str(profile), "--duration", "20", "--kv-cache-gb", "0.25",
                 "--modes", "online-only", "coserve", "--out", str(out), "--json", str(result_json)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "coserve" in printed and "offline tok/s" in printed
    saved = json.loads(result_json.read_text())
    assert set(saved) == {"online-only", "coserve"} and saved["coserve"]["config"]["simulated"] is True
    assert (out / "report.md").is_file()
    # A missing profile is a clear error, not a traceback.
    assert main(["sim", "coserve", "--profile", str(tmp_path / "none.json"), "--duration", "5"]) == 2
    assert "no latency profile" in capsys.readouterr().err


def test_without_riders_coserve_stays_under_its_offline_ceiling_and_riders_lift_it():
    # The ceiling (bench/ceiling.py) says offline batches can only use the time online work leaves;
    # on this CPU-like machine, whose 20 ms floor makes a few riders nearly free, riders lift coserve
    # above it, and a variant without riders stays on it.
    results = simulate(modes=("online-only", "coserve", "coserve:rider_cost_share=0"))
    ceilings = offline_ceilings(results)
    without = ceilings["coserve:rider_cost_share=0"]
    assert results["coserve:rider_cost_share=0"].config["engine"]["mode_offline_tokens"].get("co-serving", 0) == 0
    assert 0.9 * without.ceiling_tokens_per_s <= without.measured_tokens_per_s <= 1.01 * without.ceiling_tokens_per_s
    riding = ceilings["coserve"]
    assert results["coserve"].config["engine"]["mode_offline_tokens"]["co-serving"] > 0
    assert riding.measured_tokens_per_s > 1.05 * riding.ceiling_tokens_per_s


def test_the_report_states_the_latency_models_error_per_step_mode(results, tmp_path):
    from backfill.bench.report import markdown_table

    errors = results["coserve"].config["engine"]["model_error"]
    assert set(errors) == {"co-serving", "offline-batching"}
    for e in errors.values():  # the profile is the machine: the model is exact
        assert e["steps"] > 10 and e["median"] < 0.01 and e["p90"] < 0.01
    assert "priority" not in {m for m, r in results.items() if r.config["engine"].get("model_error")}
    assert "## Latency model error" in markdown_table(results, "online-only")


def test_a_profile_that_is_off_shows_in_the_model_error_and_in_the_frontier(tmp_path, capsys):
    from backfill.bench.frontier import run_frontier, settings

    # The policy plans on a profile 30% too fast; its drift correction takes most of that back.
    fast = LatencyModel((1, 8, 1024), (14.0, 14.0, 370.0), ms_per_kctx=0.7)
    short = CoserveScenario(duration_s=10.0, **{k: getattr(SCENARIO, k) for k in (
        "prompt_len", "output_len", "offline_prompt_len", "offline_output_len", "offline_concurrency",
        "offline_pool", "warmup_s")})
    points = run_frontier(settings(short, [0.2, 0.4], [(500.0, 60.0)]),
                          lambda sc, out: simulate(scenario=sc, latency=fast, modes=("priority", "coserve")),
                          tmp_path, log=lambda *a: None)
    assert [p.online_load for p in points] == [0.2, 0.4]
    error = points[0].model_error["coserve"]["co-serving"]
    assert error["steps"] > 0 and error["median"] > 0
    table = (tmp_path / "frontier.md").read_text()
    assert "| 0.2 | 500 / 60 |" in table and "| 0.4 | 500 / 60 |" in table
    assert len(json.loads((tmp_path / "frontier.json").read_text())) == 2


def test_mixed_step_graphs_are_priced_only_where_the_engine_knob_turns_them_on(tmp_path):
    """With --mixed-graphs a machine whose profile has a mixed table graphs steps with prompt chunks;
    without it (the default, as the measured H200 runs ran) both the plan and the machine price them eagerly."""
    from dataclasses import replace

    from backfill.policy.latency_model import BatchShape

    gpu = replace(CPU_LIKE, decode_grid=(1, 64), decode_ms=(5.0, 8.0), mixed_grid=(1, 64), mixed_ms=(5.0, 8.0))
    gpu.save(tmp_path / "gpu.json")
    step = BatchShape().plus(1, 100).plus(8, 0)
    _, latency, machine = load_inputs(ServingConfig(kv_cache_gb=0.05, mixed_graphs=True), profile=tmp_path / "gpu.json")
    assert latency.graphs_mixed(step) and machine.cost.estimate_ms(step) < 10.0
    _, latency, machine = load_inputs(ServingConfig(kv_cache_gb=0.05), profile=tmp_path / "gpu.json",
                                      machine=tmp_path / "gpu.json")
    assert not latency.graphs_mixed(step) and not machine.cost.graphs_mixed(step)
    assert machine.cost.estimate_ms(step) == CPU_LIKE.estimate_ms(step) >= 20.0


def test_a_machine_that_slows_mid_run_is_followed_by_the_latency_model():
    # Steps cost twice the profile from 15 s into each mode's run; the policy's correction follows.
    slowed = simulate(scenario=replace(SCENARIO, slowdown_at_s=15.0),
                      modes=("online-only", "coserve", "coserve:follow_drift=off"))
    drift = slowed["coserve"].config["engine"]["latency_drift"]
    assert drift["max_factor"] > 1.6 and drift["end_factor"] > 1.6
    before = [f for t, f in drift["timeline"] if t < 14.0]
    after = [f for t, f in drift["timeline"] if t > 17.0]
    assert before and after and max(before) < 1.1 and min(after) > 1.6   # within 2 s of the slowdown
    steady = simulate(modes=("coserve",))["coserve"].config["engine"]["latency_drift"]
    assert steady["max_factor"] < 1.05 and steady["flags"] == 0
    # Online latency under the slowdown stays near online-only's under the same schedule.
    alone, co = slowed["online-only"].metrics.online, slowed["coserve"].metrics.online
    assert co.tpot_ms.p99 <= 1.25 * alone.tpot_ms.p99 and co.ttft_ms.p99 <= 1.25 * alone.ttft_ms.p99
    with pytest.raises(InvalidRequestError):
        SimMachine(CPU_LIKE, 512, slowdown_factor=0.0)
