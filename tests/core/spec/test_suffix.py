"""The suffix drafter (core/spec/suffix.py) on its own: drafts on small examples, the same drafts as a plain
walk over every match length and occurrence (hypothesis), the recent-output store (FIFO by count, off at 0,
compaction), the prompt's end and what joins the store, and the config checks."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferhal.core.config.schema import SpecConfig
from inferhal.core.errors import UserError
from inferhal.core.spec import suffix
from inferhal.core.spec.proposer import DraftWant, StepSeq, TargetStep, check_spec_config, make_proposer
from inferhal.core.spec.suffix import SuffixProposer


def draft(p: SuffixProposer, ids, limit=None, rid="r"):
    return p.propose([DraftWant(rid, list(ids), p.k if limit is None else limit, {})])[rid]


def finish(p: SuffixProposer, prompt, output, rid):
    """A request's life as the engine drives it: the prompt step, one decode step, freed."""
    p.prefill(TargetStep((StepSeq(rid, 0, len(prompt), 0, list(prompt) + list(output[:1]), {}),)))
    toks = list(prompt) + list(output)
    p.prefill(TargetStep((StepSeq(rid, len(prompt), len(output) - 1, 0, toks, {}),)))
    p.free(rid)


def test_a_match_drafts_what_followed_it_and_longer_matches_earn_longer_drafts():
    p = SuffixProposer(k=8)
    # "1 2 3" occurred at the start, followed by 10 11 12: a 3-token match drafts at most 3 tokens (factor 1)
    assert draft(p, [1, 2, 3, 10, 11, 12, 13, 3, 99, 5, 1, 2, 3]) == [10, 11, 12]
    # one token of match: one token of draft
    assert draft(p, [7, 40, 41, 42, 9, 7]) == [40]
    # a loop drafts up to the context's end (the occurrence runs into it)
    assert draft(p, [1, 2, 1, 2, 1]) == [2, 1]
    assert draft(p, [5]) == [] and draft(p, [5, 6, 7]) == []  # nothing recurs


def test_limits_factor_depth_and_k():
    ids = list(range(20)) + [50] + list(range(20))  # the last 20 tokens occurred before, followed by 50 0 1 ...
    assert draft(SuffixProposer(k=8), ids) == [50, 0, 1, 2, 3, 4, 5, 6]
    assert draft(SuffixProposer(k=8), ids, limit=3) == [50, 0, 1]
    assert draft(SuffixProposer(k=2), ids) == [50, 0]
    # depth 6: match + draft <= 6 tokens, so the best split is a 3-token match drafting 3
    assert draft(SuffixProposer(k=8, max_tree_depth=6), ids) == [50, 0, 1]
    # factor 0.5: a match of m drafts m // 2 (depth 24: m = 16 drafts 8; depth 8: at most 2)
    assert draft(SuffixProposer(k=8, max_spec_factor=0.5), ids) == [50, 0, 1, 2, 3, 4, 5, 6]
    assert draft(SuffixProposer(k=8, max_spec_factor=0.5, max_tree_depth=8), ids) == [50, 0]


def test_the_majority_continuation_min_token_prob_and_ties():
    # "7" (a one-token match each time) was followed by 1 three times and by 2 once: 1 at probability 3/4
    ids = [7, 1, 10, 7, 1, 11, 7, 2, 12, 7, 1, 13, 7]
    assert draft(SuffixProposer(k=1), ids) == [1]
    assert draft(SuffixProposer(k=1, min_token_prob=0.8), ids) == []
    # "7 1" three times: 0 at 2/3; of those two, one goes on 20 and one 21 (a tie: the latest, at 1/3), then
    # the one occurrence left runs on at 1/3
    ids = [7, 1, 0, 20, 7, 1, 0, 21, 7, 1, 5, 22, 7, 1]
    assert draft(SuffixProposer(k=4, max_spec_factor=4.0), ids) == [0, 21, 7, 1]
    assert draft(SuffixProposer(k=4, max_spec_factor=4.0, min_token_prob=0.4), ids) == [0]
    assert draft(SuffixProposer(k=1), [3, 7, 1, 4, 7, 2, 5, 7]) == [2]  # a tie: the latest occurrence's token


def _walk(seqs, starts, most, pmin):
    """The reference walk: occurrences (sequence, position), majority token, ties to the latest occurrence."""
    toks, prob, score = [], 1.0, 0.0
    occ = list(starts)
    while len(toks) < most and occ:
        if len(occ) == 1:  # as the drafter sums a lone occurrence's run (the same floating-point sum)
            s, i = occ[0]
            run = list(seqs[s][i : i + most - len(toks)])
            toks += run
            score += prob * len(run)
            break
        nxt = [seqs[s][i] if i < len(seqs[s]) else None for s, i in occ]
        counts = {}
        for t in nxt:
            if t is not None:
                counts[t] = counts.get(t, 0) + 1
        if not counts:
            break
        top = max(counts.values())
        tok = [t for t in nxt if t is not None and counts[t] == top][-1]
        if prob * top / len(occ) < pmin:
            break
        prob = prob * top / len(occ)
        toks.append(tok)
        score += prob
        occ = [(s, i + 1) for (s, i), t in zip(occ, nxt) if t == tok]
    return toks, score


def reference(ctx, outputs, k, depth, factor, pmin):
    """Every match length of every store, walked: the highest score, a tie to the longer match, then the own store."""
    n = len(ctx)
    best = (0.0, 0, [])
    stores = [([ctx], 1, n - 1, lambda s, e: e <= n - 2), (list(outputs), 2, n, lambda s, e: True)]
    for seqs, lo, hi, ok in stores:
        for m in range(lo, min(depth - 1, hi) + 1):
            most = max(0, min(k, math.floor(m * factor + 1e-6), depth - m))
            starts = [(s, e + 1) for s, seq in enumerate(seqs) for e in range(m - 1, len(seq))
                      if ok(s, e) and list(seq[e - m + 1 : e + 1]) == list(ctx[n - m :])]
            if not starts:
                continue
            toks, score = _walk(seqs, starts, most, pmin)
            if score > best[0] or (score == best[0] and toks and m > best[1]):
                best = (score, m, toks)
    return best[2]


@settings(max_examples=300, deadline=None)
@given(ctx=st.lists(st.integers(0, 3), min_size=1, max_size=40),
       outputs=st.lists(st.lists(st.integers(0, 3), min_size=2, max_size=15), max_size=3),
       k=st.integers(1, 6), depth=st.integers(2, 10), factor=st.sampled_from([0.5, 1.0, 2.0]),
       pmin=st.sampled_from([0.0, 0.1, 0.4]))
def test_drafts_equal_a_plain_walk_over_every_match(ctx, outputs, k, depth, factor, pmin):
    p = SuffixProposer(k=k, max_tree_depth=depth, max_spec_factor=factor, min_token_prob=pmin)
    for i, out in enumerate(outputs):
        finish(p, [9, 9], out, f"done{i}")
    assert [list(p.recent.a[s:e]) for s, e in p.recent.segments] == [list(o) for o in outputs]
    assert draft(p, ctx) == reference(ctx, outputs, k, depth, factor, pmin)


def test_outputs_join_the_recent_store_and_the_oldest_leave_it():
    p = SuffixProposer(k=4, max_cached_requests=2)
    finish(p, [1, 2, 3], [20, 21, 22, 23, 24], "a")  # only the output joins, not the prompt
    assert [list(p.recent.a[s:e]) for s, e in p.recent.segments] == [[20, 21, 22, 23, 24]]
    assert draft(p, [8, 20, 21], rid="x") == [22, 23]  # another request drafts from it
    finish(p, [1], [30, 31, 32], "b")
    finish(p, [1], [40, 41, 42], "c")  # a's output is evicted
    assert len(p.recent.segments) == 2 and draft(p, [8, 20, 21], rid="y") == []
    assert draft(p, [8, 40, 41], rid="z") == [42]
    off = SuffixProposer(k=4, max_cached_requests=0)
    finish(off, [1], [20, 21, 22, 23], "a")
    assert draft(off, [8, 20, 21], rid="x") == [] and "a" not in off.reqs and not off.recent.segments


def test_a_chunked_prompt_ends_where_the_first_output_token_was_sampled():
    p = SuffixProposer(k=4)
    prompt = list(range(100, 110))
    p.prefill(TargetStep((StepSeq("r", 0, 4, 0, prompt, {}),)))  # a chunk: no token sampled
    assert p.reqs["r"].prompt_len is None
    p.prefill(TargetStep((StepSeq("r", 4, 6, 0, prompt + [7], {}),)))  # the last chunk samples 7
    p.prefill(TargetStep((StepSeq("r", 10, 1, 0, prompt + [7, 8], {}),)))
    assert p.reqs["r"].prompt_len == 10
    p.free("r")
    assert [list(p.recent.a[s:e]) for s, e in p.recent.segments] == [[7, 8]] and not p.reqs


def test_compaction_keeps_what_is_live(monkeypatch):
    monkeypatch.setattr(suffix, "_COMPACT_AT", 8)
    p = SuffixProposer(k=3, max_cached_requests=2)
    for i in range(6):
        finish(p, [1], [50 + i, 60 + i, 70 + i, 80 + i], f"r{i}")
    # compacted when r4 came (r0..r2 evicted): r3, r4 from position 1, then r5; r3 evicted since (6 entries,
    # 31 without compaction)
    assert (p.recent.n, p.recent.live) == (16, 6)
    assert [list(p.recent.a[s:e]) for s, e in p.recent.segments] == [[54, 64, 74, 84], [55, 65, 75, 85]]
    assert draft(p, [3, 55, 65], rid="q") == [75, 85] and draft(p, [3, 53, 63], rid="q2") == []
    assert max(np.concatenate([np.frombuffer(v, dtype=np.int64) for v in p.recent.index.values()])) < 16


def test_many_candidates_stay_bounded():
    p = SuffixProposer(k=4)
    ids = [5, 6] * 3000 + [5]
    assert draft(p, ids) == [6, 5, 6, 5]  # the latest MAX_CANDIDATES occurrences of 5 decide


@pytest.mark.parametrize("cfg, words", [
    (SpecConfig(method="suffix", num_speculative_tokens=0), "num_speculative_tokens >= 1"),
    (SpecConfig(method="suffix", num_speculative_tokens=4, suffix_max_tree_depth=1), "suffix_max_tree_depth must be >= 2"),
    (SpecConfig(method="suffix", num_speculative_tokens=4, suffix_max_cached_requests=-1),
     "suffix_max_cached_requests must be >= 0"),
    (SpecConfig(method="suffix", num_speculative_tokens=4, suffix_max_spec_factor=0.0), "suffix_max_spec_factor must be > 0"),
    (SpecConfig(method="suffix", num_speculative_tokens=4, suffix_min_token_prob=1.5), "suffix_min_token_prob must be in"),
    (SpecConfig(method="ngram", num_speculative_tokens=2, suffix_min_token_prob=0.3), "read by spec.method=suffix only"),
    (SpecConfig(suffix_max_tree_depth=8), "read by spec.method=suffix only"),
])
def test_bad_configs_name_the_field(cfg, words):
    with pytest.raises(UserError, match=words):
        check_spec_config(cfg)


def test_from_config_reads_every_suffix_field():
    p = make_proposer(SpecConfig(method="suffix", num_speculative_tokens=5, suffix_max_tree_depth=12,
                                 suffix_max_cached_requests=7, suffix_max_spec_factor=2.0,
                                 suffix_min_token_prob=0.25), None)
    assert (p.k, p.depth, p.recent.cap, p.factor, p.min_prob) == (5, 12, 7, 2.0, 0.25)
    assert p.num_speculative_tokens == 5 and p.kv_groups() == [] and not p.needs_hidden
