"""Turns logits into tokens, each row with its own SamplingParams and random generator.

Order of the logits processors as in vLLM: penalties (repetition, then frequency and presence)
on the raw logits, then temperature, top-k, top-p and min-p. Logprobs are the raw model's
(log_softmax of the logits before any of them), as vLLM returns by default. A row with a
constraint (a grammar, engine/grammar.py) has the tokens it disallows masked out first, and the
constraint is advanced past the token picked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from backfill.engine.sampling_params import SamplingParams, TokenLogprob

if TYPE_CHECKING:  # the grammar library (llguidance) loads only where a request is constrained
    from backfill.engine.device_sampler import DeviceSampler
    from backfill.engine.grammar import TokenConstraint


# Below this, logits / temperature overflows float32; such a temperature means greedy (as in vLLM).
_MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class Pick:
    token_id: int
    logprob: TokenLogprob | None = None


@dataclass(frozen=True)
class History:
    """The tokens a row has seen: penalties read them."""

    prompt_ids: Sequence[int]
    output_ids: Sequence[int]


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A per-request generator: a seeded request samples the same tokens whatever it is batched with."""
    if params.greedy:
        return None
    gen = torch.Generator(device="cpu")
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed)
    return gen


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """logits [N, vocab] fp32 -> one token per row (no penalties, no logprobs)."""
    return [pick.token_id for pick in sample_picks(logits, params, generators)]


def sample_picks(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                 histories: list[History | None] | None = None,
                 constraints: list[TokenConstraint | None] | None = None,
                 device_sampler: DeviceSampler | None = None) -> list[Pick]:
    """logits [N, vocab] -> one Pick per row; histories[i] is needed where params[i].penalized;
    constraints[i], where given, limits row i's choice and is advanced past it.

    With a device sampler, a step whose rows it can all take is sampled where the logits are."""
    if device_sampler is not None and not any(c is not None for c in constraints or ()):
        from backfill.engine.device_sampler import fits

        if fits(params):
            return [Pick(token) for token in device_sampler.sample(logits, params, generators)]
    logits = logits.float().cpu()
    constraints = constraints or [None] * len(params)
    plain = [not p.penalized and p.temperature < _MIN_TEMPERATURE and c is None for p, c in zip(params, constraints)]
    greedy_tokens = logits.argmax(dim=-1).tolist() if any(plain) else []
    raw_logprobs = (torch.log_softmax(logits, dim=-1) if any(p.logprobs is not None for p in params) else None)
    out: list[Pick] = []
    for row, (p, gen) in enumerate(zip(params, generators)):
        if plain[row]:
            token = greedy_tokens[row]
        else:
            scores = logits[row]
            if p.penalized:
                history = histories[row] if histories is not None else None
                if history is None:
                    raise ValueError("a penalized row needs its token history")
                scores = apply_penalties(scores, p, history)
            if constraints[row] is not None:
                allowed = constraints[row].allowed_tokens(scores.shape[-1])
                scores = scores.masked_fill(~allowed, float("-inf"))
            token = int(scores.argmax().item()) if p.temperature < _MIN_TEMPERATURE else _sample_row(scores, p, gen)
        logprob = _logprob(raw_logprobs[row], token, p.logprobs) if raw_logprobs is not None and \
            p.logprobs is not None else None
        if constraints[row] is not None:
            constraints[row].accept(token)
        out.append(Pick(token, logprob))
    return out


def apply_penalties(logits: torch.Tensor, p: SamplingParams, history: History) -> torch.Tensor:
    """vLLM's repetition, frequency and presence penalties on one row of raw logits."""
    scores = logits.clone()
    vocab = scores.shape[-1]
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({t for t in (*history.prompt_ids, *history.output_ids) if t < vocab}),
                            dtype=torch.long)
        if len(seen):
            picked = scores[seen]
            scores[seen] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
    if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and len(history.output_ids):
        ids = torch.tensor([t for t in history.output_ids if t < vocab], dtype=torch.long)
        counts = torch.bincount(ids, minlength=vocab).to(scores.dtype)
        scores -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(scores.dtype)
    return scores


def _logprob(row_logprobs: torch.Tensor, token: int, num_top: int) -> TokenLogprob:
    top: tuple[tuple[int, float], ...] = ()
    if num_top > 0:
        values, ids = torch.topk(row_logprobs, num_top)
        top = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(row_logprobs[token]), top)


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    scores = logits / p.temperature
    if p.top_k > 0 and p.top_k < scores.shape[-1]:
        kth = torch.topk(scores, p.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = probs.cumsum(dim=-1) - probs >= p.top_p
        # Explicitly: a top_p below float32's range (1e-300) rounds to 0, and 0 >= 0 would drop it.
        drop[0] = False
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
    probs = torch.softmax(scores, dim=-1)
    if p.min_p > 0.0:
        # min-p: keep tokens at least min_p times as likely as the most likely one (vLLM).
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return int(torch.multinomial(probs, 1, generator=gen).item())
