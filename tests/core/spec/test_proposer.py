"""The proposer contract: a drafter registered in ``PROPOSERS`` runs through the engine with no engine
change, is driven in the documented order (accept, prefill, propose, free) and cannot change greedy output."""

from __future__ import annotations

from inferhal import LLM, SamplingParams
from inferhal.core.engine.llm import compose_config
from inferhal.core.spec import proposer


class Echo:
    """Drafts the last token k times; records how the engine drives it."""

    needs_hidden = False
    num_lookahead_tokens = 0
    reads_next_token = False
    calls: list = []

    def __init__(self, k):
        self.num_speculative_tokens = k

    @classmethod
    def from_config(cls, cfg, ctx):
        return cls(cfg.num_speculative_tokens)

    def kv_groups(self):
        return []

    def accept(self, rid, drafted, accepted):
        assert 0 <= accepted <= drafted
        self.calls.append(("accept", rid))

    def prefill(self, step):
        for s in step.seqs:
            assert s.start + s.num_exact <= len(s.token_ids) - 1 or s.num_exact == 0
        self.calls.append(("prefill", tuple(s.request_id for s in step.seqs)))

    def propose(self, wants, kv=None):
        self.calls.append(("propose", tuple(w.request_id for w in wants)))
        return {w.request_id: [w.token_ids[-1]] * min(self.num_speculative_tokens, w.limit) for w in wants}

    def free(self, rid):
        self.calls.append(("free", rid))


def test_a_registered_drafter_runs_without_engine_changes(monkeypatch):
    monkeypatch.setitem(proposer.PROPOSERS, "echo", Echo)
    prompts = [[5, 5, 5, 5, 6], [1, 2, 3], [9, 9, 9]]
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = LLM.from_config(compose_config("deepseek_v4_tiny", "reference")).generate(prompts, sp)
    eng = LLM.from_config(compose_config("deepseek_v4_tiny", "reference",
                                         overrides=["spec.method=echo", "spec.num_speculative_tokens=2"]))
    got = eng.generate(prompts, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert eng.engine.stats["draft_tokens"] > 0
    kinds = [c[0] for c in Echo.calls]
    assert kinds.count("free") == 3 and kinds[0] == "prefill"
    for i, c in enumerate(Echo.calls):  # every step: accepts, then one prefill, then one propose
        if c[0] == "accept":
            assert Echo.calls[i + 1][0] in ("accept", "prefill", "free")
        if c[0] == "prefill" and i + 1 < len(Echo.calls):
            assert Echo.calls[i + 1][0] in ("propose", "prefill", "free")
