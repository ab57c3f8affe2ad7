"""Per-token cost of two grammar libraries on the default model's tokenizer: mask + advance.

Replays the tokens of a valid JSON document under its schema through llguidance and xgrammar
and times, per token, computing the allowed-token mask and advancing the grammar (what the
sampler does per constrained row). Also the one-off grammar compile time.

    flock /tmp/bench.lock .venv/bin/python scripts/grammar_library_cost.py --json docs/results/grammar-libraries.json

xgrammar comes with the [profile] extra (`pip install -e '.[profile]'`); llguidance is a runtime dependency.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from backfill.engine.weights import load_model

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "email": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "email", "tags", "address"]}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines", "poetry"],
            "address": {"city": "London", "zip": "W1"}}


def time_llguidance(tokenizer, token_ids: list[int], vocab: int, rounds: int) -> dict:
    import llguidance
    import llguidance.torch as lltorch
    started = time.perf_counter()
    lltok = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab, eos_token=tokenizer.eos_token_id)
    tokenizer_s = time.perf_counter() - started
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    per_token, compile_s = [], []
    bitmask = lltorch.allocate_token_bitmask(1, vocab)
    for _ in range(rounds):
        started = time.perf_counter()
        matcher = llguidance.LLMatcher(lltok, grammar)
        compile_s.append(time.perf_counter() - started)
        for token in token_ids:
            t0 = time.perf_counter()
            lltorch.fill_next_token_bitmask(matcher, bitmask)
            assert matcher.consume_token(token), matcher.get_error()
            per_token.append(time.perf_counter() - t0)
    return {"tokenizer_s": tokenizer_s, "compile_ms_median": statistics.median(compile_s) * 1e3,
            "per_token_us_median": statistics.median(per_token) * 1e6,
            "per_token_us_p99": sorted(per_token)[int(0.99 * len(per_token))] * 1e6}


def time_xgrammar(tokenizer, token_ids: list[int], vocab: int, rounds: int) -> dict:
    import xgrammar as xgr
    started = time.perf_counter()
    pieces = tokenizer.backend.get_vocab(with_added_tokens=True)
    encoded = [""] * vocab
    for piece, index in pieces.items():
        encoded[index] = piece
    info = xgr.TokenizerInfo(encoded, vocab_type=xgr.VocabType.BYTE_LEVEL, vocab_size=vocab,
                             stop_token_ids=[tokenizer.eos_token_id])
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    tokenizer_s = time.perf_counter() - started
    per_token, compile_s = [], []
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    for _ in range(rounds):
        started = time.perf_counter()
        matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False))
        compile_s.append(time.perf_counter() - started)
        for token in token_ids:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            assert matcher.accept_token(token)
            per_token.append(time.perf_counter() - t0)
    return {"tokenizer_s": tokenizer_s, "compile_ms_median": statistics.median(compile_s) * 1e3,
            "per_token_us_median": statistics.median(per_token) * 1e6,
            "per_token_us_p99": sorted(per_token)[int(0.99 * len(per_token))] * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = load_model(None).tokenizer
    token_ids = tokenizer.encode(json.dumps(DOCUMENT)) + [tokenizer.eos_token_id]
    vocab = tokenizer.vocab_size
    result = {"model_vocab": vocab, "tokens_per_document": len(token_ids), "rounds": args.rounds,
              "llguidance": time_llguidance(tokenizer, token_ids, vocab, args.rounds),
              "xgrammar": time_xgrammar(tokenizer, token_ids, vocab, args.rounds)}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
