"""One request's life inside the scheduler: tokens, KV blocks, host checkpoint, output text."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

import torch

from backfill.engine.kv_pool import HostBlocks
from backfill.engine.lora import LoraAdapter
from backfill.engine.prefix_cache import BlockHash
from backfill.engine.runner import make_generator
from backfill.policy.interface import SeqView
from backfill.types import FinishReason, GenerationRequest, RequestClass


class Detokenizer(Protocol):
    def push(self, token_ids: list[int]) -> str: ...


class SeqStatus(enum.Enum):
    WAITING = "waiting"    # holds no device blocks
    RUNNING = "running"    # holds device blocks
    FINISHED = "finished"


@dataclass
class HostCheckpoint:
    """Host copies of a sequence's KV, one entry per logical block; the last may be partial. None
    for a block other requests shared when it was copied: re-found in the prefix cache on restore."""

    blocks: list[HostBlocks | None] = field(default_factory=list)
    num_tokens: int = 0


@dataclass
class Sequence:
    request: GenerationRequest
    detokenizer: Detokenizer | None = None
    adapter: LoraAdapter | None = None  # resolved from request.adapter when the request was added
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: SeqStatus = SeqStatus.WAITING
    checkpoint: HostCheckpoint = field(default_factory=HostCheckpoint)
    generator: torch.Generator | None = None
    text: str = ""
    emitted_text_len: int = 0
    finish_reason: FinishReason | None = None
    first_token_s: float | None = None
    first_scheduled_s: float | None = None   # when a step first ran it (its queue time ends)
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0
    num_restored_tokens: int = 0
    # Prefix caching: content addresses of its first full blocks (prompt, then output), as far as
    # computed; how many leading blocks of block_table are registered in (or mapped from) the cache;
    # whether its first schedule looked the prompt up, and the prompt tokens found cached there.
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_registered_blocks: int = 0
    prefix_looked_up: bool = False
    num_cached_tokens: int = 0

    def __post_init__(self) -> None:
        self.generator = make_generator(self.request.sampling)

    @property
    def seq_id(self) -> str:
        return self.request.request_id

    @property
    def request_class(self) -> RequestClass:
        return self.request.request_class

    @property
    def is_online(self) -> bool:
        return self.request.request_class is RequestClass.ONLINE

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_token_ids) + len(self.output_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        prompt = self.request.prompt_token_ids
        if end <= len(prompt):
            return prompt[start:end]
        return (prompt + self.output_ids)[start:end]

    @property
    def cache_key(self) -> str:
        """What besides its tokens sets its KV apart (the adapter's load), for block addresses."""
        return self.adapter.cache_key if self.adapter is not None else ""

    def view(self, suspended: bool, num_cached_tokens: int = 0, next_block_key: BlockHash | None = None) -> SeqView:
        """This request as the policy sees it; suspended: its tokens are in the suspended step;
        num_cached_tokens: what a prefix-cache hit would map when it is next scheduled;
        next_block_key: the address of the next full prompt block it would compute."""
        request = self.request
        return SeqView(request.request_id, request.request_class, request.arrival_time, len(self.prompt_ids),
                       self.num_tokens, self.num_computed, len(self.block_table), self.status is SeqStatus.RUNNING,
                       self.checkpoint.num_tokens, request.sampling.max_tokens, len(self.output_ids),
                       self.first_token_s, suspended, num_cached_tokens, next_block_key)

    def append_token(self, token: int, now_s: float, eos_token_ids: tuple[int, ...],
                     max_model_len: int) -> FinishReason | None:
        """Add a sampled token and its text; the reason the request ends with it, if it does."""
        params = self.request.sampling
        if self.first_token_s is None:
            self.first_token_s = now_s
        self.output_ids.append(token)
        stop_ids = params.stop_token_ids + (() if params.ignore_eos else eos_token_ids)
        if token in stop_ids and len(self.output_ids) > params.min_tokens:
            return FinishReason.STOP
        before = len(self.text)
        self.append_text([token])
        cut = self.find_stop_string(params.stop, len(self.text) - before)
        if cut is not None:
            if params.include_stop_str_in_output:   # vLLM's field: the stop string found there is kept
                cut += max(len(s) for s in params.stop if self.text.startswith(s, cut))
            self.text = self.text[:cut]
            return FinishReason.STOP
        if len(self.output_ids) >= params.max_tokens or self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None

    def append_text(self, token_ids: list[int]) -> None:
        if self.detokenizer is not None:
            self.text += self.detokenizer.push(token_ids)

    def find_stop_string(self, stops: tuple[str, ...], new_text_len: int) -> int | None:
        """Index in self.text where the earliest stop string begins, looking only at new text."""
        if not stops:
            return None
        longest = max(len(s) for s in stops)
        window_start = max(0, len(self.text) - new_text_len - longest + 1)
        hits = [i for s in stops if (i := self.text.find(s, window_start)) >= 0]
        return min(hits) if hits else None

    def take_text_delta(self, stops: tuple[str, ...], final: bool) -> str:
        """New text to stream; holds back a tail that could still grow into a stop string."""
        end = len(self.text)
        if stops and not final:
            end = max(self.emitted_text_len, end - (max(len(s) for s in stops) - 1))
        delta = self.text[self.emitted_text_len:end]
        self.emitted_text_len = end
        return delta
