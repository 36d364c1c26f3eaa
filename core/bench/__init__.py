"""Benchmarks: ``inferhal bench <kind>`` runs ``inferhal.core.bench.<kind>.run(cfg)``."""

from __future__ import annotations

import json
import os
from typing import Any


def write_json(cfg: Any, name: str, payload: Any) -> str:
    """Write a bench's result to ``output=`` (or ``bench.output_dir``/``name``), creating the folder; the path."""
    out = str(cfg.get("output") or os.path.join(str(cfg.bench.output_dir), name))
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(payload, f, indent=2)
    return out
