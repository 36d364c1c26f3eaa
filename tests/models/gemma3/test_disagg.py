"""Gemma 3 270M through a prefill engine and a decode engine (one loaded model, two KV pools, the
loopback connector): greedy tokens equal the colocated engine's for a prompt past the 512-token sliding
window (its window groups move one window, its full-attention groups every block) and one that shares
its first 592 tokens (a prefix hit on the prefill side). One request at a time on both sides, as in the
colocated run, so the fp32 products are the same shapes and no near-tie can flip."""

from __future__ import annotations

import pytest

from inferhal.core.config.schema import CacheConfig, SchedulerConfig
from inferhal.core.disagg import local
from inferhal.core.disagg.handoff import side
from inferhal.core.engine.engine import Engine
from inferhal.core.sampling.params import SamplingParams

from prompts import PROMPTS, long_prompt

pytestmark = pytest.mark.slow


def test_gemma_disaggregated_greedy_equals_colocated(gemma):
    loaded, be = gemma
    tok = loaded.tokenizer
    long = tok.encode(long_prompt())[:600]
    ids = [tok.encode(PROMPTS[0]), long, long[:592] + tok.encode(" and so on, and so forth")]
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    sched, cache = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=1024), CacheConfig(num_blocks=128)
    colo = Engine(loaded, be, sched, cache, 2048)
    want = [colo.add_request(p, sp) for p in ids]
    outs = {}
    while colo.has_unfinished():
        for o in colo.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
    pre = Engine(loaded, be, sched, cache, 2048, transfer=side("prefill"))
    dec = Engine(loaded, be, sched, cache, 2048, transfer=side("decode"))
    got, stats = local.generate(pre, dec, ids, sp)
    assert [o.outputs[0].token_ids for o in got] == [outs[r] for r in want]
    assert stats.cached[got[2].request_id] >= 576  # whole blocks of the shared 592 tokens
    assert {s.kind for s in pre.specs} == {"sliding", "full"}
    # the 600-token prompt: its full-attention groups send all 38 blocks, its sliding groups one window's
    window, bs = loaded.model.cfg.sliding_window, pre.kv_manager.block_size
    for s in pre.specs:
        n = stats.blocks[got[1].request_id][s.name]
        assert n == (-(-600 // bs) if s.kind == "full" else -(-600 // bs) - (600 - window + 1) // bs), (s.name, n)
    for e in (pre, dec):
        assert e.kv_manager.reqs == {}
        e.kv_manager.check()
