"""The stored transformers answers (tests/fixtures/transformers_oracle.py): the top-K comparison is never looser
than the full rows' where it matters, and a stale store fails naming what changed."""

from __future__ import annotations

import pytest
import torch

import transformers_oracle as tor


def _steps(rows: torch.Tensor) -> tor.Steps:
    top = rows.topk(tor.TOP_K, dim=-1)
    return tor.Steps(top.values, top.indices)


def test_max_diff_is_at_most_the_full_rows_and_catches_a_risen_tail_token():
    g = torch.Generator().manual_seed(0)
    want = torch.randn(3, 1000, generator=g) * 5
    steps = _steps(want)
    for s in range(3):
        ours = want[s] + (torch.rand(1000, generator=g) - 0.5) * 1e-3
        full = float((ours - want[s]).abs().max())
        assert tor.max_diff(ours, steps, s) <= full + 1e-6
    ours = want[0].clone()
    tail = int(want[0].argmin())  # far outside the top-K
    ours[tail] = float(want[0].max()) + 1.0  # a token the full comparison would flag by > 1
    assert tor.max_diff(ours, steps, 0) > 1.0


def test_decided_stops_at_the_first_near_tie():
    vals = torch.tensor([[5.0, 1.0], [3.0, 2.99], [4.0, 0.0]])
    steps = tor.Steps(vals, torch.tensor([[0, 1], [2, 3], [4, 5]]))
    assert tor.decided(steps, 0.1) == 1
    assert tor.decided(steps, 0.001) == 3


def test_a_stale_store_fails_naming_the_field(tmp_path, monkeypatch):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"weights")
    monkeypatch.setattr(tor, "STORE", tmp_path)
    monkeypatch.delenv("INFERHAL_ORACLE", raising=False)
    key = tor._key(str(model), [[1, 2, 3]], 4, torch.float32)
    rows = torch.randn(4, 100)
    st = _steps(rows)
    torch.save({"key": key, "answer": {"tokens": [[1, 2, 3, 4]], "values": [st.values], "indices": [st.indices.int()]}},
               tmp_path / "job.pt")
    toks, steps = tor.transformers_greedy("job", str(model), [[1, 2, 3]], 4, torch.float32, 1e-3, 2e-3)[0]
    assert toks == [1, 2, 3, 4] and torch.equal(steps.values, st.values)
    with pytest.raises(pytest.fail.Exception, match="max_new: stored 4, now 5"):
        tor.transformers_greedy("job", str(model), [[1, 2, 3]], 5, torch.float32, 1e-3, 2e-3)
    model.write_bytes(b"other weights")
    tor._sha256.cache_clear()
    with pytest.raises(pytest.fail.Exception, match="sha256"):
        tor.transformers_greedy("job", str(model), [[1, 2, 3]], 4, torch.float32, 1e-3, 2e-3)
    with pytest.raises(pytest.fail.Exception, match="no stored answer"):
        tor.transformers_greedy("other", str(model), [[1, 2, 3]], 4, torch.float32, 1e-3, 2e-3)


def test_check_mode_compares_a_run_with_the_store():
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(4, 500, generator=g) * 4
    stored = [([1, 2, 3, 4], _steps(rows))]
    tor._compare("job", [([1, 2, 3, 4], _steps(rows + 1e-5))], stored, 1e-4, 2e-4)  # host noise: agrees
    with pytest.raises(AssertionError, match="top-K logits moved"):
        tor._compare("job", [([1, 2, 3, 4], _steps(rows + 1e-2))], stored, 1e-4, 2e-4)
    with pytest.raises(AssertionError, match="transformers now gives"):
        tor._compare("job", [([1, 2, 9, 4], _steps(rows))], stored, 1e-4, 2e-4)
