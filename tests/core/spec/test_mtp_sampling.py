"""Sampling with MTP drafts keeps the target's output distribution (rejection sampling through the
backend's ``spec.verify``), shown by a chi-square test, with a broken verifier as the negative control.

A tiny DeepSeek-V4 with a 16-token vocabulary samples 3 tokens at temperature 1 after a fixed prompt,
once per seed (N requests; the seeds fix the outcome, so the test is deterministic, not flaky). The exact distributions of the 2nd and 3rd tokens (both pass through
verification at k=2) come from the model's full logprobs over every 1- and 2-token continuation. The
drafts are steered to each context's most likely token (the MTP drafter runs underneath), so drafts are
often accepted and a wrong verifier shows. Each of the two marginals is tested at significance
alpha = 5e-4 (1e-3 for the pair, Bonferroni); a verifier that, on rejection, draws from p instead of
norm(max(0, p - q)) must fail the same test.
"""

from __future__ import annotations

import pytest
import torch

from inferhal import LLM, SamplingParams
from inferhal.core.engine.llm import compose_config

V, N, PROMPT = 16, 1000, [1, 2, 3]
ALPHA = 5e-4


def llm(*overrides):
    return LLM.from_config(compose_config("deepseek_v4_tiny", "reference", overrides=[
        f"model.arch.vocab_size={V}", f"scheduler.max_num_seqs={N}", f"scheduler.max_num_batched_tokens={8 * N}",
        f"cache.num_blocks={4 * N}", *overrides]))


def dists(eng, prompts):
    """Next-token distribution (temperature 1) after each prompt: [len(prompts), V]."""
    outs = eng.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=V))
    lp = torch.full((len(prompts), V), float("-inf"), dtype=torch.float64)
    for i, o in enumerate(outs):
        for t, v in o.logprobs[0].items():
            lp[i, t] = v
    return torch.softmax(lp, dim=-1)


@pytest.fixture(scope="module")
def exact():
    eng = llm()
    p1 = dists(eng, [PROMPT])[0]  # [V]
    p2 = dists(eng, [PROMPT + [a] for a in range(V)])  # [V, V]: o1 -> o2
    p3 = dists(eng, [PROMPT + [a, b] for a in range(V) for b in range(V)]).view(V, V, V)  # o1, o2 -> o3
    joint = p1[:, None, None] * p2[:, :, None] * p3  # [o1, o2, o3]
    return p2, p3, joint.sum(dim=(0, 2)), joint.sum(dim=(0, 1))


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square against ``probs``; cells expected below 5 are pooled into one."""
    exp = probs * counts.sum()
    small = exp < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]]) if small.any() else counts
    exp = torch.cat([exp[~small], exp[small].sum()[None]]) if small.any() else exp
    keep = exp > 0
    x = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(x / 2)))


def broken_verify():
    """spec.verify with the classic bug: on a rejection, the replacement is drawn from p (not the residual)."""
    from inferhal.backends.reference.sampling import filtered_probs

    def verify(drafts, draft_probs, logits, p):
        b, s = drafts.shape
        out = torch.full((b, s + 1), -1, dtype=torch.long)
        n = torch.zeros(b, dtype=torch.long)
        for r in range(b):
            gen = p.generators[r]
            k = 0
            while k <= s:
                pt = filtered_probs(logits[r, k], p, r)
                if k < s and torch.rand((), generator=gen) < pt[drafts[r, k]]:
                    out[r, k] = drafts[r, k]
                    k += 1
                    continue
                out[r, k] = torch.multinomial(pt, 1, generator=gen)[0]
                break
            n[r] = min(k, s) + 1
        return out, n

    return verify


class Ops(dict):
    """The backend's op table with one op replaced."""

    def __init__(self, base, **extra):
        super().__init__()
        self.base, self.extra = base, extra

    def __getitem__(self, key):
        return self.extra.get(key.replace(".", "_")) or self.base[key]

    def __getattr__(self, name):
        return getattr(self.base, name)


def sample(exact, broken=False):
    p2, p3, _, _ = exact
    eng = llm("spec=mtp", "spec.num_speculative_tokens=2")
    prop = eng.engine.proposer
    orig = prop.propose

    def propose(wants, kv=None):  # each context's most likely next tokens (the drafter runs underneath)
        got = orig(wants, kv)
        for w in wants:
            ctx = list(w.token_ids[len(PROMPT):])
            if w.request_id in got and len(ctx) == 1:
                d1 = int(p2[ctx[0]].argmax())
                got[w.request_id] = [d1, int(p3[ctx[0], d1].argmax())][:len(got[w.request_id])]
        return got

    prop.propose = propose
    if broken:
        sampler = eng.engine.runner.sampler  # what calls spec.verify
        sampler.ops = Ops(sampler.ops, spec_verify=broken_verify())
    params = [SamplingParams(max_tokens=4, temperature=1.0, seed=i, ignore_eos=True) for i in range(N)]
    outs = eng.generate([PROMPT] * N, params)
    toks = torch.tensor([o.token_ids for o in outs])  # [N, 4]
    st = eng.engine.stats
    return toks, st


def test_sampled_tokens_follow_the_target_distribution_and_a_broken_verifier_fails(exact):
    _, _, m2, m3 = exact
    toks, st = sample(exact)
    assert st["accepted_tokens"] > 0.1 * st["draft_tokens"] > 0  # drafts are often accepted
    ps = [chi2_pvalue(torch.bincount(toks[:, i], minlength=V).double(), m) for i, m in ((1, m2), (2, m3))]
    print(f"\nchi-square p-values: verifier {ps}, broken verifier (below) ", end="")
    assert min(ps) > ALPHA, f"chi-square p-values {ps} (alpha {ALPHA} each)"
    bad, _ = sample(exact, broken=True)
    bps = [chi2_pvalue(torch.bincount(bad[:, i], minlength=V).double(), m) for i, m in ((1, m2), (2, m3))]
    print(bps, st["accepted_tokens"], "of", st["draft_tokens"], "drafts accepted")
    assert min(bps) < ALPHA, f"the broken verifier passed: p-values {bps}"
