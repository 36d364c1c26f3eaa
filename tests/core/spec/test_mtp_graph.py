"""The MTP drafter's prefill and chained drafts as one fixed-shape, host-read-free step (core/spec/mtp_graph.py),
on the tiny DeepSeek-V4 with its fitted MTP layer, reference ops on the CPU, ``deterministic=true``. A stand-in
graph runner (capture keeps copies of the inputs; each replay copies new inputs in and runs the step under core's
host-read guard, where a read in core or model code raises) replays it against the eager drafter on the same KV
state: the same drafts and, bit for bit, the same KV afterwards. The engine-level run (drafts and tokens of a whole
generation, graphs on against off) is tests/core/engine/test_graphs_spec.py's. No device graph is captured here."""

from __future__ import annotations

import pytest
import torch

from inferhal import LLM
from inferhal.core.engine.graphs import DecodeGraphs
from inferhal.core.engine.host_sync import HostSyncGuard
from inferhal.core.engine.llm import compose_config
from inferhal.core.spec.mtp_graph import MtpDraftGraphs
from inferhal.core.spec.proposer import DraftWant, StepSeq, TargetStep

K, Q = 2, 3  # drafts; rows a sequence of the verification step before


class Guarded:
    """Capture: copies of the inputs; replay: new inputs copied in, the step run under the host-read guard."""

    def __init__(self) -> None:
        self.captured, self.replays = [], 0

    def capture(self, fn, *example):
        static = [a.clone() for a in example]
        self.captured.append((int(static[2].shape[0]) - 1, int(static[0].shape[0]) // (int(static[2].shape[0]) - 1)))

        def replay(*args):
            assert [a.shape for a in args] == [s.shape for s in static]
            for s, a in zip(static, args):
                s.copy_(a)
            with HostSyncGuard():
                out = fn(*static)
            self.replays += 1
            return out

        return replay


@pytest.fixture(scope="module")
def eng():
    return LLM.from_config(compose_config("deepseek_v4_tiny_mtp", "reference", [
        "deterministic=true", "spec=mtp", f"spec.num_speculative_tokens={K}", "cache.num_blocks=16"])).engine


def setup(eng, exact, limits, rows=None):
    """Requests of 20, 9 and 33 tokens computed before a verification step of ``Q`` rows each (``rows``: per
    request) that stood ``exact`` positions; their KV pool filled with seeded values; → the step, the wants."""
    g = torch.Generator().manual_seed(0)
    for buf, _ in eng.kv_storage.groups.values():
        buf.copy_(torch.randn(buf.shape, generator=g).to(buf.dtype) * 0.1)
    kvm, seqs, wants = eng.kv_manager, [], []
    rows = rows or [Q] * len(exact)
    for i, (start, n, lim, q) in enumerate(zip([20, 9, 33], exact, limits, rows)):
        rid = f"r{i}"
        if rid not in kvm.reqs:  # the same blocks in every call
            assert kvm.allocate(rid, 0, start + Q + K)
        toks = torch.randint(1, 190, (start + n + 1,), generator=g).tolist()
        seqs.append(StepSeq(rid, start, n, i * Q, toks, kvm.block_ids(rid), q))
        wants.append(DraftWant(rid, toks, lim, kvm.block_ids(rid)))
    m = eng.model.cfg
    hidden = torch.randn(len(exact) * Q, m.hc_mult, m.hidden_size, generator=g)
    return TargetStep(tuple(seqs), hidden, eng.kv_storage), wants


def graphs(eng, runner):
    decode = DecodeGraphs(runner, eng.model, eng.specs, eng.kv_manager.block_size, eng.max_model_len, [1, 2, 4],
                          eng.kv_storage, num_drafts=K, hidden=True)
    return MtpDraftGraphs(eng.proposer, decode, eng.max_model_len)


def kv_state(eng):
    return [buf.clone() for buf, _ in eng.kv_storage.groups.values()]


def test_draft_replays_give_the_eager_drafts_and_kv_without_a_host_read(eng):
    """One capture (3 sequences: a bucket of 4 with a padding sequence) replayed for two calls: every draft
    after 3, 1 and 2 exact positions, then limits of 1 (no chained draft) and 0 (none) after 2, 3 and 1; each
    replay gives the eager drafter's drafts and leaves the KV pool bit for bit as it does, twice alike."""
    runner = Guarded()
    g = graphs(eng, runner)
    for exact, limits, times in [([3, 1, 2], [5, 5, 5], 2), ([2, 3, 1], [5, 1, 0], 1)]:
        step, wants = setup(eng, exact, limits)
        eng.proposer.prefill(step)
        want = eng.proposer.propose(wants, eng.kv_storage)
        want_kv = kv_state(eng)
        assert [len(want.get(f"r{i}", ())) for i in range(3)] == [min(K, max(lim, 0)) for lim in limits]
        for _ in range(times):
            step, wants = setup(eng, exact, limits)
            assert g.draft(step, wants) == want
            assert all(torch.equal(a, b) for a, b in zip(kv_state(eng), want_kv))
    assert runner.captured == [(4, Q)] and runner.replays == 3 and g.num_captures == 1 and g.num_replays == 3
    assert list(g._replays) == [(4, Q, K)]


def test_a_call_that_is_not_uniform_runs_eagerly(eng):
    """A sequence whose step computed fewer rows, a sequence without a want, more sequences than a bucket:
    no plan (the eager drafter runs); a plain decode's step (one row each) has one."""
    g = graphs(eng, Guarded())
    step, wants = setup(eng, [3, 1, 2], [5, 5, 5], rows=[Q, 2, Q])
    assert g.plan(step, wants) is None
    step, wants = setup(eng, [3, 1, 2], [5, 5, 5])
    assert g.plan(step, wants[:2]) is None and g.plan(step, None) is None
    assert g.plan(step, wants) == (Q, [K, K, K])
    g.decode.sizes = (2,)
    assert g.plan(step, wants) is None
