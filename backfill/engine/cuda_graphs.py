"""Decode steps replayed from captured CUDA graphs: one graph per layer, per (batch, context) bucket.

On a GPU a decode step of a small model is bound by kernel launches from Python (hundreds per
step), not by memory: the step takes many times the time its weights take to read (docs/gpu.md
has the figures). Replaying a captured graph launches a layer's kernels in one call.
The graphs are per layer, not per step, so the scheduler's safepoint still runs between two layers
(ConServe §4.3: an offline step yields at the next layer) and an abort leaves the KV pool as the
eager path leaves it: the uncommitted positions written so far are overwritten when the step is redone.

A step that no safepoint may stop (an online or co-serving step: ConServe §4.3 preempts only
offline work) has no use for the layer boundaries, so each bucket also holds one graph of the
whole step, replayed in one call where the per-layer graphs take num_layers + 1; steps with a
safepoint replay the per-layer ones.

A graph replays fixed shapes at fixed addresses. A step of b sequences runs in the smallest batch
bucket >= b; the extra rows decode token 0 at position 0 into a scratch block taken from the pool
once, so they never touch a live sequence's KV. Block tables are padded to a power-of-two bucket
and the key mask hides everything past each sequence's context. The serving stack captures every
bucket its context limit can reach at load (`capture_all`), biggest first as vLLM does, so that no
online step pays for a capture: built on first use, a bucket cost its step tens of milliseconds, and
the first requests after start-up, the online-only baseline's among them, took those stalls.

Mixed steps (`mixed=True`): a step of decodes beside prompt chunks, up to BATCH_BUCKETS[-1] tokens
in all, replays the same buckets with one row per token: a prompt token at position p is a row
that attends to its sequence's first p + 1 keys, through the same block table as the sequence's
other rows. Every layer writes all rows' K and V before its attention reads them, so within a
chunk each token sees the tokens before it, as causal attention does. Without these graphs any
step with a prompt token runs eagerly, so a co-serving step could carry an offline prompt only at
an eager step's cost (ConServe §4.2 Algorithm 1 fills the step with prompt chunks). Full graphs,
not piecewise ones (dense parts graphed, attention eager between them), because both decode
attentions here (gather + SDPA with a key mask, and the Triton paged kernel) take any mix of
context lengths at fixed shapes, and the eager prefill attention, one SDPA per chunk with shapes
that change every step, would keep a step's launches and host time between the pieces. The cost:
a prompt token reads its context as a decode does, not once per tile of a chunk as prefill
attention does, which the bucket limit keeps small.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

from backfill.engine.kv_pool import KVBlockPool
from backfill.engine.model import AttentionMetadata, LlamaModel
from backfill.engine.step import Safepoint, StepAborted

if TYPE_CHECKING:
    from backfill.engine.step import SeqChunk

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MIN_BLOCKS_BUCKET = 4


def batch_bucket(batch: int) -> int | None:
    """The smallest captured batch size that holds batch sequences; None above the largest."""
    return next((b for b in BATCH_BUCKETS if b >= batch), None)


def blocks_bucket(blocks: int) -> int:
    """Block-table width for a step whose longest sequence spans `blocks` blocks: a power of two."""
    width = MIN_BLOCKS_BUCKET
    while width < blocks:
        width *= 2
    return width


@dataclass(frozen=True)
class StepRows:
    """A step as the buckets' rows: one per token, each with its position and its sequence's table."""

    token_ids: list[int]
    positions: list[int]
    tables: list[list[int]]
    logit_rows: list[int]  # the last row of each chunk that wants logits, in the chunks' order


def step_rows(chunks: list[SeqChunk]) -> StepRows:
    """One row per token of the step: a decode is one row, a prompt chunk of n tokens n rows."""
    ids: list[int] = []
    positions: list[int] = []
    tables: list[list[int]] = []
    logit_rows: list[int] = []
    for c in chunks:
        ids.extend(c.token_ids)
        positions.extend(range(c.start_pos, c.start_pos + len(c.token_ids)))
        tables.extend([c.block_table] * len(c.token_ids))
        if c.want_logits:
            logit_rows.append(len(ids) - 1)
    return StepRows(ids, positions, tables, logit_rows)


class _StaticBatch:
    """The fixed tensors one bucket's graphs read and write, and a pinned host copy of the step's
    integers so a step's inputs reach the device in one asynchronous copy."""

    def __init__(self, model: LlamaModel, kv: KVBlockPool, batch: int, blocks: int, logits: torch.Tensor) -> None:
        cfg, dev = model.config, model.device
        self.batch, self.blocks, self.block_size = batch, blocks, kv.block_size
        sizes = [batch] * 4 + [batch * blocks]  # ids, positions, slots, context lengths, block tables
        self.host = torch.zeros(sum(sizes), dtype=torch.long, pin_memory=dev.type == "cuda")
        self.ints = torch.zeros(sum(sizes), dtype=torch.long, device=dev)
        self.input_ids, positions, slots, context_lens, tables = self.ints.split(sizes)
        self.copied = torch.cuda.Event() if dev.type == "cuda" else None
        key_slots = blocks * kv.block_size
        self.key_positions = torch.arange(key_slots, device=dev)
        rows = torch.arange(batch, device=dev)
        self.meta = AttentionMetadata(
            positions=positions, slot_mapping=slots, decode_token_index=rows,
            decode_block_tables=tables.view(batch, blocks),
            decode_key_mask=torch.zeros(batch, 1, 1, key_slots, dtype=model.dtype, device=dev),
            prefills=[], logits_index=rows, decode_context_lens=context_lens)
        self.hidden = torch.zeros(batch, cfg.hidden_size, dtype=model.dtype, device=dev)
        self.normed = torch.zeros_like(self.hidden)  # triton layers: the next matmul's normed input
        self.cos = torch.zeros(batch, 1, cfg.head_dim, dtype=model.dtype, device=dev)
        self.sin = torch.zeros_like(self.cos)
        self.logits = logits  # [batch, vocab] fp32, shared by the batch's buckets: one step runs at a time

    def stage(self, token_ids: list[int], positions: list[int], tables: list[list[int]], scratch_block: int) -> None:
        """Write one step's integers (rows past len(token_ids) are padding) and start their copy."""
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy has read the host buffer
        host, b, n, bs = self.host.numpy(), self.batch, len(token_ids), self.block_size
        ids, pos, slots, ctx = (host[i * b:(i + 1) * b] for i in range(4))
        rows = host[4 * b:].reshape(b, self.blocks)
        ids[:] = 0
        pos[:] = 0
        slots[:] = scratch_block * bs
        ctx[:] = 1
        rows[:] = scratch_block
        ids[:n] = token_ids
        pos[:n] = positions
        ctx[:n] = [p + 1 for p in positions]
        for i, (p, table) in enumerate(zip(positions, tables)):
            slots[i] = table[p // bs] * bs + p % bs
            used = p // bs + 1
            rows[i, :used] = table[:used]
        self.ints.copy_(self.host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()


@dataclass
class _Bucket:
    batch: _StaticBatch
    runs: list[Callable[[], None]]  # graph replays, or the parts themselves where nothing is captured
    whole: Callable[[], None]  # the whole step in one replay (or all parts in turn), for steps without a safepoint


class DecodeGraphs:
    """Runs decode-only steps of up to BATCH_BUCKETS[-1] sequences through per-layer graphs, and
    with mixed=True any step of up to BATCH_BUCKETS[-1] tokens (decodes beside prompt chunks).

    capture=False runs the same fixed-shape parts eagerly (any device): tests on CPU check the
    padding and bucketing that the graphs replay.
    """

    def __init__(self, model: LlamaModel, kv: KVBlockPool, capture: bool | None = None,
                 whole_step: bool = True, mixed: bool = False) -> None:
        self.capture = model.device.type == "cuda" if capture is None else capture
        self.whole_step = whole_step  # False: steps without a safepoint also replay the per-layer graphs
        self.mixed = mixed  # steps with prompt chunks replay the buckets too (module doc)
        self.whole_step_runs = 0  # steps run as one graph (tests and benchmarks read it)
        self.mixed_runs = 0  # replayed steps with a prompt token or a row that wants no logits
        if self.capture and model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {model.device}")
        self.model, self.kv = model, kv
        # One block of the pool is the padding rows' scratch for good: the scheduler sees one block fewer.
        self.scratch_block = kv.allocate(1)[0]
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        # One logits buffer per batch size, not per bucket: with a large vocabulary it is the
        # biggest static tensor (64 x 128k fp32 is 32 MiB), and a batch has a bucket per context width.
        self._logits: dict[int, torch.Tensor] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None

    @property
    def captured_buckets(self) -> list[tuple[int, int]]:
        """(batch, blocks) buckets built so far."""
        return sorted(self._buckets)

    def capture_all(self, max_context_tokens: int) -> int:
        """Build every (batch, blocks) bucket a decode within max_context_tokens can use; returns
        how many buckets exist. Biggest first: smaller graphs then reuse the shared pool's memory."""
        widest = blocks_bucket(-(-max_context_tokens // self.kv.block_size))
        widths = [MIN_BLOCKS_BUCKET]
        while widths[-1] < widest:
            widths.append(widths[-1] * 2)
        for batch in reversed(BATCH_BUCKETS):
            for blocks in reversed(widths):
                self._bucket(batch, blocks)
        return len(self._buckets)

    @staticmethod
    def _is_decode_step(chunks: list[SeqChunk]) -> bool:
        return all(c.is_decode and c.want_logits for c in chunks)

    def fits(self, chunks: list[SeqChunk]) -> bool:
        """Whether this step fits a bucket: a decode of sequences that all want logits, or with
        mixed steps on, any step of at most BATCH_BUCKETS[-1] tokens."""
        if not chunks or sum(len(c.token_ids) for c in chunks) > BATCH_BUCKETS[-1]:
            return False
        return self.mixed or self._is_decode_step(chunks)

    def forward(self, chunks: list[SeqChunk], safepoint: Safepoint | None = None) -> torch.Tensor:
        """fp32 logits [chunks wanting logits, vocab], in the chunks' order; raises
        StepAborted(layer) when the safepoint says stop."""
        bs = self.kv.block_size
        rows = step_rows(chunks)
        bucket = self._bucket(batch_bucket(len(rows.token_ids)), blocks_bucket(max(rows.positions) // bs + 1))
        bucket.batch.stage(rows.token_ids, rows.positions, rows.tables, self.scratch_block)
        decode_step = self._is_decode_step(chunks)
        self.mixed_runs += not decode_step
        if safepoint is None and self.whole_step:
            bucket.whole()
            self.whole_step_runs += 1
        else:
            for i, run in enumerate(bucket.runs):
                # Run i is layer i; the last run (i == num_layers) is the LM head, as in the eager forward.
                if i > 0 and safepoint is not None and safepoint(i):
                    raise StepAborted(i)
                run()
        logits = bucket.batch.logits
        if decode_step:  # every row wants its logits, in order
            return logits[:len(chunks)].clone()
        return logits.index_select(0, torch.tensor(rows.logit_rows, dtype=torch.long, device=logits.device))

    def _bucket(self, batch: int, blocks: int) -> _Bucket:
        key = (batch, blocks)
        if key not in self._buckets:
            self._buckets[key] = self._build(batch, blocks)
        return self._buckets[key]

    def _build(self, batch: int, blocks: int) -> _Bucket:
        if batch not in self._logits:
            self._logits[batch] = torch.zeros(batch, self.model.config.vocab_size, dtype=torch.float32,
                                              device=self.model.device)
        static = _StaticBatch(self.model, self.kv, batch, blocks, self._logits[batch])
        num_layers = self.model.config.num_layers
        parts = ([lambda: (self._prologue(static), self._layer(0, static))]
                 + [lambda li=li: self._layer(li, static) for li in range(1, num_layers)]
                 + [lambda: self._head(static)])
        if not self.capture:
            return _Bucket(static, parts, lambda: [part() for part in parts])
        static.stage([], [], [], self.scratch_block)  # all padding: warm-up and capture touch only scratch
        # Warm up on a side stream first (cuBLAS workspaces, allocator), as capture requires.
        side = torch.cuda.Stream(self.model.device)
        side.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(side), torch.inference_mode():
            for part in parts:
                part()
        torch.cuda.current_stream(self.model.device).wait_stream(side)
        graphs = []
        with torch.inference_mode():
            for part in parts:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    part()
                graphs.append(graph)
            whole = None
            if self.whole_step:
                # The same parts once more in one graph; it shares the pool and the static tensors.
                whole = torch.cuda.CUDAGraph()
                with torch.cuda.graph(whole, pool=self._pool):
                    for part in parts:
                        part()
        log.info("captured decode graphs for batch %d, %d blocks", batch, blocks)
        return _Bucket(static, [graph.replay for graph in graphs],
                       whole.replay if whole is not None else lambda: [graph.replay() for graph in graphs])

    # The parts: the eager forward's decode math on fixed tensors (backfill/engine/model.py), or with
    # cuda_kernels="triton" the fused layer (backfill/engine/triton_fused.py), which carries each
    # layer's normed output to the next part in s.normed.
    @torch.inference_mode()
    def _prologue(self, s: _StaticBatch) -> None:
        m = self.model
        s.hidden.copy_(m.embed.index_select(0, s.input_ids))
        if m.cuda_kernels == "triton":  # RoPE reads the tables by position, attention the context lengths
            cfg = m.config
            s.normed.copy_(F.rms_norm(s.hidden, (cfg.hidden_size,), m.layers[0]["attn_norm"], cfg.rms_norm_eps))
            return
        s.cos.copy_(m.rope_cos.index_select(0, s.meta.positions).unsqueeze(1))
        s.sin.copy_(m.rope_sin.index_select(0, s.meta.positions).unsqueeze(1))
        padding = s.key_positions.unsqueeze(0) >= s.meta.decode_context_lens.unsqueeze(1)
        mask = s.meta.decode_key_mask
        mask.zero_().masked_fill_(padding.view(mask.shape), float("-inf"))

    @torch.inference_mode()
    def _layer(self, li: int, s: _StaticBatch) -> None:
        m, cfg = self.model, self.model.config
        if m.cuda_kernels == "triton":
            from backfill.engine.triton_fused import decode_layer

            next_norm = m.layers[li + 1]["attn_norm"] if li + 1 < cfg.num_layers else m.final_norm
            decode_layer(m, li, s.hidden, s.normed, s.meta, self.kv, next_norm)
            return
        layer = m.layers[li]
        n_q, hd = cfg.num_heads, cfg.head_dim
        rows = s.batch
        x = F.rms_norm(s.hidden, (cfg.hidden_size,), layer["attn_norm"], cfg.rms_norm_eps)
        q, k, v = m.split_qkv(layer, layer["qkv"](x), s.cos, s.sin)
        m._write_kv(li, k, v, s.meta, self.kv)
        attn = m._decode_attention(q, li, s.meta, self.kv).reshape(rows, n_q * hd)
        h = layer["o"].add_to(s.hidden, attn)
        x = F.rms_norm(h, (cfg.hidden_size,), layer["mlp_norm"], cfg.rms_norm_eps)
        gate, up = layer["gate_up"](x).chunk(2, dim=-1)
        s.hidden.copy_(layer["down"].add_to(h, F.silu(gate).mul_(up)))

    @torch.inference_mode()
    def _head(self, s: _StaticBatch) -> None:
        m, cfg = self.model, self.model.config
        if m.cuda_kernels == "triton":
            x = s.normed  # the last layer normed its output with the final norm
        else:
            x = F.rms_norm(s.hidden, (cfg.hidden_size,), m.final_norm, cfg.rms_norm_eps)
        s.logits.copy_(m.lm_head_logits(x))
