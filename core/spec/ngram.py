"""The n-gram drafter (prompt lookup): the tokens that followed the latest earlier occurrence of the
context's last ``n`` tokens are proposed as the next ones, for the longest ``n`` in
``[ngram_min, ngram_max]`` that occurs. No model and no device: text that repeats its prompt or itself
(code, lists, quotes, a small model's loops) is drafted for free, and the target model verifies every
draft in the same forward that computes the next token (the backend's ``spec.verify`` op).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from inferhal.core.config.schema import SpecConfig
from inferhal.core.errors import UserError
from inferhal.core.spec.proposer import METHODS, DraftContext, DraftWant, TargetStep, check_spec_config  # noqa: F401


class NgramProposer:
    """Drafts up to ``k`` tokens per request from its own prompt and output (a
    :class:`~inferhal.core.spec.proposer.Proposer` with no state: prefill, accept and free do nothing)."""

    needs_hidden = False
    num_lookahead_tokens = 0
    reads_next_token = False

    def __init__(self, k: int, ngram_min: int = 1, ngram_max: int = 4) -> None:
        if k < 1 or not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"NgramProposer needs k >= 1 and 1 <= ngram_min <= ngram_max, got {k}, {ngram_min}, "
                             f"{ngram_max}")
        self.k, self.ngram_min, self.ngram_max = k, ngram_min, ngram_max

    @property
    def num_speculative_tokens(self) -> int:
        return self.k

    @staticmethod
    def check_config(cfg: SpecConfig) -> None:
        if not 1 <= cfg.ngram_min <= cfg.ngram_max:
            raise UserError(f"spec.ngram_min and spec.ngram_max need 1 <= ngram_min <= ngram_max, "
                            f"got {cfg.ngram_min} and {cfg.ngram_max}")

    @classmethod
    def from_config(cls, cfg: SpecConfig, ctx: DraftContext | None = None) -> "NgramProposer | None":
        check_spec_config(cfg)
        if cfg.method == "none":
            return None
        return cls(cfg.num_speculative_tokens, cfg.ngram_min, cfg.ngram_max)

    # ------------------------------------------------------------------ the proposer contract

    def kv_groups(self) -> list:
        return []

    def accept(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        pass

    def prefill(self, step: TargetStep) -> None:
        pass

    def free(self, request_id: str) -> None:
        pass

    def propose(self, wants: Sequence[DraftWant], kv: Any = None) -> dict[str, list[int]]:
        return {w.request_id: self.lookup(w.token_ids, w.limit) for w in wants}

    def lookup(self, token_ids: Sequence[int], limit: int | None = None) -> list[int]:
        """At most ``min(k, limit)`` draft tokens to follow ``token_ids``; ``[]`` when no n-gram recurs."""
        k = self.k if limit is None else min(self.k, limit)
        n_tok = len(token_ids)
        if k < 1 or n_tok < self.ngram_min + 1:
            return []
        a = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.ngram_max, n_tok - 1), self.ngram_min - 1, -1):
            # windows starting at s = 0 .. n_tok-n-1: each is followed by at least one token, and none is the suffix
            hits = np.flatnonzero((sliding_window_view(a[:-1], n) == a[-n:]).all(axis=1))
            if hits.size:
                s = int(hits[-1]) + n  # the latest occurrence: the freshest continuation
                return a[s : s + k].tolist()
        return []
