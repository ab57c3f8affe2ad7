"""Replay of public LLM serving traces: BurstGPT, Azure LLM inference, Mooncake.

Each loader returns a `Trace`: records sorted by arrival, timestamps re-based so the first
request arrives at 0 s and divided by `speedup` (2.0 replays twice as fast), cut to the first
`max_requests`. A malformed row raises TraceFormatError naming the file and 1-based line.

Formats (as published):
  BurstGPT  CSV  Timestamp (s), Model, Request tokens, Response tokens, Total tokens, Log Type.
            Rows with 0 response tokens are failed requests in that trace; they are skipped.
  Azure     CSV  TIMESTAMP ("2023-11-16 18:15:46.6805900", up to 7 fractional digits, optional
            UTC offset), ContextTokens, GeneratedTokens.
  Mooncake  JSONL  timestamp (ms), input_length, output_length, optional hash_ids (512-token
            block hashes; kept so a caller can rebuild shared prefixes).
"""

from __future__ import annotations

import calendar
import csv
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from backfill.errors import TraceFormatError

FORMATS = ("burstgpt", "azure", "mooncake")


@dataclass(frozen=True)
class TraceRecord:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Trace:
    records: tuple[TraceRecord, ...]
    source: str
    format: str

    def __len__(self) -> int:
        return len(self.records)

    @property
    def duration_s(self) -> float:
        return self.records[-1].arrival_s if self.records else 0.0

    @property
    def arrivals_s(self) -> list[float]:
        return [r.arrival_s for r in self.records]


def load_trace(path: str | Path, fmt: str | None = None, *, speedup: float = 1.0,
               max_requests: int | None = None) -> Trace:
    """Load a trace; fmt is one of FORMATS, or None to pick it from the extension and header."""
    path = Path(path)
    fmt = fmt or _detect(path)
    if fmt == "burstgpt":
        return load_burstgpt(path, speedup=speedup, max_requests=max_requests)
    if fmt == "azure":
        return load_azure(path, speedup=speedup, max_requests=max_requests)
    if fmt == "mooncake":
        return load_mooncake(path, speedup=speedup, max_requests=max_requests)
    raise TraceFormatError(f"{path}: unknown trace format {fmt!r}; known: {', '.join(FORMATS)}")


def load_burstgpt(path: str | Path, *, speedup: float = 1.0, max_requests: int | None = None,
                  model: str | None = None) -> Trace:
    """BurstGPT CSV; `model` keeps only rows of that Model column value (e.g. "ChatGPT")."""
    path = Path(path)
    rows = []
    for line, row in _csv_rows(path, ("Timestamp", "Request tokens", "Response tokens")):
        if model is not None and row.get("Model") != model:
            continue
        ts = _number(row["Timestamp"], "Timestamp", path, line)
        prompt = _count(row["Request tokens"], "Request tokens", path, line)
        output = _count(row["Response tokens"], "Response tokens", path, line)
        if output == 0:
            continue
        rows.append((ts, TraceRecord(0.0, prompt, output)))
    return _finish(rows, path, "burstgpt", speedup, max_requests)


def load_azure(path: str | Path, *, speedup: float = 1.0, max_requests: int | None = None) -> Trace:
    """Azure LLM inference trace CSV (2023 and 2024 releases)."""
    path = Path(path)
    rows = []
    for line, row in _csv_rows(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens")):
        ts = parse_azure_timestamp(row["TIMESTAMP"], path, line)
        prompt = _count(row["ContextTokens"], "ContextTokens", path, line)
        output = _count(row["GeneratedTokens"], "GeneratedTokens", path, line)
        if output == 0:
            continue
        rows.append((ts, TraceRecord(0.0, prompt, output)))
    return _finish(rows, path, "azure", speedup, max_requests)


def load_mooncake(path: str | Path, *, speedup: float = 1.0, max_requests: int | None = None) -> Trace:
    """Mooncake JSONL (one object per line; blank lines are ignored)."""
    path = Path(path)
    rows = []
    for line, text in _lines(path):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"{path}:{line}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise TraceFormatError(f"{path}:{line}: expected a JSON object, got {type(obj).__name__}")
        for key in ("timestamp", "input_length", "output_length"):
            if key not in obj:
                raise TraceFormatError(f"{path}:{line}: missing field {key!r}")
        ts_ms = _number(obj["timestamp"], "timestamp", path, line)
        prompt = _count(obj["input_length"], "input_length", path, line)
        output = _count(obj["output_length"], "output_length", path, line)
        hash_ids = obj.get("hash_ids")
        if hash_ids is not None:
            if not isinstance(hash_ids, list) or not all(isinstance(h, int) and not isinstance(h, bool)
                                                         for h in hash_ids):
                raise TraceFormatError(f"{path}:{line}: hash_ids must be a list of integers")
            hash_ids = tuple(hash_ids)
        if output == 0:
            continue
        rows.append((ts_ms / 1000.0, TraceRecord(0.0, prompt, output, hash_ids)))
    return _finish(rows, path, "mooncake", speedup, max_requests)


_AZURE_TS = re.compile(r"^(\d{4}-\d{2}-\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?"
                       r"\s*(Z|[+-]\d{2}:?\d{2})?$")


def parse_azure_timestamp(text: str, path: str | Path = "<string>", line: int = 0) -> tuple[int, float]:
    """(whole UTC epoch seconds, fraction) of an Azure TIMESTAMP.

    Kept as two parts because 7 fractional digits (100 ns) do not survive a float of epoch seconds.
    """
    m = _AZURE_TS.match(text.strip())
    if m is None:
        raise TraceFormatError(f"{path}:{line}: TIMESTAMP {text!r} is not 'YYYY-MM-DD HH:MM:SS[.fffffff]'")
    date, hh, mm, ss, frac, tz = m.groups()
    try:
        year, month, day = (int(p) for p in date.split("-"))
        secs = calendar.timegm((year, month, day, int(hh), int(mm), int(ss), 0, 0, 0))
        if not (1 <= month <= 12 and 1 <= day <= calendar.monthrange(year, month)[1]
                and int(hh) < 24 and int(mm) < 60 and int(ss) < 61):
            raise ValueError
    except ValueError:
        raise TraceFormatError(f"{path}:{line}: TIMESTAMP {text!r} is not a valid date and time") from None
    if tz and tz != "Z":
        sign = 1 if tz[0] == "+" else -1
        digits = tz[1:].replace(":", "")
        secs -= sign * (int(digits[:2]) * 3600 + int(digits[2:]) * 60)
    return secs, float("0." + frac) if frac else 0.0


def _detect(path: Path) -> str:
    if path.suffix in (".jsonl", ".json"):
        return "mooncake"
    header = next(iter(_lines(path)), (1, ""))[1]
    if "TIMESTAMP" in header:
        return "azure"
    if "Timestamp" in header:
        return "burstgpt"
    raise TraceFormatError(f"{path}:1: cannot tell the trace format from the header {header.strip()!r}; "
                           f"name it ({', '.join(FORMATS)})")


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    try:
        with path.open(encoding="utf-8", newline="") as f:
            yield from enumerate(f, start=1)
    except FileNotFoundError:
        raise TraceFormatError(f"{path}: no such trace file") from None
    except UnicodeDecodeError as exc:
        raise TraceFormatError(f"{path}: not UTF-8 text ({exc.reason})") from None


def _csv_rows(path: Path, required: tuple[str, ...]) -> Iterator[tuple[int, dict[str, str]]]:
    lines = _lines(path)
    first = next(lines, None)
    if first is None:
        raise TraceFormatError(f"{path}:1: empty file, expected a CSV header")
    header = [h.strip() for h in next(csv.reader([first[1]]))]
    missing = [c for c in required if c not in header]
    if missing:
        raise TraceFormatError(f"{path}:1: CSV header lacks column(s) {', '.join(missing)}; got {header}")
    for line, text in lines:
        if not text.strip():
            continue
        cells = next(csv.reader([text]))
        if len(cells) != len(header):
            raise TraceFormatError(f"{path}:{line}: expected {len(header)} fields, got {len(cells)}")
        yield line, {h: c.strip() for h, c in zip(header, cells)}


def _number(value: object, name: str, path: Path, line: int) -> float:
    try:
        x = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        x = math.nan
    if not math.isfinite(x) or x < 0:
        raise TraceFormatError(f"{path}:{line}: {name} must be a finite number >= 0, got {value!r}")
    return x


def _count(value: object, name: str, path: Path, line: int) -> int:
    x = _number(value, name, path, line)
    if x != int(x):
        raise TraceFormatError(f"{path}:{line}: {name} must be a whole number of tokens, got {value!r}")
    return int(x)


def _finish(rows: list[tuple], path: Path, fmt: str, speedup: float, max_requests: int | None) -> Trace:
    if not isinstance(speedup, (int, float)) or not math.isfinite(speedup) or speedup <= 0:
        raise TraceFormatError(f"{path}: speedup must be a positive number, got {speedup!r}")
    if max_requests is not None and (not isinstance(max_requests, int) or max_requests < 1):
        raise TraceFormatError(f"{path}: max_requests must be a positive integer, got {max_requests!r}")
    if not rows:
        raise TraceFormatError(f"{path}: the trace has no usable requests")
    rows.sort(key=lambda r: r[0])  # stable: equal timestamps keep file order
    if max_requests is not None:
        rows = rows[:max_requests]
    first = rows[0][0]
    if isinstance(first, tuple):  # Azure: (epoch seconds, fraction)
        base_s, base_frac = first
        times = [((s - base_s) + (f - base_frac)) / speedup for (s, f), _ in rows]
    else:
        times = [(ts - first) / speedup for ts, _ in rows]
    records = tuple(TraceRecord(t, r.prompt_tokens, r.output_tokens, r.hash_ids) for t, (_, r) in zip(times, rows))
    return Trace(records, str(path), fmt)
