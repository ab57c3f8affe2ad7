import pytest

from backfill.bench.verdict import MIN_SAMPLES_P99, Verdict


def test_too_few_samples_is_not_a_verdict():
    v = Verdict("P99 pause, ms", 0.5, 1.0, samples=1, min_samples=MIN_SAMPLES_P99)
    assert v.met is None
    assert v.met_text == "n/a (too few samples: 1)"
    assert "P99 pause, ms" in v.describe() and "n=1" in v.describe() and f"min {MIN_SAMPLES_P99}" in v.describe()


@pytest.mark.parametrize("value, comparison, met", [(0.9, "<=", True), (1.1, "<=", False), (1.1, ">=", True),
                                                    (0.9, ">=", False)])
def test_enough_samples_compare_value_and_target(value, comparison, met):
    v = Verdict("q", value, 1.0, samples=20, min_samples=20, comparison=comparison)
    assert v.met is met and v.met_text == ("yes" if met else "no")


def test_within_uses_the_tolerance_and_a_missing_value_is_n_a():
    assert Verdict("rate", 7.0, 6.0, samples=2, min_samples=2, comparison="within", tolerance=0.25).met is True
    assert Verdict("rate", 8.0, 6.0, samples=2, min_samples=2, comparison="within", tolerance=0.25).met is False
    assert Verdict("rate", None, 6.0, samples=5, min_samples=2).met is None
    assert Verdict("q", 1.0, float("nan"), samples=50, min_samples=2).met is False   # no target: never met


def test_unknown_comparison_is_refused():
    with pytest.raises(ValueError):
        Verdict("q", 1.0, 1.0, samples=1, min_samples=1, comparison="<")


def test_as_dict_round_trips_the_verdict():
    d = Verdict("q", 2.0, 1.0, samples=30, min_samples=20, sample_unit="requests").as_dict()
    assert d["met"] is False and d["met_text"] == "no" and d["samples"] == 30 and d["sample_unit"] == "requests"


def test_the_closing_sentence_reads_met_missed_and_thin_verdicts_with_their_counts():
    from backfill.bench.verdict import closing_sentence, ratio_text

    met = Verdict("burst P99 TTFT / SLO", 1.5, 2.0, samples=40, min_samples=MIN_SAMPLES_P99,
                  sample_unit="admitted requests")
    missed = Verdict("after P99 TTFT / SLO", 1.11, 1.0, samples=23, min_samples=MIN_SAMPLES_P99)
    thin = Verdict("before P99 TTFT / SLO", 0.5, 1.0, samples=19, min_samples=MIN_SAMPLES_P99,
                   sample_unit="admitted requests")
    text = closing_sentence([met, missed, thin])
    assert text.startswith("This run met 1 of 3 targets (burst P99 TTFT / SLO 1.5 against the target <= 2, n=40)")
    assert "missed 1 (after P99 TTFT / SLO 1.11 against the target <= 1, n=23)" in text
    assert "could not judge 1 (before P99 TTFT / SLO: 19 admitted requests, 20 needed)" in text
    assert closing_sentence([]) == "No target was judged."
    assert ratio_text(1.1099999999999999) == "1.11x" and ratio_text(None) == "-" and ratio_text(float("nan")) == "-"
