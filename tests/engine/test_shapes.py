"""The random-weight shapes: each family's options, loading as random:SHAPE, and the CLI flags."""

import argparse

import pytest

from backfill.cli import build_parser
from backfill.engine.shapes import SHAPES, model_from_args, shape_config
from backfill.engine.weights import load_model, read_model_config
from backfill.engine.loaded_model import expected_weight_shapes
from backfill.errors import InvalidRequestError, UnsupportedModelError


def test_shapes_carry_their_family_options():
    assert shape_config("llama3-8b").rope_scaling.factor == 8.0
    assert shape_config("llama3.2-3b").rope_scaling.factor == 32.0
    assert shape_config("qwen2.5-7b").qkv_bias and shape_config("qwen2.5-7b").num_kv_heads == 4
    qwen3 = shape_config("qwen3-tiny")
    assert qwen3.qk_norm and qwen3.head_dim * qwen3.num_heads != qwen3.hidden_size
    for name in SHAPES:  # the default tokenizer's ids must be valid rows of every embedding
        assert shape_config(name).vocab_size >= 49152, name
    with pytest.raises(UnsupportedModelError, match="unknown model shape 'gpt-5'"):
        shape_config("gpt-5")


def test_random_shape_loads_with_the_default_tokenizer():
    loaded = load_model("random:qwen2.5-tiny")
    assert loaded.config.name == "random-qwen2.5-tiny" and loaded.config == read_model_config("random:qwen2.5-tiny")
    assert {k: tuple(v.shape) for k, v in loaded.weights.items()} == expected_weight_shapes(loaded.config)
    assert loaded.weights["model.layers.0.self_attn.q_proj.bias"].std() > 0
    assert loaded.tokenizer.encode_chat([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("argv", [["bench", "engine"], ["bench", "coserve"], ["profile"], ["sim", "coserve"]])
def test_commands_take_random_weights_and_a_shape(argv):
    args = build_parser().parse_args([*argv, "--random-weights", "--shape", "llama3.1-tiny"])
    assert model_from_args(args) == "random:llama3.1-tiny"
    assert model_from_args(build_parser().parse_args([*argv, "--random-weights"])) == "random:smollm2-135m"


def test_shape_flags_misuse_is_an_error():
    with pytest.raises(InvalidRequestError, match="--shape needs --random-weights"):
        model_from_args(argparse.Namespace(model=None, random_weights=False, shape="qwen3-tiny"))
    with pytest.raises(InvalidRequestError, match="replaces --model"):
        model_from_args(argparse.Namespace(model="x.gguf", random_weights=True, shape=None))
