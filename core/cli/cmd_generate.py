"""``inferhal generate prompt=... | messages=[...] | prompts_file=...``: generate text with the engine."""

from __future__ import annotations

from inferhal.core.errors import UserError


def run(cfg, words) -> int:
    try:
        from inferhal.core.engine.cli_generate import generate
    except ImportError as exc:  # until the engine lands
        raise UserError(f"the engine is not available in this build: {exc}") from None
    return generate(cfg)
