"""Decode steps of a few sequences through compiled layer pieces (gpt-fast's approach, CPU).

A decode step of a few sequences reads every weight once and does little arithmetic, so its time
is memory traffic plus per-op overhead. Eager PyTorch pays both badly here: about twenty dispatches
per layer (norms, RoPE, SiLU, views, residual adds), and oneDNN's and MKL's matrix-vector kernels
read the weights well below the speed a plain reduction streams them at. Inductor turns each piece
into one C++ loop that takes the weight's rows as dot products (a reduction, at reduction speed)
with the residual adds, norms, RoPE and SiLU fused in. `backfill bench engine --compile-decode`
measures both paths side by side (docs/benchmarks.md).

Four pieces per layer, each one matmul and the pointwise work after it: q/k/v with RoPE; o with
the residual and the MLP's norm; gate/up with SiLU; down with the residual and the next layer's
norm (or the final norm, before the LM head). A matmul's input is always a finished tensor: fused
after a norm, inductor recomputes the normed vector for every weight row, which makes bf16 decode
compute-bound. Each piece is traced once (make_fx) and lowered by inductor's inner compiler, and
the generated code is called with nothing in front of it: torch.compile's guard checks and AOT
autograd's runtime wrappers cost a visible share of a small step on every call. Without guards
the pieces trust their inputs' shapes, which a decode of a given batch size fixes: the pieces are
compiled once per batch size.

Batches of two and three sequences take the same pieces with one dot product per (row, sequence),
all sequences' products of a row in one pass over it, so the weights are still read once. From
about four sequences the products' horizontal sums cost as much as the eager GEMMs, so bigger
batches stay eager.

On a CPU with AVX-512 BF16 or AVX2, the pieces multiply through the small-batch kernel instead
(engine/small_batch_matmul.py), in bf16 or fp32: the weights are packed for it at load, it reads
them at streaming speed for up to eight sequences, and the pieces are built for batch sizes 1 to
8 (docs/benchmarks.md compares them with eager). A co-serving step that carries a few
offline decodes with an online one is such a batch.

Larger decode batches (a burst of online requests, an offline batch) are compute-bound at any
size: the kernel and oneDNN multiply at the same rate there (the kernel keeps a tile of the weight
in cache for all eight-row chunks), and what eager loses is the rest of the step, about twenty
dispatches per layer. So the packed pieces are also built for buckets of 16 to 128 rows; a
batch runs in the smallest bucket that holds it, its rows padded with zeros (a padded row costs
its share of the matmuls, which is why the buckets are close together). On a CPU with AMX tiles
the packed weights also multiply on them (the same packing), which reads them faster than oneDNN
from a handful of rows up; each weight at each size takes the path the kernel choice measured
fastest, the LM head too. These buckets compile on a
background thread after load (seconds each, cached on disk by inductor), so the server starts
as fast as before and large batches stay eager until their bucket is ready.

The pieces work row by row, so a step with prompt chunks (alone or beside decodes) runs them too
when its token count fits a size: only attention, which runs between the pieces, tells a prompt
token from a decode (causal SDPA over the chunk and its prefix, as the eager path). A prompt of up
to 128 tokens is then prefilled in one compiled step, and its time to first token drops with it.

Only the stretches with fixed shapes are compiled. Decode attention over the paged cache is not:
its context grows every step and would recompile a static graph, and a dynamic one runs slower
than eager (also with the block-table gather fused in, once the KV is not in cache). It runs
through the paged-attention kernel where that is built (engine/paged_attention.py), else through
gather + SDPA. The KV writes are the eager model's. The safepoints are before each layer and
before its down projection (ConServe §4.3); the eager path's third one, between attention and the
MLP, is left out: for a few sequences the o and gate/up projections are a small share of a layer.
An abort at one carries the step's rows, so the eager path goes on from there (ConServe §4.4).

Steps of more rows than the largest bucket (prompt chunks of a few hundred to a few thousand
tokens, decode batches past 128) run pieces compiled once with the row count as a symbol: every
matmul through the model's `Linear` (oneDNN, fastest at that size), and the norms, RoPE and SiLU
fused around them as in a bucket. Eager, each of those pointwise ops is a pass over the rows.

Where the machine's matmuls run a row count 8 past a multiple of 16 slower than the next multiple
(oneDNN's AMX kernels, whose tiles take 16 rows), a step past the buckets runs padded to the
multiple, its extra rows zeros as in a bucket: the kernel choice times a layer's matmuls at such
pairs of counts (engine/kernel_choice.py) and says whether.

Which kernel multiplies each weight at each batch size is measured on the machine, not assumed
(engine/kernel_choice.py): where the model's own matmul (oneDNN, on AMX tiles where the CPU has
them) beats the small-batch kernel, that piece's matmul runs before it through the model's
`Linear` (with the residual add fused for o and down) and the piece compiles only what follows.
"""

from __future__ import annotations

import atexit
import logging
import threading
from dataclasses import dataclass, fields
from typing import Callable

import torch
import torch.nn.functional as F
from torch._inductor import config as inductor_config
from torch._inductor.compile_fx import compile_fx_inner
from torch._inductor.decomposition import select_decomp_table
from torch._guards import TracingContext, detect_fake_mode, tracing
from torch.fx.experimental import _config as fx_config
from torch.fx.experimental.proxy_tensor import make_fx

from backfill.engine import kernel_choice
from backfill.engine.kernel_choice import KernelChoice
from backfill.engine.rope import apply_rope
from backfill.engine.small_batch_matmul import (can_pack, load_small_batch_matmul, load_tiles_matmul,
                                                pack_for_small_batches, packed_matmul, packed_matmul_tiles, tiles_take)
from backfill.engine.small_batch_matmul import kernel_digest as small_batch_kernel_digest

log = logging.getLogger(__name__)


# Decode batch sizes that get compiled pieces (see the module doc for why no more): with the
# dot products, and with the small-batch kernel.
DECODE_BATCH_SIZES = (1, 2, 3)
PACKED_DECODE_BATCH_SIZES = (1, 2, 3, 4, 5, 6, 7, 8)
# Padded buckets for larger steps (packed weights only), in the order they are compiled: the full
# decode batches of a burst first, then 128, which holds a prompt of up to 128 tokens (a chat turn:
# its time to first token) and an offline decode batch of more than 64 sequences.
PACKED_DECODE_BUCKETS = (64, 32, 16, 48, 24, 128)
# Steps of more rows (prompt chunks, large decode batches) run pieces compiled once for any row
# count, traced at this many: padding them to a bucket would cost matmuls, and eager they pay
# for unfused norms, RoPE and SiLU.
LARGE_STEP_EXAMPLE_ROWS = 257
# Their weight matmuls run through the kernel the choice takes at this many rows (a step of the
# coserve policy's 512-token budget): oneDNN where it is faster (on AMX tiles, say), else the
# small-batch kernel, fused in the pieces as in the buckets (on AVX2 it outruns oneDNN there too).
LARGE_STEP_CHOICE_ROWS = 512
# Every size the packed pieces run at, where the kernel choice times both paths.
CHOICE_ROWS = tuple(sorted(set(PACKED_DECODE_BATCH_SIZES + PACKED_DECODE_BUCKETS))) + (LARGE_STEP_CHOICE_ROWS,)


def _gemv(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x @ weight.T as dot products of the weight rows, accumulated in fp32: [B, in] -> [B, out].

    One reduction per sequence, over the same rows: inductor fuses them into one loop over the
    weight that feeds all B accumulators. Broadcast as [B, out, in] instead, it loops over the
    sequences outside and reads the weights B times.
    """
    return torch.stack([(weight.float() * x[b].float()).sum(-1) for b in range(x.shape[0])])


Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (weight, x [B, in]) -> fp32 [B, out]


def _packed_matmul(out_features: int, tiles: bool = False) -> Matmul:
    """x @ W.T through the small-batch kernel (or, with tiles, its AMX version), for a weight packed
    by pack_for_small_batches."""
    op = torch.ops.backfill.packed_matmul_tiles if tiles else torch.ops.backfill.packed_matmul
    return lambda packed_weight, x: op(packed_weight, x, out_features)


def _norm(h, norm_weight, eps: float):
    """RMSNorm: the first layer's attention norm, on the embedding."""
    return F.rms_norm(h, (h.shape[-1],), norm_weight, eps)


def _qkv_rope(x, w_qkv, cos, sin, n_q: int, n_kv: int, matmul: Matmul = _gemv):
    """Fused q/k/v projection of the normed x and RoPE: [B, hidden] -> q [B, n_q, hd], k and v [B, n_kv, hd]."""
    return _rope_split(matmul(w_qkv, x).to(x.dtype), cos, sin, n_q, n_kv)


def _rope_split(qkv, cos, sin, n_q: int, n_kv: int):
    """RoPE on a q/k/v product [B, (n_q + 2 n_kv) hd], split into q, k and v."""
    hd = cos.shape[-1]
    qk = apply_rope(qkv[:, :(n_q + n_kv) * hd].view(-1, n_q + n_kv, hd), cos, sin)
    return qk[:, :n_q], qk[:, n_q:], qkv[:, (n_q + n_kv) * hd:].view(-1, n_kv, hd)


def _project_then_norm(h, x, weight, norm_weight, eps: float, matmul: Matmul = _gemv):
    """h + x @ weight.T (the o or down projection and residual), and the next norm of that."""
    h = h + matmul(weight, x).to(h.dtype)
    return h, F.rms_norm(h, (h.shape[-1],), norm_weight, eps)


def _gate_up_silu(x, w_gate_up, matmul: Matmul = _gemv):
    """Fused gate/up projection of the normed x and SiLU(gate) * up."""
    return _silu_mul(matmul(w_gate_up, x), x.dtype)


def _silu_mul(gate_up, dtype: torch.dtype):
    """SiLU(gate) * up of a gate/up product, in fp32, as dtype."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(dtype)


def _lm_head(x, w_head, matmul: Matmul = _gemv):
    """The LM head on the final-normed x; fp32 logits."""
    return matmul(w_head, x)


_COMPILE_LOCK = threading.Lock()


def _compile(fn, example_args: tuple[torch.Tensor, ...], dynamic_rows: bool = False):
    """fn traced on the example tensors and compiled by inductor, called with no wrapper in front.
    With dynamic_rows the sizes are traced as symbols, and the code takes inputs of any row count.

    torch.compile checks guards on every call (a step makes about ninety), and even
    torch._inductor.compile runs each call through AOT autograd's runtime wrappers. Here the graph is traced with inductor's decompositions and lowered
    by its inner compiler, and the generated module's own entry point is called directly. Without
    its size asserts nothing checks the inputs: the caller must pass contiguous tensors of the
    examples' shapes and dtypes, which fixed-shape batch-1 decode does. The pieces are pure
    functions (the KV writes stay outside), so nothing AOT autograd does is needed.
    """
    single = False

    def as_tuple(*args):  # the inner compiler takes graphs that return a tuple
        nonlocal single
        out = fn(*args)
        single = not isinstance(out, tuple)  # known once traced
        return (out,) if single else out

    # make_fx and inductor's config patches keep process-global state: a second model compiling on
    # another thread (a bucket thread still running, say) would corrupt this trace, so one at a time.
    with _COMPILE_LOCK:
        if not dynamic_rows:
            graph = make_fx(as_tuple, decomposition_table=select_decomp_table())(*example_args)
            with inductor_config.patch(size_asserts=False):
                compiled = compile_fx_inner(graph, list(example_args))
        else:
            # Each size its own symbol: with duck shaping, rows that happen to equal a width share it.
            with fx_config.patch(use_duck_shape=False):
                graph = make_fx(as_tuple, decomposition_table=select_decomp_table(),
                                tracing_mode="symbolic")(*example_args)
            # The symbolic inputs carry the shape environment the inner compiler reads sizes from.
            fakes = [node.meta["val"] for node in graph.graph.nodes if node.op == "placeholder"]
            fake_mode = detect_fake_mode(fakes)
            with tracing(TracingContext(fake_mode)), fake_mode, inductor_config.patch(size_asserts=False):
                compiled = compile_fx_inner(graph, fakes)
    call = compiled.current_callable  # takes the inputs as one list (and may empty it)
    if single:
        return lambda *args: call(list(args))[0]
    return lambda *args: call(list(args))


@dataclass
class DecodeLayer:
    """One layer's matmul weights in the layout the pieces read: plain [out, in] tensors for the
    dot products, or packed for the small-batch kernel (engine/small_batch_matmul.py)."""

    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


LAYER_WEIGHTS = tuple(f.name for f in fields(DecodeLayer))


class DecodePieces:
    """The pieces of a decode step for one batch size (their inputs' first dimension).

    Each matmul piece runs its matmul inside (the small-batch kernel, fused with what follows) or,
    where the kernel choice says the model's own `Linear` is faster at this size, calls that
    Linear first and a compiled piece for the rest.
    """

    def __init__(self, compiled: dict[str, Callable], outside: frozenset[str], layers: list[DecodeLayer],
                 linears: list[dict]) -> None:
        self.compiled, self.outside, self.layers, self.linears = compiled, outside, layers, linears
        self.norm = compiled["norm"]
        # None: the model's own LM head (a bucket, or the Linear is faster here).
        self.lm_head_logits: Callable | None = compiled.get("lm_head")

    def qkv_rope(self, x: torch.Tensor, li: int, cos: torch.Tensor, sin: torch.Tensor):
        if "qkv" in self.outside:
            return self.compiled["qkv"](self.linears[li]["qkv"](x), cos, sin)
        return self.compiled["qkv"](x, self.layers[li].qkv, cos, sin)

    def o_then_norm(self, h: torch.Tensor, attn: torch.Tensor, li: int, norm_weight: torch.Tensor):
        if "o" in self.outside:
            h = self.linears[li]["o"].add_to(h, attn)
            return h, self.compiled["o"](h, norm_weight)
        return self.compiled["o"](h, attn, self.layers[li].o, norm_weight)

    def gate_up_silu(self, x: torch.Tensor, li: int):
        if "gate_up" in self.outside:
            return self.compiled["gate_up"](self.linears[li]["gate_up"](x))
        return self.compiled["gate_up"](x, self.layers[li].gate_up)

    def down_then_norm(self, h: torch.Tensor, act: torch.Tensor, li: int, norm_weight: torch.Tensor):
        if "down" in self.outside:
            h = self.linears[li]["down"].add_to(h, act)
            return h, self.compiled["down"](h, norm_weight)
        return self.compiled["down"](h, act, self.layers[li].down, norm_weight)


class CompiledDecode:
    """Runs steps of a few tokens (decodes and prompt chunks) through compiled pieces; the model
    routes them here.

    Keeps its own copy of the matmul weights (the eager path's are packed for oneDNN and opaque),
    so it costs the model's weight memory once more. Where the small-batch kernel builds, that copy is
    packed for the small-batch kernel, which reads the weights at streaming speed for up to eight
    sequences, and the pieces are built for batch sizes 1 to 8 (and, by compile_buckets, for
    padded buckets up to 128); elsewhere the copy is plain, the pieces take the dot products, and
    they stop at 3. With `linears` (the model's own matmuls of each layer, and its LM head), each
    weight at each batch size runs through whichever of the two the kernel choice measured faster
    (engine/kernel_choice.py). Compilation happens here, at load, so no request pays for it; where
    it cannot (no C++ compiler, say), `ready` is False and the model stays eager.
    """

    def __init__(self, layers: list[DecodeLayer], lm_head: torch.Tensor, eps: float, num_heads: int,
                 num_kv_heads: int, head_dim: int, small_batch_kernel: bool = True,
                 linears: list[dict] | None = None, lm_head_linear: Callable | None = None,
                 linear_name: str = "linear", dtype: torch.dtype | None = None) -> None:
        """dtype: the activations' (default: the weights'); fp32 activations over bf16 weights are a bf16
        model on a CPU without bf16 matmul kernels (engine/linear.py), whose small steps still read
        the weights at two bytes."""
        self.eps = eps
        self.dtype = dtype or lm_head.dtype
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.hidden_size = lm_head.shape[1]
        self.out_features = {name: getattr(layers[0], name).shape[0] for name in LAYER_WEIGHTS}
        self.out_features["lm_head"] = lm_head.shape[0]
        self.intermediate_size = layers[0].down.shape[1]
        self.packed = small_batch_kernel and _small_batch_kernel_takes(layers, lm_head)
        if self.packed:
            layers = [DecodeLayer(*(pack_for_small_batches(getattr(layer, name)) for name in LAYER_WEIGHTS))
                      for layer in layers]
            lm_head = pack_for_small_batches(lm_head)
        self.layers, self.lm_head = layers, lm_head
        self.in_features = {"qkv": self.hidden_size, "o": num_heads * head_dim, "gate_up": self.hidden_size,
                            "down": self.intermediate_size, "lm_head": self.hidden_size}
        # The weights the tile kernel also takes (bf16, inputs in whole tiles), on a CPU with AMX.
        self.tiled = frozenset(name for name, n in self.in_features.items() if tiles_take(lm_head.dtype, n)) \
            if self.packed and self.dtype == lm_head.dtype and load_tiles_matmul() else frozenset()
        self.linears = linears or []
        self.lm_head_linear = lm_head_linear
        # Which weights run through the model's Linear at which batch size; none without linears.
        self.kernel_choice: KernelChoice | None = None
        if self.packed and linears is not None and lm_head_linear is not None:
            self.kernel_choice = kernel_choice.load_or_measure(self._choice_signature(),
                                                               lambda: self._measure_choice(linear_name))
        batch_sizes = PACKED_DECODE_BATCH_SIZES if self.packed else DECODE_BATCH_SIZES
        self.pieces: dict[int, DecodePieces] = {}
        # Padded buckets, filled by compile_buckets (dict stores are atomic: the engine thread
        # reads it while a background thread adds to it).
        self.buckets: dict[int, DecodePieces] = {}
        # Steps larger than every bucket, any row count (the matmuls as chosen at LARGE_STEP_CHOICE_ROWS).
        self.large: DecodePieces | None = None
        self.pad_large_steps = True
        self._bucket_thread: threading.Thread | None = None
        self._stopping = False
        try:
            for batch in batch_sizes:
                self.pieces[batch] = self._compile_pieces(batch)
            self.ready = True
        except Exception as exc:  # inductor raises many types (no compiler, unsupported op): all mean "stay eager"
            log.warning("compiled decode unavailable, decode stays eager: %s", exc)
            self.pieces.clear()
            self.ready = False

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype the pieces read the matmul weights in (the model's, which may be below the activations')."""
        return self.lm_head.dtype

    def _choice_signature(self) -> dict:
        return {"what": "compiled-decode", "hidden": self.hidden_size, "intermediate": self.intermediate_size,
                "out_features": self.out_features, "dtype": str(self.lm_head.dtype),
                "activations": str(self.dtype), "layers": len(self.layers),
                "rows": list(CHOICE_ROWS),
                "small_batch_kernel": small_batch_kernel_digest()}

    def time_matmuls(self, rows: tuple[int, ...]) -> KernelChoice | None:
        """Both paths timed again at `rows` on the process's threads (a benchmark's view of a
        step's matmul time); None without a choice to make."""
        if self.kernel_choice is None:
            return None
        return self._measure_choice(self.kernel_choice.linear_name, rows, one_thread=False)

    def _measure_choice(self, linear_name: str, rows: tuple[int, ...] | None = None,
                        one_thread: bool = True) -> KernelChoice:
        """Each path timed at every size the pieces run, over every layer's weights and the LM head."""
        paths = (kernel_choice.SMALL_BATCH,) + ((kernel_choice.TILES,) if self.tiled else ()) + (kernel_choice.LINEAR,)
        choice = kernel_choice.measure(self._step_matmuls, paths, rows or CHOICE_ROWS, linear_name, one_thread)
        choice.large_rows_us = kernel_choice.measure_large_rows(self._layer_matmuls_at, one_thread)
        return choice

    def _step_matmuls(self, path: str, rows: int) -> list[tuple[str, Callable[[], object]]]:
        """A step's matmuls through `path` on `rows` random rows, in a step's order: (name, call)."""
        dtype = self.dtype
        x = {name: torch.randn(rows, n, dtype=dtype) * 0.1 for name, n in self.in_features.items()}
        # A large step's pieces leave the LM head to the model (a prompt chunk wants few rows' logits).
        lm_head = [(None, "lm_head")] if rows <= max(PACKED_DECODE_BUCKETS) else []
        weights = [(li, name) for li in range(len(self.layers)) for name in LAYER_WEIGHTS] + lm_head
        calls = []
        for li, name in weights:
            if path == kernel_choice.LINEAR:
                linear = self.lm_head_linear if li is None else self.linears[li][name]
                calls.append((name, lambda f=linear, v=x[name]: f(v)))
            elif path == kernel_choice.SMALL_BATCH or name in self.tiled:
                weight = self.lm_head if li is None else getattr(self.layers[li], name)
                matmul = packed_matmul_tiles if path == kernel_choice.TILES else packed_matmul
                calls.append((name, lambda f=matmul, w=weight, v=x[name], n=self.out_features[name]: f(w, v, n)))
        return calls

    def _layer_matmuls_at(self, rows: int) -> Callable[[], object]:
        """Layer 0's four matmuls through the model's Linear on `rows` rows (a large step's)."""
        linears, dtype = self.linears[0], self.dtype
        x = torch.randn(rows, self.hidden_size, dtype=dtype) * 0.1
        attn = torch.randn(rows, self.num_heads * self.head_dim, dtype=dtype) * 0.1
        act = torch.randn(rows, self.intermediate_size, dtype=dtype) * 0.1
        return lambda: (linears["qkv"](x), linears["o"].add_to(x, attn), linears["gate_up"](x),
                        linears["down"].add_to(x, act))

    def compile_buckets(self, background: bool = True) -> None:
        """Compile the padded buckets for larger batches (packed weights only), then the pieces for
        larger steps, on a daemon thread or here; each serves steps as soon as it is compiled."""
        if not self.ready or self._bucket_thread is not None:
            return
        self._bucket_thread = threading.Thread(target=self._compile_buckets, name="compile-decode-buckets",
                                               daemon=True)
        # A process that exits while a bucket compiles would abort in C++ ("terminate called without
        # an active exception"): at exit, no further bucket starts and the one compiling finishes.
        # Registered with threading's exit hooks, which run before concurrent.futures shuts its pools
        # down (compiling a bucket submits to one); atexit's would run after.
        register = getattr(threading, "_register_atexit", atexit.register)
        register(self._stop_buckets)
        self._bucket_thread.start()
        if not background:
            self.wait_for_buckets()

    @property
    def compiling_buckets(self) -> bool:
        """True while the background thread still compiles buckets (they share the cores with steps)."""
        return self._bucket_thread is not None and self._bucket_thread.is_alive()

    def wait_for_buckets(self, timeout_s: float | None = None) -> None:
        if self._bucket_thread is not None:
            self._bucket_thread.join(timeout_s)

    def _stop_buckets(self) -> None:
        self._stopping = True
        self.wait_for_buckets()

    def _compile_buckets(self) -> None:
        for batch in PACKED_DECODE_BUCKETS if self.packed else ():
            if self._stopping:
                return
            try:
                self.buckets[batch] = self._compile_pieces(batch)
            except Exception as exc:  # as at load: this bucket's batches stay eager
                log.warning("compiled decode bucket %d unavailable, its batches stay eager: %s", batch, exc)
                return
        if not self._stopping:
            self.compile_large_steps()

    def compile_large_steps(self) -> None:
        """Compile the pieces for steps larger than every bucket (any row count), here; the
        bucket thread calls it after the buckets."""
        if not self.ready or self.large is not None or not self.linears:
            return
        outside = frozenset(LAYER_WEIGHTS) if self.kernel_choice is None else \
            self.kernel_choice.linear_names(LARGE_STEP_CHOICE_ROWS) & frozenset(LAYER_WEIGHTS)
        try:
            self.large = self._compile_pieces(LARGE_STEP_EXAMPLE_ROWS, lm_head=False, outside=outside,
                                              dynamic_rows=True, choice_rows=LARGE_STEP_CHOICE_ROWS)
        except Exception as exc:  # as a bucket: large steps stay eager
            log.warning("compiled pieces for large steps unavailable, they stay eager: %s", exc)

    def pieces_for(self, batch: int) -> tuple[int, DecodePieces] | None:
        """The pieces a decode of `batch` sequences runs on and the batch size they take (>= batch,
        the rest padding); None: eager."""
        pieces = self.pieces.get(batch)
        if pieces is not None:
            return batch, pieces
        fits = [size for size in tuple(self.buckets) if size >= batch]
        if not fits:
            large = self.large
            if large is not None and batch > max(PACKED_DECODE_BUCKETS):
                return self.large_step_rows(batch), large
            return None
        size = min(fits)
        return size, self.buckets[size]

    def large_step_rows(self, batch: int) -> int:
        """The rows a step of `batch` rows past every bucket runs at: padded to the multiple the
        kernel choice measured faster (KernelChoice.large_step_row_multiple), else its own."""
        if not self.pad_large_steps or self.kernel_choice is None:
            return batch
        multiple = self.kernel_choice.large_step_row_multiple
        return -(-batch // multiple) * multiple

    def set_large_step_padding(self, enabled: bool) -> None:
        """Pad large steps as the kernel choice says (the default), or run them at their own rows
        (a benchmark's comparison of the two)."""
        self.pad_large_steps = enabled

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.pieces))

    def outside(self, batch: int) -> frozenset[str]:
        """The weights whose matmul runs through the model's Linear at this batch size."""
        return self.kernel_choice.linear_names(batch) if self.kernel_choice is not None else frozenset()

    def lm_head_rows(self, x: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits of a few final-normed rows (a prompt chunk's last, say) through the
        small-batch or tile kernel, where one reads the LM head faster than the model's own; None
        where the kernels do not take them or the model's LM head is faster."""
        rows = x.shape[0]
        if not self.packed or rows > PACKED_DECODE_BATCH_SIZES[-1] or rows == 0 or "lm_head" in self.outside(rows):
            return None
        return self.matmul("lm_head", rows)(self.lm_head, x.contiguous())

    def matmul(self, name: str, batch: int) -> Matmul:
        """How the pieces of `batch` rows multiply by the weight `name` (qkv, o, gate_up, down or
        lm_head): the kernel the choice took for it at that size."""
        if not self.packed:
            return _gemv
        tiles = name in self.tiled and self.kernel_choice is not None \
            and self.kernel_choice.path(name, batch) == kernel_choice.TILES
        return _packed_matmul(self.out_features[name], tiles)

    def _compile_pieces(self, batch: int, lm_head: bool = True, outside: frozenset[str] | None = None,
                        dynamic_rows: bool = False, choice_rows: int | None = None) -> DecodePieces:
        """Compile every piece now, on inputs of the shapes decode will use (the weights are real);
        without lm_head, the model's own LM head takes the final-normed rows. A piece whose matmul
        runs outside (the model's Linear; by default as the kernel choice says for this size)
        compiles only what follows its matmul. dynamic_rows: for any row count, traced at batch;
        choice_rows: the size whose chosen kernels the pieces take (default: batch)."""
        hidden_size, dtype, device = self.hidden_size, self.dtype, self.lm_head.device
        h = torch.zeros(batch, hidden_size, dtype=dtype, device=device)
        attn = torch.zeros(batch, self.num_heads * self.head_dim, dtype=dtype, device=device)
        norm = torch.ones(hidden_size, dtype=dtype, device=device)
        # Distinct example tensors: inductor compiles inputs that alias in the examples as one input.
        cos, sin = (torch.zeros(batch, 1, self.head_dim, dtype=dtype, device=device) for _ in range(2))
        eps, n_q, n_kv = self.eps, self.num_heads, self.num_kv_heads

        def mm(name: str) -> Matmul:
            return self.matmul(name, choice_rows or batch)

        layer = self.layers[0]
        act = torch.zeros(batch, self.intermediate_size, dtype=dtype, device=device)
        outside = self.outside(batch) if outside is None else outside
        product = {name: torch.zeros(batch, self.out_features[name], dtype=dtype, device=device)
                   for name in ("qkv", "gate_up")}

        def compile_(fn, example_args):
            return _compile(fn, example_args, dynamic_rows)

        with torch.inference_mode():
            compiled = {"norm": compile_(lambda *t: _norm(*t, eps), (h, norm))}
            compiled["qkv"] = (compile_(lambda *t: _rope_split(*t, n_q, n_kv), (product["qkv"], cos, sin))
                               if "qkv" in outside else
                               compile_(lambda *t: _qkv_rope(*t, n_q, n_kv, mm("qkv")), (h, layer.qkv, cos, sin)))
            compiled["o"] = (compile_(lambda *t: _norm(*t, eps), (h.clone(), norm.clone())) if "o" in outside else
                             compile_(lambda *t: _project_then_norm(*t, eps, mm("o")), (h, attn, layer.o, norm)))
            compiled["gate_up"] = (compile_(lambda y: _silu_mul(y, dtype), (product["gate_up"],))
                                   if "gate_up" in outside else
                                   compile_(lambda *t: _gate_up_silu(*t, mm("gate_up")), (h, layer.gate_up)))
            compiled["down"] = (compile_(lambda *t: _norm(*t, eps), (h.clone(), norm.clone()))
                                if "down" in outside else
                                compile_(lambda *t: _project_then_norm(*t, eps, mm("down")),
                                         (h, act, layer.down, norm)))
            if lm_head and "lm_head" not in outside:
                compiled["lm_head"] = compile_(lambda *t: _lm_head(*t, mm("lm_head")), (h, self.lm_head))
        return DecodePieces(compiled, outside, self.layers, self.linears)


def _small_batch_kernel_takes(layers: list[DecodeLayer], lm_head: torch.Tensor) -> bool:
    """Whether every weight is one the small-batch kernel takes, on a CPU where it is built."""
    weights = [lm_head, *(getattr(layer, name) for layer in layers for name in LAYER_WEIGHTS)]
    return all(can_pack(w) for w in weights) and load_small_batch_matmul()
