"""End-to-end golden outputs: greedy token ids of the tiny models, recorded on the reference backend
(``scripts`` in :mod:`.golden_data`), compared on the qualified backend. Filled in once the engine exists."""

from __future__ import annotations


def run(cfg, active) -> list[dict]:
    return []
