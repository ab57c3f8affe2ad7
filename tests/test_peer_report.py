"""scripts/peer_report.py: backfill against the faster of vLLM's two core splits, level by level."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _report_module():
    spec = importlib.util.spec_from_file_location("peer_report", ROOT / "scripts" / "peer_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bursts(path: Path, rates: dict[int, float]) -> None:
    levels = [{"concurrency": c, "tokens_per_s": r, "mean_ttft_ms": 100.0 * c, "p50_tpot_ms": 20.0}
              for c, r in rates.items()]
    path.write_text(json.dumps({"levels": levels}))


def test_each_level_is_compared_with_the_faster_vllm(tmp_path):
    _bursts(tmp_path / "burst-backfill.json", {1: 70.0, 64: 300.0})
    _bursts(tmp_path / "burst-backfill-avx2.json", {1: 35.0, 64: 150.0})
    _bursts(tmp_path / "burst-vllm.json", {1: 30.0, 64: 400.0})          # both cores
    _bursts(tmp_path / "burst-vllm-1core.json", {1: 35.0, 64: 200.0})    # its default
    doc = _report_module().build(tmp_path)
    one, many = doc["bursts"]
    assert (one["best_vllm"], one["best_vllm_tok_s"], one["backfill_over_vllm_tok_s"]) == ("vllm-1core", 35.0, 2.0)
    assert (many["best_vllm"], many["best_vllm_tok_s"], many["backfill_over_vllm_tok_s"]) == ("vllm", 400.0, 0.75)
    assert many["backfill_avx2_over_backfill_tok_s"] == 0.5
    table = _report_module().markdown(doc)
    assert "| 64 | 400.0 (6400) | 200.0 (6400) | 400.0 (6400) vllm | 300.0 (6400) | 0.75 | 150.0 (6400) | 0.50 |" in table


def test_a_missing_part_is_left_out(tmp_path):
    _bursts(tmp_path / "burst-backfill.json", {8: 250.0})
    doc = _report_module().build(tmp_path)
    (row,) = doc["bursts"]
    assert row["best_vllm"] is None and row["backfill_over_vllm_tok_s"] is None
    assert "| 8 | - | - | - | 250.0 (800) | - | - | - |" in _report_module().markdown(doc)


def test_llama_server_gets_its_own_table_beside_backfill(tmp_path):
    _bursts(tmp_path / "burst-backfill.json", {1: 60.0, 64: 320.0})
    _bursts(tmp_path / "burst-llamacpp.json", {1: 40.0, 64: 80.0})
    doc = _report_module().build(tmp_path)
    assert [r["backfill_over_llamacpp_tok_s"] for r in doc["bursts"]] == [1.5, 4.0]
    table = _report_module().markdown(doc)
    assert "llama-server on the same GGUF" in table and "| 64 | 80.0 (6400) | 320.0 (6400) | 4.00 |" in table
    doc = _report_module().build(tmp_path / "none") if (tmp_path / "none").mkdir() is None else None
    assert "llama-server" not in _report_module().markdown(doc)


def test_avx2_forced_backfill_is_compared_with_the_faster_avx2_vllm(tmp_path):
    _bursts(tmp_path / "burst-backfill-avx2.json", {1: 36.0, 64: 160.0})
    _bursts(tmp_path / "burst-vllm-avx2.json", {1: 12.0, 64: 40.0})        # bf16
    _bursts(tmp_path / "burst-vllm-avx2-fp32.json", {1: 18.0, 64: 200.0})  # fp32
    doc = _report_module().build(tmp_path)
    one, many = doc["bursts"]
    assert (one["best_vllm_avx2"], one["backfill_avx2_over_vllm_avx2_tok_s"]) == ("vllm-avx2-fp32", 2.0)
    assert (many["best_vllm_avx2_tok_s"], many["backfill_avx2_over_vllm_avx2_tok_s"]) == (200.0, 0.8)
    table = _report_module().markdown(doc)
    assert "AVX2 forced on both" in table and "| 64 | 40.0 (6400) | 200.0 (6400) | 160.0 (6400) | 0.80 |" in table
    (tmp_path / "none").mkdir()
    assert "AVX2 forced on both" not in _report_module().markdown(_report_module().build(tmp_path / "none"))


def test_on_a_cpu_without_avx512_vllms_fp32_run_is_the_peer_when_it_is_its_fastest(tmp_path):
    _bursts(tmp_path / "burst-backfill.json", {1: 47.0, 64: 160.0})
    _bursts(tmp_path / "burst-vllm-avx2-fp32.json", {1: 29.0, 64: 200.0})  # native there: no bf16 run
    _bursts(tmp_path / "burst-vllm.json", {1: 14.0, 64: 28.0})             # its bf16 default, slower
    one, many = _report_module().build(tmp_path)["bursts"]
    assert (one["best_vllm"], one["best_vllm_tok_s"]) == ("vllm-avx2-fp32", 29.0)
    assert (many["best_vllm"], many["backfill_over_vllm_tok_s"]) == ("vllm-avx2-fp32", 0.8)
    assert "| 200.0 (6400) vllm-avx2-fp32 | 160.0 (6400) | 0.80 |" in _report_module().markdown(
        _report_module().build(tmp_path))
