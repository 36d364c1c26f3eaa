"""OpTable: per-op lookup, fallback bookkeeping, and ``intercept`` (wrap ops for a block, then restore)."""

from __future__ import annotations

import pytest

from inferhal.core.ops.table import OpTable
from inferhal.core.profile import ExecLevel


def _table():
    native = {"linear": lambda x, w: ("native-linear", x, w), "norm.rms": lambda x, w, p: ("native-norm", x)}
    fallback = {"linear": lambda x, w: "ref-linear", "act.gated": lambda g, u, p: ("ref-act", g, u)}
    return OpTable("fake", native, fallback, ExecLevel.INTERPRETER)


def test_intercept_wraps_the_chosen_ops_keeps_their_metadata_and_restores_them():
    t = _table()
    before = {op: t._entries[op] for op in ("linear", "norm.rms", "act.gated")}
    calls = []

    def wrap(e):
        def fn(*a, **kw):
            calls.append(e.op_id)
            return e.fn(*a, **kw)
        return fn

    with t.intercept(wrap, ["linear"]) as wrapped:
        assert wrapped == ["linear"]
        assert t["linear"](1, 2) == ("native-linear", 1, 2)  # still the native op underneath
        assert t["norm.rms"](3, 4, None) == ("native-norm", 3)  # not chosen: untouched
        e = t.entry("linear")
        assert (e.native, e.level, e.note) == (True, ExecLevel.INTERPRETER, "")
    assert calls == ["linear"]
    assert {op: t._entries[op] for op in before} == before
    assert t["linear"](1, 2) == ("native-linear", 1, 2) and calls == ["linear"]


def test_intercept_of_every_op_nests_and_restores_on_an_exception():
    t = _table()
    before = dict(t._entries)
    seen = []
    tag = lambda name: lambda e: (lambda *a: (seen.append((name, e.op_id)), e.fn(*a))[1])  # noqa: E731
    with pytest.raises(ValueError, match="boom"):
        with t.intercept(tag("outer")) as wrapped:
            assert sorted(wrapped) == ["act.gated", "linear", "norm.rms"]
            with t.intercept(tag("inner"), ["act.gated"]):
                assert t["act.gated"](5, 6, None) == ("ref-act", 5, 6)
            t["act.gated"](7, 8, None)
            raise ValueError("boom")
    assert seen == [("inner", "act.gated"), ("outer", "act.gated"), ("outer", "act.gated")]
    assert t._entries == before


def test_intercept_refuses_unknown_or_missing_ops_before_changing_anything():
    t = _table()
    before = dict(t._entries)
    with pytest.raises(KeyError, match="unknown op id 'linaer'.*did you mean linear"):
        with t.intercept(lambda e: e.fn, ["linear", "linaer"]):
            pass
    with pytest.raises(NotImplementedError, match="intercept: op 'rope.apply'.*'fake'"):
        with t.intercept(lambda e: e.fn, ["linear", "rope.apply"]):
            pass
    assert t._entries == before


def test_a_fallback_log_keeps_the_newest_entries_and_counts_all():
    from inferhal.core.ops.table import FallbackLog

    log = FallbackLog(keep=4)
    m0 = log.mark()
    for i in range(10):
        log.append(("linear", f"why {i % 3}"))
    assert list(log) == [("linear", f"why {i % 3}") for i in range(6, 10)] and isinstance(log, list)
    assert log.total == 10 and log.counts[("linear", "why 0")] == 4
    assert log.since(m0) == list(log)  # more than it keeps happened since: the newest it has
    m = log.mark()
    assert log.since(m) == []
    log.append(("lm_head", "quantised"))
    assert log.since(m) == [("lm_head", "quantised")] and len(log) == 4


def test_qualify_reads_a_fallback_log_past_its_bound():
    from inferhal.core.ops.table import FallbackLog
    from inferhal.core.qualify.runner import _fell_back, _mark

    log = FallbackLog(keep=2)
    for _ in range(5):
        log.append(("norm.rms", "old"))
    start = _mark(log)  # len(log) would be 2 here, and stay 2
    log.append(("norm.rms", "dtype float64"))
    assert _fell_back(log, start, "norm.rms") == ["dtype float64"] and _fell_back(log, start, "linear") == []
    plain = [("a", "x")]
    assert _mark(plain) == 1 and _fell_back(plain + [("a", "y")], 1, "a") == ["y"]
