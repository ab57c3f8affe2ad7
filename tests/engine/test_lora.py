"""LoRA adapters in the engine's forward against transformers + peft, alone and in mixed batches."""

import json

import pytest
import torch

from backfill.engine.config import ModelConfig
from backfill.engine.kv_pool import KVBlockPool
from backfill.engine.lora import AdapterRegistry, LoraBatch, load_adapter
from backfill.engine.model import LlamaModel
from backfill.engine.runner import ModelRunner
from backfill.engine.step import SeqChunk
from backfill.errors import AdapterLoadError, UnknownAdapterError

pytest.importorskip("transformers")
pytest.importorskip("peft")

from lora_helpers import ALL_TARGETS, make_peft_adapter  # noqa: E402
from lora_helpers import hf_llama as hf_model  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cfg = ModelConfig.tiny()
    base = hf_model(cfg)
    weights = {k: v.clone() for k, v in base.state_dict().items()}
    root = tmp_path_factory.mktemp("adapters")
    peft_a = make_peft_adapter(hf_model(cfg), root / "a", 4, 8, ALL_TARGETS, seed=1)
    peft_b = make_peft_adapter(hf_model(cfg), root / "b", 8, 4, ["q_proj", "v_proj", "down_proj"], seed=2)
    runner = ModelRunner(LlamaModel(cfg, weights), KVBlockPool(cfg, num_blocks=128, block_size=8))
    runner.adapters.load("a", root / "a")
    runner.adapters.load("b", root / "b")
    return cfg, base, {"a": peft_a, "b": peft_b}, runner, root


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def run(runner, ids: list[int], adapter: str | None, decode_tokens: list[int] = ()) -> list[torch.Tensor]:
    """Prefill ids then decode decode_tokens one by one; the logits after each step."""
    table = runner.kv.allocate(runner.kv.blocks_needed(len(ids) + len(decode_tokens)))
    lora = runner.adapters.get(adapter) if adapter else None
    out = [runner.execute([SeqChunk("s", ids, 0, table, adapter=lora)]).logits[0]]
    for i, token in enumerate(decode_tokens):
        out.append(runner.execute([SeqChunk("s", [token], len(ids) + i, table, adapter=lora)]).logits[0])
    runner.kv.free(table)
    return out


def test_adapter_logits_match_peft(setup):
    cfg, base, peft_models, runner, _ = setup
    ids, extra = prompt(21, 0), prompt(3, 1)
    for name, model in peft_models.items():
        got = run(runner, ids, name, extra)
        for i, logits in enumerate(got):
            want = reference_logits(model, ids + extra[:i])[-1]
            torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
        # The adapter changes the output: the test would fail if it were not applied.
        assert (got[0] - reference_logits(base, ids)[-1]).abs().max() > 1e-2
    base_logits = run(runner, ids, None)[0]
    torch.testing.assert_close(base_logits, reference_logits(base, ids)[-1], atol=1e-4, rtol=1e-4)


def test_greedy_tokens_match_peft_generate(setup):
    _, _, peft_models, runner, _ = setup
    ids = prompt(9, 4)
    model = peft_models["a"]
    with torch.no_grad():
        want = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=8, do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
    lora = runner.adapters.get("a")
    table = runner.kv.allocate(runner.kv.blocks_needed(len(ids) + 8))
    tokens, feed, pos = [], ids, 0
    for _ in range(8):
        logits = runner.execute([SeqChunk("g", feed, pos, table, adapter=lora)]).logits[0]
        pos += len(feed)
        feed = [int(logits.argmax())]
        tokens.append(feed[0])
    runner.kv.free(table)
    assert tokens == want


def test_mixed_batch_equals_each_alone(setup):
    """Base + two adapters, prefills and decodes, interleaved in one step: each row equals its run alone."""
    _, _, _, runner, _ = setup
    names = [None, "a", "b", "a", None]
    prompts = [prompt(n, 20 + n) for n in (6, 11, 17, 5, 9)]
    alone = [run(runner, p[:-1], name, p[-1:])[-1] for p, name in zip(prompts, names)]
    alone_prefill = [run(runner, p, name)[0] for p, name in zip(prompts, names)]
    tables = [runner.kv.allocate(runner.kv.blocks_needed(len(p))) for p in prompts]
    adapters = [runner.adapters.get(n) if n else None for n in names]
    # Rows 0, 1, 3 are prefilled and decode; rows 2 and 4 prefill in the same step as they do.
    for i in (0, 1, 3):
        runner.execute([SeqChunk(i, prompts[i][:-1], 0, tables[i], want_logits=False, adapter=adapters[i])])
    chunks = [SeqChunk(i, prompts[i][-1:], len(prompts[i]) - 1, tables[i], adapter=adapters[i]) for i in (0, 1)]
    chunks += [SeqChunk(2, prompts[2], 0, tables[2], adapter=adapters[2]),
               SeqChunk(3, prompts[3][-1:], len(prompts[3]) - 1, tables[3], adapter=adapters[3]),
               SeqChunk(4, prompts[4], 0, tables[4], adapter=adapters[4])]
    out = runner.execute(chunks)
    assert out.logit_seq_ids == [0, 1, 2, 3, 4]
    # "a" has two runs (rows 1 and 3, not adjacent): the gathered path; "b" one: the sliced path.
    for row, want in enumerate([alone[0], alone[1], alone_prefill[2], alone[3], alone_prefill[4]]):
        torch.testing.assert_close(out.logits[row], want, atol=1e-4, rtol=1e-4)
    for t in tables:
        runner.kv.free(t)


def test_batch_groups_spans_by_adapter(setup):
    _, _, _, runner, _ = setup
    a, b = runner.adapters.get("a"), runner.adapters.get("b")
    assert LoraBatch.from_spans([(None, 0, 3), (None, 3, 1)], torch.device("cpu")) is None
    batch = LoraBatch.from_spans([(a, 0, 3), (a, 3, 2), (None, 5, 1), (b, 6, 2), (a, 8, 1)], torch.device("cpu"))
    groups = {adapter.name: rows for adapter, rows in batch.groups}
    assert groups["b"] == slice(6, 8)
    assert groups["a"].tolist() == [0, 1, 2, 3, 4, 8]


def test_base_only_steps_carry_no_lora(setup):
    _, _, _, runner, _ = setup
    _, meta, _ = runner._prepare([SeqChunk("x", [5, 6, 7], 0, [0])])
    assert meta.lora is None


def test_rslora_and_partial_layers(setup, tmp_path):
    cfg, _, _, _, _ = setup
    model = make_peft_adapter(hf_model(cfg), tmp_path / "r", 4, 16, ["o_proj", "up_proj"], seed=3,
                              use_rslora=True, layers_to_transform=[1, 2])
    adapter = load_adapter(tmp_path / "r", "r", cfg, torch.float32)
    assert adapter.scale == pytest.approx(16 / 2) and adapter.target_modules == ("o_proj", "up_proj")
    assert not adapter.layers[0] and set(adapter.layers[1]) == {"o", "gate_up"}
    weights = {k: v.clone() for k, v in hf_model(cfg).state_dict().items()}
    runner = ModelRunner(LlamaModel(cfg, weights), KVBlockPool(cfg, num_blocks=16, block_size=8))
    runner.adapters.load("r", tmp_path / "r")
    ids = prompt(13, 7)
    torch.testing.assert_close(run(runner, ids, "r")[0], reference_logits(model, ids)[-1], atol=1e-4, rtol=1e-4)


def test_registry_errors(setup, tmp_path):
    cfg, _, _, runner, root = setup
    registry = AdapterRegistry(cfg, torch.float32, torch.device("cpu"))
    with pytest.raises(AdapterLoadError, match="does not exist"):
        registry.load("x", tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterLoadError, match="adapter_config.json"):
        registry.load("x", tmp_path / "empty")
    registry.load("a", root / "a")
    with pytest.raises(AdapterLoadError, match="already loaded"):
        registry.load("a", root / "b")
    assert registry.load("a", root / "b", replace=True).rank == 8
    assert registry.unload("a").name == "a" and registry.names() == []
    with pytest.raises(UnknownAdapterError, match="'a'"):
        registry.get("a")
    with pytest.raises(UnknownAdapterError):
        registry.unload("a")


@pytest.mark.parametrize("change, message", [
    ({"r": 0}, "r must be a positive integer"),
    ({"target_modules": ["q_proj", "lm_head"]}, "lm_head"),
    ({"use_dora": True}, "use_dora"),
    ({"peft_type": "IA3"}, "not LORA"),
])
def test_bad_configs_are_refused(setup, tmp_path, change, message):
    cfg, _, _, _, root = setup
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((root / "a" / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, **change}))
    (bad / "adapter_model.safetensors").write_bytes((root / "a" / "adapter_model.safetensors").read_bytes())
    with pytest.raises(AdapterLoadError, match=message):
        load_adapter(bad, "bad", cfg, torch.float32)


def test_adapter_for_another_model_is_refused(setup, tmp_path):
    _, _, _, _, root = setup
    wider = ModelConfig.tiny(hidden_size=128, intermediate_size=256)
    with pytest.raises(AdapterLoadError, match="expected"):
        load_adapter(root / "a", "a", wider, torch.float32)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "adapter_config.json").write_text((root / "a" / "adapter_config.json").read_text())
    (tmp_path / "x" / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(AdapterLoadError, match="unreadable"):
        load_adapter(tmp_path / "x", "x", ModelConfig.tiny(), torch.float32)
