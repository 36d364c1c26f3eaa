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
