"""Server options: defaults < config file < BACKFILL_API_KEY < flags, each validated with a clear error."""

from __future__ import annotations

import argparse

import pytest

from backfill.errors import InvalidRequestError, ServerConfigError
from backfill.options import options_of, value_of
from backfill.policy.config import CoServeConfig
from backfill.policy.interface import SafepointLayout
from backfill.server.config import ServerConfig, add_serve_arguments, config_from_args, default_db_path
from backfill.serving.config import ServingConfig


def parse(*argv: str) -> ServerConfig:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_defaults(monkeypatch, tmp_path):
    monkeypatch.delenv("BACKFILL_API_KEY", raising=False)
    monkeypatch.setenv("BACKFILL_CACHE_DIR", str(tmp_path))
    config = parse()
    assert (config.host, config.port, config.api_key, config.tiny) == ("127.0.0.1", 8000, None, False)
    assert config.db_path == tmp_path / "server-8000.db" == default_db_path(8000)
    assert config.serving.policy == "coserve" and config.serving.coserve.slo.ttft_ms == 1000.0
    assert config.serving.coserve.interference_slack == 0.05


def test_flags_override_file_and_env(monkeypatch, tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('port = 9001\nttft-slo-ms = 250\napi_key = "from-file"\npolicy = "priority"\n'
                    'max_online_queue = 7\ntiny = true\n')
    monkeypatch.setenv("BACKFILL_API_KEY", "from-env")
    config = parse("--config", str(toml), "--port", "9002", "--tpot-slo-ms", "40", "--db", str(tmp_path / "d.db"))
    assert config.port == 9002 and config.max_online_queue == 7 and config.tiny
    assert config.api_key == "from-env"
    assert config.serving.coserve.slo.ttft_ms == 250.0 and config.serving.coserve.slo.tpot_ms == 40.0
    assert config.serving.policy == "priority"
    assert config.db_path == tmp_path / "d.db"
    assert parse("--config", str(toml), "--api-key", "from-flag").api_key == "from-flag"


def test_json_config_file(monkeypatch, tmp_path):
    monkeypatch.delenv("BACKFILL_API_KEY", raising=False)
    path = tmp_path / "c.json"
    path.write_text('{"kv-cache-gb": 2, "max_model_len": 1024, "max-body-mb": 5}')
    config = parse("--config", str(path))
    assert config.serving.kv_cache_gb == 2.0 and config.serving.max_model_len == 1024 and config.max_body_mb == 5.0
    tuned = parse("--preempt-target-ms", "4", "--interference-slack", "0.05").serving
    assert (tuned.coserve.preempt_target_ms, tuned.coserve.interference_slack) == (4.0, 0.05)


@pytest.mark.parametrize("text, suffix, message", [
    ("port = 'x'", ".toml", "port must be a int"),
    ("bogus = 1", ".toml", "unknown option 'bogus'"),
    ("port = ", ".toml", "not valid TOML"),
    ("[1, 2]", ".json", "table/object"),
    ('{"tiny": 1}', ".json", "tiny must be a bool"),
])
def test_bad_config_files(tmp_path, text, suffix, message):
    path = tmp_path / f"c{suffix}"
    path.write_text(text)
    with pytest.raises(ServerConfigError, match=message):
        parse("--config", str(path))


def test_missing_config_file(tmp_path):
    with pytest.raises(ServerConfigError, match="cannot read"):
        parse("--config", str(tmp_path / "nope.toml"))


@pytest.mark.parametrize("argv, error, message", [
    (["--port", "70000"], ServerConfigError, "port"),
    (["--max-online-queue", "0"], ServerConfigError, "max_online_queue"),
    (["--max-body-mb", "nan"], ServerConfigError, "max_body_mb"),
    (["--drain-timeout-s", "-1"], ServerConfigError, "drain_timeout_s"),
    (["--api-key", " "], ServerConfigError, "api_key"),
    (["--log-level", "loud"], ServerConfigError, "log_level"),
    (["--policy", "magic"], InvalidRequestError, "policy"),
    (["--dtype", "int3"], InvalidRequestError, "dtype"),
    (["--ttft-slo-ms", "0"], InvalidRequestError, "ttft_ms"),
    (["--kv-cache-gb", "0"], InvalidRequestError, "kv_cache_gb"),
    (["--preempt-target-ms", "0"], InvalidRequestError, "preempt_target_ms"),
    (["--interference-slack", "-0.5"], InvalidRequestError, "interference_slack"),
    (["--rider-cost-share", "-1"], InvalidRequestError, "rider_cost_share"),
    (["--rider-cost-share", "nan"], InvalidRequestError, "rider_cost_share"),
])
def test_invalid_values(monkeypatch, argv, error, message):
    monkeypatch.delenv("BACKFILL_API_KEY", raising=False)
    with pytest.raises(error, match=message):
        parse(*argv)


def test_tiny_gets_a_small_kv_cache_unless_set(monkeypatch):
    monkeypatch.delenv("BACKFILL_API_KEY", raising=False)
    assert parse("--tiny").serving.kv_cache_gb < 0.1
    assert parse("--tiny", "--kv-cache-gb", "0.5").serving.kv_cache_gb == 0.5


def test_tiny_is_hidden_from_help():
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert "--tiny" not in parser.format_help() and "--max-online-queue" in parser.format_help()


def test_auto_dtype_resolves_per_device(monkeypatch):
    import torch

    from backfill.engine import linear, small_batch_matmul

    config = parse("--dtype", "auto", "--device", "cpu")
    assert config.serving.dtype == "auto"
    monkeypatch.setattr(linear, "cpu_has_bf16_matmul", lambda: False)
    monkeypatch.setattr(small_batch_matmul, "kernel_isa", lambda: None)
    assert config.serving.resolved_dtype == "float32" and config.serving.torch_dtype.is_floating_point
    # AVX2: bf16 weights that compiled steps read at two bytes, computed (and cached) in fp32.
    monkeypatch.setattr(small_batch_matmul, "kernel_isa", lambda: "avx2")
    assert config.serving.resolved_dtype == "bfloat16" and config.serving.compute_dtype == torch.float32
    assert parse("--dtype", "auto", "--device", "cpu", "--no-compile-decode").serving.resolved_dtype == "float32"
    monkeypatch.setattr(linear, "cpu_has_bf16_matmul", lambda: True)
    assert config.serving.resolved_dtype == "bfloat16" and config.serving.compute_dtype == torch.bfloat16
    assert parse("--dtype", "float16").serving.resolved_dtype == "float16"


@pytest.mark.parametrize("field, flag, default, bad", [
    ("compile_decode", "--no-compile-decode", True, '"yes"'),
    ("cuda_graphs", "--no-cuda-graphs", True, '"off"'),
    ("release_suspended", "--no-release-suspended", True, '"no"'),
])
def test_switch_from_flag_or_file(tmp_path, field, flag, default, bad):
    key = field.replace("_", "-")
    option = next(o for o in options_of(ServingConfig) if o.name == field)
    assert value_of(parse().serving, option) is default
    assert value_of(parse(flag).serving, option) is (not default)
    toml = tmp_path / "c.toml"
    toml.write_text(f"{key} = {str(not default).lower()}\n")
    assert value_of(parse("--config", str(toml)).serving, option) is (not default)
    toml.write_text(f"{key} = {bad}\n")
    with pytest.raises(ServerConfigError, match=f"{key} must be a bool"):
        parse("--config", str(toml))


def test_serve_runs_the_commands_defaults_below_file_and_flags(tmp_path):
    """`backfill serve` as a user starts it runs what the other commands run (auto dtype, compiled
    steps); a config file and a flag each override them; the tiny test model keeps the dataclass's."""
    assert (parse().serving.dtype, parse().serving.compile_decode) == ("auto", True)
    toml = tmp_path / "c.toml"
    toml.write_text('dtype = "float32"\ncompile-decode = false\n')
    from_file = parse("--config", str(toml)).serving
    assert (from_file.dtype, from_file.compile_decode) == ("float32", False)
    assert parse("--config", str(toml), "--dtype", "bfloat16").serving.dtype == "bfloat16"
    tiny = parse("--tiny").serving
    assert (tiny.dtype, tiny.compile_decode) == ("float32", False)


def test_cuda_graphs_change_nothing_on_a_cpu():
    # Graphs are a CUDA mechanism: on a CPU the setting changes nothing.
    assert not parse("--device", "cpu").serving.uses_cuda_graphs


def test_decode_attention_from_flag_or_file(tmp_path):
    assert parse().serving.decode_attention == "auto"
    assert parse("--decode-attention", "sdpa").serving.decode_attention == "sdpa"
    toml = tmp_path / "c.toml"
    toml.write_text('decode-attention = "sdpa"\n')
    assert parse("--config", str(toml)).serving.decode_attention == "sdpa"
    toml.write_text('decode-attention = "flash"\n')
    with pytest.raises(InvalidRequestError, match="decode_attention must be one of auto, sdpa"):
        parse("--config", str(toml))


def test_release_suspended_reaches_the_coserve_policy():
    from backfill.policy.latency_model import LatencyModel
    from backfill.serving.build import make_policy

    latency = LatencyModel((1, 64), (1.0, 2.0))
    layout = SafepointLayout(4, 0.5)
    assert make_policy(ServingConfig(), latency, layout).config.release_suspended is True
    held = ServingConfig(coserve=CoServeConfig(release_suspended=False))
    assert make_policy(held, latency, layout).config.release_suspended is False


def test_rider_cost_share_from_flag_or_file_reaches_the_riders(tmp_path):
    from backfill.policy.latency_model import LatencyModel
    from backfill.serving.build import make_policy

    assert parse().serving.coserve.rider_cost_share == 1.0
    assert parse("--rider-cost-share", "1").serving.coserve.rider_cost_share == 1.0
    toml = tmp_path / "c.toml"
    toml.write_text("rider-cost-share = 0.8\n")
    serving = parse("--config", str(toml)).serving
    assert make_policy(serving, LatencyModel((1, 64), (1.0, 2.0)), SafepointLayout(4, 0.5)).riders.cost_share == 0.8
    toml.write_text('rider-cost-share = "half"\n')
    with pytest.raises(ServerConfigError, match="rider-cost-share"):
        parse("--config", str(toml))
