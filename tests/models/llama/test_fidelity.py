"""SmolLM2-135M-Instruct (the PyPI GGUF) against transformers loading the same file through ``gguf_file=``.

- Tokens: for 10 prompts (plain text, code, numbers, French, and chat turns in the file's own template),
  24 greedy tokens from ``LLM.generate`` equal transformers' ``generate`` token for token up to
  transformers' first near-tie (top-2 margin under ``TIE`` = 2 x ``LOGIT_ATOL``, which the host's summation
  order may split; tests/models/gemma3/harness.py ``decided``); at least ``MIN_DECIDED`` of the steps must
  come before one.
- Logits: every step's fp32 logits (prefill and decode, through the paged harness) are within
  ``LOGIT_ATOL`` of transformers' at transformers' top-64 tokens, and no other token rises above its 64th logit by
  more (transformers' answers are stored: tests/fixtures/transformers_oracle.py). Both dequantise the same Q4_1/Q8_0 blocks to the same fp32 weights
  (gguf.quants for Q4_1 on both sides; q/k rows un-permuted the same way) and compute in fp32, so the
  differences come only from reduction order (GEMM blocking, SDPA vs our per-sequence softmax, RMSNorm's
  sum). Measured: see LOGIT_ATOL's comment.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "gemma3"))  # the paged harness and the transformers oracle
from harness import agreed, assert_enough_decided, decided, greedy  # noqa: E402
from transformers_oracle import max_diff, transformers_greedy  # noqa: E402

pytestmark = pytest.mark.slow

MAX_NEW = 24
#: measured max |diff| 1.7e-4 over 10 prompts x 24 steps (fp32 reduction order through 30 layers); 5e-4
#: leaves a ~3x margin and stays far below a real numerics error (a wrong rope order, base or norm eps
#: moves logits by > 0.1)
LOGIT_ATOL = 5e-4
TIE = 2 * LOGIT_ATOL
MIN_DECIDED = 0.8  # of all prompts' steps

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village by the sea,",
    "1, 1, 2, 3, 5, 8, 13,",
    "Les plus beaux endroits de Paris sont",
    "Q: What is 12 times 12?\nA:",
    "The three laws of thermodynamics are",
]
CHATS = [
    [{"role": "user", "content": "What is the boiling point of water?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Name three fruits."}],
]


@pytest.fixture(scope="module")
def prompt_ids(smollm):
    tok = smollm[0].tokenizer
    return [tok.encode(t) for t in TEXTS] + [tok.encode(tok.apply_chat_template(m), add_bos=False) for m in CHATS]


@pytest.fixture(scope="module")
def oracle(smollm_path, prompt_ids):
    """transformers' greedy tokens and per-step top-64 logits (stored: tests/fixtures/transformers_oracle.py; a run
    takes ~40 s)."""
    return transformers_greedy("smollm2_135m_instruct-fp32", smollm_path, prompt_ids, MAX_NEW, torch.float32,
                               LOGIT_ATOL, TIE)


def test_greedy_tokens_equal_transformers_through_llm(smollm, prompt_ids, oracle):
    from inferhal.core.engine.llm import LLM
    from inferhal.core.sampling.params import SamplingParams

    lm, be = smollm
    llm = LLM.from_loaded(lm, be, max_model_len=1024, block_size=16)
    outs = llm.generate([list(i) for i in prompt_ids], SamplingParams(max_tokens=MAX_NEW, temperature=0.0,
                                                                      ignore_eos=True))
    assert len(outs) >= 8
    for i, (o, (want, want_logits)) in enumerate(zip(outs, oracle)):
        n = decided(want_logits, TIE)
        assert list(o.token_ids)[:n] == want[:n], f"prompt {i} ({len(prompt_ids[i])} tokens), before step {n}"
    assert_enough_decided(oracle, TIE, MIN_DECIDED)


def test_logits_close_to_transformers_at_every_step(smollm, prompt_ids, oracle):
    toks, logits = greedy(smollm[0].model, prompt_ids, MAX_NEW)
    worst = 0.0
    for b, (want_toks, want_logits) in enumerate(oracle):
        same = agreed(toks[b], want_toks)
        assert same >= decided(want_logits, TIE), f"prompt {b}: token {same} differs before transformers' first near-tie"
        # the steps run on the same tokens as transformers'
        diff = max(max_diff(logits[s][b], want_logits, s) for s in range(min(same + 1, MAX_NEW)))
        worst = max(worst, diff)
        assert diff <= LOGIT_ATOL, f"prompt {b}: max |logit diff| {diff:.2e} > {LOGIT_ATOL}"
    print(f"max |logit diff| over {len(oracle)} prompts x {MAX_NEW} steps: {worst:.3e}")
