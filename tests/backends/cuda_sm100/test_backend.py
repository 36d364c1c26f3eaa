"""The cuda_sm100 backend through the registry, in interpreter mode (no GPU here)."""

import pytest
import torch

from inferhal.backends.cuda_sm100 import device
from inferhal.backends.cuda_sm100.ops import KERNEL_OPS
from inferhal.core.config.schema import BackendConfig
from inferhal.core.ops.params import RmsNormParams
from inferhal.core.registry import BackendRegistry


@pytest.fixture(scope="module")
def active():
    return BackendRegistry.discover().select(BackendConfig(name="cuda_sm100", interpret=True, strict=False))


def test_interpreter_selection_reports_interpreter_level(active):
    assert active.profile.exec_level.value == "interpreter"
    prov = active.ops.provenance()
    for op_id in KERNEL_OPS:
        assert prov[op_id] == "interpreter", op_id  # never "device" without a GPU
    assert active.graph_runner() is None
    x = torch.randn(3, 16)
    torch.testing.assert_close(active.ops["norm.rms"](x, None, RmsNormParams()),
                               x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6), rtol=1e-5, atol=1e-5)
    assert "tuning: interpreter" in active.ops.entry("norm.rms").note


def test_declared_ops_match_kernel_table():
    cov = BackendRegistry.discover().coverage()["cuda_sm100"]
    for op_id in KERNEL_OPS:
        assert cov[op_id] == "interpreter"


def test_probe_without_gpu_is_unavailable_with_reason():
    probe = device.probe(interpret=False)
    if probe.available:  # pragma: no cover - only on a machine with a GPU
        pytest.skip("a CUDA GPU is present")
    assert "interpret=true" in probe.reason


def test_capability_tables():
    assert device.ARCHS[(10, 0)]["mma"] == "tcgen05" and device.ARCHS[(10, 3)]["mma"] == "tcgen05"
    sm90 = device.ARCHS[(9, 0)]
    assert "fp4_grouped_gemm" not in sm90["features"] and "fp4_grouped_gemm" in sm90["degraded"]
    for chip in ("B200", "B300", "H200"):
        t = device.CHIPS[chip]
        assert t["bandwidth"] > 1e12 and t["flops"]["bfloat16"] > 1e14 and t["source"]
    assert device.identify("NVIDIA B200", 10, 0, 180 * 10**9) == "B200"
    assert device.identify("NVIDIA H200", 9, 0, 141 * 10**9) == "H200"
    assert device.identify("NVIDIA H100 80GB HBM3", 9, 0, 80 * 2**30) is None  # no table: no roofline claimed


def test_options_select_the_kernels_and_are_checked():
    """backend.options.attn_decode (split, the default, or single) binds the attention wrappers' kernel,
    fp8_matmul (widen, the default, or w8a8) the FP8 path of moe.experts and linear; an unknown value or option
    is refused naming it (the backend read no option before: any was silently dropped)."""
    from inferhal.core.errors import UserError

    reg = BackendRegistry.discover()
    for value in (None, "split", "single"):
        opts = {} if value is None else {"attn_decode": value}
        ops = reg.select(BackendConfig(name="cuda_sm100", interpret=True, options=opts)).ops
        for op_id in ("attn.paged", "attn.sparse_topk", "indexer.scores"):
            entry = ops.entry(op_id)
            assert entry.fn.fn.keywords["decode"] == (value or "split") and f"decode: {value or 'split'}" in entry.note
        assert "decode" not in ops.entry("norm.rms").fn.fn.keywords
    ops = reg.select(BackendConfig(name="cuda_sm100", interpret=True, options={"fp8_matmul": "w8a8"})).ops
    for op_id in ("moe.experts", "linear"):
        assert ops.entry(op_id).fn.fn.keywords["fp8"] == "w8a8" and "fp8: w8a8" in ops.entry(op_id).note
    assert "fp8" not in ops.entry("lm_head").fn.fn.keywords
    with pytest.raises(UserError, match=r"fp8_matmul='fp4' is not one of widen, w8a8"):
        reg.select(BackendConfig(name="cuda_sm100", interpret=True, options={"fp8_matmul": "fp4"}))
    with pytest.raises(UserError, match=r"attn_decode='fast' is not one of split, single"):
        reg.select(BackendConfig(name="cuda_sm100", interpret=True, options={"attn_decode": "fast"}))
    for value in (None, "exact", "padded"):  # ep_exchange: how moe.dispatch exchanges (auto by default)
        opts = {} if value is None else {"ep_exchange": value}
        ops = reg.select(BackendConfig(name="cuda_sm100", interpret=True, options=opts)).ops
        assert ops.entry("moe.dispatch").fn.fn.keywords["exchange"] == (value or "auto")
    with pytest.raises(UserError, match=r"ep_exchange='fast' is not one of auto, exact, padded"):
        reg.select(BackendConfig(name="cuda_sm100", interpret=True, options={"ep_exchange": "fast"}))
    with pytest.raises(UserError, match=r"unknown option\(s\) \['torch_device'\] for the cuda_sm100 backend"):
        reg.select(BackendConfig(name="cuda_sm100", interpret=True, options={"torch_device": "cuda:1"}))


def test_op_variants_offer_every_kernel_the_options_switch(active):
    """The device run times old and new kernels side by side through the ``op_variants`` extra
    (core/qualify/device_run/common.py: variants): each switched op under every value of its option, bound to
    this target's tuning; the variant named by the default options is the op table's own kernel."""
    from inferhal.core.qualify.device_run.common import variants

    offered = active.extra("op_variants")
    assert set(offered) == {"attn.paged", "attn.sparse_topk", "indexer.scores", "moe.experts", "linear"}
    for op_id in ("attn.paged", "attn.sparse_topk", "indexer.scores"):
        got = variants(active, op_id)
        assert set(got) == {"default", "attn_decode=split", "attn_decode=single"}
        assert got["attn_decode=single"].keywords == {"target": "interpreter", "decode": "single"}
        table = active.ops.entry(op_id).fn.fn
        assert got["attn_decode=split"].func is table.func and got["attn_decode=split"].keywords == table.keywords
    assert set(offered["moe.experts"]) == {"fp8_matmul=widen", "fp8_matmul=w8a8", "path=tiled"}
    assert offered["moe.experts"]["path=tiled"].keywords == {"target": "interpreter", "path": "tiled"}
    assert set(offered["linear"]) == {"fp8_matmul=widen", "fp8_matmul=w8a8", "path=tiled"}
    assert offered["linear"]["path=tiled"].keywords == {"target": "interpreter", "path": "tiled"}


@pytest.mark.parametrize("op_id", ["linear", "moe.experts"])
def test_linear_and_experts_run_the_tiled_kernels_at_every_m_in_the_batch_invariant_mode(op_id):
    """linear's decode kernel (up to 128 rows) and moe.experts' decode tiles (few pairs an expert) sum in another
    order than the tiled kernels (larger steps), so the batch-invariant mode binds the tiled path (declared
    invariant in that mode only)."""
    from inferhal.backends.cuda_sm100.ops import BATCH_INVARIANCE

    reg = BackendRegistry.discover()
    on = reg.select(BackendConfig(name="cuda_sm100", interpret=True, batch_invariant=True)).ops.entry(op_id).fn.fn
    off = reg.select(BackendConfig(name="cuda_sm100", interpret=True)).ops.entry(op_id).fn.fn
    assert on.keywords.get("path") == "tiled" and "path" not in off.keywords
    assert BATCH_INVARIANCE[op_id].mode_only
