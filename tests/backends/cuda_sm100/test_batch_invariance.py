"""cuda_sm100's batch-invariance declarations (backends/cuda_sm100/ops.py: BATCH_INVARIANCE), checked in Triton's
interpreter (level: interpreter, not a hardware result): for every op it declares invariant, a row computed alone
is bitwise the row computed inside batches of other sizes (1, half, all but one, all), through qualify's own
batch-invariance check on the smallest fp32 conformance case of the op (fp32: the interpreter's bf16 paths
truncate stores and upcast dots, FACTS.md). Ops without a batch dimension in their cases (kv.write,
sample.mask) and the two sort paths of topk.select get their own checks; a batch-dependent op makes the check
fail (negative control). What the interpreter cannot show: hardware reduction trees; the audit of tiles and
splits (no tile or split chosen from the token count) is in the declarations' reasons."""

from __future__ import annotations

import functools

import pytest
import torch

from inferhal.core.config.schema import BackendConfig
from inferhal.core.qualify import checks
from inferhal.core.qualify.cases import op_cases
from inferhal.core.qualify.cases.base import CaseEnv
from inferhal.core.registry import BackendRegistry

NO_BATCH_DIM = ("kv.write", "sample.mask")  # checked below by hand
#: cheaper than the first fp32 case (interpreter seconds on a 2-core VM, measured)
PICK = {"attn.compress": "HCA", "attn.sparse_topk": "window only", "topk.select": "T=6 S=100", "sample": "seeded",
        "spec.verify": "seeded"}


@pytest.fixture(scope="module")
def active():
    reg = BackendRegistry.discover()
    return reg.select(BackendConfig(name="cuda_sm100", interpret=True, batch_invariant=True))


def smallest_case(op_id: str):
    cases = [c for c in op_cases(op_id, "quick") if c.dtype == "float32" and c.rows is not None]
    cases = [c for c in cases if PICK.get(op_id, "") in c.label] or cases
    return cases[0]


def invariance(active, case, fn=None):
    fn = fn or active.ops.entry(case.op_id).fn
    ctx = checks.CaseContext(fn=fn, ref_fn=fn, torch_device="cpu", seed=0, reruns=0, batch_invariant=True,
                             peak_bandwidth=0.0, peak_flops=0.0, measure="interpreter", env=CaseEnv(active))
    return checks.batch_invariance(case, ctx, checks.call(case, fn, 0, "cpu", ctx.env))


def test_every_op_is_declared_and_the_mode_is_on(active):
    from inferhal.backends.cuda_sm100.ops import BATCH_INVARIANCE, KERNEL_OPS

    assert set(KERNEL_OPS) == set(BATCH_INVARIANCE) == set(active.ops.natives())
    assert active.profile.supports("batch_invariant") and active.profile.exec_level.value == "interpreter"


@pytest.mark.parametrize("op_id", sorted(set(__import__("inferhal.backends.cuda_sm100.ops", fromlist=["x"])
                                             .KERNEL_OPS) - set(NO_BATCH_DIM)))
def test_a_row_alone_equals_the_row_in_batches_of_other_sizes(active, op_id):
    case = smallest_case(op_id)
    res = invariance(active, case)
    assert res["ok"] is True, f"{case.key}: {res['message']}"
    assert 1 in res["sizes"] and len(res["sizes"]) >= 2, res


def test_kv_write_encodes_each_token_alone_as_in_the_batch(active):
    fn = active.ops.entry("kv.write").fn
    for label in ("fp8", "fp4"):  # per-token fp8 scale (amax of the row), and an FP4 record per entry
        case = next(c for c in op_cases("kv.write", "quick") if c.dtype == "float32" and label in c.label)
        (vals, cache, slots, p), kw = case.build(0)
        fn(vals, cache, slots, p, **kw)
        for n in (1, 5):
            (v2, c2, s2, p2), kw2 = case.build(0)
            fn(v2[:n], c2, s2[:n], p2, **kw2)
            sl = slots[:n][slots[:n] >= 0]
            bs = cache.shape[1]
            got, want = c2[sl // bs, sl % bs], cache[sl // bs, sl % bs]
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (case.key, n)
            if kw:
                assert torch.equal(kw2["scale_cache"][sl // bs, sl % bs], kw["scale_cache"][sl // bs, sl % bs])


def test_sample_mask_masks_a_row_alone_as_in_the_batch(active):
    fn = active.ops.entry("sample.mask").fn
    case = op_cases("sample.mask", "quick")[0]
    (logits, words, rows), _ = case.build(0)
    full = logits.clone()
    fn(full, words, rows)
    for n in (1, 2):
        part = logits.clone()
        fn(part, words[:n], rows[:n])
        assert torch.equal(part[rows[:n]], full[rows[:n]])


def test_topk_rows_take_the_same_entries_through_either_sort_path(active):
    """A short row alone is sorted whole; padded with -inf to a wide batch it takes the bisection path
    (the width decides, and indexer.scores pads to the batch's widest row): the same indices."""
    topk = active.ops.entry("topk.select").fn
    g = torch.Generator().manual_seed(3)
    short = torch.randn(2, 40, generator=g)
    short[0, 7] = short[0, 3]  # a tie: the lower index first
    wide = torch.full((3, 300), float("-inf"))  # 300 > the interpreter's BLOCK_SORT (256): bisection
    wide[:2, :40] = short
    wide[2] = torch.randn(300, generator=g)
    alone, batched = topk(short[:1], 8), topk(wide, 8)
    assert torch.equal(alone[0], batched[0]) and torch.equal(topk(short, 8), batched[:2])


def test_moe_experts_adds_the_choices_of_a_token_in_order():
    from inferhal.kernels.moe_experts import ordered_sum

    y = torch.tensor([[[1e8], [1.0], [-1e8]]], dtype=torch.float32)  # (1e8 + 1) - 1e8 = 0 in fp32, in this order
    assert ordered_sum(y).item() == 0.0 and ordered_sum(y[:, [0, 2, 1]]).item() == 1.0
    assert ordered_sum(torch.zeros(2, 0, 3)).shape == (2, 3)


def test_negative_control_a_batch_dependent_op_fails_the_check(active):
    case = smallest_case("norm.rms")
    fn = active.ops.entry("norm.rms").fn

    @functools.wraps(fn)
    def split_by_batch(x, *a, **k):  # what a split chosen from the token count does: another rounding
        y = fn(x, *a, **k)
        return y * (1.0 + 2.0 ** -20) if x.shape[0] > 4 else y

    res = invariance(active, case, split_by_batch)
    assert res["ok"] is False and "rows computed alone differ from the full batch" in res["message"]
