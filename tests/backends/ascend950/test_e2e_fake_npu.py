"""The tiny DeepSeek-V4 end to end on the ascend950 op table over the documented fake NPU: greedy tokens equal
the reference backend's. Every torch_npu / vllm-ascend / aten call is checked against the recorded contract.

This is not a hardware result (level wired-unrun): the fake computes what each operator's documentation says,
so the test proves the wrappers' wiring and the model's use of them, not what the NPU computes. The tiny
model's shapes are off some operators' documented limits (hc_mult 2 / hidden 64 for npu_hc_pre_v2, window 16
for npu_sparse_attn_sharedkv's fixed 128 band): those ops fall back to the reference, visibly, and the test
pins exactly which and why."""

from __future__ import annotations

import collections
import dataclasses

import pytest

from inferhal.backends.ascend950.ops import NPU_OPS, provide
from inferhal.backends.reference.ops import OPS as REF
from inferhal.core.engine.llm import LLM
from inferhal.core.ops.table import OpTable
from inferhal.core.profile import ExecLevel
from inferhal.core.sampling.params import SamplingParams

PROMPTS = [[1, 17, 130, 5, 99, 42, 7], [3, 3, 81, 190, 12]]  # vocab 192

#: the tiny model's shapes the operators do not take (every other call of these ops would be wired)
SHAPE_FALLBACKS = {"mhc.pre": "hc_mult 2", "mhc.head": "hc_mult 2", "attn.sparse_topk": "window 16"}


def fake_npu_llm(reference: LLM, rec, overrides):
    """An LLM whose op table is ascend950's over the recorded fake NPU ``rec`` (fallbacks: the reference's ops);
    KV storage and communication stay the reference backend's (CPU tensors)."""
    native = provide(rec, triton=False)  # the Triton ops need triton-ascend (or the interpreter), not the fake
    wrappers = next(iter(native.values())).fn.__self__
    table = OpTable("ascend950", native, REF, ExecLevel.WIRED_UNRUN)
    active = dataclasses.replace(reference.engine.backend, ops=table)
    return LLM("deepseek_v4_tiny", active_backend=active, overrides=overrides), wrappers


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float32", marks=pytest.mark.slow)])
def test_tiny_v4_greedy_tokens_on_the_fake_npu_equal_reference(recorder, dtype):
    overrides = [f"model.dtype={dtype}"]
    sp = SamplingParams(max_tokens=6, temperature=0.0)
    ref = LLM("deepseek_v4_tiny", backend="reference", overrides=overrides)
    want = [o.token_ids for o in ref.generate(PROMPTS, sp)]
    npu, wrappers = fake_npu_llm(ref, recorder, overrides)
    assert set(npu.engine.backend.ops.provenance().values()) == {"wired-unrun", "fallback"}
    got = [o.token_ids for o in npu.generate(PROMPTS, sp)]
    assert got == want, f"greedy tokens differ (fallbacks taken: {sorted(set(wrappers.events))})"
    called = collections.Counter(c.op for c in recorder.calls)
    fell = {op: why for op, why in wrappers.events}
    if dtype == "bfloat16":  # the V4 hot path reaches its operators
        for op in ("npu_lightning_indexer", "moe_gating_top_k_hash", "npu_hc_post", "npu_grouped_matmul",
                   "npu_moe_init_routing_v2", "npu_rms_norm", "npu_rotary_mul", "aten_linear", "aten_embedding"):
            assert called[op] > 0, op
        assert set(fell) == set(SHAPE_FALLBACKS)
        assert all(SHAPE_FALLBACKS[op] in why for op, why in fell.items())
    else:  # fp32: the fp16/bf16-only operators fall back too, each saying so
        assert {"indexer.scores", "moe.experts"} <= set(fell) and called["moe_gating_top_k_hash"] > 0
    assert set(called) <= {op for ops in NPU_OPS.values() for op in ops}
