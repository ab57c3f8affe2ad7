"""Llama-family decoder over a paged KV cache, executed one layer at a time.

One forward pass takes a flattened mixed batch: every scheduled token of every sequence in
one [T] vector. Decoding sequences (one new token each) share one batched attention call;
sequences in (chunked) prefill attend one at a time. Between layers the caller's safepoint
may abort the pass (ConServe §4.3): the KV written so far belongs to positions the
scheduler has not committed, so it is simply overwritten when the work is redone. The abort
also carries where the pass stopped (a SuspendedStep), so the caller may continue it instead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

from backfill.engine.config import ModelConfig
from backfill.engine.kv_pool import KVBlockPool
from backfill.engine.linear import Linear, matmul_kernel_for
from backfill.engine.rope import apply_rope
from backfill.engine.step import Safepoint, StepAborted, SuspendedStep

if TYPE_CHECKING:
    from backfill.engine.compiled_decode import CompiledDecode, DecodePieces
    from backfill.engine.kernel_choice import KernelChoice
    from backfill.engine.lora import LoraBatch
    from backfill.engine.paged_attention import PagedDecodeAttention, PagedPromptAttention

log = logging.getLogger(__name__)


@dataclass
class PrefillSpan:
    """Tokens [token_start, token_start + num_tokens) of the flat batch belong to one sequence
    whose first new token sits at absolute position start_pos."""

    token_start: int
    num_tokens: int
    start_pos: int
    block_ids: torch.Tensor  # [blocks covering start_pos + num_tokens]


@dataclass
class AttentionMetadata:
    positions: torch.Tensor        # [T] absolute position of each token
    slot_mapping: torch.Tensor     # [T] flat KV slot (block * block_size + offset) of each token
    decode_token_index: torch.Tensor | None  # [Bd] where the decode tokens sit in the flat batch
    decode_block_tables: torch.Tensor | None  # [Bd, max_blocks] (padded with block 0)
    # [Bd, 1, 1, max_blocks * block_size], added to the scores: 0 = attend, -inf = padding
    # (None when the paged-attention kernel runs decode attention: it reads decode_context_lens)
    decode_key_mask: torch.Tensor | None
    prefills: list[PrefillSpan]
    logits_index: torch.Tensor     # [N] flat positions whose logits are wanted
    decode_context_lens: torch.Tensor | None = None  # [Bd] tokens each decoding sequence attends to
    lora: LoraBatch | None = None  # the step's LoRA adapters by token (engine/lora.py); None: base model only
    # The prefills as the prompt-attention kernel takes them (set where it runs): [S, 3] rows of
    # (token_start, num_tokens, start_pos), and their block tables [S, width] (padded with block 0).
    prefill_spans: torch.Tensor | None = None
    prefill_block_tables: torch.Tensor | None = None



LM_HEAD_SLICES = 4  # safepoints inside the LM head of an abortable step (see forward)
# A layer's work between its three safepoints (before attention, before gate/up, before down):
# the MLP is three quarters of a Llama layer's weights. The simulator spreads a step's time by it.
LAYER_STRETCH_SHARES = (0.25, 0.5, 0.25)


class LlamaModel:
    """Weights as plain tensors; no nn.Module machinery on the hot path (gpt-fast style)."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 compile_decode: bool = False, paged_attention_kernel: bool = False,
                 paged_prompt_kernel: bool = False, cuda_kernels: str = "torch") -> None:
        """cuda_kernels="triton": decode attention and the CUDA-graph decode layers run Triton kernels
        (engine/triton_attention.py, engine/triton_fused.py); any device, so tests run them on CPU in
        Triton's interpreter. The serving config asks for them on CUDA only."""
        if cuda_kernels not in ("torch", "triton"):
            raise ValueError(f"cuda_kernels must be torch or triton, got {cuda_kernels!r}")
        self.config = config
        self.cuda_kernels = cuda_kernels
        self.device = torch.device(device)
        kernel = matmul_kernel_for(self.device, dtype)
        # Activations and the KV cache are in the matmuls' dtype: a bf16 model on a CPU without bf16
        # matmul kernels keeps its weights' bf16 values and computes in fp32 (engine/linear.py).
        self.dtype = kernel.compute_dtype
        if self.device.type == "cuda" and torch.backends.cuda.cudnn_sdp_enabled():
            # PyTorch may send SDPA to cuDNN, which builds a plan for every new shape, and prefill
            # spans come in every length: a step of unseen lengths costs several planned ones
            # (docs/gpu.md has the figures). Process-wide.
            log.info("turning off cuDNN attention: it plans every new prefill shape anew")
            torch.backends.cuda.enable_cudnn_sdp(False)

        def weight(name: str) -> torch.Tensor:
            """A weight in the model's dtype (matmul weights: the Linears and compiled pieces take them so)."""
            return weights[name].to(device=self.device, dtype=dtype).contiguous()

        def w(name: str) -> torch.Tensor:
            """A weight as the activations use it (embeddings, norms): its dtype's values, in theirs."""
            return weight(name).to(self.dtype)

        self.matmul_kernel = kernel.name
        if kernel.upcast:
            log.info("no %s matmul kernels on this CPU: %s weights, computed in %s", dtype, dtype, kernel.compute_dtype)

        def linear(matrix: torch.Tensor) -> Linear:
            return Linear(matrix, kernel.packed, kernel.compute_dtype)

        self.embed = w("model.embed_tokens.weight")
        lm_head = self.embed if config.tie_word_embeddings else w("lm_head.weight")
        # The LM head reads the largest matrix of the model (the whole vocabulary); in slices with
        # a safepoint between them a pause or preemption never waits for all of it.
        slice_rows = -(-lm_head.shape[0] // LM_HEAD_SLICES)
        self.lm_head_slices = [Linear(part, kernel.packed, kernel.compute_dtype) for part in lm_head.split(slice_rows)]
        self.final_norm = w("model.norm.weight")
        self.layers = []
        plain_layers = []  # the [out, in] weights, kept only for compiled decode
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            # Fusing q/k/v and gate/up into one matmul each halves the kernel launches per layer.
            plain = dict(
                qkv=torch.cat([weight(p + "self_attn.q_proj.weight"), weight(p + "self_attn.k_proj.weight"),
                               weight(p + "self_attn.v_proj.weight")]),
                o=weight(p + "self_attn.o_proj.weight"),
                gate_up=torch.cat([weight(p + "mlp.gate_proj.weight"), weight(p + "mlp.up_proj.weight")]),
                down=weight(p + "mlp.down_proj.weight"))
            self.layers.append(dict(attn_norm=w(p + "input_layernorm.weight"),
                                    mlp_norm=w(p + "post_attention_layernorm.weight"),
                                    **{name: linear(matrix) for name, matrix in plain.items()},
                                    **self._attention_extras(p, w)))
            if compile_decode:
                plain_layers.append(plain)
        t = torch.arange(config.max_position_embeddings, dtype=torch.float64)
        freqs = torch.outer(t, config.rope_inv_freq())  # Llama 3's scaling, where the model has it
        emb = torch.cat([freqs, freqs], dim=-1)
        self.rope_cos = emb.cos().to(device=self.device, dtype=self.dtype)
        self.rope_sin = emb.sin().to(device=self.device, dtype=self.dtype)
        self.compiled_decode: CompiledDecode | None = None
        if compile_decode:
            self.compiled_decode = self._build_compiled_decode(plain_layers, lm_head.to(dtype))
        # Decode attention straight from the paged pool (CPU kernel); None: gather + SDPA.
        self.paged_decode_attention: PagedDecodeAttention | None = None
        if paged_attention_kernel and self.device.type == "cpu":
            from backfill.engine.paged_attention import load_paged_decode_attention

            self.paged_decode_attention = load_paged_decode_attention()
        # Prompt attention of every chunk of a step in one call per layer (CPU kernel); None: SDPA per chunk.
        self.paged_prompt_attention: PagedPromptAttention | None = None
        if paged_prompt_kernel and self.device.type == "cpu":
            from backfill.engine.paged_attention import load_paged_prompt_attention

            self.paged_prompt_attention = load_paged_prompt_attention()
        if cuda_kernels == "triton":
            from backfill.engine.triton_attention import paged_decode_attention

            self.paged_decode_attention = paged_decode_attention

    def _attention_extras(self, prefix: str, w: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        """Qwen2's q/k/v biases as one [q + k + v] vector; Qwen3's q and k norm weights as one
        [n_q + n_kv, head_dim] table, so the fused q/k/v output takes each in one op."""
        cfg, extras = self.config, {}
        if cfg.qkv_bias:
            extras["qkv_bias"] = torch.cat([w(prefix + f"self_attn.{n}_proj.bias") for n in "qkv"])
        if cfg.qk_norm:
            extras["qk_norm"] = torch.cat([w(prefix + "self_attn.q_norm.weight").expand(cfg.num_heads, -1),
                                           w(prefix + "self_attn.k_norm.weight").expand(cfg.num_kv_heads, -1)])
        return extras

    def split_qkv(self, layer: dict, qkv: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused projection's output [T, (n_q + 2 n_kv) hd] as q [T, n_q, hd] and k, v [T, n_kv, hd],
        with the bias, the q/k norm and RoPE applied (the eager forward and the CUDA-graph parts share it)."""
        cfg = self.config
        n_q, n_kv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if "qkv_bias" in layer:
            qkv = qkv + layer["qkv_bias"]
        qk = qkv[:, :(n_q + n_kv) * hd].view(-1, n_q + n_kv, hd)
        if "qk_norm" in layer:
            qk = F.rms_norm(qk, (hd,), None, cfg.rms_norm_eps) * layer["qk_norm"]
        # RoPE on q and k together: one rotation over n_q + n_kv heads.
        qk = apply_rope(qk, cos, sin)
        return qk[:, :n_q], qk[:, n_q:], qkv[:, (n_q + n_kv) * hd:].view(-1, n_kv, hd)

    def _build_compiled_decode(self, plain_layers: list[dict[str, torch.Tensor]],
                               lm_head: torch.Tensor) -> CompiledDecode | None:
        if self.device.type != "cpu":
            log.warning("compiled decode is built for CPU; %s decode stays eager", self.device)
            return None
        from backfill.engine.compiled_decode import CompiledDecode, DecodeLayer

        cfg = self.config
        if cfg.qkv_bias or cfg.qk_norm:
            # The compiled q/k/v piece has neither; such models decode through the eager path.
            log.warning("compiled decode does not take q/k/v biases or q/k norms (%s); decode stays eager",
                        cfg.architecture)
            return None
        # The model's own Linears are the other path the kernel choice times (engine/kernel_choice.py).
        linears = [{name: layer[name] for name in plain} for layer, plain in zip(self.layers, plain_layers)]
        compiled = CompiledDecode([DecodeLayer(**plain) for plain in plain_layers], lm_head, cfg.rms_norm_eps,
                                  cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, linears=linears,
                                  lm_head_linear=self.lm_head_logits, linear_name=self.matmul_kernel,
                                  dtype=self.dtype)
        return compiled if compiled.ready else None

    @property
    def kernel_choice(self) -> KernelChoice | None:
        """The compiled pieces' measured choice of matmul kernel per weight and step size; None
        without compiled decode (or where only one kernel is built)."""
        return self.compiled_decode.kernel_choice if self.compiled_decode is not None else None

    def time_matmuls(self, rows: tuple[int, ...]) -> KernelChoice | None:
        """Both matmul paths timed at `rows` on this process's threads (for benchmarks); None
        where the compiled pieces have no kernel choice."""
        return self.compiled_decode.time_matmuls(rows) if self.compiled_decode is not None else None

    @property
    def decode_run_batches(self) -> tuple[int, ...]:
        """The batch sizes an eager decode's weight matmuls run at: a batch below the smallest runs
        at it (Linear pads its rows, engine/linear.py). The compiled pieces pad nothing up to eight
        sequences; above, a batch runs in its padded bucket once that bucket is compiled."""
        if self.compiled_decode is not None:
            return tuple(sorted(self.compiled_decode.buckets))
        rows = self.lm_head_slices[0].min_rows
        return (rows,) if rows > 1 else ()

    def lm_head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of final-normed rows through every LM-head slice at once (no safepoint between)."""
        return torch.cat([head(x) for head in self.lm_head_slices], dim=1)

    @property
    def weight_bytes(self) -> int:
        """Bytes a decode step of one sequence reads from the weights: every matmul's (as the compiled
        pieces hold them where they run it: bf16 over fp32 activations reads two bytes a weight, else
        in the Linears' compute dtype) and the norms'."""
        tensors = [t for layer in self.layers for t in layer.values()] + self.lm_head_slices + [self.final_norm]
        matmul_dtype = self.compiled_decode.weight_dtype if self.compiled_decode is not None else None
        return sum((t.numel() * matmul_dtype.itemsize if matmul_dtype is not None else t.nbytes)
                   if isinstance(t, Linear) else t.numel() * t.element_size() for t in tensors)

    def _write_kv(self, li: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, kv: KVBlockPool) -> None:
        kv.k_slots[li].index_copy_(0, meta.slot_mapping, k)
        kv.v_slots[li].index_copy_(0, meta.slot_mapping, v)

    def _compiled_pieces_for(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> tuple[int, DecodePieces] | None:
        """The compiled pieces for this step and the batch size they take, if they hold its token
        count, else None. Decodes and prompt chunks alike: every piece works row by row, and only
        attention, which runs between the pieces, tells a prompt token from a decode."""
        if self.compiled_decode is None or meta.lora is not None:
            return None
        return self.compiled_decode.pieces_for(input_ids.shape[0])

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv: KVBlockPool,
                safepoint: Safepoint | None = None, resume: SuspendedStep | None = None) -> torch.Tensor:
        """Run all layers on the flat batch; return fp32 logits [N, vocab] for meta.logits_index.

        With resume, continue an aborted forward of the same batch from where it stopped.
        """
        compiled = self._compiled_pieces_for(input_ids, meta) if resume is None else None
        if compiled is not None:
            return self._forward_compiled(compiled[1], input_ids, meta, kv, safepoint, padded_to=compiled[0])
        cfg = self.config
        cos = self.rope_cos.index_select(0, meta.positions).unsqueeze(1)
        sin = self.rope_sin.index_select(0, meta.positions).unsqueeze(1)
        lora = meta.lora
        if resume is None:
            h, act, start_layer, start_stage = self.embed.index_select(0, input_ids), None, 0, 0
        else:
            (h, act), start_layer, start_stage = resume.carry, resume.layer, resume.stage

        def check(li: int, stage: int) -> None:
            if safepoint is not None and safepoint(li):
                raise StepAborted(li, SuspendedStep(li, stage, (h, act if stage == 2 else None)))

        for li in range(start_layer, cfg.num_layers):
            layer = self.layers[li]
            first_stage = start_stage if li == start_layer else 0
            if first_stage <= 0:
                if li > 0:
                    check(li, 0)
                x = F.rms_norm(h, (cfg.hidden_size,), layer["attn_norm"], cfg.rms_norm_eps)
                qkv = layer["qkv"](x)
                if lora is not None:
                    lora.add(li, "qkv", x, qkv)
                q, k, v = self.split_qkv(layer, qkv, cos, sin)
                self._write_kv(li, k, v, meta, kv)
                attn = self._attention(q, li, meta, kv)
                h = layer["o"].add_to(h, attn)
                if lora is not None:
                    lora.add(li, "o", attn, h)
            # Two more safepoints inside the layer (after attention, after gate/up) halve the
            # longest stretch without a check: the MLP is three quarters of a layer's work.
            if first_stage <= 1:
                check(li, 1)
                x = F.rms_norm(h, (cfg.hidden_size,), layer["mlp_norm"], cfg.rms_norm_eps)
                gate_up = layer["gate_up"](x)
                if lora is not None:
                    lora.add(li, "gate_up", x, gate_up)
                gate, up = gate_up.chunk(2, dim=-1)
                act = F.silu(gate).mul_(up)
            check(li, 2)
            h = layer["down"].add_to(h, act)
            if lora is not None:
                lora.add(li, "down", act, h)
        # The LM head runs in slices with a safepoint between two: for a big batch of logits it is
        # the longest stretch of the step. Stage i >= 1 of layer num_layers is "before slice i",
        # with the normed rows as hidden and the logits of the slices before it as act.
        head_stage = start_stage if start_layer == cfg.num_layers else 0
        if head_stage == 0:
            check(cfg.num_layers, 0)
            last = h.index_select(0, meta.logits_index)
            last = F.rms_norm(last, (cfg.hidden_size,), self.final_norm, cfg.rms_norm_eps)
            parts = []
        else:
            last, parts = h, [act]
        for i in range(head_stage, len(self.lm_head_slices)):
            if i > head_stage and safepoint is not None and safepoint(cfg.num_layers):
                raise StepAborted(cfg.num_layers, SuspendedStep(cfg.num_layers, i, (last, torch.cat(parts, dim=1))))
            parts.append(self.lm_head_slices[i](last))
        return torch.cat(parts, dim=1).float()

    def _forward_compiled(self, fast: DecodePieces, input_ids: torch.Tensor, meta: AttentionMetadata,
                          kv: KVBlockPool, safepoint: Safepoint | None, padded_to: int | None = None) -> torch.Tensor:
        """forward for a step of a few tokens (decodes, prompt chunks or both): the same layers,
        safepoints and KV writes, with the fixed-shape stretches compiled (engine/compiled_decode.py).
        A prompt token costs what a decode does, less its attention, instead of an eager step's
        per-op overhead. padded_to: the pieces' batch size, where it is larger than the step's (a
        bucket): the pieces run on zero rows past the batch, which attention, the KV writes and the
        logits leave out."""
        cfg = self.config
        batch = input_ids.shape[0]
        pad = (padded_to or batch) - batch
        positions = F.pad(meta.positions, (0, pad)) if pad else meta.positions
        h = self.embed.index_select(0, input_ids)
        if pad:
            h = F.pad(h, (0, 0, 0, pad))
        cos = self.rope_cos.index_select(0, positions).unsqueeze(1)
        sin = self.rope_sin.index_select(0, positions).unsqueeze(1)
        decode_only = not meta.prefills
        kernel = self.paged_decode_attention if decode_only else None
        if decode_only and kernel is None and batch == 1:
            blocks, context = meta.decode_block_tables[0], int(meta.positions[0]) + 1
        x = fast.norm(h, self.layers[0]["attn_norm"])  # the normed input of the next matmul
        last = len(self.layers) - 1
        # An abort carries what the eager path needs to go on from there (its stages 0 and 2).
        for li, layer in enumerate(self.layers):
            if safepoint is not None and li > 0 and safepoint(li):
                raise StepAborted(li, SuspendedStep(li, 0, (h[:batch], None)))
            q, k, v = fast.qkv_rope(x, li, cos, sin)
            if pad:
                q, k, v = q[:batch], k[:batch], v[:batch]
            if decode_only and kernel is not None:
                # Reads the pool in place (engine/paged_attention.py), after writing the step's keys
                # and values into it: one call a layer where the write took two more.
                attn = kernel(q, kv.k[li], kv.v[li], meta.decode_block_tables, meta.decode_context_lens,
                              k_new=k, v_new=v, slots=meta.slot_mapping).view(batch, -1)
            else:
                self._write_kv(li, k, v, meta, kv)
                if not decode_only:  # prompt chunks (and any decodes beside them)
                    attn = self._attention(q, li, meta, kv)
                elif batch == 1:
                    attn = self._single_decode_attention(q, li, blocks, context, kv)
                else:
                    attn = self._decode_attention(q, li, meta, kv).reshape(batch, -1)
            if pad:
                attn = F.pad(attn, (0, 0, 0, pad))
            # One safepoint fewer than the eager path (none between attention and the MLP): the o
            # and gate/up projections of a few sequences are a fraction of a millisecond.
            h, x = fast.o_then_norm(h, attn, li, layer["mlp_norm"])
            act = fast.gate_up_silu(x, li)
            if safepoint is not None and safepoint(li):
                raise StepAborted(li, SuspendedStep(li, 2, (h[:batch], act[:batch])))
            next_norm = self.layers[li + 1]["attn_norm"] if li < last else self.final_norm
            h, x = fast.down_then_norm(h, act, li, next_norm)
        if safepoint is not None and safepoint(cfg.num_layers):
            raise StepAborted(cfg.num_layers, SuspendedStep(cfg.num_layers, 0, (h[:batch], None)))
        every_row = decode_only and meta.logits_index.shape[0] == batch
        if fast.lm_head_logits is not None and every_row:  # a bucket's padding rows dropped
            return fast.lm_head_logits(x, self.compiled_decode.lm_head)[:batch]
        # A bucket, or the rows that want logits (a prompt chunk's last): through the small-batch or tile
        # kernel where the kernel choice found it faster for so few rows, else the eager LM head.
        rows = x[:batch] if every_row else x.index_select(0, meta.logits_index)
        logits = None if every_row else self.compiled_decode.lm_head_rows(rows)
        return logits if logits is not None else self.lm_head_logits(rows).float()

    def _single_decode_attention(self, q: torch.Tensor, li: int, blocks: torch.Tensor, context: int,
                                 kv: KVBlockPool) -> torch.Tensor:
        """One sequence's decode attention: [1, n_q, hd] -> [1, n_q * hd]. With one sequence there
        is no padding to mask, only the last block's unused tail to cut off."""
        n_q, n_kv, hd = self.config.num_heads, self.config.num_kv_heads, self.config.head_dim
        # The gathered copy [blocks, block_size, n_kv, hd] seen as [1, n_kv, context, hd] in one view
        # (a per-op cost of about a microsecond is worth saving thirty times a step).
        heads_first = ((1, n_kv, context, hd), (0, hd, n_kv * hd, 1))
        keys = kv.k[li].index_select(0, blocks).as_strided(*heads_first)
        values = kv.v[li].index_select(0, blocks).as_strided(*heads_first)
        o = F.scaled_dot_product_attention(q.reshape(1, n_kv, n_q // n_kv, hd), keys, values)
        return o.reshape(1, n_q * hd)

    def _decode_attention(self, q: torch.Tensor, li: int, meta: AttentionMetadata, kv: KVBlockPool) -> torch.Tensor:
        """One query per sequence against its paged context: [Bd, n_q, hd] -> [Bd, n_q, hd]."""
        n_q, n_kv, hd = self.config.num_heads, self.config.num_kv_heads, self.config.head_dim
        tables = meta.decode_block_tables
        if self.paged_decode_attention is not None:  # reads the pool in place, no padding
            return self.paged_decode_attention(q.contiguous(), kv.k[li], kv.v[li], tables, meta.decode_context_lens)
        batch, max_blocks = tables.shape
        flat = tables.view(-1)
        ctx = max_blocks * kv.block_size
        keys = kv.k[li].index_select(0, flat).view(batch, ctx, n_kv, hd).transpose(1, 2)
        values = kv.v[li].index_select(0, flat).view(batch, ctx, n_kv, hd).transpose(1, 2)
        # The query heads sharing a KV head become that head's "query rows" (they all sit at the
        # same position): one attention per KV head, no expanded copies of K and V; on CPU enable_gqa
        # with a mask is several times slower and dominated long-context decode steps.
        grouped = q.reshape(batch, n_kv, n_q // n_kv, hd)
        o = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=meta.decode_key_mask)
        return o.reshape(batch, n_q, hd)

    def _attention(self, q: torch.Tensor, li: int, meta: AttentionMetadata, kv: KVBlockPool) -> torch.Tensor:
        cfg = self.config
        n_q, n_kv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bs = kv.block_size
        if meta.decode_token_index is not None and not meta.prefills:
            # Decode-only step: tokens are exactly the decoding sequences, in order.
            return self._decode_attention(q, li, meta, kv).reshape(q.shape[0], n_q * hd)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous: q may be a view of q/k/v
        if meta.decode_token_index is not None:
            qd = q.index_select(0, meta.decode_token_index)
            out.index_copy_(0, meta.decode_token_index, self._decode_attention(qd, li, meta, kv))
        if self.paged_prompt_attention is not None and meta.prefill_spans is not None:
            self.paged_prompt_attention(q, kv.k[li], kv.v[li], meta.prefill_spans, meta.prefill_block_tables, out)
            return out.view(q.shape[0], n_q * hd)
        for span in meta.prefills:
            ctx = span.start_pos + span.num_tokens
            keys = kv.k[li].index_select(0, span.block_ids).view(-1, n_kv, hd)[:ctx].transpose(0, 1).unsqueeze(0)
            values = kv.v[li].index_select(0, span.block_ids).view(-1, n_kv, hd)[:ctx].transpose(0, 1).unsqueeze(0)
            qp = q[span.token_start:span.token_start + span.num_tokens].transpose(0, 1).unsqueeze(0)
            if span.start_pos == 0:
                o = F.scaled_dot_product_attention(qp, keys, values, is_causal=True, enable_gqa=n_q != n_kv)
            else:
                # Chunked prefill: query i sits at start_pos + i and sees keys up to there.
                qpos = torch.arange(span.start_pos, ctx, device=q.device).unsqueeze(1)
                kpos = torch.arange(ctx, device=q.device).unsqueeze(0)
                o = F.scaled_dot_product_attention(qp, keys, values, attn_mask=kpos <= qpos,
                                                   enable_gqa=n_q != n_kv)
            out[span.token_start:span.token_start + span.num_tokens] = o.squeeze(0).transpose(0, 1)
        return out.view(q.shape[0], n_q * hd)
