"""The resume journal: one JSON line per completed case, appended and flushed as each case finishes.

The first line fingerprints the run (backend, level, seed, reruns, op filter, op provenance). A rerun
with the same fingerprint skips the journalled cases; a different fingerprint starts a fresh journal
(the old one is kept as ``journal.jsonl.prev``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path


class Journal:
    def __init__(self, path: Path, fingerprint: dict, resume: bool = True) -> None:
        self.path = Path(path)
        self.fingerprint = fingerprint
        self.done: dict[str, dict] = {}
        if resume and self.path.exists():
            self._load()
        if not self.done:
            if self.path.exists():
                os.replace(self.path, self.path.with_name(self.path.name + ".prev"))
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("w") as f:
                f.write(json.dumps({"fingerprint": fingerprint}) + "\n")

    def _load(self) -> None:
        lines = self.path.read_text().splitlines()
        try:
            head = json.loads(lines[0]) if lines else {}
        except json.JSONDecodeError:
            return
        if head.get("fingerprint") != self.fingerprint:
            return
        for line in lines[1:]:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a kill: that case runs again
                continue
            self.done[row["key"]] = row
        # rewrite without the torn line, so appends start on a fresh line
        with self.path.open("w") as f:
            f.write(json.dumps({"fingerprint": self.fingerprint}) + "\n")
            for row in self.done.values():
                f.write(json.dumps(row, default=str) + "\n")

    @property
    def resumed(self) -> int:
        return len(self.done)

    def record(self, row: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(row, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.done[row["key"]] = row
