"""Checks that need an Ascend NPU with CANN and torch_npu (marker ``ascend``; they skip with the probe's reason
anywhere else). They are what takes an op from wired-unrun to device: docs/backends.md, "Ascend 950: the first
run on hardware", says how to run them and what to send back."""

from __future__ import annotations

import pytest

from inferhal.backends.ascend950.device import probe

PROMPTS = [[1, 17, 130, 5, 99, 42, 7], [3, 3, 81, 190, 12]]


def needs_npu():
    pr = probe()
    if not pr.available:
        pytest.skip(f"needs an Ascend NPU with CANN and torch_npu: {pr.reason}")
    return pr


@pytest.mark.ascend
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_on_hardware_tiny_v4_greedy_tokens_equal_reference(dtype, capsys):
    """The tiny DeepSeek-V4 on ascend950 (every wrapper's torch_npu / vllm-ascend / aten call checked against
    the recorded contract) gives the reference's greedy tokens; the per-call fallbacks are printed."""
    needs_npu()
    from inferhal.core.engine.llm import LLM
    from inferhal.core.sampling.params import SamplingParams

    sp = SamplingParams(max_tokens=6, temperature=0.0)
    overrides = [f"model.dtype={dtype}", "+backend.options.record_npu_calls=true"]
    want = [o.token_ids for o in LLM("deepseek_v4_tiny", backend="reference", overrides=overrides[:1]).generate(PROMPTS, sp)]
    npu = LLM("deepseek_v4_tiny", backend="ascend950", overrides=overrides)
    got = [o.token_ids for o in npu.generate(PROMPTS, sp)]
    wrappers = npu.engine.backend.ops.entry("norm.rms").fn.fn.__self__
    with capsys.disabled():
        print(f"\nascend950 tiny V4 {dtype}: tokens {got} (reference {want}); fallbacks: {sorted(set(wrappers.events))}")
        print(f"operators called: {sorted({c.op for c in wrappers.npu.calls})}")
    assert got == want


@pytest.mark.ascend
def test_on_hardware_fp8_kv_with_v4_attention_shapes_equals_reference(capsys):
    """``cache.kv_dtype=fp8`` with V4's attention shapes on a 950: kv_compress_epilog writes the 640-byte rows and
    npu_kv_quant_sparse_attn_sharedkv reads them (tests/backends/ascend950/test_e2e_kv_fp8.py on the fake)."""
    needs_npu()
    from inferhal.backends.ascend950.device import query_profile

    if not query_profile().supports("kv_quant_sparse_attn_sharedkv"):
        pytest.skip("the FP8 KV operators are 950PR/DT only (cache.kv_dtype=fp8 is refused on this NPU)")
    import importlib.util
    import pathlib

    from inferhal.core.engine.llm import LLM
    from inferhal.core.sampling.params import SamplingParams

    spec = importlib.util.spec_from_file_location("e2e_kv_fp8", pathlib.Path(__file__).with_name("test_e2e_kv_fp8.py"))
    e2e = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(e2e)
    prompts = [[(7 * i + 3) % 191 + 1 for i in range(22)], [(5 * i + 1) % 191 + 1 for i in range(9)]]
    sp = SamplingParams(max_tokens=3, temperature=0.0)
    overrides = ["model.dtype=bfloat16", "cache.kv_dtype=fp8", *e2e.V4_ATTENTION]
    want = [o.token_ids for o in LLM("deepseek_v4_tiny", backend="reference", overrides=overrides).generate(prompts, sp)]
    npu = LLM("deepseek_v4_tiny", backend="ascend950", overrides=[*overrides, "+backend.options.record_npu_calls=true"])
    got = [o.token_ids for o in npu.generate(prompts, sp)]
    wrappers = npu.engine.backend.ops.entry("kv.write").fn.fn.__self__
    called = {c.op for c in wrappers.npu.calls}
    with capsys.disabled():
        print(f"\nascend950 fp8 KV, V4 attention shapes: tokens {got} (reference {want}); fallbacks: "
              f"{sorted(set(wrappers.events))}\noperators called: {sorted(called)}")
    assert got == want and {"kv_compress_epilog", "npu_kv_quant_sparse_attn_sharedkv"} <= called
