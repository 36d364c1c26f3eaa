"""Suffix decoding (``spec.method=suffix``): drafts copied from where the context's latest tokens occurred
before, in the request's own prompt and output and in the outputs of recent requests, for as long as those
earlier occurrences agree on what came next. No model and no device; the target verifies every draft.

The method is Snowflake's (ArcticInference; arXiv 2411.04975; vLLM's ``method: suffix``): agent loops,
tool calls and code repeat long spans of their own and of earlier requests' outputs, so a draft can run for
many tokens where the repetition is sure and stop early where it is not.

**Two stores.** The request's tokens (prompt and output so far), and the outputs of the latest
``spec.suffix_max_cached_requests`` finished requests (first in, first out; 0 keeps none). A request's
output joins the recent store when it is freed (ArcticInference adds it token by token, so running requests
also draft from each other's unfinished outputs; here only finished ones count).

**A draft.** A match of length ``m`` is an earlier position whose ``m`` tokens before it equal the context's
last ``m`` (``m <= spec.suffix_max_tree_depth - 1``). From all occurrences of one match, the next token is the
one most of them continue with; its estimated probability is the share of those occurrences that do
(occurrences that end there, at a store's end or a request boundary, count against it), multiplied along the
draft; the occurrences that disagree drop out. Drafting stops when the probability falls under
``spec.suffix_min_token_prob``, when no occurrence goes on, or at
``min(spec.num_speculative_tokens, limit, floor(m * spec.suffix_max_spec_factor), spec.suffix_max_tree_depth - m)``
tokens: longer matches earn longer drafts. Over every match length and both stores the draft with the highest
score (the sum of its tokens' probabilities) is proposed; a tie goes to the longer match, then to the
request's own store. This is what ArcticInference's walk down a depth-bounded suffix tree with counts
computes ("path" speculation; its tree mode is not here: the verifier takes a chain).

**How, and what it costs.** No tree: the stores are token arrays, searched with numpy. The request's
tokens are scanned whole for its last token (one compare over a few thousand int32); the recent store is
indexed by token pair, so it is searched from the positions of the context's last two tokens (a recent
output's matches are two tokens or longer). Each query looks at the latest :data:`MAX_CANDIDATES`
occurrences at most, so a very common token costs a bounded scan; match lengths of all candidates come
from one gathered compare, and each distinct set of occurrences is walked once, longest matches first,
skipping a set whose longest possible draft cannot beat the best score found. :attr:`SuffixProposer.host_s`
sums the host time of every call (``inferhal bench agent`` reports it per step against the step time).

**The prompt's end.** The contract does not give a request's prompt length; the recent store wants outputs
only. It is taken from the first step that computed a request's positions up to one before its last token
(the step that sampled its first output token): a chunked prefill whose chunk ends exactly one token before
the prompt's end looks the same, and then one prompt token joins the stored output (harmless: a draft).
"""

from __future__ import annotations

import time
from array import array
from bisect import bisect_left
from collections import deque
from typing import Any, Optional, Sequence

import numpy as np

from inferhal.core.config.schema import SpecConfig
from inferhal.core.errors import UserError
from inferhal.core.spec.proposer import DraftContext, DraftWant, TargetStep

#: the latest occurrences of the context's last token (own store) or token pair (recent store) one query
#: looks at, at most: a bound on the host cost of very common tokens
MAX_CANDIDATES = 1024
#: the recent store is rebuilt without its evicted part once that part is this many tokens or more (and more
#: than the live part)
_COMPACT_AT = 1 << 16


def _grow(a: np.ndarray, need: int) -> np.ndarray:
    """``a`` with room for ``need`` entries, new ones -1."""
    if need <= len(a):
        return a
    b = np.full(max(need, 2 * len(a)), -1, dtype=a.dtype)
    b[: len(a)] = a
    return b


class _Own:
    """One request's tokens in ``a[1 : n + 1]``, with -1 before the first and after the last (where matches
    and continuations stop); ``prompt_len`` once known."""

    __slots__ = ("a", "n", "prompt_len")

    def __init__(self) -> None:
        self.a = np.full(256, -1, dtype=np.int32)
        self.n = 0
        self.prompt_len: Optional[int] = None

    def sync(self, token_ids: Sequence[int]) -> None:
        """Append what ``token_ids`` (the request's tokens now: they only grow) holds past what is stored."""
        m = len(token_ids)
        if m < self.n:  # never seen from the engine; start over rather than draft from stale tokens
            self.n = 0
        if m == self.n:
            return
        self.a = _grow(self.a, m + 2)
        self.a[self.n + 1 : m + 1] = token_ids[self.n : m]
        self.n = m
        self.a[m + 1] = -1

    def tokens(self) -> np.ndarray:
        return self.a[1 : self.n + 1]


class _Recent:
    """The outputs of the latest ``cap`` finished requests, end to end in ``a`` (-1 before the first and
    after each), and for every token pair the positions of its second token (ascending)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.a = np.full(1 << 12, -1, dtype=np.int32)
        self.n = 1  # a[0] = -1
        self.segments: deque[tuple[int, int]] = deque()  # [start, end) of each kept output
        self.index: dict[int, array] = {}
        self.live = 1  # positions below are evicted

    def add(self, out: np.ndarray) -> None:
        if self.cap == 0 or len(out) < 2:
            return
        s, n = self.n, len(out)
        self.a = _grow(self.a, s + n + 1)
        self.a[s : s + n] = out
        self.a[s + n] = -1
        self.n = s + n + 1
        self.segments.append((s, s + n))
        self._index(out, s)
        while len(self.segments) > self.cap:
            self.segments.popleft()
            self.live = self.segments[0][0]
        dead = self.live - 1
        if dead >= _COMPACT_AT and dead > self.n - self.live:
            self._compact()

    def _index(self, out: np.ndarray, s: int) -> None:
        keys = (out[:-1].astype(np.int64) << 32) | out[1:].astype(np.int64)
        index = self.index
        for q, key in enumerate(keys.tolist(), s + 1):
            pos = index.get(key)
            if pos is None:
                index[key] = array("q", (q,))
            else:
                pos.append(q)

    def _compact(self) -> None:
        outs = [self.a[s:e].copy() for s, e in self.segments]
        self.a = np.full(max(1 << 12, 2 * (self.n - self.live) + 1), -1, dtype=np.int32)
        self.n, self.live, self.index, self.segments = 1, 1, {}, deque()
        for out in outs:
            s = self.n
            self.a[s : s + len(out)] = out
            self.n = s + len(out) + 1
            self.segments.append((s, s + len(out)))
            self._index(out, s)

    def candidates(self, x: int, y: int) -> Optional[np.ndarray]:
        """Positions of ``y`` right after ``x`` (live, the latest :data:`MAX_CANDIDATES`), or None."""
        pos = self.index.get((x << 32) | y)
        if pos is None:
            return None
        lo = max(bisect_left(pos, self.live), len(pos) - MAX_CANDIDATES)
        return np.frombuffer(pos[lo:], dtype=np.int64) if lo < len(pos) else None


class SuffixProposer:
    """Suffix decoding on the :class:`~inferhal.core.spec.proposer.Proposer` contract (no KV, no hidden
    states; prefill records each request's tokens, free moves its output to the recent store)."""

    needs_hidden = False
    num_lookahead_tokens = 0
    reads_next_token = False

    def __init__(self, k: int, max_tree_depth: int = 24, max_cached_requests: int = 10000,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1) -> None:
        if k < 1 or max_tree_depth < 2 or max_cached_requests < 0 or max_spec_factor <= 0 \
                or not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"SuffixProposer needs k >= 1, max_tree_depth >= 2, max_cached_requests >= 0, "
                             f"max_spec_factor > 0 and 0 <= min_token_prob <= 1; got {k}, {max_tree_depth}, "
                             f"{max_cached_requests}, {max_spec_factor}, {min_token_prob}")
        self.k, self.depth, self.factor, self.min_prob = k, max_tree_depth, max_spec_factor, min_token_prob
        self.recent = _Recent(max_cached_requests)
        self.reqs: dict[str, _Own] = {}
        self.host_s = 0.0  # host time of every call, summed
        self.num_proposals = 0  # requests drafted for (each want of each propose call)

    @property
    def num_speculative_tokens(self) -> int:
        return self.k

    @staticmethod
    def check_config(cfg: SpecConfig) -> None:
        checks = (("suffix_max_tree_depth", cfg.suffix_max_tree_depth >= 2, ">= 2 (a match and a draft token)"),
                  ("suffix_max_cached_requests", cfg.suffix_max_cached_requests >= 0,
                   ">= 0 (0: draft from the request's own tokens only)"),
                  ("suffix_max_spec_factor", cfg.suffix_max_spec_factor > 0, "> 0"),
                  ("suffix_min_token_prob", 0.0 <= cfg.suffix_min_token_prob <= 1.0, "in [0, 1]"))
        for name, ok, want in checks:
            if not ok:
                raise UserError(f"spec.{name} must be {want}, got {getattr(cfg, name)}")

    @classmethod
    def from_config(cls, cfg: SpecConfig, ctx: DraftContext | None = None) -> "SuffixProposer":
        cls.check_config(cfg)
        return cls(cfg.num_speculative_tokens, cfg.suffix_max_tree_depth, cfg.suffix_max_cached_requests,
                   cfg.suffix_max_spec_factor, cfg.suffix_min_token_prob)

    # ------------------------------------------------------------------ the proposer contract

    def kv_groups(self) -> list:
        return []

    def accept(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        pass  # the stores hold only tokens the target decided

    def prefill(self, step: TargetStep) -> None:
        t0 = time.perf_counter()
        for s in step.seqs:
            own = self.reqs.get(s.request_id)
            if own is None:
                own = self.reqs[s.request_id] = _Own()
            own.sync(s.token_ids)
            if own.prompt_len is None and s.start + s.num_exact == len(s.token_ids) - 1:
                own.prompt_len = s.start + s.num_exact  # this step sampled the first output token
        self.host_s += time.perf_counter() - t0

    def free(self, request_id: str) -> None:
        t0 = time.perf_counter()
        own = self.reqs.pop(request_id, None)
        if own is not None and own.prompt_len is not None:
            self.recent.add(own.tokens()[own.prompt_len :].copy())
        self.host_s += time.perf_counter() - t0

    def propose(self, wants: Sequence[DraftWant], kv: Any = None) -> dict[str, list[int]]:
        t0 = time.perf_counter()
        out = {}
        for w in wants:
            own = self.reqs.get(w.request_id)
            if own is None:
                own = self.reqs[w.request_id] = _Own()
            own.sync(w.token_ids)
            out[w.request_id] = self.draft(own, w.limit)
        self.num_proposals += len(wants)
        self.host_s += time.perf_counter() - t0
        return out

    # ------------------------------------------------------------------ drafting

    def draft(self, own: _Own, limit: Optional[int] = None) -> list[int]:
        """The best draft to follow ``own``'s tokens, at most ``min(k, limit)`` tokens (``[]``: none)."""
        cap = self.k if limit is None else min(self.k, limit)
        n = own.n
        if cap < 1 or n < 2:
            return []
        a = own.a
        tail = a[n : max(0, n - self.depth + 1) : -1]  # the context's last tokens, latest first
        cand = np.flatnonzero(a[1:n] == a[n]) + 1  # earlier positions of the last token
        best = _best(a, cand[-MAX_CANDIDATES:], tail, 1, cap, self.depth, self.factor, self.min_prob, (0.0, 0, []))
        if self.recent.segments and len(tail) >= 2:  # recent matches are two tokens or longer
            rc = self.recent.candidates(int(a[n - 1]), int(a[n]))
            if rc is not None:
                best = _best(self.recent.a, rc, tail, 2, cap, self.depth, self.factor, self.min_prob, best)
        return best[2]


def _draft_len(m: int, cap: int, depth: int, factor: float) -> int:
    return max(0, min(cap, int(m * factor + 1e-6), depth - m))


def _best(store: np.ndarray, cand: np.ndarray, tail: np.ndarray, least: int, cap: int, depth: int, factor: float,
          min_prob: float, best: tuple[float, int, list[int]]) -> tuple[float, int, list[int]]:
    """``best`` or a better ``(score, match length, draft)`` from the occurrences ``cand`` (positions in
    ``store`` of the context's last token) of the context ``tail`` (latest first), matches of ``least`` tokens
    or more."""
    if not cand.size:
        return best
    span = np.arange(len(tail))
    idx = cand[:, None] - span  # [C, M]: each candidate's tokens back from it
    np.maximum(idx, 0, out=idx)  # store[0] is -1: a match stops there
    eq = store[idx] == tail
    ml = np.where(eq.all(axis=1), len(tail), eq.argmin(axis=1))  # [C] match length of each candidate
    lengths = np.unique(ml)[::-1]  # longest first
    for j, v in enumerate(lengths.tolist()):
        lo = max(int(lengths[j + 1]) if j + 1 < len(lengths) else 0, least - 1)
        if v < least:
            break
        # the same occurrences match every length in (lo, v]: one walk, as long as the longest draft they allow
        most = max(_draft_len(x, cap, depth, factor) for x in range(v, lo, -1))
        if most < best[0] or (most == best[0] and v <= best[1]):
            continue  # every draft token has probability <= 1: this set cannot win
        toks, score = _walk(store, cand[ml >= v] + 1, most, min_prob)
        # every length allowing this many tokens gives this draft: a tie counts the longest of them
        m = max(x for x in range(v, lo, -1) if _draft_len(x, cap, depth, factor) >= len(toks))
        if score > best[0] or (score == best[0] and toks and m > best[1]):
            best = (score, m, toks)
    return best


def _walk(store: np.ndarray, at: np.ndarray, most: int, min_prob: float) -> tuple[list[int], float]:
    """Follow the occurrences continuing at positions ``at`` (ascending) for at most ``most`` tokens, the
    majority token each time → (draft, score)."""
    toks: list[int] = []
    prob, score = 1.0, 0.0
    while len(toks) < most and at.size:
        if at.size == 1:  # one occurrence: its run, to its end or the cap, all at the same probability
            run = store[at[0] : at[0] + most - len(toks)]
            stop = np.flatnonzero(run < 0)
            run = run[: stop[0]] if stop.size else run
            toks += run.tolist()
            score += prob * len(run)
            break
        nxt = store[at]
        first = nxt[0]
        if (nxt == first).all():
            if first < 0:
                break
            tok, votes = int(first), at.size
        else:
            ok = nxt[nxt >= 0]
            if not ok.size:
                break
            vals, counts = np.unique(ok, return_counts=True)
            votes = int(counts.max())
            tied = vals[counts == votes]
            # a tie goes to the token of the latest occurrence among them
            tok = int(tied[0]) if len(tied) == 1 else int(nxt[np.flatnonzero(np.isin(nxt, tied))[-1]])
        p = prob * votes / at.size
        if p < min_prob:
            break
        prob = p
        toks.append(tok)
        score += prob
        at = at[nxt == tok] + 1
    return toks, score

