"""Executes one scheduled step: a mixed batch of prefill chunks and decode tokens.

The runner is the schedulers' whole view of the model: give it chunks (which tokens of which
sequence, where its KV blocks are), optionally a safepoint called between layers, and get
logits back - or StepOutput.aborted when the safepoint said stop. Block allocation and host
copies go through `runner.kv` (KVBlockPool).

Then the sampler (`sample_picks`, at the end of this module) turns the step's logits into tokens,
each row with its own SamplingParams and random generator. Order of the logits processors as in
vLLM: penalties (repetition, then frequency and presence) on the raw logits, then temperature,
top-k, top-p and min-p. Logprobs are the raw model's (log_softmax of the logits before any of
them), as vLLM returns by default. A row with a constraint (a grammar, engine/grammar.py) has the
tokens it disallows masked out first, and the constraint is advanced past the token picked.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from backfill.engine.config import ModelConfig, SafepointLayout
from backfill.engine.kv_pool import KVBlockPool
from backfill.engine.model import LAYER_STRETCH_SHARES, AttentionMetadata, LlamaModel, PrefillSpan
from backfill.engine.step import Safepoint, SeqChunk, StepAborted, SuspendedStep
from backfill.sampling_params import SamplingParams, TokenConstraint, TokenLogprob

if TYPE_CHECKING:
    from backfill.engine.cuda_graphs import DecodeGraphs
    from backfill.engine.device_sampler import DeviceSampler
    from backfill.engine.lora import AdapterRegistry


# Safepoint checks the CPU may run ahead of the GPU's progress (see paced_on_gpu).
GPU_RUN_AHEAD_CHECKS = 1


def paced_on_gpu(safepoint: Safepoint) -> Safepoint:
    """The safepoint, called only once the GPU has finished all work from before the previous check.

    Kernels launch asynchronously: unpaced, the CPU passes every safepoint of a big step within a
    few milliseconds and then waits in synchronize() for the rest of it, blind to arrivals (ConServe
    §4.3 needs the check to see the step's progress). One check of run-ahead
    keeps an interval of work queued, so a GPU-bound step never starves, while an abort leaves at most
    that interval to finish; a launch-bound step finds its events done and never waits.
    """
    pending: deque[torch.cuda.Event] = deque()

    def paced(layer: int) -> bool:
        event = torch.cuda.Event()
        event.record()
        pending.append(event)
        if len(pending) > GPU_RUN_AHEAD_CHECKS:
            pending.popleft().synchronize()
        return safepoint(layer)

    return paced


@dataclass
class StepOutput:
    logits: torch.Tensor | None          # [N, vocab] fp32, rows in order of chunks wanting logits
    logit_seq_ids: list[int | str]
    aborted: bool = False
    aborted_at_layer: int | None = None
    duration_s: float = 0.0
    num_tokens: int = 0
    suspended: SuspendedStep | None = None  # an aborted step that can be continued from its safepoint
    extra: dict = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVBlockPool, decode_graphs: DecodeGraphs | None = None) -> None:
        """decode_graphs: run the decode steps that fit it through captured CUDA graphs
        (backfill/engine/cuda_graphs.py); None runs every step eagerly."""
        if kv.dtype != model.dtype:
            # A bf16 model on a CPU without bf16 matmul kernels computes in fp32 (engine/linear.py).
            raise ValueError(f"the KV cache is {kv.dtype} but the model computes in {model.dtype}: "
                             f"build the pool with the model's dtype")
        self.model = model
        self.kv = kv
        self.device = model.device
        self.decode_graphs = decode_graphs
        # Samples on the logits' device where a step's rows allow (engine/device_sampler.py); None: on the host.
        self.device_sampler: DeviceSampler | None = None
        self._adapters: AdapterRegistry | None = None

    @property
    def adapters(self) -> AdapterRegistry:
        """The LoRA adapters this runner serves, by name (created on first use)."""
        if self._adapters is None:
            from backfill.engine.lora import AdapterRegistry

            # In the activations' dtype: a bf16 model on a CPU without bf16 GEMMs computes in fp32.
            self._adapters = AdapterRegistry(self.config, self.model.dtype, self.device)
        return self._adapters

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def warming_up(self) -> bool:
        """True while compiled decode's padded buckets still compile in the background."""
        compiled = self.model.compiled_decode
        return compiled is not None and compiled.compiling_buckets

    def wait_until_warm(self, timeout_s: float | None = None) -> None:
        """Block until the background compile ends: a measurement then starts as a server that
        reports ready (/ready) does."""
        if self.model.compiled_decode is not None:
            self.model.compiled_decode.wait_for_buckets(timeout_s)

    @property
    def decode_run_batches(self) -> tuple[int, ...]:
        """The batch sizes this runner's decode steps run their weight matmuls at (ascending): a
        decode of b sequences runs at the smallest that holds b, above them at b (HARLI's stage 1
        is evaluated there). The CUDA-graph buckets where graphs replay decode, else the model's."""
        if self.decode_graphs is not None:
            from backfill.engine.cuda_graphs import BATCH_BUCKETS

            return BATCH_BUCKETS
        return self.model.decode_run_batches

    @property
    def safepoint_layout(self) -> SafepointLayout:
        return SafepointLayout(self.config.num_layers, max(LAYER_STRETCH_SHARES))

    def execute(self, chunks: list[SeqChunk], safepoint: Safepoint | None = None,
                resume: SuspendedStep | None = None) -> StepOutput:
        """Run one step; with resume, continue that aborted step (the same chunks) from its safepoint."""
        start = time.perf_counter()
        if not chunks:
            return StepOutput(None, [], duration_s=0.0)
        # Steps with a LoRA adapter run eagerly: the captured graphs hold the base model only.
        graphed = (resume is None and self.decode_graphs is not None and self.decode_graphs.fits(chunks)
                   and not any(chunk.adapter is not None for chunk in chunks))
        if graphed:
            for chunk in chunks:
                self._check(chunk)
            input_ids, meta, logit_ids = None, None, [chunk.seq_id for chunk in chunks if chunk.want_logits]
        elif resume is None:
            input_ids, meta, logit_ids = self._prepare(chunks)
        else:
            (input_ids, meta), logit_ids = resume.prepared, list(resume.logit_ids)
        num_tokens = sum(len(c.token_ids) for c in chunks) if graphed else int(input_ids.shape[0])
        if safepoint is not None and self.device.type == "cuda":
            safepoint = paced_on_gpu(safepoint)
        try:
            if graphed:
                logits = self.decode_graphs.forward(chunks, safepoint)
            else:
                logits = self.model.forward(input_ids, meta, self.kv, safepoint, resume=resume)
        except StepAborted as abort:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the step has yielded once its queued kernels are done
            duration_s = time.perf_counter() - start
            suspended = abort.suspended
            if suspended is not None:
                ran_s = (resume.ran_s if resume is not None else 0.0) + duration_s
                suspended.attach_batch(chunks, (input_ids, meta), logit_ids, ran_s)
            return StepOutput(None, [], aborted=True, aborted_at_layer=abort.layer,
                              duration_s=duration_s, num_tokens=num_tokens, suspended=suspended)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return StepOutput(logits, logit_ids, duration_s=time.perf_counter() - start, num_tokens=num_tokens)

    def _check(self, chunk: SeqChunk) -> None:
        """ValueError for a chunk the step cannot run: no tokens, past the context, short block table."""
        end = chunk.start_pos + len(chunk.token_ids)
        if not chunk.token_ids:
            raise ValueError(f"chunk for sequence {chunk.seq_id} has no tokens")
        if end > self.config.max_position_embeddings:
            raise ValueError(f"sequence {chunk.seq_id} reaches position {end} beyond "
                             f"{self.config.max_position_embeddings}")
        if len(chunk.block_table) * self.kv.block_size < end:
            raise ValueError(f"sequence {chunk.seq_id}: block table holds {len(chunk.block_table) * self.kv.block_size} "
                             f"tokens, step needs {end}")

    def _prepare(self, chunks: list[SeqChunk]) -> tuple[torch.Tensor, AttentionMetadata, list]:
        bs = self.kv.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_index: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSpan] = []
        prefill_tables: list[list[int]] = []
        logits_index: list[int] = []
        logit_ids: list[int | str] = []
        adapter_spans = []
        for chunk in chunks:
            self._check(chunk)
            n = len(chunk.token_ids)
            end = chunk.start_pos + n
            first = len(ids)
            ids.extend(chunk.token_ids)
            if chunk.adapter is not None:
                adapter_spans.append((chunk.adapter, first, n))
            for p in range(chunk.start_pos, end):
                positions.append(p)
                slots.append(chunk.block_table[p // bs] * bs + p % bs)
            if chunk.is_decode:
                decode_index.append(first)
                decode_tables.append(chunk.block_table[: -(-end // bs)])
                decode_lens.append(end)
            else:
                used = chunk.block_table[: -(-end // bs)]
                prefill_tables.append(used)
                prefills.append(PrefillSpan(first, n, chunk.start_pos,
                                            torch.tensor(used, dtype=torch.long, device=self.device)))
            if chunk.want_logits:
                logits_index.append(first + n - 1)
                logit_ids.append(chunk.seq_id)
        dev = self.device
        meta = AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            decode_token_index=None, decode_block_tables=None, decode_key_mask=None,
            prefills=prefills,
            logits_index=torch.tensor(logits_index, dtype=torch.long, device=dev),
        )
        if prefills and self.model.paged_prompt_attention is not None:
            width = max(len(t) for t in prefill_tables)
            meta.prefill_spans = torch.tensor([(span.token_start, span.num_tokens, span.start_pos) for span in prefills],
                                              dtype=torch.long, device=dev)
            meta.prefill_block_tables = torch.tensor([t + [0] * (width - len(t)) for t in prefill_tables],
                                                     dtype=torch.long, device=dev)
        if adapter_spans:
            from backfill.engine.lora import LoraBatch

            meta.lora = LoraBatch.from_spans(adapter_spans, dev)
        if decode_index:
            width = max(len(t) for t in decode_tables)
            padded = [t + [0] * (width - len(t)) for t in decode_tables]
            meta.decode_token_index = torch.tensor(decode_index, dtype=torch.long, device=dev)
            meta.decode_block_tables = torch.tensor(padded, dtype=torch.long, device=dev)
            lens = torch.tensor(decode_lens, dtype=torch.long, device=dev).unsqueeze(1)
            meta.decode_context_lens = lens.view(-1)
            if self.model.paged_decode_attention is None:  # the kernel reads the lengths, SDPA a mask
                # Additive, in the model's dtype, built once per step: SDPA would turn a boolean
                # mask into this in every layer.
                key_pos = torch.arange(width * bs, device=dev).unsqueeze(0)
                padding = (key_pos >= lens).view(len(decode_index), 1, 1, width * bs)
                meta.decode_key_mask = torch.zeros(padding.shape, dtype=self.model.dtype,
                                                   device=dev).masked_fill_(padding, float("-inf"))
        return torch.tensor(ids, dtype=torch.long, device=dev), meta, logit_ids


# --- the sampler: logits -> tokens ----------------------------------------------------------------

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
