"""Sampling on the device (engine/device_sampler.py): greedy equals argmax, filters keep only the
allowed tokens, draws follow the distribution, a seed fixes a row's draws whatever the batch, and
the scheduler routes a step there only when the runner has one and every row fits."""

import pytest
import torch

from backfill.engine.device_sampler import DeviceSampler, RowParams, fits, sample_tokens, uniform_noise
from backfill.engine.runner import make_generator
from backfill.sampling_params import SamplingParams
from backfill.types import GenerationRequest, RequestClass
from backfill.serving.build import build_scheduler
from backfill.serving.config import ServingConfig


def _rows(device, temperature, top_k=0, top_p=1.0, seeds=None, n=1):
    seeds = seeds if seeds is not None else list(range(n))
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p) for _ in seeds]
    return RowParams.of(params, seeds, torch.device(device))


def test_greedy_rows_take_the_argmax(device):
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(0)).to(device)
    rows = RowParams.of([SamplingParams(temperature=0.0)] * 4 + [SamplingParams(temperature=1.0, seed=1)],
                        [0] * 5, torch.device(device))
    tokens = sample_tokens(logits, rows)
    assert tokens[:4].tolist() == logits[:4].argmax(-1).tolist()


def test_top_k_and_top_p_keep_only_allowed_tokens(device):
    logits = torch.tensor([[0.0, 3.0, 2.9, 1.0, -1.0]] * 64, device=device)
    top2 = sample_tokens(logits, _rows(device, 1.0, top_k=2, n=64))
    assert set(top2.tolist()) == {1, 2}
    # top_p 0.5: token 1 alone carries less than half, tokens 1 and 2 reach it.
    nucleus = sample_tokens(logits, _rows(device, 1.0, top_p=0.5, n=64))
    assert set(nucleus.tolist()) == {1, 2}
    assert set(sample_tokens(logits, _rows(device, 1.0, top_k=1, n=64)).tolist()) == {1}
    assert set(sample_tokens(logits, _rows(device, 1.0, n=64)).tolist()) >= {0, 1, 2, 3}


def test_draws_follow_the_softmax(device):
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5], device=device)
    n = 4000
    tokens = sample_tokens(logits.expand(n, -1), _rows(device, 0.7, n=n), filtered=False)
    freq = torch.bincount(tokens.cpu(), minlength=4).float() / n
    expected = torch.softmax(logits.cpu() / 0.7, dim=-1)
    assert (freq - expected).abs().max() < 0.03  # about four standard errors at n = 4000


def test_noise_is_uniform_and_depends_on_the_seed_only(device):
    seeds = torch.tensor([7, 7, 8], device=device)
    u = uniform_noise(seeds, 50000)
    assert u.min() > 0 and u.max() < 1 and abs(float(u.mean()) - 0.5) < 0.01
    assert torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])


def test_a_seeded_row_draws_the_same_tokens_whatever_its_batch(device):
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(1)).to(device)
    sampler = DeviceSampler(torch.device(device))
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    alone = sampler.sample(logits[:1], [params], [make_generator(params)])
    others = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2)]
    batched = sampler.sample(logits[[1, 0, 2]], [others[0], params, others[1]],
                             [make_generator(p) for p in (others[0], params, others[1])])
    assert batched[1] == alone[0]
    assert sampler.rows_sampled == 4


def test_fits_leaves_penalties_logprobs_and_min_p_to_the_host():
    assert fits([SamplingParams(temperature=0.8, top_k=5, top_p=0.9)])
    assert not fits([SamplingParams(repetition_penalty=1.2)])
    assert not fits([SamplingParams(logprobs=2)])
    assert not fits([SamplingParams(temperature=1.0, min_p=0.1)])


@pytest.mark.parametrize("penalized", [False, True])
def test_the_scheduler_samples_on_the_runners_device_sampler(tiny_runner, penalized):
    tiny_runner.device_sampler = sampler = DeviceSampler(tiny_runner.device)
    scheduler = build_scheduler(tiny_runner, ServingConfig(policy="fcfs", max_model_len=64))
    extra = {"repetition_penalty": 1.3} if penalized else {}
    scheduler.add(GenerationRequest([5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, **extra),
                                    RequestClass.ONLINE))
    while scheduler.has_work():
        scheduler.step()
    assert sampler.rows_sampled == (0 if penalized else 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="graph capture needs a GPU")
def test_sampling_replays_in_a_cuda_graph():
    logits = torch.randn(4, 1000, device="cuda")
    rows = _rows("cuda", 0.9, top_k=50, top_p=0.9, n=4)
    expected = sample_tokens(logits, rows)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sample_tokens(logits, rows)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
