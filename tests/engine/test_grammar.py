"""Grammar constraints in the sampler: every sampled token keeps the output inside the grammar."""

from __future__ import annotations

import json
import re

import pytest
import torch

from backfill.engine.byte_tokenizer import ByteTokenizer
from backfill.engine.grammar import GrammarCompiler, InvalidGrammarError
from backfill.engine.runner import History, make_generator, sample_picks
from backfill.sampling_params import SamplingParams

VOCAB = 260


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler.for_tokenizer(ByteTokenizer(VOCAB), VOCAB)


def generate(compiler, grammar: str, params: SamplingParams, steps: int = 80, seed: int = 0) -> str:
    """Sample from random logits under the grammar until it allows only EOS."""
    constraint = compiler.constraint(grammar)
    torch.manual_seed(seed)
    generator = make_generator(params)
    out = []
    for _ in range(steps):
        pick = sample_picks(torch.randn(1, VOCAB) * 3, [params], [generator], [History([5], out)],
                            constraints=[constraint])[0]
        if pick.token_id == ByteTokenizer.eos_token_id:
            break
        out.append(pick.token_id)
    assert constraint.done and constraint.error is None
    return bytes(out).decode("utf-8")


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=80),
                                    SamplingParams(temperature=1.0, seed=3, max_tokens=80),
                                    SamplingParams(temperature=0.7, top_p=0.9, presence_penalty=1.0, max_tokens=80)])
def test_sampled_output_matches_the_regex(compiler, params):
    text = generate(compiler, compiler.regex(r"[0-9]{3}-[a-z]{2,4}"), params)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text), text


def test_json_schema_output_parses_and_validates(compiler):
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
              "required": ["color", "ok"], "additionalProperties": False}
    for seed in range(3):
        value = json.loads(generate(compiler, compiler.json_schema(schema), SamplingParams(seed=seed), seed=seed))
        assert value["color"] in ("red", "green") and isinstance(value["ok"], bool)


def test_choice_and_lark(compiler):
    assert generate(compiler, compiler.choice(["yes", "no way"]), SamplingParams(seed=1)) in ("yes", "no way")
    assert generate(compiler, compiler.lark('start: "a" "b"+ "c"'), SamplingParams(seed=2)).startswith("ab")
    assert generate(compiler, compiler.lark('root ::= "x" | "y"'), SamplingParams(seed=2)) in ("x", "y")


def test_mask_allows_only_what_the_grammar_accepts(compiler):
    constraint = compiler.constraint(compiler.choice(["ab"]))
    allowed = constraint.allowed_tokens(VOCAB)
    assert allowed.nonzero().flatten().tolist() == [ord("a")]
    constraint.accept(ord("a"))
    constraint.accept(ord("b"))
    assert constraint.allowed_tokens(VOCAB).nonzero().flatten().tolist() == [ByteTokenizer.eos_token_id]


def test_unconstrained_rows_are_untouched(compiler):
    logits = torch.randn(2, VOCAB)
    constraint = compiler.constraint(compiler.choice(["z"]))
    params = [SamplingParams.greedy_params(), SamplingParams.greedy_params()]
    picks = sample_picks(logits, params, [None, None], constraints=[None, constraint])
    assert picks[0].token_id == int(logits[0].argmax()) and picks[1].token_id == ord("z")


@pytest.mark.parametrize("build, value", [("regex", "[a-"), ("lark", "start: undefined_rule"),
                                          ("json_schema", {"type": "object", "properties": {"a": {"type": "strin"}}})])
def test_bad_grammar_is_a_typed_error(compiler, build, value):
    with pytest.raises(InvalidGrammarError):
        compiler.check(getattr(compiler, build)(value))
