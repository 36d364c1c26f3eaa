"""The cases of the DeepSeek-V4 paged ops, the EP ops and act.gated: seeded, shaped like an engine step,
and sharp enough that an op with a plausible bug fails the check that should catch it (while an op that
only uses a freedom the contract allows, such as dispatch's receive order, passes)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from inferhal.core.profile import ExecLevel
from inferhal.core.qualify import runner
from inferhal.core.qualify.cases import op_cases
from inferhal.core.qualify.cases.base import CaseEnv
from inferhal.core.qualify.checks import call
from inferhal.core.qualify.numerics import bitwise_equal

NEW_OPS = ("attn.sparse_topk", "attn.compress", "indexer.scores", "moe.dispatch", "moe.combine", "act.gated")


@pytest.fixture(scope="module")
def refs():
    from inferhal.core.config.schema import BackendConfig
    from inferhal.core.registry import BackendRegistry

    reg = BackendRegistry.discover()
    return SimpleNamespace(plain=reg.select(BackendConfig(name="reference")),
                           bi=reg.select(BackendConfig(name="reference", batch_invariant=True)))


class Patched:
    """The batch-invariant reference with some ops replaced (and a communicator that counts its uses)."""

    def __init__(self, base, ops: dict):
        self.name, self.config, self.profile, self.device = "patched", base.config, base.profile, base.device
        self._base, self._ops, self.comms = base, ops, 0
        self.ops = SimpleNamespace(entry=lambda op: SimpleNamespace(fn=self._ops.get(op) or base.ops.entry(op).fn))

    def communicator(self, layout):
        self.comms += 1
        return self._base.communicator(layout)


def _case(op: str, dtype: str, contains: str):
    return next(c for c in op_cases(op, "quick") if c.dtype == dtype and contains in c.label)


def _row(case, active, reference):
    opts = runner.QualifyOptions(reruns=1, progress=False)
    return runner.run_case(case, active, reference, ExecLevel.DEVICE, opts, {}, measure="not timed in tests")


def _flat(obj):
    """Every tensor inside a case's inputs (AttnBatch and other dataclasses included), in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _flat(o)]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _flat(v)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in _flat(getattr(obj, f.name))]
    return []


def test_every_op_the_reference_claims_has_quick_and_full_cases(refs):
    claimed = runner.claimed_ops(refs.plain)
    assert set(NEW_OPS) <= set(claimed)
    assert [op for op in claimed if not op_cases(op, "quick")] == []
    for op in NEW_OPS:
        quick, full = op_cases(op, "quick"), op_cases(op, "full")
        assert len(full) > len(quick) and {c.dtype for c in quick} == {"float32", "bfloat16"}
        assert all(c.tol.why for c in full) and len({c.key for c in full}) == len(full)


@pytest.mark.parametrize("op", NEW_OPS)
def test_builders_are_seeded(op):
    for case in op_cases(op, "quick"):
        a, b, other = _flat(case.build(3)), _flat(case.build(3)), _flat(case.build(4))
        assert len(a) == len(b) and all(bitwise_equal(x, y)[0] for x, y in zip(a, b)), case.key
        assert not all(x.shape == y.shape and bitwise_equal(x, y)[0] for x, y in zip(a, other)), case.key


def test_paged_inputs_are_a_mixed_step_with_released_window_blocks():
    case = _case("attn.sparse_topk", "float32", "CSA")
    (q, kv, swa, comp_cache, comp_batch, topk, p), _ = case.build(0)
    assert (swa.block_table < 0).any(), "sliding blocks out of the window are released"
    assert swa.tokens_per_slot == 1 and comp_batch.tokens_per_slot == 4
    new = (swa.query_start_loc[1:] - swa.query_start_loc[:-1]).tolist()
    assert 1 in new and max(new) > 1  # decode and prefill in one step
    visible = (swa.positions + 1) // comp_batch.tokens_per_slot
    assert ((topk >= visible[:, None]) & (topk >= 0)).any(), "some picks are not closed yet: the op must drop them"
    assert (topk == -1).any() and (topk >= 0).any()
    # attn.compress: every row closes a window, and every sequence of the step closes at least one
    (state, sb, rows, *_), _ = _case("attn.compress", "float32", "CSA").build(0)
    assert bool(((sb.positions[rows] + 1) % 4 == 0).all())
    seq_of_row = torch.searchsorted(sb.query_start_loc[1:].long(), rows, right=True)
    assert sorted(set(seq_of_row.tolist())) == list(range(sb.num_seqs))


@pytest.mark.parametrize("op", NEW_OPS)
def test_new_cases_pass_on_the_batch_invariant_reference(refs, op):
    active = Patched(refs.bi, {})
    for case in op_cases(op, "quick")[:2]:
        row = _row(case, active, refs.plain)
        assert row["status"] == "pass", row["message"]
        assert row["batch_invariance"]["status"] == "pass", (case.key, row["batch_invariance"])
    if op.startswith("moe."):
        assert active.comms > 0, "the EP cases take their communicator from the backend under test"


def _next_up(o):
    return torch.nextafter(o, torch.full_like(o, float("inf")))


def _mutants():
    from inferhal.backends.reference import deepseek, ep, ops

    def topk_ignores_causality(q, kv, batch, cc, cb, topk, p, sinks=None):
        cb = None if cb is None else dataclasses.replace(cb, tokens_per_slot=1)  # every picked entry "visible"
        return deepseek.attn_sparse_topk(q, kv, batch, cc, cb, topk, p, sinks)

    def topk_batch_dependent(q, kv, batch, *a, **kw):  # 1 ulp off only when sharing a 3-sequence batch
        o = deepseek.attn_sparse_topk(q, kv, batch, *a, **kw)
        return _next_up(o) if batch.num_seqs >= 3 else o

    def indexer_unmasked(*a):
        s = deepseek.indexer_scores(*a)
        return torch.where(torch.isinf(s), torch.zeros_like(s), s)

    def indexer_old_width(q, keys, batch, *a):  # S = max(seq_lens), the width before the block table's reach
        return deepseek.indexer_scores(q, keys, batch, *a)[:, : int(batch.seq_lens.max())]

    def indexer_pad_not_masked(q, keys, batch, *a):  # the columns past max(seq_lens) left 0, not -inf
        s = deepseek.indexer_scores(q, keys, batch, *a)
        s[:, int(batch.seq_lens.max()):] = 0.0
        return s

    def compress_without_bias(state, batch, rows, bias, *a):
        return deepseek.attn_compress(state, batch, rows, torch.zeros_like(bias), *a)

    def compress_pads_computed(state, batch, rows, *a):  # a -1 row pooled as the first row instead of zeros
        return deepseek.attn_compress(state, batch, torch.where(rows < 0, rows[0], rows), *a)

    @dataclasses.dataclass
    class Reversed:  # dispatch's receive order is free: reverse it, and undo that in combine
        inner: object

    def dispatch_reversed(x, ids, comm, p):
        r = ep.moe_dispatch(x, ids, comm, p)
        return dataclasses.replace(r, x=r.x.flip(0), local_ids=r.local_ids.flip(0), handle=Reversed(r.handle))

    def combine_unreversed(y, w, handle, comm, p):
        return ep.moe_combine(y.flip(0), w, handle.inner, comm, p)

    def combine_unweighted(y, w, handle, comm, p):
        return ep.moe_combine(y, torch.ones_like(w), handle, comm, p)

    def gelu_exact(gate, up, p):
        return torch.nn.functional.gelu(gate) * up if p.kind == "gelu_tanh" else ops.act_gated(gate, up, p)

    return dict(topk_ignores_causality=topk_ignores_causality, topk_batch_dependent=topk_batch_dependent,
                indexer_unmasked=indexer_unmasked, indexer_old_width=indexer_old_width,
                indexer_pad_not_masked=indexer_pad_not_masked, compress_without_bias=compress_without_bias,
                compress_pads_computed=compress_pads_computed,
                dispatch_reversed=dispatch_reversed, combine_unreversed=combine_unreversed,
                combine_unweighted=combine_unweighted, gelu_exact=gelu_exact)


@pytest.mark.parametrize("mutant, ops, case, expect", [
    ("topk_ignores_causality", ("attn.sparse_topk",), ("attn.sparse_topk", "bfloat16", "CSA"), "numerics"),
    ("topk_batch_dependent", ("attn.sparse_topk",), ("attn.sparse_topk", "float32", "HCA"), "batch_invariance"),
    ("indexer_unmasked", ("indexer.scores",), ("indexer.scores", "float32", "Hi=4"), "numerics"),
    ("indexer_old_width", ("indexer.scores",), ("indexer.scores", "bfloat16", "table+"), "numerics"),
    ("indexer_pad_not_masked", ("indexer.scores",), ("indexer.scores", "float32", "table+"), "numerics"),
    ("compress_without_bias", ("attn.compress",), ("attn.compress", "bfloat16", "HCA"), "numerics"),
    ("compress_pads_computed", ("attn.compress",), ("attn.compress", "float32", "padded"), "numerics"),
    ("dispatch_reversed", ("moe.dispatch",), ("moe.dispatch", "bfloat16", "skip"), "pass"),
    ("dispatch_reversed+combine_unreversed", ("moe.dispatch", "moe.combine"), ("moe.combine", "float32", "skip"),
     "pass"),
    ("combine_unweighted", ("moe.combine",), ("moe.combine", "bfloat16", "T=16"), "numerics"),
    ("gelu_exact", ("act.gated",), ("act.gated", "float32", "gelu_tanh"), "numerics"),
])
def test_plausible_bugs_fail_the_right_check_and_allowed_freedoms_pass(refs, mutant, ops, case, expect):
    fns = _mutants()
    active = Patched(refs.bi, {op: fns[name] for op, name in zip(ops, mutant.split("+"))})
    row = _row(_case(*case), active, refs.plain)
    if expect == "pass":
        assert row["status"] == "pass", row["message"]
        return
    assert row["status"] == "fail" and row[expect]["ok"] is False, row
    assert row["determinism"]["ok"] is True
    if expect == "batch_invariance":  # close enough to the reference, but not the same bits in every batch
        assert row["numerics"]["ok"] is True, row["numerics"]


def test_dispatch_result_is_compared_as_a_multiset(refs):
    case = _case("moe.dispatch", "float32", "skip")
    env = CaseEnv(refs.plain)
    x, ids = call(case, refs.plain.ops.entry("moe.dispatch").fn, 0, "cpu", env)
    (tx, tids, _, _), _ = case.build(0)
    assert x.shape[0] == int((tids >= 0).sum()) > 0
    assert bool((ids[1:] >= ids[:-1]).all())  # canonical order: by local expert id first


def test_fingerprint_tells_batch_invariant_runs_apart(refs, tmp_path):
    opts = runner.QualifyOptions(ops=("act.gated",), reruns=1, progress=False, output_dir=str(tmp_path))
    a, b = runner.fingerprint(refs.plain, opts), runner.fingerprint(refs.bi, opts)
    assert a["batch_invariant"] is False and b["batch_invariant"] is True
    assert "batch_invariant" in b["features"] and "batch_invariant" not in a["features"]
    first = runner.run(refs.plain, refs.plain, opts)
    assert runner.run(refs.plain, refs.plain, opts)["resumed_cases"] == len(first["rows"]) > 0
    bi = runner.run(refs.bi, refs.plain, opts)  # same directory, other mode: nothing reused
    assert bi["resumed_cases"] == 0
    assert {r["batch_invariance"]["status"] for r in bi["rows"]} == {"pass"}
    assert {r["batch_invariance"]["status"] for r in first["rows"]} == {"not claimed"}
