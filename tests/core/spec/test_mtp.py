"""MTP speculative decoding through the engine (tiny DeepSeek-V4 with one MTP layer, fp32 reference):

- greedy output at k = 1, 2, 3 is token for token the output without drafts, for a mixed-length batch
  under a small KV budget (preemption), chunked prefill and prefix hits, with drafts accepted often
  (a random MTP head accepts almost nothing, so the drafts are steered: the first m of each step are the
  true continuation, m varying, while the MTP drafter runs underneath);
- the MTP drafter's own first draft of every step equals an offline recompute over the final sequence:
  its paged state stays exact through acceptance, roll back, preemption, prefix hits and chunking;
- limits and bad input: max_tokens with no room for drafts, stop strings cutting accepted drafts,
  k out of range, a model without MTP weights.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from inferhal import LLM, SamplingParams
from inferhal.core.engine.llm import compose_config
from inferhal.core.errors import UserError
from inferhal.core.models.base import ForwardBatch
from inferhal.core.paging.batch import SeqSlice, build_attn_batches

BASE = [(7 * i + 3) % 190 + 1 for i in range(48)]
# mixed lengths; the later ones share 32- and 40-token prefixes with earlier ones (prefix hits)
PROMPTS = [BASE[:5], BASE[:37], BASE[3:20], BASE[:48], [42, 43], BASE[:40] + [9, 9, 9], BASE[:32] + [11] * 10]
SMALL = ["cache.num_blocks=8", "scheduler.max_num_batched_tokens=24", "scheduler.max_num_seqs=5"]


def llm(*overrides):
    return LLM.from_config(compose_config("deepseek_v4_tiny", "reference", overrides=list(overrides)))


def greedy(n=20):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def plain():
    eng = llm(*SMALL)
    return eng, eng.generate(PROMPTS, greedy())


def offline_drafts(eng, ids):
    """MTP layer 0's greedy draft after every position of ``ids``, from one full forward in fresh blocks
    (``[p]``: the draft for position ``p + 2``)."""
    kvm = eng.engine.kv_manager
    assert kvm.allocate("offline", 0, len(ids))
    blocks = kvm.block_ids("offline")
    try:
        pos, qsl, attn = build_attn_batches(eng.engine.specs, kvm.block_size, [SeqSlice(0, len(ids), blocks)])
        batch = ForwardBatch(torch.tensor(ids), pos, qsl, attn, torch.arange(len(ids)))
        _, hidden = eng.engine.model.forward_and_hidden(batch, eng.engine.kv_storage)
        prop = eng.engine.proposer
        streams = prop._run([SeqSlice(0, len(ids) - 1, {"mtp": blocks["mtp"]})], ids[1:], hidden[:-1], 0,
                            eng.engine.kv_storage)
        return eng.engine.model.mtp_head(streams, 0).tolist()
    finally:
        kvm.free("offline")


def steer(eng, truth):
    """Replace each step's drafts: the first m (varying with the position) from the ``truth`` sequence the
    request follows (full greedy sequences), the rest the MTP drafter's own; log the drafter's first draft
    of every step."""
    prop = eng.engine.proposer
    orig, log = prop.propose, []

    def propose(wants, kv=None):
        got = orig(wants, kv)
        for w in wants:
            d = got.get(w.request_id)
            if not d:
                continue
            log.append((w.request_id, len(w.token_ids), d[0]))
            c = len(w.token_ids)
            m = (c * 5) % (len(d) + 1)
            seq = next((t for t in truth.values() if t[:c] == list(w.token_ids)), [])
            got[w.request_id] = list(seq[c:c + m]) + d[m:]
        return got

    prop.propose = propose
    return log


@pytest.mark.parametrize("k, mode", [(1, "false"), (2, "false"), (3, "false"), (1, "true"), (3, "true")])
def test_greedy_mtp_is_token_identical_with_preemption_chunking_and_prefix_hits(plain, k, mode):
    """mode: scheduler.async_scheduling (true: the drafter runs on the step thread, on placeholders)."""
    base, want = plain
    truth = {o.request_id: o.prompt_token_ids + o.token_ids for o in want}
    eng = llm(*SMALL, "spec=mtp", f"spec.num_speculative_tokens={k}", f"scheduler.async_scheduling={mode}")
    log = steer(eng, truth)
    got = eng.generate(PROMPTS, greedy())
    for a, b in zip(want, got):
        assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason
    st = eng.engine.stats
    assert sum(o.num_preemptions for o in got) > 0 and sum(o.num_cached_tokens for o in got) > 0
    assert 0 < st["accepted_tokens"] < st["draft_tokens"]
    assert sum(o.num_draft_tokens for o in got) == st["draft_tokens"]
    assert sum(o.num_accepted_tokens for o in got) == st["accepted_tokens"]
    assert len(st["drafted_at"]) == k and st["drafted_at"][0] >= st["drafted_at"][-1]
    # the drafter's own first draft of every step equals a recompute from scratch
    assert len(log) > 30
    off = {rid: offline_drafts(eng, seq) for rid, seq in truth.items()}
    bad = [(rid, c, d) for rid, c, d in log if off[rid][c - 2] != d]
    assert not bad, f"{len(bad)} of {len(log)} drafts differ from the offline MTP: {bad[:5]}"
    eng.engine.step()  # (async: fold the step still in flight)
    assert eng.engine.kv_manager.reqs == {} and eng.engine.scheduler.running == []
    eng.engine.kv_manager.check()


@pytest.mark.parametrize("mode", ["false", "true"])
def test_no_room_for_drafts_and_stop_strings_cut_accepted_drafts_exactly(plain, mode):
    base, want = plain
    eng = llm(*SMALL, "spec=mtp", "spec.num_speculative_tokens=3", f"scheduler.async_scheduling={mode}")
    truth = {o.request_id: o.prompt_token_ids + o.token_ids for o in want}
    steer(eng, truth)  # every draft of the first call is right where m = len(d)
    for n in (1, 2, 3):
        out = eng.generate(PROMPTS[:3], greedy(n))
        assert [o.token_ids for o in out] == [o.token_ids[:n] for o in want[:3]]
        assert all(o.finish_reason == "length" for o in out)
    # a stop token among drafts: output ends at it, as without drafts
    stop = want[1].token_ids[6]
    sp = SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop], ignore_eos=True)
    a, b = base.generate(PROMPTS[1:2], sp)[0], eng.generate(PROMPTS[1:2], sp)[0]
    assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
    # a stop string completed by an accepted draft: tokens cut right after it, as without drafts (the engines'
    # model carries a tokenizer that reads text: the tiny V4 has none)
    base, eng = lettered(*SMALL), lettered(*SMALL, "spec=mtp", "spec.num_speculative_tokens=3",
                                           f"scheduler.async_scheduling={mode}")
    steer(eng, truth)
    for i in range(3, 12):
        text = Letters().decode(want[1].token_ids[i:i + 2])
        sp = SamplingParams(max_tokens=20, temperature=0.0, stop=[text], ignore_eos=True)
        a, b = base.generate(PROMPTS[1:2], sp)[0], eng.generate(PROMPTS[1:2], sp)[0]
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        assert a.finish_reason == "stop"
    assert eng.engine.stats["accepted_tokens"] > 0


def lettered(*overrides):
    """``llm(*overrides)`` over the same tiny model with the :class:`Letters` tokenizer (stop strings read text)."""
    first = llm(*overrides)
    loaded = dataclasses.replace(first.engine.loaded, tokenizer=Letters())
    return LLM.from_config(compose_config("deepseek_v4_tiny", "reference", overrides=list(overrides)),
                           loaded_model=loaded, active_backend=first.engine.backend)


class Letters:
    """A stand-in tokenizer: token ``t`` is a two-letter word, so stop strings can span tokens."""

    eos_token_ids = ()

    def decode(self, ids):
        return "".join(chr(97 + t % 26) + chr(65 + t // 26) for t in ids)


@pytest.mark.parametrize("overrides, words", [
    (["spec=mtp", "spec.num_speculative_tokens=4"], "spec.num_speculative_tokens must be in 1..3"),
    (["spec=mtp", "spec.num_speculative_tokens=0"], "num_speculative_tokens >= 1"),
    (["spec=mtp", "model.arch.num_nextn_predict_layers=0"], "model 'deepseek_v4_tiny' has no MTP weights"),
    (["model.mtp_weights=/nonexistent/mtp.safetensors"], "model.mtp_weights='/nonexistent/mtp.safetensors' is not a file"),
    (["model.mtp_weights=GARBAGE"], "model.mtp_weights='.*garbage.safetensors' is not a readable safetensors file"),
])
def test_bad_mtp_configs_are_clear_errors(overrides, words, tmp_path):
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match=words):
        llm(*[o.replace("GARBAGE", str(garbage)) for o in overrides])


def test_mtp_layers_route_their_experts_through_the_ep_runner(plain):
    """An EP rank (a world of one, in process): the MTP layer's MoE runs through the expert runner too,
    and greedy output stays the output without drafts."""
    from inferhal.core.backend import ParallelLayout
    from inferhal.core.parallel.ep_engine import attach_ep

    _, want = plain
    cfg = compose_config("deepseek_v4_tiny", "reference",
                         overrides=[*SMALL, "parallel=ep2", "eplb=default", "eplb.step_interval=0", "spec=mtp",
                                    "spec.num_speculative_tokens=2"])
    eng = LLM.from_config(cfg)
    attach_ep(eng.engine, eng.engine.backend.communicator(ParallelLayout()), cfg.eplb)
    assert not any(k.startswith("mtp.") and "experts.gate_up" in k for k in eng.engine.model.weights)
    got = eng.generate(PROMPTS, greedy())
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert eng.engine.stats["draft_tokens"] > 0


def test_the_fitted_mtp_head_is_accepted_often_and_changes_nothing():
    """deepseek_v4_tiny_mtp (fit_mtp's checkpoint, 30 % held-out top-1; a random head: 0.5 %): its drafts
    stand often, and outputs equal no drafts."""
    prompts = [torch.randint(3, 192, (8,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(6)]
    sp = greedy(24)
    want = LLM.from_config(compose_config("deepseek_v4_tiny_mtp", "reference")).generate(prompts, sp)
    eng = LLM.from_config(compose_config("deepseek_v4_tiny_mtp", "reference",
                                         overrides=["spec=mtp", "spec.num_speculative_tokens=3"]))
    got = eng.generate(prompts, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    st = eng.engine.stats
    first = st["accepted_at"][0] / st["drafted_at"][0]
    assert first > 0.2, f"first-position acceptance {first:.0%}"
    assert (st["accepted_tokens"] + st["drafted_at"][0]) / st["drafted_at"][0] > 1.25  # tokens per verify step


@pytest.mark.slow
def test_two_ep_ranks_draft_alike_and_print_the_single_process_tokens():
    """parallel=ep2 (two processes, gloo) with MTP drafts at k=3: the tokens of one process without drafts."""
    import subprocess
    import sys

    args = ["model=deepseek_v4_tiny_mtp", "prompt_ids=[7,150,33,9,81,2,64,11]", "sampling.max_tokens=16",
            "sampling.temperature=0"]

    def tokens(*more):
        r = subprocess.run([sys.executable, "-m", "inferhal.core.cli.main", "generate", *args, *more],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout.splitlines()[0].split(), r.stdout

    want, _ = tokens()
    got, out = tokens("parallel=ep2", "spec=mtp", "spec.num_speculative_tokens=3")
    assert got == want and "mtp drafts accepted" in out


class Alternating:
    """A fake structured-output grammar with state: even and odd token ids alternate, starting even. A
    rollback that left a rejected draft accepted would flip the parity of every later token."""

    terminated = False

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def fill(self, bitmask, row: int) -> None:
        bitmask[row] = 0x55555555 if len(self.accepted) % 2 == 0 else -0x55555556  # even / odd bits

    def accept(self, token: int) -> bool:
        if token % 2 != len(self.accepted) % 2:
            return False
        self.accepted.append(token)
        return True

    def rollback(self, k: int) -> None:
        del self.accepted[len(self.accepted) - k:]


@pytest.mark.parametrize("mode", ["false", "true"])
def test_mtp_drafts_under_a_grammar_give_the_constrained_output_without_drafts(mode):
    """Drafts are masked per position by the grammar state the drafts before them lead to, and the grammar
    rolls back the rejected ones: greedy output with MTP drafts (steered, so some are accepted and some
    rejected) equals the constrained output without drafts, and every token obeys the grammar."""

    def run(eng, truth=None):
        if truth is not None:
            steer(eng, truth)
        reqs = []
        for p in PROMPTS[:3]:
            r = eng.engine.make_request(p, greedy(12))
            r.grammar = Alternating()
            reqs.append(eng.engine.add(r))
        outs = {}
        while eng.engine.has_unfinished():
            for o in eng.engine.step():
                if o.finished:
                    outs[o.request_id] = o
        return [outs[r] for r in reqs]

    want = run(llm())
    for o in want:
        assert [t % 2 for t in o.outputs[0].token_ids] == [i % 2 for i in range(12)]
    eng = llm("spec=mtp", "spec.num_speculative_tokens=3", f"scheduler.async_scheduling={mode}")
    got = run(eng, {o.request_id: o.prompt_token_ids + o.outputs[0].token_ids for o in want})
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    st = eng.engine.stats
    assert 0 < st["accepted_tokens"] < st["draft_tokens"]
