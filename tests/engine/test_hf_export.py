import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_weights import random_model, tiny_gguf_config, write_tiny_gguf

from backfill.engine.hf_export import export_hf_dir
from backfill.engine.weights import load_model
from backfill.engine.loaded_model import LoadedModel
from backfill.errors import CorruptModelError


@pytest.fixture()
def tiny_loaded(tmp_path) -> LoadedModel:
    config = tiny_gguf_config()
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, config, random_model(config, seed=5))
    return load_model(path, cache_dir=tmp_path / "cache")


def test_export_roundtrips_through_load_model(tiny_loaded, tmp_path):
    out = export_hf_dir(tiny_loaded, tmp_path / "hf")
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json",
                                               "tokenizer_config.json", "generation_config.json"}
    again = load_model(out)
    assert again.config == replace(tiny_loaded.config, name="hf")
    assert again.weights.keys() == tiny_loaded.weights.keys()
    for name, tensor in tiny_loaded.weights.items():
        assert torch.equal(again.weights[name], tensor), name
    messages = [{"role": "user", "content": "the café 你好 <|im_end|>"}]
    assert again.tokenizer.encode_chat(messages) == tiny_loaded.tokenizer.encode_chat(messages)
    assert again.tokenizer.stop_token_ids == tiny_loaded.tokenizer.stop_token_ids
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == list(tiny_loaded.tokenizer.stop_token_ids)


def test_export_rejects_inconsistent_weights(tiny_loaded, tmp_path):
    weights = dict(tiny_loaded.weights)
    del weights["model.norm.weight"]
    broken = LoadedModel(tiny_loaded.config, weights, tiny_loaded.tokenizer, "broken")
    with pytest.raises(CorruptModelError, match="model.norm.weight"):
        export_hf_dir(broken, tmp_path / "hf")


def test_transformers_loads_the_export_like_the_gguf(tiny_loaded, tmp_path):
    pytest.importorskip("accelerate")  # transformers needs it to read a GGUF
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = export_hf_dir(tiny_loaded, tmp_path / "hf")
    gguf_path = Path(tiny_loaded.source)
    from_export = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    from_gguf = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                     dtype=torch.float32).eval()
    ids = torch.tensor([[1, 40, 80, 120, 200, 259, 2]])
    with torch.no_grad():
        want = from_gguf(ids).logits
        got = from_export(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    tokenizer = AutoTokenizer.from_pretrained(out)
    text = "Hello the 12 café 你好"
    assert tokenizer.encode(text, add_special_tokens=False) == tiny_loaded.tokenizer.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert (tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == tiny_loaded.tokenizer.apply_chat_template(messages))


@pytest.mark.slow
def test_real_model_export_matches_transformers_gguf(tmp_path, hf_default_model):
    from transformers import AutoModelForCausalLM

    loaded = load_model(None, cache_dir=tmp_path / "cache")
    out = export_hf_dir(loaded, tmp_path / "hf")
    ids = torch.tensor([loaded.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])])
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(ids).logits
        want = hf_default_model(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
