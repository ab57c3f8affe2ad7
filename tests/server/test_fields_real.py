"""Greedy output with penalties and logprobs on the default model, through a real server and the
openai client, against HF transformers running the same GGUF weights (vLLM's semantics)."""

from __future__ import annotations

import pytest
import torch

from backfill.serving.config import ServingConfig
from backfill.serving.build import build_engine
from backfill.server.app import create_app
from backfill.server.config import ServerConfig
from backfill.server.store import Store
import openai

from server_helpers import LiveServer

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

PROMPT = "List the days of the week, then list them again."
NUM_TOKENS = 24
PENALTIES = {"repetition_penalty": 1.3, "frequency_penalty": 0.4, "presence_penalty": 0.3}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    serving = ServingConfig(policy="fcfs", kv_cache_gb=0.25)
    db = tmp_path_factory.mktemp("real") / "server.db"
    app = create_app(build_engine(serving), ServerConfig(serving=serving, db=str(db)), Store(db))
    with LiveServer(app) as live:
        yield live


def hf_reference(hf_model, prompt_ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy decoding with HF's own repetition-penalty processor plus OpenAI's frequency/presence
    formula (logit - count x frequency - [count > 0] x presence, output tokens only); logprobs of
    the raw logits."""
    repetition = transformers.RepetitionPenaltyLogitsProcessor(PENALTIES["repetition_penalty"])
    out: list[int] = []
    logprobs: list[float] = []
    with torch.inference_mode():
        step = hf_model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(n):
            logits = step.logits[0, -1].float()
            scores = repetition(torch.tensor([prompt_ids + out]), logits[None].clone())[0]
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=scores.shape[-1]).float() \
                if out else torch.zeros_like(scores)
            scores = scores - PENALTIES["frequency_penalty"] * counts - PENALTIES["presence_penalty"] * (counts > 0)
            token = int(scores.argmax())
            out.append(token)
            logprobs.append(float(torch.log_softmax(logits, dim=-1)[token]))
            step = hf_model(torch.tensor([[token]]), past_key_values=step.past_key_values, use_cache=True)
    return out, logprobs


def test_greedy_penalties_and_logprobs_match_transformers(server, hf_default_model):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)
    messages = [{"role": "user", "content": PROMPT}]
    out = client.chat.completions.create(model=None, messages=messages, max_tokens=NUM_TOKENS, temperature=0,
                                         logprobs=True, top_logprobs=2,
                                         extra_body={"ignore_eos": True, **PENALTIES})
    prompt_ids = list(server.state.engine.tokenizer.encode_chat(messages))
    expected_ids, expected_logprobs = hf_reference(hf_default_model, prompt_ids, NUM_TOKENS)
    tokenizer = server.state.engine.tokenizer
    assert out.choices[0].message.content == tokenizer.decode(expected_ids)
    got = [entry.logprob for entry in out.choices[0].logprobs.content]
    assert got == pytest.approx(expected_logprobs, abs=5e-3)
    plain = client.chat.completions.create(model=None, messages=messages, max_tokens=NUM_TOKENS, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert plain.choices[0].message.content != out.choices[0].message.content   # the penalties bite
