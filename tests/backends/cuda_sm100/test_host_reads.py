"""Host reads in cuda_sm100's launch code during a tiny-V4 decode step (#46 item 3), in Triton's interpreter.

A CUDA graph cannot capture a step whose launch code reads a device value on the host (``.item()``,
``int(t)``, ``nonzero``, ``repeat_interleave`` without ``output_size``, ...), and a shape taken from such a
read would be baked into every replay. core's guard (:mod:`inferhal.core.engine.host_sync`) counts the reads
the backend's ops make; here every decode step of the tiny V4 on cuda_sm100 runs under it, and the reads
must be exactly :data:`REMAINING` (each with the reason it stays): a read removed from the launch code that
comes back, or a new one, fails this test with the step's list by file:line. Execution level: interpreter
(no GPU); the guard sees the same Python launch code a device runs.
"""

from __future__ import annotations

import re

import pytest

from inferhal.core.engine.host_sync import HostSyncError, HostSyncGuard
from inferhal.core.engine.llm import LLM
from inferhal.core.sampling.params import SamplingParams

PROMPTS = [[1, 17, 130, 5, 99, 42, 7], [3, 3, 81, 190, 12]]  # vocab 192
ENTRY_POINTS = ("forward", "forward_greedy", "forward_and_hidden")

#: "what at path function" -> (reads per decode step of the tiny V4, why it stays). The tiny V4 has 2 CSA
#: layers, 2 HCA layers and 8 MoE calls a step (its config: deepseek_v4_tiny).
REMAINING: dict[str, tuple[int, str]] = {
    "__float__() at kernels/embed.py embed": (1, ""),
    "tensor() at kernels/embed.py embed": (1, ""),
    "__int__() at kernels/indexer.py indexer_scores": (2, ""),
    "aten.repeat_interleave without output_size at kernels/indexer.py indexer_scores": (2, ""),
    "aten.repeat_interleave without output_size at kernels/sparse_attn.py attn_sparse_topk": (4, ""),
    "aten.nonzero at kernels/compress.py attn_compress": (4, ""),
    "aten.bincount at kernels/moe_pairs.py align_pairs": (8, ""),
    "__int__() at kernels/moe_pairs.py align_pairs": (16, ""),
    "aten.repeat_interleave without output_size at kernels/moe_pairs.py align_pairs": (8, ""),
}


def _place(key: str) -> str:
    """``"what at path:line function"`` -> ``"what at path function"`` (lines move with edits; places do not)."""
    return re.sub(r"(\S+):\d+ ", r"\1 ", key)


@pytest.fixture(scope="module")
def steps():
    """Each model call of a 4-token greedy run: (tokens in the batch, the guard that watched it)."""
    llm = LLM("deepseek_v4_tiny", backend="cuda_sm100", overrides=["backend.interpret=true", "backend.strict=true"])
    model = llm.engine.runner.model
    seen = []
    for name in ENTRY_POINTS:
        fn = getattr(model, name, None)
        if fn is None:
            continue

        def run(batch, *a, _fn=fn, **k):
            guard = HostSyncGuard()
            with guard:
                out = _fn(batch, *a, **k)
            seen.append((int(batch.input_ids.shape[0]), guard))
            return out

        setattr(model, name, run)
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(PROMPTS, sp)]
    want = [o.token_ids for o in LLM("deepseek_v4_tiny", backend="reference").generate(PROMPTS, sp)]
    return seen, got, want


def test_decode_steps_read_only_the_listed_places(steps):
    seen, got, want = steps
    assert got == want  # the guard watched the real ops: tokens unchanged
    decode = [g for n, g in seen if n == len(PROMPTS)]
    assert len(decode) == 3 and seen[0][0] > len(PROMPTS)  # a prefill, then three decode steps
    expected = {k: n for k, (n, _) in REMAINING.items()}
    for i, guard in enumerate(decode):
        places = {}
        for key, n in guard.backend_reads.items():
            places[_place(key)] = places.get(_place(key), 0) + n
        # the compressor runs on steps with a token that closes a window of 4: position 7 of the first prompt
        # on the first decode step, of the second on the third; none on the second
        want_step = {k: n for k, n in expected.items() if "compress.py" not in k or i != 1}
        assert places == want_step, f"decode step {i}: the backend's reads by place:\n" + "\n".join(guard.report())
