"""Our adapter files are PEFT's: peft + transformers compute the same logits as our LoRA forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backfill.engine.config import ModelConfig
from backfill.engine.model import LlamaModel
from backfill.finetune.config import FinetuneConfig
from backfill.finetune.layerwise import embed, layer_forward
from backfill.finetune.lora import TrainableLoraAdapter

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def test_peft_loads_our_adapter_and_agrees(tmp_path):
    cfg = ModelConfig.tiny()
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=True)
    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    model = LlamaModel(cfg, dict(hf.state_dict()))
    config = FinetuneConfig(rank=4, alpha=8, target_modules=("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"))
    adapter = TrainableLoraAdapter(config, TrainableLoraAdapter.shapes_for(cfg), cfg.num_layers, torch.Generator().manual_seed(0))
    with torch.no_grad():
        for _, b in adapter.params.values():
            b.normal_(0, 0.1)
    adapter.save(tmp_path / "adapter")
    ids = torch.tensor([[5, 17, 33, 2, 99, 100, 7, 8]])
    with torch.no_grad():
        h = embed(model, ids)
        for li in range(cfg.num_layers):
            h = layer_forward(model, adapter, li, h)
        ours = F.rms_norm(h, (cfg.hidden_size,), model.final_norm, cfg.rms_norm_eps) @ model.embed.t()
        base = hf(ids).logits  # before peft wraps hf's modules in place
        reference = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()(ids).logits
    assert (reference - base).abs().max() > 1e-3  # the adapter changes the output
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)
