"""The node benchmark's report on constructed results: verdicts from enough samples only, and a
phase reports only what can happen in it."""

from dataclasses import replace

import pytest

from backfill.errors import PolicyInputError
from backfill.bench.node_bench import (OFFLINE_OUTPUT_MAX, OFFLINE_PROMPT_MAX, MachineSpeed, NodeBenchConfig,
                                 format_table, machine_warnings, make_trace, size_to_machine, summarize)


def _ms(n, p99):
    return {"n": n, "p50": p99 / 2 if n else None, "p99": p99 if n else None, "max": p99 if n else None}


def _phase(n, ttft, tpot, *, offline=True, acks=0, reclamations=0, lost=0, tokens=100, window_s=60.0):
    r = {"window_s": window_s, "online": {"requests": n, "completed": n, "ttft_ms": _ms(n, ttft),
                                          "tpot_ms": _ms(n, tpot)}}
    if offline:
        r["preemptions_per_online_request"] = {"mean": 0.5, "max": 1, "n": n}
        r["pause"] = {"cooperative_ack_ms": _ms(acks, 2.0), "os_suspend_ms": _ms(0, 0),
                      "offline_layer_ms": _ms(50, 5.0)}
        r["offline"] = {"tokens_out": tokens, "tokens_per_s": tokens / window_s, "lost_tokens": lost,
                        "lost_tokens_per_reclamation": lost / reclamations if reclamations else 0.0,
                        "nothing_lost": True}
        r["memory"] = {"reclamations": reclamations, "reclamations_per_min": reclamations * 60 / window_s}
    return r


def test_targets_from_one_sample_say_n_a_with_the_count():
    phases = {"alone": _phase(3, 100.0, 20.0, offline=False), "valve": _phase(3, 105.0, 20.0, acks=1)}
    summary = summarize(phases, NodeBenchConfig())
    assert summary["cooperative_pause_p99_ms"]["met"] is None
    assert summary["cooperative_pause_p99_ms"]["met_text"] == "n/a (too few samples: 1)"
    assert summary["preemptions_per_request_valve"]["met_text"] == "n/a (too few samples: 3)"
    assert summary["ttft_ms_p99_ratio_valve"]["met_text"] == "n/a (too few samples: 3)"
    text = format_table({"phases": phases, "summary": summary})
    assert "met=yes" not in text and "n/a (too few samples: 1)" in text


def test_targets_with_enough_samples_are_judged_and_name_their_quantity():
    phases = {"alone": _phase(40, 100.0, 20.0, offline=False), "valve": _phase(40, 150.0, 20.0, acks=40,
                                                                               reclamations=6, lost=10),
              "fifo": _phase(40, 100.0, 20.0, reclamations=6, lost=100)}
    summary = summarize(phases, NodeBenchConfig())
    assert summary["ttft_ms_p99_ratio_valve"]["met"] is False          # 1.5x alone's P99
    assert summary["tpot_ms_p99_ratio_valve"]["met"] is True
    assert summary["cooperative_pause_p99_ms"]["met"] is True          # 2 ms ack against a 5 ms layer
    assert summary["selective_vs_fifo_lost_tokens"]["met"] is True     # 90% fewer lost tokens
    assert summary["reclamations_per_min_valve"]["met"] is True        # 6/min over two 30 s windows
    assert "TTFT" in summary["ttft_ms_p99_ratio_valve"]["quantity"]


def test_the_alone_phase_reports_no_preemptions_and_the_table_shows_none():
    phases = {"alone": _phase(40, 100.0, 20.0, offline=False)}
    assert "preemptions_per_online_request" not in phases["alone"]
    row = format_table({"phases": phases, "summary": summarize(phases, NodeBenchConfig())}).splitlines()[1]
    assert row.split()[0] == "alone" and row.split()[3] == "-"


def test_saturated_alone_and_an_empty_offline_phase_are_called_out():
    speed = MachineSpeed(prefill_ms_per_token=10.0, decode_ms_per_token=50.0, request_s=2.0)
    phases = {"alone": _phase(40, 18_000.0, 20.0, offline=False), "valve": _phase(40, 20_000.0, 20.0, tokens=0)}
    warnings = machine_warnings(phases, speed, NodeBenchConfig())
    assert any("saturates" in w and "--online-load" in w for w in warnings)
    assert any("no offline token" in w for w in warnings)
    ok = {"alone": _phase(40, 1_000.0, 20.0, offline=False), "valve": _phase(40, 1_100.0, 20.0)}
    assert machine_warnings(ok, speed, NodeBenchConfig()) == []


def test_sizing_follows_the_measured_machine():
    cfg = NodeBenchConfig(duration_s=60.0, online_load=0.4)
    slow = size_to_machine(cfg, MachineSpeed(prefill_ms_per_token=13.0, decode_ms_per_token=40.0, request_s=4.0))
    fast = size_to_machine(cfg, MachineSpeed(prefill_ms_per_token=1.0, decode_ms_per_token=8.0, request_s=0.5))
    assert slow.arrivals == "gamma:0.1:2" and fast.arrivals == "gamma:0.8:2"
    assert slow.offline_prompt_tokens[1] < fast.offline_prompt_tokens[1] <= OFFLINE_PROMPT_MAX[1]
    assert slow.offline_output_tokens <= fast.offline_output_tokens <= OFFLINE_OUTPUT_MAX
    # One offline batch of the slow machine's prompts fits its share of the window.
    assert 8 * slow.offline_prompt_tokens[1] * 13.0 / 1e3 < 0.15 * 60.0
    explicit = size_to_machine(replace(cfg, arrivals="gamma:0.5:2"), MachineSpeed(1.0, 8.0, 0.5))
    assert explicit.arrivals == "gamma:0.5:2"


def test_a_trace_needs_a_rate_and_the_load_is_a_share():
    with pytest.raises(PolicyInputError):
        make_trace(NodeBenchConfig(), 100)
    with pytest.raises(PolicyInputError):
        NodeBenchConfig(online_load=1.5)


def test_no_loss_is_n_a_where_nothing_was_reclaimed():
    phases = {"valve": _phase(40, 100.0, 20.0, reclamations=0), "fifo": _phase(40, 100.0, 20.0, reclamations=6)}
    rows = format_table({"phases": phases, "summary": summarize(phases, NodeBenchConfig())}).splitlines()
    assert rows[1].split()[0] == "valve" and rows[1].split()[-1] == "n/a"
    assert rows[2].split()[0] == "fifo" and rows[2].split()[-1] == "yes"


def test_the_table_closes_with_the_best_harvest_and_the_targets_read():
    phases = {"alone": _phase(40, 100.0, 20.0, offline=False), "valve": _phase(40, 150.0, 20.0, acks=40,
                                                                               reclamations=6, lost=10, tokens=1200),
              "fifo": _phase(40, 100.0, 20.0, reclamations=6, lost=100, tokens=600)}
    last = format_table({"phases": phases, "summary": summarize(phases, NodeBenchConfig())}).splitlines()[-1]
    assert last.startswith("Most offline tokens/s: valve (20.0; fifo 10.0). This run met ")
    assert "missed" in last and "valve: online P99 TTFT / alone's 1.5" in last
