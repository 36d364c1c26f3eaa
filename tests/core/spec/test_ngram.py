"""The n-gram drafter and the spec config checks."""

from __future__ import annotations

import pytest

from inferhal.core.config.schema import SpecConfig
from inferhal.core.errors import UserError
from inferhal.core.spec.ngram import NgramProposer, check_spec_config


def test_longest_suffix_match_wins_over_a_later_shorter_one():
    p = NgramProposer(k=3, ngram_min=1, ngram_max=3)
    # suffix "1 2 3" occurred at 0 (followed by 10 11 12); "3" alone recurs later (followed by 99)
    ids = [1, 2, 3, 10, 11, 12, 3, 99, 5, 1, 2, 3]
    assert p.lookup(ids) == [10, 11, 12]


def test_latest_occurrence_and_limits():
    p = NgramProposer(k=4, ngram_min=2, ngram_max=2)
    ids = [7, 8, 1, 7, 8, 2, 3, 7, 8]
    assert p.lookup(ids) == [2, 3, 7, 8]  # the latest earlier "7 8" is at index 3
    assert p.lookup(ids, limit=2) == [2, 3]
    assert p.lookup(ids, limit=0) == []
    assert p.lookup([7, 8, 5]) == []  # no recurring bigram
    assert p.lookup([4]) == []


def test_draft_runs_to_the_end_of_the_context():
    # a loop "a b a b a": the match of "b a" at index 1 is followed only by "b a"
    assert NgramProposer(k=5, ngram_min=1, ngram_max=2).lookup([1, 2, 1, 2, 1]) == [2, 1]


def test_min_n_is_respected():
    p = NgramProposer(k=2, ngram_min=2, ngram_max=3)
    assert p.lookup([5, 6, 9, 6]) == []  # only the unigram 6 recurs


@pytest.mark.parametrize("cfg, words", [
    (SpecConfig(method="eagle"), "spec.method must be one of"),
    (SpecConfig(method="mtp", num_speculative_tokens=4), "spec.num_speculative_tokens must be in 1..3"),
    (SpecConfig(method="none", num_speculative_tokens=2), "no effect with spec.method=none"),
    (SpecConfig(method="ngram", num_speculative_tokens=0), "num_speculative_tokens >= 1"),
    (SpecConfig(method="ngram", num_speculative_tokens=2, ngram_min=3, ngram_max=2), "ngram_min <= ngram_max"),
])
def test_bad_spec_configs_name_the_field(cfg, words):
    with pytest.raises(UserError, match=words):
        check_spec_config(cfg)


def test_from_config():
    assert NgramProposer.from_config(SpecConfig()) is None
    p = NgramProposer.from_config(SpecConfig(method="ngram", num_speculative_tokens=3, ngram_min=2, ngram_max=5))
    assert (p.k, p.ngram_min, p.ngram_max) == (3, 2, 5)
