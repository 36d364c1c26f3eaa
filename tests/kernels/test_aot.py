"""Ahead-of-time compilation for sm_100a without a GPU: the tensor-core kernels must hold tcgen05.mma.

Runs in a subprocess: this test process has TRITON_INTERPRET=1 (conftest), and AOT compilation needs
the kernels defined as JIT (not interpreted) functions. Execution level of the results: compiled.
"""

import json
import os
import subprocess
import sys

import pytest

from inferhal.kernels.registry import HOT_OPS, KERNELS

MMA = [k.name for k in KERNELS if k.mma]
#: issue #46's target: no spill stack in the decode attention, indexer, linear and MoE kernels
NO_SPILL = [k.name for k in KERNELS if k.mma and k.op_id in HOT_OPS]
#: the most shared memory one block may use on sm_90 and sm_100 (227 KB)
SHARED_MAX = 232448


def _compile(arch, names, tmp_path):
    out = tmp_path / f"{arch}.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json, sys; from inferhal.kernels.aot import compile_all; "
            f"json.dump(compile_all({arch!r}, {names!r}), open({str(out)!r}, 'w'))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["kernel"]: r for r in json.loads(out.read_text())}


@pytest.mark.slow
def test_mma_kernels_use_tcgen05_on_sm100a(tmp_path):
    rows = _compile("sm_100a", MMA, tmp_path)
    assert set(rows) == set(MMA)
    for name, r in rows.items():
        assert r["compiled"], f"{name}: {r['error']}"
        assert r["tcgen05"] and r["mma_ok"], f"{name}: no tcgen05.mma in the sm_100a PTX"
        assert r["execution_level"] == "compiled"
        assert r["registers"] is None or 0 < r["registers"] <= 255
        if name in NO_SPILL:
            assert r["spill_stack_bytes"] == 0, (name, r["registers"], r["spill_stack_bytes"])
            assert r["shared_bytes"] <= SHARED_MAX, (name, r["shared_bytes"])


@pytest.mark.slow
def test_the_fp4_expert_gemm_holds_its_registers_on_sm90a(tmp_path):
    """Hopper's FP4 experts (a V4 decode step's MoE: dot_scaled widens e2m1 to bf16 beside the gate and up
    accumulators) compiled as a launch specialises them: no spill stack (4 warps spilled 448 B)."""
    r = _compile("sm_90a", ["moe_gate_up_swiglu_fp4_dot_scaled"], tmp_path)["moe_gate_up_swiglu_fp4_dot_scaled"]
    assert r["compiled"] and r["mma_ok"] and r["specialized"], r["error"]
    assert r["spill_stack_bytes"] == 0 and r["shared_bytes"] <= SHARED_MAX, (r["registers"], r["spill_stack_bytes"])


@pytest.mark.slow
def test_gemm_kernels_carry_the_right_tcgen05_kind(tmp_path):
    """Dense GEMMs on sm_100a: bf16 and dequantised-weight GEMMs run kind::f16 (weights widened to bf16 in
    registers: FP8 weights with bf16 activations, and dot_scaled's e2m1 against bf16 activations, which Triton
    decomposes), the FP8 x FP8 GEMMs (tiled and at decode) kind::f8f6f4, the MXFP4 x MXFP4 GEMM kind::mxf4, the NVFP4 one kind::mxf4nvf4."""
    names = [k.name for k in KERNELS if k.op_id in ("linear", "lm_head", "lm_head.argmax") and k.mma]
    rows = _compile("sm_100a", names, tmp_path)
    for name, r in rows.items():
        assert r["compiled"] and r["mma_ok"], f"{name}: {r['error']}"
        want = {"linear_mxfp4_w4a4": ["mxf4"], "linear_nvfp4_w4a4": ["mxf4nvf4"]}.get(
            name, ["f8f6f4"] if "fp8_w8a8" in name else ["f16"])  # linear_fp8_w8a8, linear_decode_fp8_w8a8_n*
        assert r["tcgen05_kinds"] == want, (name, r["tcgen05_kinds"])
        assert r["shared_bytes"] <= 228 * 1024, (name, r["shared_bytes"])


def test_values_specialise_as_the_jit_does():
    """A spec's ``values`` compile as a launch with those integers would: Triton's own specialisation (1 ->
    constexpr, multiple of 16 -> divisible by 16) decides each, and every pointer counts as 16-byte aligned."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from inferhal.kernels.registry import by_name
    from inferhal.kernels.tuning import config

    for name in ("moe_down_fp8_w8a8", "moe_gate_up_swiglu_fp8_w8a8", "moe_gate_up_swiglu_fp8_block",
                 "moe_down_fp8_block", "moe_gate_up_swiglu_bf16", "moe_down_bf16", "moe_gate_up_swiglu_fp4_dot_scaled",
                 "moe_down_fp4_dot_scaled", "attn_sparse_topk_csa", "attn_sparse_topk_csa_fp8_ds_mla",
                 "indexer_scores", "indexer_scores_mxfp4", "attn_paged_latent_decode",
                 "linear_fp8_w8a8", "attn_sparse_topk_csa_split", "attn_sparse_topk_csa_split_nvfp4", "indexer_scores_split",
                 "indexer_scores_split_mxfp4"):
        spec = by_name(name)
        fn = spec.load()
        cx, attrs = spec.specialization(fn, spec.constexprs(config(spec.tuning, "cuda_sm90")))
        marked = {fn.arg_names[i[0]] for i in attrs}
        assert set(spec.values) <= set(fn.arg_names), name
        for arg, v in spec.values.items():
            kind, key = native_specialize_impl(BaseBackend, v, False, True, True)
            assert (kind == "constexpr") == (cx.get(arg) == 1 and v == 1), (name, arg)
            assert (key == "D") == (arg in marked), (name, arg)
        assert {a for a in spec.ptrs} <= marked
    assert by_name("rms_norm").specialization(by_name("rms_norm").load(), {})[1] == {}
