import os

# BACKFILL_TEST_DEVICE=cuda runs the engine and scheduler tests on a GPU (never required).
TEST_DEVICE = os.environ.get("BACKFILL_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu":
    # The Triton kernels' tests run in Triton's interpreter on CPU; it is read when triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from backfill.engine.config import ModelConfig  # noqa: E402


@pytest.fixture(scope="session")
def device() -> str:
    return TEST_DEVICE


@pytest.fixture(scope="session")
def tiny_config() -> ModelConfig:
    return ModelConfig.tiny()


@pytest.fixture(scope="session")
def hf_default_model():
    """HF transformers' own reading of the embedded default model's GGUF (float32, eval, no grads):
    the reference the real-model tests compare with. Loaded once a session, since transformers
    dequantizes the GGUF in Python (about 20 s on 2 cores). Tests only run it, never change it."""
    pytest.importorskip("accelerate")  # transformers needs it to read a GGUF
    transformers = pytest.importorskip("transformers")
    from backfill.engine.default_model import default_model_path

    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    model.requires_grad_(False)
    return model


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)
    yield


def random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random Llama weights under HF names (std 0.02 for matrices, ones for norms)."""
    g = torch.Generator().manual_seed(seed)
    hd = cfg.head_dim

    def mat(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) * (3.0 / cols ** 0.5)

    w = {"model.embed_tokens.weight": torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g),
         "model.norm.weight": torch.ones(cfg.hidden_size)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(cfg.hidden_size)
        w[p + "post_attention_layernorm.weight"] = torch.ones(cfg.hidden_size)
        w[p + "self_attn.q_proj.weight"] = mat(cfg.num_heads * hd, cfg.hidden_size)
        w[p + "self_attn.k_proj.weight"] = mat(cfg.num_kv_heads * hd, cfg.hidden_size)
        w[p + "self_attn.v_proj.weight"] = mat(cfg.num_kv_heads * hd, cfg.hidden_size)
        w[p + "self_attn.o_proj.weight"] = mat(cfg.hidden_size, cfg.num_heads * hd)
        w[p + "mlp.gate_proj.weight"] = mat(cfg.intermediate_size, cfg.hidden_size)
        w[p + "mlp.up_proj.weight"] = mat(cfg.intermediate_size, cfg.hidden_size)
        w[p + "mlp.down_proj.weight"] = mat(cfg.hidden_size, cfg.intermediate_size)
    return w


@pytest.fixture()
def tiny_runner(tiny_config):
    """A tiny random model with a 64-block pool (block size 8)."""
    from backfill.engine.kv_pool import KVBlockPool
    from backfill.engine.model import LlamaModel
    from backfill.engine.runner import ModelRunner
    return ModelRunner(LlamaModel(tiny_config, random_weights(tiny_config), device=TEST_DEVICE),
                       KVBlockPool(tiny_config, 64, 8, device=TEST_DEVICE))


def prefill_then_decode(runner, prompts: list[list[int]], blocks_each: int, steps: int = 3) -> torch.Tensor:
    """Prefill each prompt alone, then `steps` decode steps of all together, fed fixed tokens (the
    same on every runner, so rounding cannot flip a greedy choice): logits [steps, len(prompts), vocab].
    The blocks are freed again."""
    from backfill.engine.step import SeqChunk
    tables = [runner.kv.allocate(blocks_each) for _ in prompts]
    try:
        for i, (ids, table) in enumerate(zip(prompts, tables)):
            runner.execute([SeqChunk(i, ids, 0, table)])
        return torch.stack([runner.execute([SeqChunk(i, [40 + s + i], len(ids) + s, table)
                                            for i, (ids, table) in enumerate(zip(prompts, tables))]).logits
                            for s in range(steps)])
    finally:
        for table in tables:
            runner.kv.free(table)
