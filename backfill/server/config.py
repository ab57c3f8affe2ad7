"""Server options: one frozen config, from defaults < config file < BACKFILL_API_KEY < CLI flags.

Kept free of heavy imports (torch, fastapi) so `backfill serve --help` is instant.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from backfill.errors import ServerConfigError
from backfill.options import Option, add_arguments, build, knob, options_of
from backfill.paths import cache_root
from backfill.serving.config import COMMAND_DEFAULTS, ServingConfig
from backfill.validation import check_int, check_non_negative, check_positive

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
LOG_FORMATS = ("text", "json")
# auto: the faster one where it is installed (uvicorn[standard]'s httptools, uvloop), else the fallback.
HTTP_PARSERS = ("auto", "httptools", "h11")
EVENT_LOOPS = ("auto", "uvloop", "asyncio")
TINY_KV_CACHE_GB = 0.0625   # the tiny test model needs a few MiB of KV, not the real model's 1 GiB


def default_db_path(port: int) -> Path:
    """One database per port under the cache dir: a restart on the same port finds its batches,
    and two servers on different ports never run each other's."""
    return cache_root() / f"server-{port}.db"


@dataclass(frozen=True)
class ServerConfig:
    host: str = knob("127.0.0.1", "address to bind", group="server")
    port: int = knob(8000, "port to bind", group="server")
    db: str | None = knob(None, "SQLite file for files and batches; unset: server-<port>.db under "
                          "$BACKFILL_CACHE_DIR or ~/.cache/backfill", group="server")
    api_key: str | None = knob(None, "require 'Authorization: Bearer KEY' on /v1/* (also env BACKFILL_API_KEY)",
                               group="server")
    allowed_hosts: str | None = knob(None, "comma-separated Host names served besides the bound address and "
                                     "localhost / 127.0.0.1 / ::1 ('*': any); others get 403 (DNS rebinding)",
                                     group="server")
    allowed_origins: str | None = knob(None, "comma-separated web origins (e.g. https://app.example) allowed to "
                                       "call the server from a browser, with CORS ('*': any); requests from "
                                       "other origins get 403", group="server")
    max_online_queue: int = knob(256, "online (and, separately, flex) requests in flight before new ones get 429",
                                 group="server")
    # Half the SLO: under a burst the engine shares the CPU with parsing and refusing the burst, so
    # admitted requests run slower than predicted; the other half is the margin for that.
    admission_ttft_share: float = knob(0.5, "admit an online request while its predicted time to first token "
                                       "is within this share of the TTFT SLO, else 429 with Retry-After (inf: "
                                       "only --max-online-queue limits)", group="server")
    max_body_mb: float = knob(200.0, "largest request body, MiB (OpenAI's batch input limit); larger get 413",
                              group="server")
    max_offline_in_flight: int = knob(64, "batch lines in the engine at once", group="server")
    drain_timeout_s: float = knob(30.0, "on SIGTERM, the most time from the signal to the exit: in-flight requests "
                                  "run until just before it, then end with a 503 error (streams: an error chunk "
                                  "and [DONE]); the process exits 0 within it", group="server")
    drain_pre_stop_s: float = knob(0.0, "on SIGTERM, keep taking new requests this long while /ready says 503 "
                                   "'draining', so that a load balancer stops routing here before requests are "
                                   "refused; counted within --drain-timeout-s", group="server")
    served_model_name: str | None = knob(None, "model id clients send; unset: the model's name", group="server")
    log_level: str = knob("info", "log level", group="server", choices=LOG_LEVELS)
    log_format: str = knob("text", "log lines as text, or json: one object a line (an access line's request id, "
                           "trace id, client, model, class and status as keys)", group="server", choices=LOG_FORMATS)
    tiny: bool = knob(False, "tiny random-weight model (tests only)", group="server")
    fresh_db: bool = knob(False, "start even if the database is damaged or an empty file: move it aside "
                          "(PATH.damaged-<time>) and start with an empty one (default: refuse to start, exit 2)",
                          group="server")
    header_timeout_s: float = knob(10.0, "close a connection whose request headers are not complete after this "
                                   "long, s", group="server")
    body_timeout_s: float = knob(30.0, "answer 408 when a request body stalls this long between reads, s",
                                 group="server")
    http_parser: str = knob("auto", "HTTP/1.1 parser: httptools (C) or h11 (pure Python); auto: httptools where "
                            "installed", group="server", choices=HTTP_PARSERS)
    event_loop: str = knob("auto", "event loop: uvloop or asyncio's own; auto: uvloop where installed",
                           group="server", choices=EVENT_LOOPS)
    otlp_traces_endpoint: str | None = knob(None, "export OpenTelemetry traces of requests and batch lines over "
                                            "OTLP/HTTP to this URL (e.g. http://localhost:4318/v1/traces); the "
                                            "OTEL_EXPORTER_OTLP_* variables also turn it on (docs/operations.md)",
                                            group="server")
    serving: ServingConfig | None = None   # the engine config (config_from_args fills it)

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ServerConfigError("host must be a non-empty string")
        check_int(ServerConfigError, "port", self.port, 1, 65535)
        check_int(ServerConfigError, "max_online_queue", self.max_online_queue, 1)
        check_int(ServerConfigError, "max_offline_in_flight", self.max_offline_in_flight, 1)
        check_positive(ServerConfigError, "max_body_mb", self.max_body_mb)
        if not isinstance(self.admission_ttft_share, (int, float)) or isinstance(self.admission_ttft_share, bool) \
                or math.isnan(self.admission_ttft_share) or self.admission_ttft_share <= 0:
            raise ServerConfigError(f"admission_ttft_share must be a positive number or inf, got "
                                    f"{self.admission_ttft_share!r}")
        check_non_negative(ServerConfigError, "drain_timeout_s", self.drain_timeout_s)
        check_non_negative(ServerConfigError, "drain_pre_stop_s", self.drain_pre_stop_s)
        if self.drain_pre_stop_s > self.drain_timeout_s:
            raise ServerConfigError(f"drain_pre_stop_s ({self.drain_pre_stop_s:g}) must not exceed drain_timeout_s "
                                    f"({self.drain_timeout_s:g}): the pre-stop delay is part of the drain")
        check_positive(ServerConfigError, "header_timeout_s", self.header_timeout_s)
        check_positive(ServerConfigError, "body_timeout_s", self.body_timeout_s)
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.strip()):
            raise ServerConfigError("api_key must be a non-empty string")
        if self.served_model_name is not None and not self.served_model_name:
            raise ServerConfigError("served_model_name must be a non-empty string")
        for name, value, allowed in (("http_parser", self.http_parser, HTTP_PARSERS),
                                     ("event_loop", self.event_loop, EVENT_LOOPS),
                                     ("log_format", self.log_format, LOG_FORMATS)):
            if value not in allowed:
                raise ServerConfigError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        if self.log_level not in LOG_LEVELS:
            raise ServerConfigError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")

    @property
    def db_path(self) -> Path:
        return Path(self.db).expanduser() if self.db else default_db_path(self.port)


def serve_options() -> tuple[Option, ...]:
    """Every option of `backfill serve`: the server's own, then the serving config tree's."""
    return options_of(ServerConfig) + options_of(ServingConfig)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `backfill serve` / `python -m backfill.server`; an absent flag is unset."""
    parser.add_argument("--config", default=None, metavar="FILE", help="TOML or JSON file with the same keys as "
                        "these options (dashes or underscores); flags given here override it. A TOML file with "
                        "[node] / [[models]] starts a node of several models instead (docs/node.md)")
    add_arguments(parser, serve_options(), hidden=("tiny",), shown_defaults=COMMAND_DEFAULTS)


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
    types = {o.name: o.type for o in serve_options()}
    values: dict[str, object] = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        expected = types.get(key)
        if expected is None:
            raise ServerConfigError(f"config file {path}: unknown option {raw_key!r} "
                                    f"(known: {', '.join(sorted(types))})")
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise ServerConfigError(f"config file {path}: {raw_key} must be a {expected.__name__}, "
                                    f"got {value!r}")
        values[key] = value
    return values


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Merge defaults < --config file < BACKFILL_API_KEY < flags into a validated ServerConfig."""
    values: dict[str, object] = {}
    if getattr(args, "config", None):
        values.update(load_config_file(args.config))
    if os.environ.get("BACKFILL_API_KEY"):
        values["api_key"] = os.environ["BACKFILL_API_KEY"]
    for option in serve_options():
        if hasattr(args, option.name):
            values[option.name] = getattr(args, option.name)
    server_keys = {o.name for o in options_of(ServerConfig)}
    serving_values = {k: v for k, v in values.items() if k not in server_keys}
    if values.get("tiny"):
        serving_values.setdefault("kv_cache_gb", TINY_KV_CACHE_GB)
    else:  # the commands' defaults, below the file and the flags (the tiny test model keeps the dataclass's)
        serving_values = {k: v for k, v in COMMAND_DEFAULTS.items() if k not in serving_values} | serving_values
    serving = build(ServingConfig, serving_values)
    return ServerConfig(serving=serving, **{k: v for k, v in values.items() if k in server_keys})
