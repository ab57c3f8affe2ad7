"""The embedded SmolLM2-135M against HF transformers loading the same GGUF file."""

import pytest
import torch

from backfill.sampling_params import SamplingParams
from backfill.serving.config import ServingConfig
from backfill.serving.llm import LLM

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 100.",
    "Translate 'good morning' into Spanish and German.",
    "def fibonacci(n):",
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(ServingConfig(policy="fcfs", kv_cache_gb=0.25))


_HF_GREEDY: dict[tuple[tuple[int, ...], int], list[int]] = {}  # both greedy tests ask for the same prompts


def _hf_greedy(hf_model, ids: list[int], n: int) -> list[int]:
    """Plain argmax decoding with HF's KV cache: no logits processors (generate's min_new_tokens would
    mask the end-of-turn token, which we want to compare too)."""
    key = (tuple(ids), n)
    if key not in _HF_GREEDY:
        _HF_GREEDY[key] = _hf_greedy_uncached(hf_model, ids, n)
    return list(_HF_GREEDY[key])


def _hf_greedy_uncached(hf_model, ids: list[int], n: int) -> list[int]:
    out: list[int] = []
    with torch.inference_mode():
        step = hf_model(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            token = int(step.logits[0, -1].argmax())
            out.append(token)
            step = hf_model(torch.tensor([[token]]), past_key_values=step.past_key_values, use_cache=True)
    return out


def test_greedy_tokens_identical_to_hf_for_chat_prompts(llm, hf_default_model):
    prompts = [llm.encode_prompt(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    ours = llm.generate(prompts, params)   # all six batched together
    for ids, completion in zip(prompts, ours):
        assert completion.token_ids == _hf_greedy(hf_default_model, ids, 32)


def test_prefill_logits_close_to_hf(llm, hf_default_model):
    from backfill.engine.step import SeqChunk

    ids = llm.encode_prompt(PROMPTS[2])
    runner = llm.scheduler.runner
    table = runner.kv.allocate(runner.kv.blocks_needed(len(ids)))
    try:
        ours = runner.execute([SeqChunk("x", ids, 0, table)]).logits[0]
    finally:
        runner.kv.free(table)
    with torch.inference_mode():
        ref = hf_default_model(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=2e-3)


def test_chat_answer_is_sensible(llm):
    text = "".join(llm.stream(PROMPTS[0], SamplingParams(max_tokens=24, temperature=0.0)))
    assert "Paris" in text


def test_compiled_decode_greedy_tokens_identical_to_hf(hf_default_model):
    """One request at a time, so every decode step takes the compiled single-sequence path."""
    fast = LLM(ServingConfig(policy="fcfs", kv_cache_gb=0.25, dtype="float32", compile_decode=True))
    assert fast.scheduler.runner.model.compiled_decode is not None
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    for prompt in PROMPTS[:5]:
        ids = fast.encode_prompt(prompt)
        assert fast.generate([ids], params)[0].token_ids == _hf_greedy(hf_default_model, ids, 32)
