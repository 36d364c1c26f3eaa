"""``inferhal generate prompt=... | messages=[...] | prompts_file=...``: generate text with the engine.

See :mod:`inferhal.core.cli.generate` for the three modes and their output.
"""

from __future__ import annotations


def run(cfg, words) -> int:
    from inferhal.core.cli.generate import generate

    return generate(cfg)
