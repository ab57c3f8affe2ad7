"""Prompts of an exact token count, cut from a bundled text with the caller's tokenizer.

The engine takes token ids and an HTTP server takes text, so each prompt carries both, and
they agree: encode(text) == token_ids whenever the tokenizer round-trips (checked, with a
few repair rounds for merges across the cut; `Prompt.text_exact` says whether it held).

Prompt i depends only on (seed, i): it starts with a short unique tag ("17. ") and
continues from a random offset of the text, wrapping around. The tag keeps two requests from
ever sharing a prefix block by accident, so a prefix cache cannot flatter the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from typing import Protocol

import numpy as np

from backfill.errors import WorkloadError

_REPAIR_ROUNDS = 8


class TokenizerLike(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class Prompt:
    token_ids: tuple[int, ...]
    text: str
    text_exact: bool  # encode(text) == token_ids


def bundled_corpus() -> str:
    """The few-KB public-domain-style text shipped in backfill/bench/data/corpus.txt."""
    return resources.files("backfill.bench").joinpath("data/corpus.txt").read_text(encoding="utf-8")


class PromptSource:
    """Builds prompt i of n tokens, deterministically from (seed, i)."""

    def __init__(self, tokenizer: TokenizerLike, *, seed: int = 0, corpus: str | None = None) -> None:
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise WorkloadError(f"seed must be a non-negative integer, got {seed!r}")
        self.tokenizer = tokenizer
        self.seed = seed
        text = bundled_corpus() if corpus is None else corpus
        self._corpus_ids = np.asarray(self._encode(" ".join(text.split())), dtype=np.int64)
        if len(self._corpus_ids) < 16:
            raise WorkloadError(f"the prompt corpus encodes to only {len(self._corpus_ids)} tokens; need >= 16")

    @property
    def corpus_tokens(self) -> int:
        return len(self._corpus_ids)

    def prompt(self, index: int, num_tokens: int) -> Prompt:
        if not isinstance(num_tokens, (int, np.integer)) or isinstance(num_tokens, bool) or num_tokens < 1:
            raise WorkloadError(f"a prompt needs at least 1 token, got {num_tokens!r}")
        if not isinstance(index, (int, np.integer)) or index < 0:
            raise WorkloadError(f"prompt index must be a non-negative integer, got {index!r}")
        n = int(num_tokens)
        rng = np.random.default_rng([self.seed, int(index)])
        cursor = int(rng.integers(len(self._corpus_ids)))
        tag = self._encode(f"{int(index)}. ")
        ids = (tag + self._take(cursor, n))[:n]
        cursor += n
        for _ in range(_REPAIR_ROUNDS):
            text = self.tokenizer.decode(list(ids))
            again = self._encode(text)
            if again == ids:
                return Prompt(tuple(ids), text, True)
            if len(again) >= n:
                ids = again[:n]
            else:
                ids = again + self._take(cursor, n - len(again))
                cursor += n - len(again)
        return Prompt(tuple(ids), self.tokenizer.decode(list(ids)), False)

    def _take(self, start: int, n: int) -> list[int]:
        idx = (start + np.arange(n)) % len(self._corpus_ids)
        return [int(t) for t in self._corpus_ids[idx]]

    def _encode(self, text: str) -> list[int]:
        # HF-style tokenizers add BOS by default; a benchmark prompt must be plain text tokens.
        try:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        except TypeError:
            ids = self.tokenizer.encode(text)
        return [int(t) for t in ids]
