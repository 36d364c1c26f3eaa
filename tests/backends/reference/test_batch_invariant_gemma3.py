"""``deterministic=true`` on Gemma 3 270M (reference, bf16): paged attention (one row at a time over its own
keys in this mode) keeps a needle request bitwise the same alone, in a batch, across prefill chunk sizes and
with a prefix-cache hit; with the mode off the same batch changes its logprobs (the negative control, with the batch dependence
planted: tests/fixtures/batch_variant.py). One engine at a time: two real models at once would raise the suite's peak memory."""

from __future__ import annotations

import batch_variant

from inferhal import LLM, SamplingParams

NEEDLE = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"
OTHERS = ["def fibonacci(n):", "Once upon a time, in a small village, there lived", "A haiku about the sea:",
          "The three laws of thermodynamics are", "SELECT name FROM users WHERE", "The quick brown fox"]
SP = SamplingParams(max_tokens=4, temperature=0.0, logprobs=1, ignore_eos=True)


def same(a, b) -> bool:
    return a.outputs[0].token_ids == b.outputs[0].token_ids and a.outputs[0].logprobs == b.outputs[0].logprobs


def engine(mode: str) -> LLM:
    """One engine at a time (each test its own): two real models at once would raise the suite's peak memory."""
    return LLM("gemma3_270m", overrides=[f"deterministic={mode}", "model.dtype=bfloat16",
                                         "scheduler.max_num_batched_tokens=16", "model.max_model_len=256"])


def test_the_needle_is_bitwise_the_same_alone_in_a_batch_and_after_a_prefix_hit(monkeypatch):
    batch_variant.plant(monkeypatch)  # the negative control's batch dependence: the mode's products replace it
    e = engine("true")
    alone = e.generate([NEEDLE], SP)[0]  # chunks of 16 tokens, nothing cached before
    batch = OTHERS[:3] + [NEEDLE] + OTHERS[3:]
    got = e.generate(batch, SP)[3]  # chunks cut elsewhere, and the needle's first blocks now cached
    assert got.num_cached_tokens >= 16
    assert same(got, alone)


def test_negative_control_the_mode_off_changes_the_needle(monkeypatch):
    """The same batches with the mode off must change the needle, or the test above proves nothing. Whether
    the host's products depend on the batch is the host's choice (oneDNN's bf16 kernels did on AMD EPYC; on an
    Intel AMX host and on the portable path they gave the needle's exact bits), so the difference is planted:
    the default products sum K in another order when they hold more than one row
    (tests/fixtures/batch_variant.py), as the test above planted it too."""
    batch_variant.plant(monkeypatch)
    e = engine("false")
    alone = e.generate([NEEDLE], SP)[0]
    outs = [e.generate(OTHERS[:k] + [NEEDLE] + OTHERS[k:], SP)[k] for k in (1, 3, 6)]
    assert not all(same(o, alone) for o in outs)
