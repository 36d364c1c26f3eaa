"""Benchmarks: ``inferhal bench <kind>`` runs ``inferhal.core.bench.<kind>.run(cfg)``."""

from __future__ import annotations

import json
import os
from typing import Any


def write_json(cfg: Any, name: str, payload: Any) -> str:
    """Write a bench's result to ``output=`` (or ``bench.output_dir``/``name``), creating the folder; the path.
    A dict gets a ``stamp`` (commit, date, host, command: :func:`.stamp.stamp`) unless it has one."""
    from inferhal.core.bench.stamp import stamp

    out = str(cfg.get("output") or os.path.join(str(cfg.bench.output_dir), name))
    if isinstance(payload, dict) and "stamp" not in payload:
        payload = {**payload, "stamp": stamp()}
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(payload, f, indent=2)
    return out
