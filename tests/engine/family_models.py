"""Tiny random models of each supported family, built by transformers and written the way their
publishers and llama.cpp write them: HF directories (one safetensors file or shards with an index)
and GGUF files, each with a small byte-level BPE tokenizer and the family's chat template."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch

from backfill.engine.config import Llama3RopeScaling
from backfill.engine.gguf_reader import permute_qk

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|eot_id|>"]
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3_CHAT = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n'"
               " + m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
CORPUS = ["The quick brown fox jumps over the lazy dog 12345 times.", "Hello world, hello there! 2024-11-26",
          "def add(a, b):\n    return a + b\n", "Qwen and Llama and Mistral are families of models.",
          "café naïve résumé 你好 世界"] * 4

# family -> (transformers config class, HF extra options, GGUF architecture, tokenizer pre-type)
LLAMA3_ROPE = Llama3RopeScaling(factor=4.0, low_freq_factor=1.0, high_freq_factor=8.0,
                                original_max_position_embeddings=2048)
FAMILIES = {
    "llama3": ("LlamaConfig", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0,
                                                   "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 8.0,
                                                   "original_max_position_embeddings": 2048},
                                   tie_word_embeddings=False), "llama", "llama-bpe"),
    "mistral": ("MistralConfig", dict(sliding_window=None, tie_word_embeddings=False), "llama", "llama-bpe"),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True), "qwen2", "qwen2"),
    "qwen3": ("Qwen3Config", dict(head_dim=24, tie_word_embeddings=True), "qwen3", "qwen2"),
}


def build_tokenizer(pre: str):
    """A byte-level BPE of a few hundred tokens, pre-tokenized the way the family's tokenizer is."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from backfill.engine.tokenizer import _LLAMA3_SPLIT, _QWEN2_SPLIT

    tokenizer = Tokenizer(models.BPE())
    split = _LLAMA3_SPLIT if pre == "llama-bpe" else _QWEN2_SPLIT
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=360, special_tokens=SPECIALS + ["<|start_header_id|>",
                                                                           "<|end_header_id|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def hf_config(family: str, vocab_size: int):
    """The family's transformers config at a tiny size."""
    import transformers

    cls_name, extra, _, _ = FAMILIES[family]
    return getattr(transformers, cls_name)(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=3, eos_token_id=4,
        **extra)


def hf_model(family: str, vocab_size: int, seed: int = 0):
    """A tiny transformers model of the family with every weight random (biases and norms too)."""
    import transformers

    config = hf_config(family, vocab_size)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.5)
            elif param.dim() == 1:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.2)  # peaked logits: no near-ties for greedy decoding to flip on
    return model


def write_hf_dir(directory: Path, model, tokenizer, family: str, max_shard_size: str | None = None) -> Path:
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kwargs)
    tokenizer.save(str(directory / "tokenizer.json"))
    llama = FAMILIES[family][3] == "llama-bpe"
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False,
              "bos_token": "<|begin_of_text|>" if llama else None,
              "eos_token": "<|eot_id|>" if llama else "<|im_end|>",
              "chat_template": LLAMA3_CHAT if llama else CHATML}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def _gguf_tensor_name(hf: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    layer_names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                   "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                   "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
                   "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down"}
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{layer_names[module]}.{kind}"


def write_gguf(path: Path, model, tokenizer, family: str, rope_freqs: torch.Tensor | None = None) -> Path:
    """The model as llama.cpp's converter writes it: arch-prefixed metadata, Q/K rows permuted for the
    llama architecture only, tied LM heads left out, Llama 3's RoPE scaling as a rope_freqs tensor."""
    _, _, arch, pre = FAMILIES[family]
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rope = getattr(c, "rope_parameters", None) or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(head_dim)
    vocab = tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda item: item[1])]
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    specials = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    w.add_token_types([3 if t in specials else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    llama = pre == "llama-bpe"
    w.add_bos_token_id(vocab["<|begin_of_text|>"] if llama else vocab["<|endoftext|>"])
    w.add_eos_token_id(vocab["<|eot_id|>"] if llama else vocab["<|im_end|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(LLAMA3_CHAT if llama else CHATML)
    state = {k: v.detach().float() for k, v in model.state_dict().items()}
    if c.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for name, tensor in state.items():
        if arch == "llama" and name.endswith("q_proj.weight"):
            tensor = permute_qk(tensor, c.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            tensor = permute_qk(tensor, c.num_key_value_heads)
        w.add_tensor(_gguf_tensor_name(name), np.ascontiguousarray(tensor.numpy().astype(np.float32)))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    model.generation_config.eos_token_id = None  # as backfill's ignore_eos: always new_tokens tokens
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()
