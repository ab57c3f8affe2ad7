import numpy as np
import pytest

from backfill.bench.lengths import (FixedLength, LognormalLength, UniformLength, ZipfLength,
                                    parse_length_spec)
from backfill.errors import WorkloadError


def test_parse_each_form_and_round_trip():
    assert parse_length_spec("fixed:128") == FixedLength(128)
    assert parse_length_spec("64") == FixedLength(64)
    assert parse_length_spec("uniform:32:256") == UniformLength(32, 256)
    assert parse_length_spec("lognormal:128:0.5") == LognormalLength(128.0, 0.5)
    assert parse_length_spec("lognormal:128:0.5:1024") == LognormalLength(128.0, 0.5, 1024)
    assert parse_length_spec("zipf:1.2:512") == ZipfLength(1.2, 512)
    for text in ("fixed:128", "uniform:32:256", "lognormal:128:0.5", "lognormal:128:0.5:1024", "zipf:1.2:512"):
        assert str(parse_length_spec(text)) == text


def test_samples():
    rng = np.random.default_rng(0)
    assert list(FixedLength(7).sample(rng, 3)) == [7, 7, 7]
    u = UniformLength(3, 5).sample(rng, 3000)
    assert set(u.tolist()) == {3, 4, 5}
    ln = LognormalLength(100.0, 0.5).sample(rng, 50_000)
    assert np.median(ln) == pytest.approx(100, rel=0.03)
    assert ln.min() >= 1 and ln.max() <= 1600
    assert LognormalLength(100.0, 3.0, 150).sample(rng, 1000).max() == 150
    z = ZipfLength(1.2, 50).sample(rng, 50_000)
    assert z.min() == 1 and z.max() <= 50
    weights = np.arange(1, 51) ** -1.2
    assert np.mean(z == 1) == pytest.approx(weights[0] / weights.sum(), rel=0.05)
    assert z.dtype == np.int64


def test_samples_are_deterministic():
    spec = parse_length_spec("zipf:0.8:300")
    assert np.array_equal(spec.sample(np.random.default_rng(5), 100), spec.sample(np.random.default_rng(5), 100))


@pytest.mark.parametrize("text,match", [
    ("", "empty"), ("gauss:1:2", "unknown length distribution"), ("fixed", "takes 1"),
    ("uniform:5", "takes 2"), ("uniform:9:3", "lo <= hi"), ("fixed:0", ">= 1"), ("fixed:1.5", "whole"),
    ("fixed:abc", "bad number"), ("lognormal:0.5:1", "median"), ("lognormal:100:-1", "sigma"),
    ("lognormal:100:1:50", "below the median"), ("zipf:0:10", "exponent"), ("zipf:1.1:0", ">= 1"),
    ("fixed:inf", "whole"),
])
def test_bad_specs(text, match):
    with pytest.raises(WorkloadError, match=match):
        parse_length_spec(text)
