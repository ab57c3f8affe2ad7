import json

import pytest

from backfill.bench.traces import load_azure, load_burstgpt, load_mooncake, load_trace, parse_azure_timestamp
from backfill.errors import TraceFormatError

BURSTGPT = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,ChatGPT,1087,0,1087,Conversation log
118,GPT-4,417,276,693,API log
125,ChatGPT,1360,135,1495,Conversation log
"""

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.0000000,879,31
2023-11-16 18:16:00,100,20
"""


def test_burstgpt_rebased_scaled_and_failed_rows_skipped(tmp_path):
    p = tmp_path / "burst.csv"
    p.write_text(BURSTGPT)
    t = load_burstgpt(p, speedup=2.0)
    assert [r.arrival_s for r in t.records] == [0.0, 56.5, 60.0]
    assert [(r.prompt_tokens, r.output_tokens) for r in t.records] == [(472, 18), (417, 276), (1360, 135)]
    assert t.format == "burstgpt" and t.duration_s == 60.0


def test_burstgpt_model_filter_and_max_requests(tmp_path):
    p = tmp_path / "burst.csv"
    p.write_text(BURSTGPT)
    t = load_burstgpt(p, model="ChatGPT", max_requests=1)
    assert len(t) == 1 and t.records[0].prompt_tokens == 472
    assert [r.output_tokens for r in load_burstgpt(p, model="ChatGPT").records] == [18, 135]


def test_azure_seven_digit_fractions(tmp_path):
    p = tmp_path / "azure.csv"
    p.write_text(AZURE)
    t = load_azure(p)
    assert [r.arrival_s for r in t.records] == pytest.approx([0.0, 4.314579, 4.31941, 13.31941], abs=1e-9)
    assert t.records[2].prompt_tokens == 879 and t.records[2].output_tokens == 31


def test_azure_timestamp_with_utc_offset():
    plain = parse_azure_timestamp("2024-05-10 00:00:00.0099300")
    offset = parse_azure_timestamp("2024-05-10 02:00:00.00993+02:00")
    assert plain == offset
    assert plain[1] == pytest.approx(0.00993)


def test_mooncake_ms_timestamps_and_hash_ids(tmp_path):
    p = tmp_path / "mooncake.jsonl"
    rows = [{"timestamp": 1000, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48]},
            {"timestamp": 0, "input_length": 6472, "output_length": 26},
            {"timestamp": 3500, "input_length": 100, "output_length": 7, "hash_ids": []}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    t = load_mooncake(p, speedup=0.5)
    assert [r.arrival_s for r in t.records] == [0.0, 2.0, 7.0]  # sorted, re-based, slowed down 2x
    assert t.records[1].hash_ids == (46, 47, 48) and t.records[0].hash_ids is None


def test_format_detection(tmp_path):
    for name, text, fmt in (("a.csv", AZURE, "azure"), ("b.csv", BURSTGPT, "burstgpt")):
        p = tmp_path / name
        p.write_text(text)
        assert load_trace(p).format == fmt
    p = tmp_path / "c.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1}\n')
    assert load_trace(p).format == "mooncake"


@pytest.mark.parametrize("name,text,line", [
    ("b.csv", BURSTGPT.replace("118,GPT-4,417", "118,GPT-4,many"), 4),
    ("b.csv", BURSTGPT.replace("125,ChatGPT,1360,135,1495,Conversation log", "125,ChatGPT,1360"), 5),
    ("b.csv", BURSTGPT.replace("45,ChatGPT", "-45,ChatGPT"), 3),
    ("b.csv", "Time,Model\n1,x\n", 1),
    ("a.csv", AZURE.replace("2023-11-16 18:15:50.9951690", "16/11/2023 18:15"), 3),
    ("a.csv", AZURE.replace("2023-11-16 18:15:51.0000000", "2023-02-30 18:15:51"), 4),
    ("a.csv", AZURE.replace(",396,", ",39.5,"), 3),
    ("m.jsonl", '{"timestamp": 0, "input_length": 1, "output_length": 1}\n{"timestamp": 5,\n', 2),
    ("m.jsonl", '{"timestamp": 0, "input_length": 1, "output_length": 1}\n{"timestamp": 5, "input_length": 2}\n', 2),
    ("m.jsonl", '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": "x"}\n', 1),
    ("m.jsonl", '[1, 2]\n', 1),
])
def test_malformed_rows_name_file_and_line(tmp_path, name, text, line):
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(TraceFormatError, match=rf"{name}:{line}:"):
        load_trace(p)


def test_empty_missing_and_unknown(tmp_path):
    p = tmp_path / "e.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(TraceFormatError, match="no usable requests"):
        load_azure(p)
    with pytest.raises(TraceFormatError, match="no such trace file"):
        load_trace(tmp_path / "nope.csv", "azure")
    with pytest.raises(TraceFormatError, match="unknown trace format"):
        load_trace(p, "sharegpt")
    p.write_text(AZURE)
    with pytest.raises(TraceFormatError, match="speedup"):
        load_azure(p, speedup=0)
