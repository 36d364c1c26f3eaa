"""The tiny DeepSeek-V4 model end to end on cuda_sm100 in the interpreter: greedy tokens equal the
reference backend's, with ``backend.strict=true`` (no op may fall back to the reference); every op runs at
execution level "interpreter". The run (6 tokens for each of two prompts) is the package's ``tiny_v4_greedy``
(conftest.py), whose steps test_host_reads.py also checks."""

import pytest

from inferhal.backends.cuda_sm100.ops import KERNEL_OPS


@pytest.mark.slow
def test_tiny_v4_greedy_tokens_equal_reference(tiny_v4, tiny_v4_greedy):
    prov = tiny_v4.engine.backend.ops.provenance()
    assert all(prov[op] == "interpreter" for op in KERNEL_OPS), prov
    got, want, _ = tiny_v4_greedy
    assert all(len(t) == 6 for t in want)
    assert not tiny_v4.engine.backend.ops.fallbacks()
    assert got == want, "greedy tokens differ"
