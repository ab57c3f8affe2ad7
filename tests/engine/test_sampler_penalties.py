"""Penalties, min-p and logprobs of the sampler, against the formulas vLLM documents."""

from __future__ import annotations

import pytest
import torch

from backfill.engine.runner import History, apply_penalties, make_generator, sample_picks
from backfill.sampling_params import SamplingParams
from backfill.errors import InvalidSamplingError


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0, 3.0])
    p = SamplingParams(repetition_penalty=2.0)
    out = apply_penalties(logits, p, History(prompt_ids=[0, 1], output_ids=[1]))
    assert out.tolist() == [1.0, -4.0, 1.0, -1.0, 3.0]    # 2 and 3 unseen, untouched
    assert logits.tolist() == [2.0, -2.0, 1.0, -1.0, 3.0]  # the input is not modified


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = torch.zeros(4)
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(logits, p, History(prompt_ids=[3, 3, 3], output_ids=[1, 1, 2]))
    assert out.tolist() == [0.0, -1.25, -0.75, 0.0]        # 2 x 0.5 + 0.25; 1 x 0.5 + 0.25; prompt-only 3: 0


def test_greedy_with_penalties_avoids_the_repeated_token():
    logits = torch.tensor([[1.0, 0.9, 0.0]])
    plain = SamplingParams(temperature=0.0)
    penalized = SamplingParams(temperature=0.0, frequency_penalty=0.5)
    history = History([2], [0])
    assert sample_picks(logits, [plain], [None], [None])[0].token_id == 0
    assert sample_picks(logits, [penalized], [None], [history])[0].token_id == 1


def test_min_p_drops_unlikely_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2] + [1e-4] * 20]))
    p = SamplingParams(temperature=1.0, min_p=0.5, seed=1)
    gen = make_generator(p)
    tokens = {sample_picks(logits, [p], [gen])[0].token_id for _ in range(300)}
    assert tokens == {0, 1}    # 0.2 < 0.5 x 0.5 and the tail are dropped


def test_logprobs_are_the_raw_models_with_top_alternatives():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0]])
    p = SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=1.5)
    pick = sample_picks(logits, [p], [None], [History([0], [])])[0]
    raw = torch.log_softmax(logits[0], dim=-1)
    assert pick.token_id == 0 and pick.logprob.token_id == 0
    assert pick.logprob.logprob == pytest.approx(float(raw[0]))   # before the penalty
    assert [t for t, _ in pick.logprob.top] == [0, 2]
    assert sample_picks(logits, [SamplingParams()], [make_generator(SamplingParams())])[0].logprob is None


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.5), ("frequency_penalty", -2.1),
                                          ("repetition_penalty", 0.0), ("min_p", 1.2), ("logprobs", 21),
                                          ("logprobs", True)])
def test_invalid_values_are_typed_errors(field, value):
    with pytest.raises(InvalidSamplingError, match=field):
        SamplingParams(**{field: value})
