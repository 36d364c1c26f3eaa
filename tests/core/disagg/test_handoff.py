"""Prefill/decode disaggregation on the tiny V4 (fp32 reference, every KV group kind): a prefill engine
hands each request off after its first token, a decode engine adopts its KV and decodes it; the tokens
and logprobs equal one colocated engine's, with prefix hits on the prefill side, small pools on both
sides, seeded sampling, FP8 KV records and MTP drafts (the drafter's KV group moves too). Sliding groups
move their window only: a long prompt moves as many window bytes as a short one past the window."""

from __future__ import annotations

import pytest

from inferhal import LLM, SamplingParams
from inferhal.core.disagg import local
from inferhal.core.disagg.connector import LoopbackConnector
from inferhal.core.disagg.handoff import DecodeSide, PrefillSide, side, window_blocks
from inferhal.core.engine.engine import Engine
from inferhal.core.engine.llm import compose_config
from inferhal.core.errors import UserError
from inferhal.core.paging import planning

BASE = [(7 * i + 3) % 190 + 1 for i in range(160)]
# mixed lengths across block (16), window (16), CSA (4) and HCA (16) boundaries; shared prefixes (prefix hits)
PROMPTS = [BASE[:5], BASE[:37], BASE[:48], BASE[:100], BASE[:130] + [3], [42, 43], BASE[:40] + [9, 9, 9],
           BASE[:33], BASE[:131]]


def llm(*overrides):
    return LLM.from_config(compose_config("deepseek_v4_tiny", "reference", overrides=list(overrides)))


def pair(base, role_overrides=(), **kw):
    """A prefill and a decode engine over ``base``'s loaded model (weights shared, pools separate)."""
    e = base.engine
    make = lambda role: Engine(e.loaded, e.backend, kw.get("scheduler", e.scheduler.cfg), kw.get("cache"),
                               e.max_model_len, spec=kw.get("spec"), transfer=side(role))
    return make("prefill"), make("decode")


def params(n):
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    return [greedy if i % 2 == 0 else SamplingParams(max_tokens=10, temperature=0.9, seed=i, ignore_eos=True,
                                                     logprobs=1) for i in range(n)]


def same(want, got, tol=1e-5):
    worst = 0.0
    for a, b in zip(want, got):
        assert (b.outputs[0].token_ids, b.outputs[0].finish_reason) == (a.outputs[0].token_ids, a.outputs[0].finish_reason)
        for p, q in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert p.keys() == q.keys()
            worst = max([worst] + [abs(p[t] - q[t]) for t in p])
    assert worst < tol, f"logprobs differ by up to {worst:.2e}"


@pytest.mark.parametrize("overrides", [[], ["cache.kv_dtype=fp8"], ["cache.kv_dtype=fp4"]], ids=["fp32", "fp8", "fp4"])
def test_disaggregated_outputs_equal_colocated(overrides):
    from inferhal.core.config.schema import CacheConfig, SchedulerConfig

    base = llm(*overrides)
    want = base.generate(PROMPTS, params(len(PROMPTS)))
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    cache = CacheConfig(num_blocks=24, kv_dtype=overrides[0].split("=")[1] if overrides else "auto")
    pre, dec = pair(base, scheduler=sched, cache=cache)
    got, stats = local.generate(pre, dec, PROMPTS, params(len(PROMPTS)))
    # fp8: the same tokens; a record's rounding can flip where other batching moved a value by an fp32 ulp
    same(want, got, 1e-5 if not overrides else 2e-2)
    assert sum(stats.cached.values()) > 0  # prefix hits on the prefill side
    # bytes: per group, the logical blocks a decode at position P reads, each layer's slots (no page padding)
    for p, o in zip(PROMPTS, got):
        want_b = sum((lambda lo, hi: hi - lo)(*window_blocks(s, 16, len(p))) * len(s.layers) * s.slots_per_block(16)
                     * s.slot_bytes() for s in pre.specs)
        assert stats.bytes[o.request_id] == want_b
    for e in (pre, dec):
        assert e.kv_manager.reqs == {} and not e.has_unfinished()
        e.kv_manager.check()


def test_sliding_groups_move_only_their_window():
    base = llm()
    pre, dec = pair(base)
    _, stats = local.generate(pre, dec, [BASE[:64], BASE[:150]], SamplingParams(max_tokens=2, temperature=0.0,
                                                                                 ignore_eos=True))
    a, b = (stats.bytes[r] for r in sorted(stats.bytes, key=int))
    layouts = {g.name: g for g in planning.layouts(pre.specs, 16)}
    slide = sum(planning.group_block_bytes(layouts[s.name]) * (lambda lo, hi: hi - lo)(*window_blocks(s, 16, n))
                for s in pre.specs if s.kind == "sliding" for n in (64,))
    slide_long = sum(planning.group_block_bytes(layouts[s.name]) * (lambda lo, hi: hi - lo)(*window_blocks(s, 16, 150))
                     for s in pre.specs if s.kind == "sliding")
    assert slide <= slide_long <= 2 * slide  # one or two blocks of window, whatever the length
    assert b > a  # the compressed groups grow with the prompt


def test_mtp_drafts_on_both_sides_move_the_drafter_kv_and_change_no_token():
    from inferhal.core.config.schema import SpecConfig

    base = llm()
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = base.generate(PROMPTS[:5], sp)
    pre, dec = pair(base, spec=SpecConfig(method="mtp", num_speculative_tokens=2))
    got, stats = local.generate(pre, dec, PROMPTS[:5], sp)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert "mtp" in stats.by_group and dec.stats["draft_tokens"] > 0


def test_requests_ending_at_their_first_token_finish_on_the_prefill_side():
    base = llm()
    pre, dec = pair(base)
    got, stats = local.generate(pre, dec, PROMPTS[:3], SamplingParams(max_tokens=1, temperature=0.0))
    assert [o.outputs[0].finish_reason for o in got] == ["length"] * 3 and not stats.bytes
    assert dec.stats["steps"] == 0


@pytest.mark.parametrize("decode_over, words", [
    (["cache.block_size=32"], "cache.block_size is 16 and this decode instance.s is 32"),
    (["cache.kv_dtype=fp8"], "KV group 'swa'"),
    (["spec=mtp", "spec.num_speculative_tokens=1"], "KV groups differ"),
])
def test_a_mismatched_decode_instance_is_refused_at_handshake(decode_over, words):
    a, b = llm(), llm(*decode_over)
    with pytest.raises(UserError, match=words):
        local.connect(Engine(a.engine.loaded, a.engine.backend, transfer=PrefillSide()), b.engine)


def test_bad_roles_are_refused():
    base = llm()
    with pytest.raises(UserError, match="parallel.role must be one of"):
        Engine(base.engine.loaded, base.engine.backend, transfer=side("both"))
    from inferhal.core.config.schema import SchedulerConfig

    with pytest.raises(UserError, match="async_scheduling=false"):
        Engine(base.engine.loaded, base.engine.backend, SchedulerConfig(async_scheduling=True), transfer=PrefillSide())


def test_a_transfer_waits_for_room_on_the_decode_side():
    """A decode engine with room for one request at a time adopts the others as requests finish."""
    from inferhal.core.config.schema import SchedulerConfig

    base = llm()
    want = base.generate(PROMPTS[:4], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    e = base.engine
    pre = Engine(e.loaded, e.backend, transfer=PrefillSide())
    dec = Engine(e.loaded, e.backend, SchedulerConfig(max_num_seqs=1), transfer=DecodeSide())
    got, _ = local.generate(pre, dec, PROMPTS[:4], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert dec.kv_manager.reqs == {}


def test_an_aborted_transfer_waiting_for_room_is_dropped_unrun():
    """A request handed to a full decode engine waits for room; aborted meanwhile (its router said so), it is
    dropped there, never adopted: nothing of it runs, and the pool ends empty."""
    from inferhal.core.config.schema import SchedulerConfig

    e = llm().engine
    pre = Engine(e.loaded, e.backend, transfer=PrefillSide())
    dec = Engine(e.loaded, e.backend, SchedulerConfig(max_num_seqs=1), transfer=DecodeSide())
    send, recv = local.connect(pre, dec)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ids = [pre.add_request(p, sp) for p in PROMPTS[:3]]
    handed = []
    while len(handed) < 3:
        pre.step()
        for payload in pre.transfer.take():
            send.send(payload)
            handed.append(dec.transfer.add(recv.recv(timeout=30.0)))
    assert handed == ids and dec.transfer.pending() == ids[1:]  # one sequence slot: the others wait
    assert dec.abort([ids[1]]) == [] and dec.transfer.pending() == [ids[2]]
    finished = []
    while dec.has_unfinished():
        finished += [o.request_id for o in dec.step() if o.finished]
    assert finished == [ids[0], ids[2]] and dec.kv_manager.reqs == {}
    dec.kv_manager.check()


def test_loopback_connector_says_what_it_waited_for():
    from inferhal.core.disagg.connector import ConnectorError

    a, _ = LoopbackConnector.pair()
    with pytest.raises(ConnectorError, match="no 'kv' message from the peer within 0.01 s"):
        a.recv(timeout=0.01)


def test_two_processes_over_the_default_connector_give_the_colocated_tokens(tmp_path):
    """Rank 0 prefills, rank 1 decodes; the KV moves through torch.distributed point-to-point (gloo)."""
    import importlib.util
    import os

    import torch

    from inferhal.core.parallel.launch import spawn_from_file

    path = os.path.join(os.path.dirname(__file__), "workers.py")
    spec = importlib.util.spec_from_file_location("disagg_workers", path)
    wk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wk)
    want = {f"r{i}": list(o.outputs[0].token_ids) for i, o in enumerate(wk.tiny().generate(wk.PROMPTS, wk.params()))}
    spawn_from_file(path, "pd_pair", 2, str(tmp_path))
    pre, dec = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert dec["done"] == want and pre["done"] == {}
    assert pre["bytes"] == dec["bytes"] and len(dec["bytes"]) == len(want)
    assert pre["left"] == 0 and dec["left"] == 0
