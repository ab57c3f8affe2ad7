"""DNN models as sequences of ops ("kernels") that an executor launches one at a time (REEF §3).

Each model is ResNet-152-, VGG-19-, BERT-base- or GPT-2-shaped with random weights, or the default
LLM (SmolLM2, real weights) doing one prefill forward. An op reads named buffers and either writes
its result into its own output buffer or updates a buffer in place, the way PyTorch eager code does
(`nn.ReLU(inplace=True)`, `out += identity`, `scores.mul_(scale)`): in-place updates are what makes
some ops non-idempotent (REEF §4.4). Buffers live in a `Workspace`, which may sit in shared memory
so a killed worker process loses nothing but the op it was running.

Reduced inputs keep a CPU inference at milliseconds to tens of milliseconds: images are 1x3x32x32
(REEF: 224x224), token sequences are 32 long (REEF: 128). Widths and depths are the real ones
unless `scale` shrinks them (tests use small scales).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from backfill.errors import RealtimeError

MODEL_NAMES = ("resnet152", "vgg19", "bert", "gpt2", "llm")
IMAGE_SIZE = 32
SEQ_LEN = 32
_ALIGN_BYTES = 64


@dataclass(frozen=True)
class Op:
    """One kernel: fn(*inputs) returns a tensor copied into `output`, or (output None) updates inputs[0]."""

    name: str
    fn: Callable[..., torch.Tensor | None]
    inputs: tuple[str, ...]
    output: str | None

    @property
    def inplace(self) -> bool:
        return self.output is None


@dataclass(frozen=True)
class BufferSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class OpModel:
    name: str
    ops: list[Op]
    buffers: dict[str, BufferSpec]
    input_name: str
    output_name: str
    example_input: torch.Tensor
    info: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.ops)

    def layout(self) -> tuple[dict[str, int], int]:
        """Byte offset of every buffer in one flat block, and the block's size (same on every process)."""
        offsets, at = {}, 0
        for spec in self.buffers.values():
            offsets[spec.name] = at
            at += -(-spec.nbytes // _ALIGN_BYTES) * _ALIGN_BYTES
        return offsets, max(at, _ALIGN_BYTES)

    def on_device(self, device: str | torch.device) -> "OpModel":
        """The same model with its weights (the tensors its ops close over) on `device`; the ops,
        their order and buffers are unchanged, so its idempotence map holds there too."""
        memo: dict[int, torch.Tensor] = {}
        ops = [Op(op.name, _fn_on_device(op.fn, torch.device(device), memo), op.inputs, op.output) for op in self.ops]
        return OpModel(self.name, ops, self.buffers, self.input_name, self.output_name,
                       self.example_input.to(device), dict(self.info, device=str(device)))

    def workspace(self, block: memoryview | bytearray | None = None, device: str | torch.device | None = None) -> "Workspace":
        """Buffers over `block` (e.g. a SharedMemory's buf), or over fresh private memory (on
        `device`, default the example input's)."""
        offsets, size = self.layout()
        device = torch.device(device) if device is not None else self.example_input.device
        if block is None and device.type != "cpu":
            flat = torch.empty(size, dtype=torch.uint8, device=device)
            return Workspace(self, {name: flat[offsets[name]: offsets[name] + spec.nbytes].view(spec.dtype).view(spec.shape)
                                    for name, spec in self.buffers.items()})
        if block is None:
            block = bytearray(size)
        if len(block) < size:
            raise RealtimeError(f"{self.name}: workspace block of {len(block)} bytes, need {size}")
        flat = torch.frombuffer(block, dtype=torch.uint8, count=size)
        tensors = {}
        for name, spec in self.buffers.items():
            raw = flat[offsets[name]: offsets[name] + spec.nbytes]
            tensors[name] = raw.view(spec.dtype).view(spec.shape)
        return Workspace(self, tensors)

    def run(self, ws: "Workspace", start: int = 0, stop: int | None = None) -> None:
        for i in range(start, len(self.ops) if stop is None else stop):
            ws.run_op(i)

    def infer(self, x: torch.Tensor) -> torch.Tensor:
        """One undisturbed inference in private memory; returns a copy of the output."""
        ws = self.workspace()
        ws.set_input(x)
        self.run(ws)
        return ws.output().clone()


def _fn_on_device(fn: Callable, device: torch.device, memo: dict[int, torch.Tensor]) -> Callable:
    """fn rebuilt with every tensor it closes over (or takes as a default) on device, recursively
    through the functions it closes over (a conv's lambda, a block's helpers)."""
    import types

    def moved(value):
        if isinstance(value, torch.Tensor):
            if id(value) not in memo:
                memo[id(value)] = value.to(device)
            return memo[id(value)]
        if isinstance(value, types.FunctionType):
            return _fn_on_device(value, device, memo)
        if isinstance(value, (list, tuple)):
            return type(value)(moved(v) for v in value)
        return value

    if not isinstance(fn, types.FunctionType):
        return fn
    cells = tuple(types.CellType(moved(c.cell_contents)) for c in fn.__closure__ or ())
    defaults = tuple(moved(d) for d in fn.__defaults__) if fn.__defaults__ else fn.__defaults__
    out = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, defaults, cells or None)
    out.__kwdefaults__ = {k: moved(v) for k, v in fn.__kwdefaults__.items()} if fn.__kwdefaults__ else None
    return out


class Workspace:
    def __init__(self, model: OpModel, tensors: dict[str, torch.Tensor]) -> None:
        self.model = model
        self.tensors = tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def set_input(self, x: torch.Tensor) -> None:
        target = self.tensors[self.model.input_name]
        if tuple(x.shape) != tuple(target.shape) or x.dtype != target.dtype:
            raise RealtimeError(f"{self.model.name}: input must be {tuple(target.shape)} {target.dtype}, "
                                f"got {tuple(x.shape)} {x.dtype}")
        target.copy_(x)

    def output(self) -> torch.Tensor:
        return self.tensors[self.model.output_name]

    @torch.no_grad()
    def run_op(self, i: int) -> None:
        op = self.model.ops[i]
        result = op.fn(*[self.tensors[n] for n in op.inputs])
        if op.output is not None:
            self.tensors[op.output].copy_(result)


class _Builder:
    """Builds the op list by running each op once on the example input (which fixes buffer shapes)."""

    def __init__(self, name: str, x: torch.Tensor) -> None:
        self.name = name
        self.ops: list[Op] = []
        self.values: dict[str, torch.Tensor] = {"input": x.clone()}
        self.buffers = {"input": BufferSpec("input", tuple(x.shape), x.dtype)}
        self.example = x

    @torch.no_grad()
    def op(self, name: str, fn: Callable[..., torch.Tensor], *inputs: str) -> str:
        out = fn(*[self.values[n] for n in inputs]).contiguous()
        buf = f"{len(self.ops)}.{name}"
        self.values[buf] = out.clone()
        self.buffers[buf] = BufferSpec(buf, tuple(out.shape), out.dtype)
        self.ops.append(Op(name, fn, tuple(inputs), buf))
        return buf

    @torch.no_grad()
    def inplace(self, name: str, fn: Callable[..., object], target: str, *others: str) -> str:
        fn(self.values[target], *[self.values[n] for n in others])
        self.ops.append(Op(name, fn, (target, *others), None))
        return target

    def finish(self, output: str, **info: object) -> OpModel:
        return OpModel(self.name, self.ops, self.buffers, "input", output, self.example, dict(info))


def _conv(cin: int, cout: int, k: int, stride: int = 1, gen: torch.Generator | None = None) -> Callable:
    w = torch.randn(cout, cin, k, k, generator=gen) * math.sqrt(2.0 / (cin * k * k))
    return lambda x: F.conv2d(x, w, stride=stride, padding=k // 2)


def _bn(c: int, gen: torch.Generator) -> Callable:
    # Eval-mode batch norm; gamma below 1 keeps 50 residual blocks of random weights finite.
    mean, var = torch.randn(c, generator=gen) * 0.1, torch.rand(c, generator=gen) + 0.5
    gamma, beta = torch.rand(c, generator=gen) * 0.5 + 0.25, torch.randn(c, generator=gen) * 0.1
    return lambda x: F.batch_norm(x, mean, var, gamma, beta, training=False, eps=1e-5)


def _linear(cin: int, cout: int, gen: torch.Generator) -> Callable:
    w = torch.randn(cout, cin, generator=gen) / math.sqrt(cin)
    b = torch.randn(cout, generator=gen) * 0.02
    return lambda x: F.linear(x, w, b)


def _relu_(x: torch.Tensor) -> None:
    torch.relu_(x)


def _add_(x: torch.Tensor, y: torch.Tensor) -> None:
    x.add_(y)


def resnet152(scale: float = 1.0, blocks: tuple[int, ...] = (3, 8, 36, 3), seed: int = 0) -> OpModel:
    """torchvision's ResNet-152 op by op: in-place ReLU and `out += identity` as in its Bottleneck."""
    gen = torch.Generator().manual_seed(seed)
    width = lambda c: max(4, int(c * scale))  # noqa: E731
    b = _Builder("resnet152", torch.randn(1, 3, IMAGE_SIZE, IMAGE_SIZE, generator=gen))
    x = b.op("conv", _conv(3, width(64), 7, 2, gen), "input")
    x = b.op("bn", _bn(width(64), gen), x)
    b.inplace("relu_", _relu_, x)
    x = b.op("maxpool", lambda t: F.max_pool2d(t, 3, 2, 1), x)
    cin = width(64)
    for stage, n in enumerate(blocks):
        mid = width(64 * 2 ** stage)
        cout = mid * 4
        for i in range(n):
            stride = 2 if (i == 0 and stage > 0) else 1
            identity = x
            if i == 0:
                identity = b.op("conv", _conv(cin, cout, 1, stride, gen), x)
                identity = b.op("bn", _bn(cout, gen), identity)
            h = x
            for k, (ci, co, ks, st) in enumerate([(cin, mid, 1, 1), (mid, mid, 3, stride), (mid, cout, 1, 1)]):
                h = b.op("conv", _conv(ci, co, ks, st, gen), h)
                h = b.op("bn", _bn(co, gen), h)
                if k < 2:
                    b.inplace("relu_", _relu_, h)
            b.inplace("add_", _add_, h, identity)
            b.inplace("relu_", _relu_, h)
            x, cin = h, cout
    x = b.op("avgpool", lambda t: F.adaptive_avg_pool2d(t, 1).flatten(1), x)
    x = b.op("fc", _linear(cin, 1000, gen), x)
    return b.finish(x, input_shape=[1, 3, IMAGE_SIZE, IMAGE_SIZE], scale=scale, blocks=list(blocks))


_VGG19 = (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M")


def vgg19(scale: float = 1.0, seed: int = 0) -> OpModel:
    """torchvision's VGG-19 features with in-place ReLU; a CIFAR-style classifier on the 1x1 map."""
    gen = torch.Generator().manual_seed(seed)
    b = _Builder("vgg19", torch.randn(1, 3, IMAGE_SIZE, IMAGE_SIZE, generator=gen))
    x, cin = "input", 3
    for item in _VGG19:
        if item == "M":
            x = b.op("maxpool", lambda t: F.max_pool2d(t, 2, 2), x)
        else:
            cout = max(4, int(item * scale))
            x = b.op("conv", _conv(cin, cout, 3, 1, gen), x)
            b.inplace("relu_", _relu_, x)
            cin = cout
    x = b.op("flatten", lambda t: t.flatten(1), x)
    hidden = max(8, int(512 * scale))
    x = b.op("fc", _linear(cin, hidden, gen), x)
    b.inplace("relu_", _relu_, x)
    x = b.op("fc", _linear(hidden, hidden, gen), x)
    b.inplace("relu_", _relu_, x)
    x = b.op("fc", _linear(hidden, 1000, gen), x)
    return b.finish(x, input_shape=[1, 3, IMAGE_SIZE, IMAGE_SIZE], scale=scale)


def _attention_ops(b: _Builder, h: str, hidden: int, heads: int, gen: torch.Generator, causal: bool) -> str:
    """Attention as HF eager code runs it: QKV, scores, in-place scale and mask, softmax, context."""
    seq = b.values[h].shape[1]
    d = hidden // heads
    qkv = b.op("qkv", _linear(hidden, 3 * hidden, gen), h)
    split = lambda t, j: t[0, :, j * hidden:(j + 1) * hidden].view(seq, heads, d).transpose(0, 1)  # noqa: E731
    scores = b.op("scores", lambda t: torch.matmul(split(t, 0), split(t, 1).transpose(1, 2)), qkv)
    b.inplace("scale_", lambda s: s.mul_(1.0 / math.sqrt(d)), scores)
    if causal:
        mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)
        b.inplace("mask_", lambda s: s.masked_fill_(mask, float("-inf")), scores)
    probs = b.op("softmax", lambda s: torch.softmax(s, dim=-1), scores)
    ctx = b.op("context", lambda p, t: torch.matmul(p, split(t, 2)).transpose(0, 1).reshape(1, seq, hidden),
               probs, qkv)
    return b.op("proj", _linear(hidden, hidden, gen), ctx)


def _layer_norm(hidden: int, gen: torch.Generator) -> Callable:
    gamma, beta = 1.0 + 0.1 * torch.randn(hidden, generator=gen), 0.1 * torch.randn(hidden, generator=gen)
    return lambda x: F.layer_norm(x, (hidden,), gamma, beta)


def _transformer(name: str, layers: int, hidden: int, heads: int, vocab: int, causal: bool,
                 seed: int) -> OpModel:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (1, SEQ_LEN), generator=gen)
    b = _Builder(name, tokens)
    embed = torch.randn(vocab, hidden, generator=gen) * 0.02
    pos = torch.randn(SEQ_LEN, hidden, generator=gen) * 0.02
    h = b.op("embed", lambda t: F.embedding(t, embed), "input")
    b.inplace("add_pos_", lambda x: x.add_(pos), h)
    if not causal:  # BERT: post-LN (x = LN(x + sublayer(x))), GELU MLP
        h = b.op("ln", _layer_norm(hidden, gen), h)
        for _ in range(layers):
            a = _attention_ops(b, h, hidden, heads, gen, causal=False)
            b.inplace("residual_", _add_, a, h)
            h = b.op("ln", _layer_norm(hidden, gen), a)
            m = b.op("fc1", _linear(hidden, 4 * hidden, gen), h)
            m = b.op("gelu", F.gelu, m)
            m = b.op("fc2", _linear(4 * hidden, hidden, gen), m)
            b.inplace("residual_", _add_, m, h)
            h = b.op("ln", _layer_norm(hidden, gen), m)
        out = b.op("pooler", lambda x, lin=_linear(hidden, hidden, gen): torch.tanh(lin(x[:, 0])), h)
    else:  # GPT-2: pre-LN (x = x + sublayer(LN(x))), logits of the last position only (a prefill)
        for _ in range(layers):
            a = _attention_ops(b, b.op("ln", _layer_norm(hidden, gen), h), hidden, heads, gen, causal=True)
            h = b.op("residual", torch.add, h, a)
            m = b.op("fc1", _linear(hidden, 4 * hidden, gen), b.op("ln", _layer_norm(hidden, gen), h))
            m = b.op("gelu", lambda t: F.gelu(t, approximate="tanh"), m)
            h = b.op("residual", torch.add, h, b.op("fc2", _linear(4 * hidden, hidden, gen), m))
        h = b.op("ln", _layer_norm(hidden, gen), h)
        out = b.op("lm_head", lambda x: F.linear(x[:, -1], embed), h)
    return b.finish(out, seq_len=SEQ_LEN, layers=layers, hidden=hidden, heads=heads, vocab=vocab)


def bert(scale: float = 1.0, layers: int = 12, seed: int = 0) -> OpModel:
    hidden = max(16, int(768 * scale) // 16 * 16)
    return _transformer("bert", layers, hidden, 12 if hidden % 12 == 0 else 4, 30522, causal=False, seed=seed)


def gpt2(scale: float = 1.0, layers: int = 12, seed: int = 0) -> OpModel:
    hidden = max(16, int(768 * scale) // 16 * 16)
    return _transformer("gpt2", layers, hidden, 12 if hidden % 12 == 0 else 4, 50257, causal=True, seed=seed)


def llm(layers: int | None = None) -> OpModel:
    """The default LLM (SmolLM2-135M, real weights) as a DNN client: one prefill of SEQ_LEN tokens."""
    from backfill.engine.weights import load_model

    loaded = load_model(None)
    cfg, w = loaded.config, loaded.weights
    f32 = lambda name: w[name].to(torch.float32).contiguous()  # noqa: E731
    n_layers = cfg.num_layers if layers is None else min(layers, cfg.num_layers)
    hd, nh, nkv, hidden = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size
    gen = torch.Generator().manual_seed(0)
    b = _Builder("llm", torch.randint(0, cfg.vocab_size, (1, SEQ_LEN), generator=gen))
    embed = f32("model.embed_tokens.weight")
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    freqs = torch.outer(torch.arange(SEQ_LEN, dtype=torch.float64), inv_freq)
    cos, sin = [torch.cat([f, f], -1).to(torch.float32) for f in (freqs.cos(), freqs.sin())]

    def rope(t: torch.Tensor) -> torch.Tensor:
        half = t.shape[-1] // 2
        return t * cos + torch.cat([-t[..., half:], t[..., :half]], -1) * sin

    def rms(weight: torch.Tensor) -> Callable:
        return lambda x: F.rms_norm(x, (hidden,), weight, cfg.rms_norm_eps)

    def attention(x: torch.Tensor) -> torch.Tensor:
        q, k, v = x[0].split([nh * hd, nkv * hd, nkv * hd], -1)
        q = rope(q.view(SEQ_LEN, nh, hd).transpose(0, 1))
        k = rope(k.view(SEQ_LEN, nkv, hd).transpose(0, 1)).repeat_interleave(nh // nkv, 0)
        v = v.view(SEQ_LEN, nkv, hd).transpose(0, 1).repeat_interleave(nh // nkv, 0)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(1, SEQ_LEN, -1)

    h = b.op("embed", lambda t: F.embedding(t, embed), "input")
    for i in range(n_layers):
        p = f"model.layers.{i}."
        qkv_w = torch.cat([f32(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
        gate_up = torch.cat([f32(p + "mlp.gate_proj.weight"), f32(p + "mlp.up_proj.weight")])
        x = b.op("qkv", lambda t, wq=qkv_w: F.linear(t, wq), b.op("rms_norm", rms(f32(p + "input_layernorm.weight")), h))
        x = b.op("o_proj", lambda t, wo=f32(p + "self_attn.o_proj.weight"): F.linear(t, wo), b.op("attention", attention, x))
        b.inplace("residual_", _add_, h, x)  # HF Llama adds out of place; in place here keeps one residual stream
        x = b.op("gate_up", lambda t, wg=gate_up: F.linear(t, wg),
                 b.op("rms_norm", rms(f32(p + "post_attention_layernorm.weight")), h))
        x = b.op("silu_mul", lambda t: F.silu(t[..., :cfg.intermediate_size]) * t[..., cfg.intermediate_size:], x)
        x = b.op("down", lambda t, wd=f32(p + "mlp.down_proj.weight"): F.linear(t, wd), x)
        b.inplace("residual_", _add_, h, x)
    h = b.op("rms_norm", rms(f32("model.norm.weight")), h)
    out = b.op("lm_head", lambda x: F.linear(x[:, -1], embed), h)
    return b.finish(out, seq_len=SEQ_LEN, layers=n_layers, source=loaded.source)


def build_model(name: str, scale: float = 1.0) -> OpModel:
    """A model by name at `scale` of its widths; at test scales (<= 1/8) also fewer layers/blocks."""
    tiny = scale <= 0.125
    if name == "resnet152":
        return resnet152(scale, blocks=(1, 2, 2, 1)) if tiny else resnet152(scale)
    if name == "vgg19":
        return vgg19(scale)
    if name == "bert":
        return bert(scale, layers=2 if tiny else 12)
    if name == "gpt2":
        return gpt2(scale, layers=2 if tiny else 12)
    if name == "llm":
        return llm(2 if scale < 1 else None)
    raise RealtimeError(f"unknown model {name!r}; known: {', '.join(MODEL_NAMES)}")
