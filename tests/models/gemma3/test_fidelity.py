"""Gemma 3 270M (the PyPI GGUF) against transformers loading the same file through ``gguf_file=``.

- Tokens: for 10 prompts (one of 771 tokens, past the 512-token sliding window, so the engine's
  sliding-window paging releases blocks), 32 greedy tokens from ``LLM.generate`` equal
  transformers' ``generate`` token for token up to transformers' first near-tie: a step whose top-2
  margin is under ``TIE`` = 2 x ``LOGIT_ATOL``, the gap two sides each within ``LOGIT_ATOL`` can split
  on. Where that falls depends on the host's summation order, not on our numerics, so no step after it is
  compared (measured on AMD EPYC: no near-tie in these prompts, every token equal); at least
  ``MIN_DECIDED`` of the steps must be decided, or the test would prove little.
- Logits: every step's fp32 logits (prefill and decode, our model through the paged harness) are
  within ``LOGIT_ATOL`` of transformers' at transformers' top-64 tokens, and no other token of ours rises above
  transformers' 64th logit by more (transformers' answers are stored: tests/fixtures/transformers_oracle.py). Both dequantise the same GGUF to bit-identical fp32
  weights (see ``test_dequant``) and compute in fp32, so the differences come only from reduction
  order (MKL GEMM blocking for different row counts, SDPA vs our per-sequence softmax, the fp32 sum
  order of RMSNorm). Measured: max |diff| 9.8e-5 over the 10 prompts x 32 steps, on logits up to
  ~58 in magnitude (relative ~2e-6: a few fp32 ulps amplified through 18 layers). 5e-4 leaves a 5x
  margin and stays far below any real numerics error (a wrong rope base, norm offset, window or
  scale moves logits by > 0.1).
"""

from __future__ import annotations

import pytest
import torch

from harness import agreed, assert_enough_decided, decided, greedy
from prompts import PROMPTS, long_prompt
from transformers_oracle import max_diff, transformers_greedy

pytestmark = pytest.mark.slow

MAX_NEW = 32
LOGIT_ATOL = 5e-4
TIE = 2 * LOGIT_ATOL
MIN_DECIDED = 0.8  # of all prompts' steps


@pytest.fixture(scope="module")
def prompt_ids(gemma):
    tok = gemma[0].tokenizer
    ids = [tok.encode(p) for p in PROMPTS + [long_prompt()]]
    assert max(len(i) for i in ids) > gemma[0].model.cfg.sliding_window
    return ids


@pytest.fixture(scope="module")
def oracle(gemma_path, prompt_ids):
    """transformers' greedy tokens and per-step top-64 logits (stored; a run takes ~90 s and 3.2 GB)."""
    return transformers_greedy("gemma3_270m-fp32", gemma_path, prompt_ids, MAX_NEW, torch.float32, LOGIT_ATOL, TIE)


NGRAM = ("spec=ngram", "spec.num_speculative_tokens=3", "spec.disable_by_batch_size=0")


@pytest.mark.parametrize("spec", [(), NGRAM], ids=["plain", "ngram"])
def test_greedy_tokens_equal_transformers_through_llm(gemma, prompt_ids, oracle, spec):
    # with n-gram drafts, the verified rows run through the multi-token (prefill) paths: still fp32, still
    # transformers' tokens
    from inferhal.core.engine.llm import LLM
    from inferhal.core.sampling.params import SamplingParams

    lm, be = gemma
    llm = LLM.from_loaded(lm, be, max_model_len=1024, block_size=16, overrides=list(spec))
    outs = llm.generate([list(i) for i in prompt_ids], SamplingParams(max_tokens=MAX_NEW, temperature=0.0,
                                                                      ignore_eos=True))
    for i, (o, (want, want_logits)) in enumerate(zip(outs, oracle)):
        n = decided(want_logits, TIE)
        assert list(o.token_ids)[:n] == want[:n], f"prompt {i} ({len(prompt_ids[i])} tokens), before step {n}"
    assert_enough_decided(oracle, TIE, MIN_DECIDED)
    if spec:
        st = llm.engine.stats
        assert st["accepted_tokens"] > 0, st  # drafts were verified and some accepted


def test_logits_close_to_transformers_at_every_step(gemma, prompt_ids, oracle):
    model = gemma[0].model
    diffs = torch.zeros(len(oracle), MAX_NEW)

    def compare(s, logits):  # each step's logits checked as they come (none kept)
        for b, (_, want_logits) in enumerate(oracle):
            diffs[b, s] = max_diff(logits[b], want_logits, s)

    toks, _ = greedy(model, prompt_ids, MAX_NEW, each=compare)
    worst = 0.0
    for b, (want_toks, want_logits) in enumerate(oracle):
        same = agreed(toks[b], want_toks)
        assert same >= decided(want_logits, TIE), f"prompt {b}: token {same} differs before transformers' first near-tie"
        diff = float(diffs[b, : same + 1].max())  # the steps run on the same tokens as transformers'
        worst = max(worst, diff)
        assert diff <= LOGIT_ATOL, f"prompt {b}: max |logit diff| {diff:.2e} > {LOGIT_ATOL}"
    print(f"max |logit diff| over {len(oracle)} prompts x {MAX_NEW} steps (to each one's first other token): {worst:.3e}")
