"""The compressed rows a DeepSeek-V4 step closes, without the host's plan (#46 item 3: a captured graph's step).

``closing_rows`` takes a host-known count: exact with the plan (``ForwardBatch.seqs``), else
``closing_row_bound`` of the step's shapes with -1 rows (slot -1) past the device's count. Here:
the bound holds for every step the paging layer can build and is the true maximum over small steps
(Hypothesis and a brute-force sweep); the rows without the plan are the plan's rows then -1s; and the
tiny V4 on the reference, stepped without the plan, gives with the -1 rows the logits it gave with the
exact rows (bitwise in batch-invariant mode, where every op's row is computed alone; within 1e-6 by
default), so the same greedy tokens. (tests/core/engine/test_host_sync.py: the same tokens as with the
plan, no host read in model code; tests/backends/cuda_sm100/test_host_reads.py: none in the backend.)
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inferhal import LLM
from inferhal.core.engine.llm import compose_config
from inferhal.core.models.base import ForwardBatch
from inferhal.core.models.deepseek_v4.attention import closing_row_bound, closing_rows
from inferhal.core.paging.batch import SeqSlice, build_attn_batches
from inferhal.core.paging.spec import KVGroupSpec

BS = 128  # a multiple of every ratio tried


def _step(ratio: int, seqs: list[tuple[int, int, int]]):
    """(slot mapping of a compressed group, the step's SeqSlices) for (num_computed, num_new, write_from) seqs."""
    spec = KVGroupSpec("comp", "compressed", (0,), (4,), torch.float32, tokens_per_slot=ratio)
    blocks = -(-max([c + n for c, n, _ in seqs] + [1]) // BS)
    slices = [SeqSlice(c, n, {"comp": list(range(i * blocks, (i + 1) * blocks))}, w)
              for i, (c, n, w) in enumerate(seqs)]
    pos, qsl, attn = build_attn_batches([spec], BS, slices)
    return attn["comp"], pos, qsl, slices


def _batch(a, pos, qsl, slices=None) -> ForwardBatch:
    return ForwardBatch(torch.zeros_like(pos), pos, qsl, {"comp": a}, qsl[1:] - 1, seqs=slices)


seq_st = st.tuples(st.integers(0, 300), st.integers(0, 70), st.integers(0, 400))


@settings(max_examples=300, deadline=None)
@given(ratio=st.sampled_from([2, 4, 16, 128]), seqs=st.lists(seq_st, min_size=1, max_size=6))
def test_the_bound_holds_and_the_rows_are_the_plans_then_padding(ratio, seqs):
    a, pos, qsl, slices = _step(ratio, seqs)
    slots = a.slot_mapping
    exact = torch.nonzero(slots >= 0).flatten()
    t = int(pos.shape[0])
    assert exact.numel() <= closing_row_bound(t, len(seqs), ratio)
    planned = closing_rows(slots, _batch(a, pos, qsl, slices), ratio)
    bounded = closing_rows(slots, _batch(a, pos, qsl), ratio)
    if exact.numel() == 0:
        assert planned is None
    else:
        assert torch.equal(planned[0], exact) and torch.equal(planned[1], slots[exact])
    if t == 0 or closing_row_bound(t, len(seqs), ratio) == 0:
        assert bounded is None
        return
    rows, sl = bounded
    n = exact.numel()
    assert rows.shape[0] == closing_row_bound(t, len(seqs), ratio)
    assert torch.equal(rows[:n], exact) and torch.equal(sl[:n], slots[exact])
    assert bool((rows[n:] == -1).all()) and bool((sl[n:] == -1).all())


def test_the_bound_is_the_most_a_step_can_close():
    """Every split of T tokens over B sequences (each at every offset within a window): the largest count
    of closing rows equals the bound, so no smaller host number would do."""
    for ratio, b in itertools.product((2, 3, 4), (1, 2, 3)):
        for t in range(0, 9):
            best = 0
            for split in itertools.product(range(t + 1), repeat=b):
                if sum(split) != t:
                    continue
                # each sequence's best start: its n tokens holding ceil(n / ratio) window ends
                best = max(best, sum(max(len([p for p in range(c, c + n) if (p + 1) % ratio == 0])
                                         for c in range(ratio)) for n in split))
            assert best == closing_row_bound(t, b, ratio), (ratio, b, t)


# ---------------------------------------------------------------- the tiny V4 with and without padding

PROMPTS = [[5, 6, 7, 8, 9] * 3, [3, 4, 5], [11, 12, 13, 14] * 5 + [15]]


def _exact_rows(slots, batch, ratio):
    """closing_rows before the bound: the exact rows, counted by ``nonzero`` (a host read)."""
    rows = torch.nonzero(slots >= 0).flatten()
    return (rows, slots[rows]) if rows.numel() else None


def _run(model, v4, with_plan: bool, steps: int = 6):
    """Greedy steps over a paged driver; the logits of every step (a prefill, then decodes)."""
    drv = v4.PagedDriver(model)
    out, nxt = [], {i: p for i, p in enumerate(PROMPTS)}
    for _ in range(steps):
        nc = {sid: drv.computed.get(sid, 0) for sid in nxt}
        b = drv.batch(nxt)
        if with_plan:
            b = dataclasses.replace(b, seqs=tuple(SeqSlice(nc[s], len(new), drv.tables[s]) for s, new in nxt.items()))
        logits = model.forward(b, drv.kv)
        for sid, new in nxt.items():
            drv.computed[sid] = nc[sid] + len(new)
        out.append(logits)
        nxt = {sid: [int(t)] for sid, t in zip(nxt, logits.argmax(-1))}
    return out


@pytest.fixture(scope="module", params=[False, True], ids=["default", "batch_invariant"])
def tiny(request):
    bi = str(request.param).lower()
    return request.param, LLM.from_config(compose_config("deepseek_v4_tiny", "reference",
                                                         [f"backend.batch_invariant={bi}"])).engine.runner.model


def test_padding_rows_change_no_logit(tiny, v4, monkeypatch):
    """Without the plan, the bound's -1 rows against the exact rows (nonzero, as before the bound): the same
    logits at every step, bitwise in batch-invariant mode (each op computes a row alone), within 1e-6 in
    the default mode; at least one step had padding rows."""
    from inferhal.core.models.deepseek_v4 import attention

    bi, model = tiny
    padded = []
    real = attention.closing_rows

    def watch(slots, batch, ratio):
        out = real(slots, batch, ratio)
        padded.append(out is not None and bool((out[0] < 0).any()))
        return out

    monkeypatch.setattr(attention, "closing_rows", watch)
    got = _run(model, v4, False)
    monkeypatch.setattr(attention, "closing_rows", _exact_rows)
    want = _run(model, v4, False)
    assert any(padded)
    for w, g in zip(want, got):
        assert torch.equal(w.argmax(-1), g.argmax(-1))
        if bi:
            assert torch.equal(w, g)
        else:
            torch.testing.assert_close(g, w, rtol=0, atol=1e-6)

