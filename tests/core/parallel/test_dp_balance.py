"""Placing requests on DP ranks under `inferhal serve` (core/parallel/dp_balance.py): by tokens and cache, by
vLLM's ``waiting * 4 + running``, round robin; session keys and their bounded table; and the balance figure."""

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferhal.core.parallel.dp_balance import MAX_SESSIONS, POLICIES, Sessions, TokenLoad, balance, place


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


def test_a_session_key_keeps_its_rank_ahead_of_a_prefix_held_elsewhere():
    table = Sessions()
    # turn 1 of two sessions in one batch: apart, by tokens; their keys are recorded
    first = place("tokens_cache", idle(2), [[0, 0], [0, 0]], [hashes(1), hashes(2)], [32, 32], margin=100,
                  keys=["a", "b"], sessions=table)
    assert first == [0, 1] and table.items() == [("a", 0), ("b", 1)]
    # turn 2 of "b" shares no prefix with its turn 1 and starts with blocks rank 0 holds: the prefix alone says 0
    turn2 = dict(cached_blocks=[[3], [0]], block_hashes=[hashes(1, 5, 6)], prompt_lens=[48], margin=100)
    assert place("tokens_cache", idle(2), **turn2) == [0]
    assert place("tokens_cache", idle(2), **turn2, keys=["b"], sessions=table) == [1]
    assert place("tokens_cache", idle(2), **turn2, keys=[None], sessions=table) == [0]  # a request without a key
    # a new key is placed as usual and recorded where it went
    assert place("tokens_cache", idle(2), **turn2, keys=["c"], sessions=table) == [0] and table.get("c") == 0


def test_a_session_key_moves_when_its_rank_is_past_the_margin():
    table = Sessions()
    table.put("s", 0)
    loads = [TokenLoad(0, 1, 0, 700), TokenLoad(0, 0, 0, 200)]  # rank 0 carries 500 tokens more
    args = ([[0], [0]], [hashes(4)], [16])
    assert place("tokens_cache", loads, *args, margin=500, keys=["s"], sessions=table) == [0]
    assert place("tokens_cache", loads, *args, margin=499, keys=["s"], sessions=table) == [1]
    assert table.get("s") == 1  # the key moved with it
    assert place("tokens_cache", [TokenLoad(0, 0, 0, 0)] * 2, *args, margin=0, keys=["s"], sessions=table) == [1]


def test_keys_in_one_batch_follow_each_other_and_other_policies_ignore_them():
    table = Sessions()
    got = place("tokens_cache", idle(2), [[0] * 3] * 2, [hashes(1), hashes(2), hashes(3)], [100, 10, 10],
                margin=200, keys=["x", "y", "x"], sessions=table)
    assert got[2] == got[0]  # "x" placed earlier in the batch: its second request follows, within the margin
    for policy in ("vllm", "round_robin"):
        before = table.items()
        want = place(policy, idle(2), [[0], [0]], [hashes(1)], [8], 0, start=1)
        assert place(policy, idle(2), [[0], [0]], [hashes(1)], [8], 0, start=1, keys=["y"], sessions=table) == want
        assert table.items() == before


def test_the_session_table_forgets_the_least_recently_placed_key_first():
    assert Sessions().size == MAX_SESSIONS
    table = Sessions(size=3)
    for i, key in enumerate("abcd"):
        table.put(key, i % 2)
    assert [k for k, _ in table.items()] == ["b", "c", "d"] and table.get("a") is None
    table.put("b", 1)  # placed again: the most recent
    table.put("e", 0)
    assert [k for k, _ in table.items()] == ["d", "b", "e"] and len(table) == 3
    with pytest.raises(ValueError, match="at least one key"):
        Sessions(size=0)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(0, 300),
       st.lists(st.lists(st.tuples(st.integers(0, 9), st.integers(1, 4), st.integers(1, 200),
                                   st.sampled_from([None, "k0", "k1", "k2", "k3", "k4"])),
                         min_size=1, max_size=5), min_size=1, max_size=6))
def test_ranks_placing_alike_keep_equal_bounded_tables_and_a_key_stays_home_within_the_margin(n, size, margin,
                                                                                                 batches):
    """Two ranks run ``place`` on the same batches: equal choices and tables. Replayed against a plain LRU of
    ``size`` keys: a keyed request goes to its remembered rank whenever that rank is within the margin of the least
    loaded, its key then names the rank it got, and the table holds the ``size`` keys placed last."""
    mine, theirs = Sessions(size), Sessions(size)
    model: OrderedDict = OrderedDict()
    loads = [TokenLoad(0, 0, 0, 0) for _ in range(n)]
    for batch in batches:
        prompts = [hashes(*range(first, first + blocks)) for first, blocks, _, _ in batch]
        cached = [[(first + r) % 2 for first, _, _, _ in batch] for r in range(n)]
        lens, keys = [ln for _, _, ln, _ in batch], [k for _, _, _, k in batch]
        got = place("tokens_cache", loads, cached, prompts, lens, margin, keys=keys, sessions=mine)
        assert place("tokens_cache", loads, cached, prompts, lens, margin, keys=keys, sessions=theirs) == got
        assert mine.items() == theirs.items() and len(mine) <= size
        tokens = [ld.tokens for ld in loads]
        for key, ln, r in zip(keys, lens, got):
            if key is not None:
                home = model.get(key)
                if home is not None and tokens[home] - min(tokens) <= margin:
                    assert r == home
                model[key] = r
                model.move_to_end(key)
                while len(model) > size:
                    model.popitem(last=False)
            tokens[r] += ln
        assert mine.items() == list(model.items())
        loads = [TokenLoad(0, 0, 0, t) for t in tokens]  # the next batch sees this one's prompts as load


def test_balance_is_max_over_mean():
    assert balance([10, 10]) == 1.0
    assert balance([30, 10]) == pytest.approx(1.5)
    assert balance([0, 0]) == 0.0
