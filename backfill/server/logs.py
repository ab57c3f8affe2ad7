"""The server's log lines: text (the default) or JSON, one object a line (--log-format json).

A JSON line has `time` (UTC, ISO 8601 with milliseconds), `level`, `logger` and `message`, plus
the fields a line was logged with (`extra={"fields": {...}}`): the access log's request id, trace
id, client address, model, class and status, so a log pipeline (Loki, Elasticsearch, Cloud
Logging) can index them and join a request's line to its trace.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {"time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
                "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage()}
        line.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure_logging(log_level: str, log_format: str) -> None:
    """The root logger's level and format (uvicorn's own loggers propagate to it)."""
    level = logging.DEBUG if log_level in ("debug", "trace") else getattr(logging, log_level.upper(), logging.INFO)
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    if log_format == "json":   # uvicorn's loggers keep their own text handlers unless told otherwise
        for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
            logger = logging.getLogger(name)
            logger.handlers[:] = []
            logger.propagate = True
