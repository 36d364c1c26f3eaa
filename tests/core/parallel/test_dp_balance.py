"""Placing requests on DP ranks under `inferhal serve` (core/parallel/dp_balance.py): by tokens and cache, by
vLLM's ``waiting * 4 + running``, round robin; and the balance figure."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferhal.core.parallel.dp_balance import POLICIES, TokenLoad, balance, place


def idle(n):
    return [TokenLoad(0, 0, 0, 0) for _ in range(n)]


def hashes(*blocks):
    """Chained hashes of a prompt whose leading blocks are ``blocks`` (equal ids, equal prefixes)."""
    out, prev = [], b""
    for b in blocks:
        prev = prev + bytes([b])
        out.append(prev)
    return out


def test_tokens_cache_goes_to_the_rank_holding_the_longest_prefix():
    loads = [TokenLoad(0, 1, 0, 300), TokenLoad(0, 0, 0, 0)]
    # rank 0 holds 3 leading blocks of the prompt, rank 1 one: rank 0, though it carries 300 more tokens
    assert place("tokens_cache", loads, [[3], [1]], [hashes(1, 2, 3, 4)], [64], margin=512) == [0]


def test_tokens_cache_leaves_the_holder_when_its_load_exceeds_the_least_by_more_than_the_margin():
    loads = [TokenLoad(0, 1, 100, 500), TokenLoad(0, 0, 0, 0)]
    assert place("tokens_cache", loads, [[3], [0]], [hashes(1, 2, 3)], [48], margin=600) == [0]
    assert place("tokens_cache", loads, [[3], [0]], [hashes(1, 2, 3)], [48], margin=599) == [1]


def test_tokens_cache_counts_tokens_not_requests():
    # rank 0 runs one 4,000-token request, rank 1 six short ones: a new prompt with no hit goes to rank 1
    loads = [TokenLoad(0, 1, 0, 4000), TokenLoad(2, 4, 60, 300)]
    assert place("tokens_cache", loads, [[0], [0]], [hashes(9)], [20], margin=0) == [1]
    # vLLM's score sees 1 against 12 and sends it to the long one
    assert place("vllm", loads, [[0], [0]], [hashes(9)], [20], margin=0) == [0]


def test_tokens_cache_keeps_a_batch_sharing_a_prefix_together_and_balances_the_rest_by_tokens():
    prompts = [hashes(1, 2, 3), hashes(1, 2, 4), hashes(7), hashes(8)]
    got = place("tokens_cache", idle(2), [[0] * 4, [0] * 4], prompts, [48, 48, 16, 16], margin=64)
    assert got[0] == got[1]  # the second shares two blocks with the first, placed on it in the same batch
    # the two short ones go to the other rank: 16 + 16 tokens there stay below the 96 of the first two
    assert got[2] == got[3] != got[0]


def test_a_multi_turn_session_stays_on_its_rank_by_prefix():
    turn1 = hashes(5, 6)
    turn2 = hashes(5, 6, 7, 8)  # the next turn starts with the previous prompt and answer
    ranks = place("tokens_cache", idle(4), [[0]] * 4, [turn1], [32], margin=1000)
    cached = [[2 if r == ranks[0] else 0] for r in range(4)]
    loads = [TokenLoad(0, 1, 0, 32) if r == ranks[0] else TokenLoad(0, 0, 0, 0) for r in range(4)]
    assert place("tokens_cache", loads, cached, [turn2], [64], margin=1000) == ranks


def test_vllm_and_round_robin():
    loads = [TokenLoad(1, 0, 0, 0), TokenLoad(0, 3, 0, 0), TokenLoad(0, 0, 0, 0)]  # scores 4, 3, 0
    assert place("vllm", loads, [[0] * 3] * 3, [hashes(1)] * 3, [8] * 3, margin=0) == [2, 1, 0]
    assert place("round_robin", loads, [[5] * 3] * 3, [hashes(1)] * 3, [8] * 3, margin=0, start=5) == [2, 0, 1]


def test_unknown_policy_and_no_ranks_are_errors():
    with pytest.raises(ValueError, match="least_loaded"):
        place("least_loaded", idle(2), [[0], [0]], [hashes(1)], [8], 0)
    with pytest.raises(ValueError, match="at least one rank"):
        place("vllm", [], [], [hashes(1)], [8], 0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5), st.integers(0, 3000), st.integers(0, 3000)),
                min_size=1, max_size=4),
       st.lists(st.tuples(st.integers(1, 4), st.integers(1, 300)), min_size=1, max_size=6),
       st.integers(0, 2000), st.sampled_from(POLICIES))
def test_every_request_gets_a_rank_and_tokens_cache_never_passes_the_margin(raw, reqs, margin, policy):
    loads = [TokenLoad(*r) for r in raw]
    n = len(loads)
    prompts = [hashes(*range(first, first + 3)) for first, _ in reqs]
    cached = [[(i + r) % 3 for i in range(len(reqs))] for r in range(n)]
    got = place(policy, loads, cached, prompts, [ln for _, ln in reqs], margin)
    assert len(got) == len(reqs) and all(0 <= r < n for r in got)
    if policy == "tokens_cache":  # replay: each choice is the least loaded rank or within the margin of it
        tokens = [ld.tokens for ld in loads]
        for (_, ln), r in zip(reqs, got):
            assert tokens[r] - min(tokens) <= margin or tokens[r] == min(tokens)
            tokens[r] += ln


def test_balance_is_max_over_mean():
    assert balance([10, 10]) == 1.0
    assert balance([30, 10]) == pytest.approx(1.5)
    assert balance([0, 0]) == 0.0
