"""The DISB report's closing sentence, on constructed rows."""

from backfill.bench.realtime_bench import closing, format_rows


def _row(n, p99_vs, tput_vs):
    return {"rt_requests": n, "rt_p50_norm": 1.0, "rt_p99_norm": 1.5, "rt_p99_vs_rt_only": p99_vs,
            "throughput_norm": 1.0, "throughput_vs_seq": tput_vs, "preemptions": 0, "preempt_us": {},
            "reexecuted_ops": 0, "padded_ops": 0}


def test_the_sentence_names_the_reef_modes_that_met_both_targets_and_concurrent_beside_them():
    rows = {"rt-only": _row(300, 1.0, 0.6), "seq": _row(300, 3.5, 1.0), "concurrent": _row(300, 0.986, 1.62),
            "reef": _row(300, 1.63, 0.68), "reef-pad-evict": _row(300, 1.04, 1.44)}
    text = closing("A", rows)
    assert text.startswith("DISB A: reef-pad-evict met both targets") and "1.04x and 1.44x over 300" in text
    assert "concurrent (no priorities): 0.99x RT-only at 1.62x SEQ." in text
    assert "missed 2 (reef: RT P99 / RT-only's 1.63" in text
    assert format_rows("A", rows).splitlines()[-1] == text


def test_no_reef_mode_meeting_both_is_said_and_thin_runs_are_not_judged():
    rows = {"rt-only": _row(10, 1.0, 0.6), "seq": _row(10, 3.5, 1.0), "reef": _row(10, 1.0, 1.2)}
    text = closing("B", rows)
    assert text.startswith("DISB B: no REEF mode met both targets this run.")
    assert "could not judge 2" in text
