"""Every supported family (Llama 3.1 RoPE scaling, Mistral, Qwen2 biases, Qwen3 q/k norm with its own
head_dim) loads from an HF directory, sharded safetensors and GGUF, and decodes the greedy tokens
transformers decodes, through the real serving stack (scheduler, paged KV, paged-attention kernel)."""

import json
from dataclasses import replace

import pytest
import torch
from family_models import (FAMILIES, LLAMA3_ROPE, build_tokenizer, hf_config, hf_greedy, hf_model, write_gguf,
                           write_hf_dir)

from backfill.engine.config import ModelConfig
from backfill.engine.cuda_graphs import DecodeGraphs
from backfill.engine.kv_pool import KVBlockPool
from backfill.engine.model import LlamaModel
from backfill.engine.runner import ModelRunner
from backfill.engine.step import SeqChunk
from backfill.sampling_params import SamplingParams
from backfill.engine.weights import load_model, random_model, read_model_config
from backfill.errors import CorruptModelError, UnsupportedModelError
from backfill.serving.config import ServingConfig
from backfill.serving.build import build_runner
from backfill.serving.llm import LLM

PROMPTS = [[5, 17, 40, 99, 123], list(range(30, 70)), [301, 250, 12, 12, 12, 9, 81, 140]]
NEW_TOKENS = 8


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, transformers model, HF directory, GGUF file, transformers' greedy tokens per prompt)."""
    name = request.param
    tokenizer = build_tokenizer(FAMILIES[name][3])
    model = hf_model(name, tokenizer.get_vocab_size())
    root = tmp_path_factory.mktemp(name)
    # Sharded for half the families: save_pretrained splits at max_shard_size and writes the index.
    sharded = name in ("llama3", "qwen3")
    hf_dir = write_hf_dir(root / "hf", model, tokenizer, name, max_shard_size="100KB" if sharded else None)
    rope_freqs = None
    if name == "llama3":
        rope_freqs = LLAMA3_ROPE.freq_divisors(_unscaled_inv_freq(hf_dir)).float()
    gguf_path = write_gguf(root / f"{name}.gguf", model, tokenizer, name, rope_freqs)
    want = [hf_greedy(model, ids, NEW_TOKENS) for ids in PROMPTS]
    return name, model, hf_dir, gguf_path, want


def _unscaled_inv_freq(hf_dir) -> torch.Tensor:
    return replace(load_model(hf_dir).config, rope_scaling=None).rope_inv_freq()


def _backfill_greedy(loaded, **serving) -> list[list[int]]:
    cfg = ServingConfig(policy="fcfs", kv_cache_gb=0.01, max_model_len=256, **serving)
    llm = LLM(cfg, loaded=loaded)
    params = SamplingParams.greedy_params(NEW_TOKENS, ignore_eos=True)
    return [c.token_ids for c in llm.generate(PROMPTS, params)]


def test_hf_directory_matches_transformers(family):
    name, model, hf_dir, _, want = family
    loaded = load_model(hf_dir)
    c = loaded.config
    assert c.architecture == ("mistral" if name == "mistral" else FAMILIES[name][2])
    assert (c.qkv_bias, c.qk_norm) == (name == "qwen2", name == "qwen3")
    assert c.head_dim == (24 if name == "qwen3" else 16)
    assert c.rope_scaling == (LLAMA3_ROPE if name == "llama3" else None)
    assert _backfill_greedy(loaded) == want
    assert (hf_dir / "model.safetensors.index.json").is_file() == (name in ("llama3", "qwen3"))


def test_gguf_matches_transformers_and_the_hf_tokenizer(family, tmp_path):
    name, model, hf_dir, gguf_path, want = family
    from_gguf = load_model(gguf_path, cache_dir=tmp_path)
    from_hf = load_model(hf_dir)
    # A GGUF names Mistral's architecture llama (the same decoder).
    assert from_gguf.config.architecture == FAMILIES[name][2]
    assert from_gguf.config == replace(from_hf.config, name=from_gguf.config.name,
                                       architecture=from_gguf.config.architecture,
                                       rms_norm_eps=from_gguf.config.rms_norm_eps,
                                       rope_scaling=from_gguf.config.rope_scaling,
                                       bos_token_id=from_gguf.config.bos_token_id,
                                       eos_token_id=from_gguf.config.eos_token_id)
    if name == "llama3":  # recovered from rope_freqs: other parameters, the same frequencies
        torch.testing.assert_close(from_gguf.config.rope_inv_freq(), from_hf.config.rope_inv_freq())
    for key, tensor in from_hf.weights.items():
        torch.testing.assert_close(from_gguf.weights[key], tensor, rtol=0, atol=0)
    assert _backfill_greedy(from_gguf) == want
    text = "Hello world 2024, the café naïve 你好!"
    assert from_gguf.tokenizer.encode(text) == from_hf.tokenizer.encode(text)
    messages = [{"role": "user", "content": "Hi there"}]
    assert from_gguf.tokenizer.encode_chat(messages) == from_hf.tokenizer.encode_chat(messages)
    # The second load reads the dequantized cache (an HF directory of this family) the same way.
    again = load_model(gguf_path, cache_dir=tmp_path)
    assert again.config == from_gguf.config and again.weights.keys() == from_gguf.weights.keys()


def test_sdpa_decode_and_graph_parts_agree_with_the_kernel(family):
    """The gather + SDPA decode attention and the CUDA-graph parts run eagerly give the kernel's tokens."""
    name, model, hf_dir, _, want = family
    loaded = load_model(hf_dir)
    assert _backfill_greedy(loaded, decode_attention="sdpa") == want
    lm = LlamaModel(loaded.config, loaded.weights)
    kv = KVBlockPool(loaded.config, 64, 8)
    runner = ModelRunner(lm, kv, DecodeGraphs(lm, kv, capture=False))
    tables, tokens = [], []
    for i, ids in enumerate(PROMPTS):
        tables.append(kv.allocate(kv.blocks_needed(len(ids) + NEW_TOKENS)))
        tokens.append([int(runner.execute([SeqChunk(i, ids, 0, tables[i])]).logits[0].argmax())])
    for _ in range(NEW_TOKENS - 1):
        chunks = [SeqChunk(i, [tokens[i][-1]], len(ids) + len(tokens[i]) - 1, tables[i])
                  for i, ids in enumerate(PROMPTS)]
        assert runner.decode_graphs.fits(chunks)
        for i, row in enumerate(runner.execute(chunks).logits):
            tokens[i].append(int(row.argmax()))
    assert tokens == want


def test_sliding_window_is_refused_past_the_window(tmp_path):
    config = ModelConfig.tiny(architecture="mistral", sliding_window=64)
    weights = random_model(config)
    with pytest.raises(UnsupportedModelError, match=r"sliding window of 64 tokens.*--max-model-len 64"):
        build_runner(config, weights, ServingConfig(kv_cache_gb=0.01, max_model_len=2048))
    build_runner(config, weights, ServingConfig(kv_cache_gb=0.01, max_model_len=64))


def _hf_dir_with(tmp_path, family: str, **changes):
    """A directory whose config.json is the family's as transformers writes it, with changes (the
    config is read before any weight, so none are needed)."""
    config = hf_config(family, 360).to_dict()
    config.update(changes)
    directory = tmp_path / family
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("changes, named", [
    ({"model_type": "gemma2"}, "model_type 'gemma2'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}}, "rope scaling 'yarn'"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
])
def test_unsupported_options_are_named(tmp_path, changes, named):
    directory = _hf_dir_with(tmp_path, "mistral", **changes)
    with pytest.raises(UnsupportedModelError, match=named):
        read_model_config(directory)


def test_qwen2_sliding_layers_and_mistral_window_are_read(tmp_path):
    qwen = _hf_dir_with(tmp_path, "qwen2", sliding_window=32, layer_types=["full_attention", "sliding_attention"])
    assert read_model_config(qwen).sliding_window == 32
    unused = _hf_dir_with(tmp_path / "b", "qwen2", sliding_window=32, use_sliding_window=False, layer_types=None)
    assert read_model_config(unused).sliding_window is None
    mistral = _hf_dir_with(tmp_path / "c", "mistral", sliding_window=4096)
    assert read_model_config(mistral).sliding_window == 4096


def test_missing_shard_is_corrupt(family, tmp_path):
    name, _, hf_dir, _, _ = family
    if name != "llama3":
        pytest.skip("one sharded family is enough")
    import shutil

    copy = shutil.copytree(hf_dir, tmp_path / "copy")
    shard = sorted(copy.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(CorruptModelError, match=shard.name):
        load_model(copy)


def test_gguf_rope_freqs_that_are_not_llama3_are_refused(family, tmp_path):
    name, model, hf_dir, _, _ = family
    if name != "llama3":
        pytest.skip("the llama architecture is the one that carries rope_freqs")
    freqs = torch.linspace(3.0, 1.0, load_model(hf_dir).config.head_dim // 2)  # rising frequency factor
    path = write_gguf(tmp_path / "odd.gguf", model, build_tokenizer("llama-bpe"), name, freqs)
    with pytest.raises(UnsupportedModelError, match="rope_freqs"):
        load_model(path, cache_dir=tmp_path / "cache")
