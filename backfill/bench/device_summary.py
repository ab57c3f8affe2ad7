"""A device-check part's summary.json, written after every row so a timeout keeps what finished.

Format (scripts/gpu_check.sh folds every part's file into one table):
  {"part": NAME, "rows": [{"measure", "value", "reference", "note"}, ...], "skipped": [reason, ...]}
Parts that share a directory add to one file (read, extend, write).
"""

from __future__ import annotations

import json
import os
from pathlib import Path


class PartSummary:
    def __init__(self, out_dir: str | Path, part: str) -> None:
        self.path = Path(out_dir) / "summary.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.part = part
        self.data = {"part": part, "rows": [], "skipped": []}
        if self.path.exists():
            try:
                old = json.loads(self.path.read_text())
                if isinstance(old, dict):
                    self.data["rows"] = list(old.get("rows", []))
                    self.data["skipped"] = list(old.get("skipped", []))
                    self.data["part"] = old.get("part", part)
            except ValueError:
                pass  # a torn file from a killed run: start again
        self.write()

    def row(self, measure: str, value: str, reference: str = "", note: str = "") -> None:
        self.data["rows"].append({"measure": measure, "value": value, "reference": reference, "note": note})
        self.write()
        print(f"| {measure} | {value} | {reference} | {note} |", flush=True)

    def skip(self, what: str) -> None:
        self.data["skipped"].append(what)
        self.write()
        print(f"SKIPPED: {what}", flush=True)

    def write(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n")
        os.replace(tmp, self.path)


__all__ = ["PartSummary"]
