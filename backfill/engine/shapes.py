"""Named model shapes for random-weight runs: `--random-weights --shape NAME`, or the model path
`random:NAME`.

A decode step's speed depends on the shapes of the weights, not on their values, so benchmarks of
the families people serve (Llama 3.1 / 3.2, Qwen2.5, Qwen3, Mistral) need no download. Each big
shape is the published config of its model; each `-tiny` shape keeps its family's options (RoPE
scaling, q/k/v biases, q/k norm with head_dim apart from hidden / heads) at a size a 2-core CPU
runs in a smoke test. All of them carry the default model's tokenizer, so the vocabulary is at
least its 49,152 tokens.
"""

from __future__ import annotations

from backfill.engine.config import Llama3RopeScaling, ModelConfig
from backfill.errors import UnsupportedModelError

DEFAULT_SHAPE = "smollm2-135m"

_LLAMA31_ROPE = Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=8192)
_LLAMA32_ROPE = Llama3RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=8192)
_DEFAULT_VOCAB = 49152  # the default model's tokenizer: the tiny shapes' vocabulary


def _llama31_8b() -> dict:
    return dict(architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                num_layers=32, num_heads=32, num_kv_heads=8, max_position_embeddings=131072,
                rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000,
                eos_token_id=128009, rope_scaling=_LLAMA31_ROPE)


_SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(vars(ModelConfig.smollm2_135m()), name=None),
    "llama3-8b": _llama31_8b(),
    "llama3.1-8b": _llama31_8b(),
    "llama3.2-3b": dict(architecture="llama", vocab_size=128256, hidden_size=3072, intermediate_size=8192,
                        num_layers=28, num_heads=24, num_kv_heads=8, head_dim=128, max_position_embeddings=131072,
                        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=128000,
                        eos_token_id=128009, rope_scaling=_LLAMA32_ROPE),
    "qwen2.5-7b": dict(architecture="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_layers=28, num_heads=28, num_kv_heads=4, max_position_embeddings=32768,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       bos_token_id=151643, eos_token_id=151645, qkv_bias=True),
    "qwen3-8b": dict(architecture="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=40960,
                     rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                     bos_token_id=151643, eos_token_id=151645, qk_norm=True),
    # CPU-sized members of each family (about 15-30M parameters, most of them the embedding).
    "llama3.1-tiny": dict(architecture="llama", vocab_size=_DEFAULT_VOCAB, hidden_size=256, intermediate_size=768,
                          num_layers=4, num_heads=8, num_kv_heads=2, max_position_embeddings=8192,
                          rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                          bos_token_id=1, eos_token_id=2, rope_scaling=_LLAMA31_ROPE),
    "qwen2.5-tiny": dict(architecture="qwen2", vocab_size=_DEFAULT_VOCAB, hidden_size=256, intermediate_size=768,
                         num_layers=4, num_heads=8, num_kv_heads=2, max_position_embeddings=8192,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, qkv_bias=True),
    "qwen3-tiny": dict(architecture="qwen3", vocab_size=_DEFAULT_VOCAB, hidden_size=256, intermediate_size=768,
                       num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64, max_position_embeddings=8192,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                       bos_token_id=1, eos_token_id=2, qk_norm=True),
    "mistral-tiny": dict(architecture="mistral", vocab_size=_DEFAULT_VOCAB, hidden_size=256, intermediate_size=768,
                         num_layers=4, num_heads=8, num_kv_heads=2, max_position_embeddings=8192,
                         rope_theta=1000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2),
}

SHAPES = tuple(_SHAPES)


RANDOM_PREFIX = "random:"


def random_model_name(shape: str) -> str:
    """The model path that load_model reads as random weights of a registered shape."""
    return RANDOM_PREFIX + shape


def shape_config(shape: str) -> ModelConfig:
    """The ModelConfig of a registered shape, named random-SHAPE."""
    if shape not in _SHAPES:
        raise UnsupportedModelError(f"unknown model shape {shape!r} (known: {', '.join(SHAPES)})")
    return ModelConfig(**{**_SHAPES[shape], "name": f"random-{shape}"})


def add_shape_args(parser) -> None:
    """--random-weights and --shape on a command that takes --model."""
    parser.add_argument("--random-weights", action="store_true",
                        help="random weights instead of --model (speed does not depend on the values), with the "
                             "default model's tokenizer")
    parser.add_argument("--shape", default=None, choices=SHAPES,
                        help=f"with --random-weights: the model shape (default {DEFAULT_SHAPE}); docs/models.md")


def model_from_args(args) -> str | None:
    """The model path a command's --model / --random-weights / --shape name (random:SHAPE for random weights)."""
    from backfill.errors import InvalidRequestError

    if not getattr(args, "random_weights", False):
        if getattr(args, "shape", None) is not None:
            raise InvalidRequestError("--shape needs --random-weights")
        return getattr(args, "model", None)
    if getattr(args, "model", None) is not None:
        raise InvalidRequestError("--random-weights replaces --model: give one of them")
    return random_model_name(args.shape or DEFAULT_SHAPE)
