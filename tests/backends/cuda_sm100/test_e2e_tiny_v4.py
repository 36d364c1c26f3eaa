"""The tiny DeepSeek-V4 model end to end on cuda_sm100 in the interpreter: greedy tokens equal the
reference backend's, with ``backend.strict=true`` (no op may fall back to the reference); every op runs at
execution level "interpreter"."""

import pytest

from inferhal.core.engine.llm import LLM
from inferhal.core.sampling.params import SamplingParams
from inferhal.backends.cuda_sm100.ops import KERNEL_OPS

PROMPTS = [[1, 17, 130, 5, 99, 42, 7], [3, 3, 81, 190, 12]]  # vocab 192


@pytest.mark.slow
def test_tiny_v4_greedy_tokens_equal_reference():
    sp = SamplingParams(max_tokens=6, temperature=0.0)
    ref = LLM("deepseek_v4_tiny", backend="reference")
    kern = LLM("deepseek_v4_tiny", backend="cuda_sm100", overrides=["backend.interpret=true", "backend.strict=true"])
    prov = kern.engine.backend.ops.provenance()
    assert all(prov[op] == "interpreter" for op in KERNEL_OPS), prov
    want = [o.token_ids for o in ref.generate(PROMPTS, sp)]
    got = [o.token_ids for o in kern.generate(PROMPTS, sp)]
    assert not kern.engine.backend.ops.fallbacks()
    assert got == want, "greedy tokens differ"
