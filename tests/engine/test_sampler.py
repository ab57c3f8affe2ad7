import pytest
import torch

from backfill.engine.runner import make_generator, sample
from backfill.sampling_params import SamplingParams
from backfill.errors import InvalidSamplingError


def test_greedy_picks_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 0.0]])
    p = SamplingParams.greedy_params()
    assert sample(logits, [p, p], [None, None]) == [1, 0]


def test_seeded_sampling_is_reproducible_and_batch_independent():
    logits = torch.randn(1, 100)
    p = SamplingParams(temperature=1.0, seed=42)
    alone = [sample(logits, [p], [g])[0] for g in [make_generator(p)] for _ in range(5)]
    g1, g2 = make_generator(p), make_generator(SamplingParams(temperature=1.0, seed=7))
    other = SamplingParams(temperature=1.0, seed=7)
    batched = [sample(torch.cat([logits, torch.randn(1, 100)]), [p, other], [g1, g2])[0] for _ in range(5)]
    assert alone == batched


def test_top_k_and_top_p_restrict_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, -10.0, -10.0]])
    k2 = SamplingParams(temperature=1.0, top_k=2, seed=0)
    gen = make_generator(k2)
    assert {sample(logits, [k2], [gen])[0] for _ in range(200)} <= {0, 1}
    p = SamplingParams(temperature=1.0, top_p=0.5, seed=0)
    gen = make_generator(p)
    assert {sample(logits, [p], [gen])[0] for _ in range(200)} == {0}


@pytest.mark.parametrize("kwargs", [
    dict(temperature=-1), dict(temperature=float("nan")), dict(top_p=0.0), dict(top_p=1.5),
    dict(top_k=-2), dict(max_tokens=0), dict(max_tokens=2.5), dict(seed="x"), dict(stop=[""]),
    dict(stop_token_ids=[-1]), dict(min_tokens=5, max_tokens=2),
])
def test_invalid_sampling_params_raise_typed_error(kwargs):
    with pytest.raises(InvalidSamplingError):
        SamplingParams(**kwargs)


def test_stop_accepts_single_string():
    assert SamplingParams(stop="END").stop == ("END",)


def test_tiny_temperature_behaves_like_greedy_instead_of_overflowing():
    logits = torch.tensor([[1.0, 3.0, 2.0]]) * 1e3
    p = SamplingParams(temperature=1e-300, seed=1)
    assert sample(logits, [p], [make_generator(p)]) == [1]


def test_top_p_below_float32_range_keeps_the_most_likely_token():
    # 1e-300 rounds to 0 in float32; the first token must still stay (it used to be dropped too,
    # leaving nothing to sample: "probability tensor contains inf, nan or element < 0").
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    p = SamplingParams(temperature=1.0, top_p=1e-300, seed=1)
    gen = make_generator(p)
    assert {sample(logits, [p], [gen])[0] for _ in range(20)} == {1}
