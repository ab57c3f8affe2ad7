"""Server options: one frozen config, from defaults < config file < BACKFILL_API_KEY < CLI flags.

Kept free of heavy imports (torch, fastapi) so `backfill serve --help` is instant.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from backfill.server.errors import ServerConfigError

if TYPE_CHECKING:
    from backfill.serving.build import ServingConfig

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
TINY_KV_CACHE_GB = 0.0625   # the tiny test model needs a few MiB of KV, not the real model's 1 GiB

# Every option of `backfill serve`, with its type (config-file values are checked against it).
OPTION_TYPES: dict[str, type] = {
    "host": str, "port": int, "model": str, "dtype": str, "device": str, "policy": str,
    "ttft_slo_ms": float, "tpot_slo_ms": float, "kv_cache_gb": float, "max_model_len": int,
    "db": str, "api_key": str, "max_online_queue": int, "max_body_mb": float,
    "max_offline_in_flight": int, "drain_timeout_s": float, "served_model_name": str,
    "log_level": str, "tiny": bool, "preempt_target_ms": float, "interference_slack": float, "compile_decode": bool,
    "decode_attention": str, "cuda_graphs": bool, "release_suspended": bool,
    "rider_cost_share": float, "fresh_db": bool, "header_timeout_s": float, "body_timeout_s": float,
}
_SERVING_KEYS = ("model", "dtype", "device", "policy", "kv_cache_gb", "max_model_len", "preempt_target_ms",
                 "interference_slack", "compile_decode", "decode_attention", "cuda_graphs", "release_suspended",
                 "rider_cost_share")


def default_db_path(port: int) -> Path:
    """One database per port under the cache dir: a restart on the same port finds its batches,
    and two servers on different ports never run each other's."""
    root = Path(os.environ.get("BACKFILL_CACHE_DIR", Path.home() / ".cache" / "backfill"))
    return root / f"server-{port}.db"


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    db: str | None = None                  # SQLite file; None = default_db_path(port)
    api_key: str | None = None             # Bearer token required on /v1/* when set
    max_online_queue: int = 256            # online (and, separately, flex) requests in flight; more get 429
    max_body_mb: float = 200.0             # OpenAI's batch input limit is 200 MB
    max_offline_in_flight: int = 64        # batch lines in the engine at once
    drain_timeout_s: float = 30.0          # SIGTERM: how long in-flight work may take to finish
    served_model_name: str | None = None   # the model id clients send; default: the engine's model name
    log_level: str = "info"
    fresh_db: bool = False                 # a damaged or 0-byte database is moved aside, not refused
    header_timeout_s: float = 10.0         # a client must finish its request headers within this
    body_timeout_s: float = 30.0           # longest wait for the next piece of a request body
    tiny: bool = False                     # tiny random-weight model (tests only)
    serving: ServingConfig | None = None   # the engine config (config_from_args fills it)

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ServerConfigError("host must be a non-empty string")
        _check_int("port", self.port, 1, 65535)
        _check_int("max_online_queue", self.max_online_queue, 1)
        _check_int("max_offline_in_flight", self.max_offline_in_flight, 1)
        _check_number("max_body_mb", self.max_body_mb, positive=True)
        _check_number("drain_timeout_s", self.drain_timeout_s, positive=False)
        _check_number("header_timeout_s", self.header_timeout_s, positive=True)
        _check_number("body_timeout_s", self.body_timeout_s, positive=True)
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.strip()):
            raise ServerConfigError("api_key must be a non-empty string")
        if self.served_model_name is not None and not self.served_model_name:
            raise ServerConfigError("served_model_name must be a non-empty string")
        if self.log_level not in LOG_LEVELS:
            raise ServerConfigError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")

    @property
    def db_path(self) -> Path:
        return Path(self.db).expanduser() if self.db else default_db_path(self.port)


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise ServerConfigError(f"{name} must be an integer {bound}, got {value!r}")


def _check_number(name: str, value: object, positive: bool) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        raise ServerConfigError(f"{name} must be a {'positive' if positive else 'non-negative'} number, "
                                f"got {value!r}")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `backfill serve` / `python -m backfill.server` (all default to None = unset)."""
    p = parser.add_argument
    p("--config", default=None, metavar="FILE", help="TOML or JSON file with the same keys as these options "
      "(dashes or underscores); flags given here override it")
    p("--host", default=None, help="address to bind (default 127.0.0.1)")
    p("--port", type=int, default=None, help="port to bind (default 8000)")
    p("--model", default=None, help="GGUF file or HF directory (default: embedded SmolLM2-135M-Instruct)")
    p("--served-model-name", default=None, help="model id clients use (default: the model's name)")
    p("--dtype", default=None, help="float32 (default), bfloat16, float16 or auto (bfloat16 where it has fast matmuls)")
    p("--device", default=None, help="auto (default), cpu or cuda[:N]")
    p("--policy", default=None, help="scheduling policy: coserve (default), priority, fcfs or online-only")
    p("--ttft-slo-ms", type=float, default=None, help="online time-to-first-token SLO (default 1000)")
    p("--tpot-slo-ms", type=float, default=None, help="online time-per-output-token SLO (default 100)")
    p("--kv-cache-gb", type=float, default=None, help="KV cache size in GiB (default 1)")
    p("--preempt-target-ms", type=float, default=None,
      help="coserve: longest offline work between two safepoints (default 8)")
    p("--interference-slack", type=float, default=None,
      help="coserve: a co-serving step may take at most (1 + this) x its online work alone "
      "(default 0.05; inf: no cap)")
    p("--no-release-suspended", dest="release_suspended", action="store_false", default=None,
      help="coserve: co-serving steps never take requests of the offline step an arrival suspended")
    p("--rider-cost-share", type=float, default=None,
      help="coserve: an offline decode rides in a co-serving step only when it adds at most this share "
      "of what an offline batch spends on a token (default 0.5)")
    p("--compile-decode", action="store_true", default=None,
      help="CPU: compile single-sequence decode steps with inductor (faster batch-1 decode)")
    p("--decode-attention", default=None, choices=["auto", "sdpa"],
      help="auto (default): on CPU, read the paged KV cache in place with a C++ kernel; sdpa: gather + SDPA")
    p("--no-cuda-graphs", dest="cuda_graphs", action="store_false", default=None,
      help="CUDA: launch every decode kernel from Python instead of replaying captured graphs")
    p("--max-model-len", type=int, default=None, help="longest prompt + output in tokens (default 2048)")
    p("--db", default=None, metavar="PATH", help="SQLite file for files and batches "
      "(default $BACKFILL_CACHE_DIR or ~/.cache/backfill, server-<port>.db)")
    p("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* (also env BACKFILL_API_KEY)")
    p("--max-online-queue", type=int, default=None, metavar="N",
      help="online requests in flight before new ones get 429 (default 256)")
    p("--max-offline-in-flight", type=int, default=None, metavar="N",
      help="batch lines in the engine at once (default 64)")
    p("--max-body-mb", type=float, default=None, help="largest request body, MiB (default 200); larger get 413")
    p("--drain-timeout-s", type=float, default=None, help="on SIGTERM, time allowed for in-flight work (default 30)")
    p("--fresh-db", action="store_true", default=None,
      help="start even if the database is damaged or an empty file: move it aside (PATH.damaged-<time>) "
      "and start with an empty one (default: refuse to start, exit 2)")
    p("--header-timeout-s", type=float, default=None,
      help="close a connection whose request headers are not complete after this long (default 10)")
    p("--body-timeout-s", type=float, default=None,
      help="answer 408 when a request body stalls this long between reads (default 30)")
    p("--log-level", default=None, help=f"one of {', '.join(LOG_LEVELS)} (default info)")
    p("--tiny", action="store_true", default=None, help=argparse.SUPPRESS)


def load_config_file(path: str | Path) -> dict[str, object]:
    """Keys of a TOML or JSON file, normalised to underscores and type-checked."""
    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ServerConfigError(f"cannot read config file {path}: {exc}") from None
    try:
        data = json.loads(text) if path.suffix.lower() == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        kind = "JSON" if path.suffix.lower() == ".json" else "TOML"
        raise ServerConfigError(f"config file {path} is not valid {kind}: {exc}") from None
    if not isinstance(data, dict):
        raise ServerConfigError(f"config file {path} must hold a table/object of options")
    values: dict[str, object] = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        expected = OPTION_TYPES.get(key)
        if expected is None:
            raise ServerConfigError(f"config file {path}: unknown option {raw_key!r} "
                                    f"(known: {', '.join(sorted(OPTION_TYPES))})")
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise ServerConfigError(f"config file {path}: {raw_key} must be a {expected.__name__}, "
                                    f"got {value!r}")
        values[key] = value
    return values


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Merge defaults < --config file < BACKFILL_API_KEY < flags into a validated ServerConfig."""
    from backfill.serving.api import SLO
    from backfill.serving.build import ServingConfig

    values: dict[str, object] = {}
    if getattr(args, "config", None):
        values.update(load_config_file(args.config))
    if os.environ.get("BACKFILL_API_KEY"):
        values["api_key"] = os.environ["BACKFILL_API_KEY"]
    for key in OPTION_TYPES:
        flag = getattr(args, key, None)
        if flag is not None:
            values[key] = flag
    serving_defaults = ServingConfig()
    serving_kwargs = {key: values[key] for key in _SERVING_KEYS if key in values}
    if values.get("tiny") and "kv_cache_gb" not in serving_kwargs:
        serving_kwargs["kv_cache_gb"] = TINY_KV_CACHE_GB
    slo = SLO(ttft_ms=values.get("ttft_slo_ms", serving_defaults.slo.ttft_ms),
              tpot_ms=values.get("tpot_slo_ms", serving_defaults.slo.tpot_ms))
    serving = ServingConfig(slo=slo, **serving_kwargs)
    server_keys = {f.name for f in fields(ServerConfig)} - {"serving"}
    return ServerConfig(serving=serving, **{k: v for k, v in values.items() if k in server_keys})
