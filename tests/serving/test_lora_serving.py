"""Requests naming LoRA adapters through the real scheduler and AsyncEngine, batched with base requests."""

import asyncio

import pytest

from backfill.engine.config import ModelConfig
from backfill.sampling_params import SamplingParams
from backfill.engine.weights import random_model
from backfill.errors import UnknownAdapterError
from backfill.types import GenerationRequest, RequestClass
from backfill.serving.config import ServingConfig
from backfill.serving.build import build_tiny_engine

pytest.importorskip("peft")
from lora_helpers import ALL_TARGETS, hf_llama, make_peft_adapter  # noqa: E402


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    cfg = ModelConfig.tiny()
    weights = random_model(cfg, seed=0)  # build_tiny_engine's weights
    root = tmp_path_factory.mktemp("serving-adapters")
    make_peft_adapter(hf_llama(cfg, weights), root / "a", 4, 8, ALL_TARGETS, seed=1, std=1.0)
    make_peft_adapter(hf_llama(cfg, weights), root / "b", 2, 4, ["v_proj", "up_proj"], seed=2, std=1.5)
    return root


def request(prompt: str, adapter: str | None, request_class=RequestClass.ONLINE) -> GenerationRequest:
    return GenerationRequest(list(prompt.encode()), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                             request_class, adapter=adapter)


def test_mixed_adapter_requests_equal_each_alone(adapters):
    async def main():
        engine = build_tiny_engine(ServingConfig(policy="priority", kv_cache_gb=0.0625, max_model_len=256))
        engine.adapters.load("a", adapters / "a")
        await engine.call_between_steps(lambda: engine.adapters.load("b", adapters / "b"))
        await engine.start()
        try:
            plan = [("the sea is", None), ("the sea is", "a"), ("tell me more", "b"), ("tell me", "a"),
                    ("zzz", None)]
            alone = [(await engine.generate(request(p, name)))[0] for p, name in plan]
            together = await asyncio.gather(*(engine.generate(request(p, name, RequestClass.OFFLINE if i % 2 else
                                                                      RequestClass.ONLINE))
                                              for i, (p, name) in enumerate(plan)))
            assert [ids for ids, _, _ in together] == alone
            assert alone[0] != alone[1]  # the adapter changes what the model says
            with pytest.raises(UnknownAdapterError, match="'nope'"):
                engine.submit(request("x", "nope"))
            # Unloading spares a request already holding the adapter.
            stream = engine.submit(request("the sea is", "a"))
            engine.adapters.unload("a")
            tokens = [t async for event in stream for t in event.token_ids]
            assert tokens == alone[1]
            assert engine.adapters.names() == ["b"]
        finally:
            await engine.stop()

    asyncio.run(main())
