"""``inferhal serve [model=NAME] [server.host=...] [server.port=...] [server.api_key=...]``: an
OpenAI-compatible HTTP server (:mod:`inferhal.core.server`)."""

from __future__ import annotations

from inferhal.core.errors import UserError


def run(cfg, words) -> int:
    if words:
        raise UserError(f"usage: inferhal serve [overrides]; got extra words {' '.join(words)!r}")
    from inferhal.core.server.serve import serve

    return serve(cfg)
