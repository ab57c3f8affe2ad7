"""Grammar-constrained decoding: a per-request token mask from a grammar, advanced per token.

    compiler = GrammarCompiler.for_tokenizer(tokenizer, vocab_size)   # once per model (about 1 s)
    grammar = compiler.json_schema({"type": "object"})              # or regex / choice / lark
    compiler.check(grammar)                                          # InvalidGrammarError, before queueing
    constraint = compiler.constraint(grammar)                        # one per request (one per choice)

The sampler (in engine/runner.py) asks a constraint for the allowed tokens before it picks a row's
token and tells it the token after; the grammar itself is llguidance's, chosen over xgrammar for
its grammar compile time per request at a per-token cost that is negligible next to a decode step
(docs/server.md, structured output). Once the grammar is complete only end-of-sequence is allowed,
so the request stops as it would on EOS.
"""

from __future__ import annotations

import json

import llguidance
import llguidance.torch as lltorch
import torch

from backfill.errors import InvalidRequestError

# Whitespace in generated JSON is fixed: a small model given free whitespace can emit newlines
# until max_tokens; these separators are what json.dumps writes and what models see in training.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class InvalidGrammarError(InvalidRequestError):
    """A schema, regex or grammar the grammar library cannot compile."""


class GrammarConstraint:
    """One request's grammar state (an llguidance matcher) and its mask buffer."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_token_id: int) -> None:
        self._matcher = matcher
        self._bitmask = lltorch.allocate_token_bitmask(1, vocab_size)
        self._bits = torch.arange(32, dtype=torch.int32)
        self._eos = eos_token_id

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None

    @property
    def done(self) -> bool:
        return self._matcher.is_stopped()

    def allowed_tokens(self, vocab_size: int) -> torch.Tensor:
        allowed = torch.zeros(vocab_size, dtype=torch.bool)
        if self._matcher.is_error():
            # A grammar that broke (it never should: the mask allows only what it accepts) ends the
            # request rather than letting it run unconstrained.
            allowed[self._eos] = True
            return allowed
        lltorch.fill_next_token_bitmask(self._matcher, self._bitmask)
        bits = ((self._bitmask[0].unsqueeze(-1) >> self._bits) & 1).flatten().bool()
        width = min(vocab_size, bits.numel())
        allowed[:width] = bits[:width]
        return allowed

    def accept(self, token_id: int) -> None:
        if not self._matcher.is_stopped() and not self._matcher.is_error():
            self._matcher.consume_token(token_id)


class GrammarCompiler:
    """Grammars for one tokenizer: builds, checks and instantiates them."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, vocab_size: int, eos_token_id: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int) -> "GrammarCompiler":
        """From backfill's Tokenizer (a `tokenizers` backend) or the byte tokenizer of tiny test models."""
        eos = tokenizer.eos_token_id
        backend = getattr(tokenizer, "backend", None)
        if backend is not None:
            return cls(llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos), vocab_size, eos)
        return cls(llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary(vocab_size, eos,
                                                                                      tokenizer.bos_token_id))),
                   vocab_size, eos)

    @staticmethod
    def json_schema(schema: dict | bool) -> str:
        if not isinstance(schema, (dict, bool)):
            raise InvalidGrammarError("a JSON schema must be an object")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        except ValueError as exc:
            raise InvalidGrammarError(f"invalid JSON schema: {exc}") from None

    @staticmethod
    def regex(pattern: str) -> str:
        return llguidance.LLMatcher.grammar_from_regex(pattern)

    @staticmethod
    def choice(options: list[str]) -> str:
        if not options:
            raise InvalidGrammarError("choice needs at least one option")
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))

    @staticmethod
    def lark(grammar: str) -> str:
        """A Lark grammar (llguidance's dialect), or a GBNF one (`rule ::= ...`, llama.cpp's and
        vLLM's EBNF), converted."""
        if "::=" in grammar:
            from llguidance.gbnf_to_lark import gbnf_to_lark
            try:
                grammar = gbnf_to_lark(grammar)
            except Exception as exc:  # the converter raises bare exceptions on syntax errors
                raise InvalidGrammarError(f"invalid GBNF grammar: {exc}") from None
        return llguidance.LLMatcher.grammar_from_lark(grammar)

    def check(self, grammar: str) -> None:
        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise InvalidGrammarError(error.strip())

    def constraint(self, grammar: str) -> GrammarConstraint:
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidGrammarError(matcher.get_error().strip())
        return GrammarConstraint(matcher, self.vocab_size, self.eos_token_id)


class _ByteVocabulary:
    """The byte tokenizer's vocabulary as llguidance reads it: ids 3..255 are bytes, the rest special."""

    def __init__(self, vocab_size: int, eos_token_id: int, bos_token_id: int | None) -> None:
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id
        self.tokens = [bytes([i]) if 3 <= i < 256 else b"\xff[" + str(i).encode() + b"]" for i in range(vocab_size)]
        self.special_token_ids = [i for i in range(vocab_size) if not 3 <= i < 256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)
