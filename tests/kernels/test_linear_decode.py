"""``linear`` at decode (kernels/linear_decode.py) in the interpreter: the reference's numerics, batch
invariance up to MAX_ROWS rows, and the grid it launches at V4-Flash's projection shapes (#46).

Tolerance: the kernel sums the same fp32 products as the tiled kernel, in another order (K splits, then the
partials in split order), so the tolerance is the tiled kernel's (tests/kernels/test_linear.py's ``links``:
one output rounding, one more for a dequantised weight). Bitwise comparisons are only between computations
equal by construction: the same kernel and tiles on a row alone and inside a batch (an MMA row never mixes
with other rows; the M tile is fixed), and the tiled path against itself. A row moved to another place in its
tile is bitwise only where the interpreter's host BLAS promises it (tests/kernels/conftest.py).
"""

import pytest
import torch
import triton

from inferhal.backends.reference import ops as ref
from inferhal.kernels.linear import linear
from inferhal.kernels.linear_decode import decode_grid
from inferhal.kernels.tuning import config
from tests.kernels.conftest import check_row_moved
from tests.kernels.test_linear import data, scale_of, weight

#: V4-Flash's dense projections at decode (conf/model/deepseek_v4_flash.yaml: hidden 4096, q_lora_rank 1024,
#: 64 heads x 512, o_groups 8 x o_lora_rank 1024, indexer 64 heads x 128, compressor 2 x 512 (CSA) / 512 (HCA),
#: 256 routed experts): name -> (N, K)
V4_FLASH = {"q_a_proj": (1024, 4096), "q_b_proj": (32768, 1024), "kv_proj": (512, 4096),
            "indexer.q_b_proj": (8192, 1024), "o_a_proj (a group)": (1024, 4096), "o_b_proj": (4096, 8192),
            "compressor CSA kv|gate": (1024, 4096), "compressor HCA kv|gate": (512, 4096), "router gate": (256, 4096),
            "indexer.weights_proj": (64, 4096)}
#: where K bounds the splits (K / MIN_SPLIT_K) below two programs per SM: the programs it reaches
SMALL = {"indexer.weights_proj": 64, "router gate": 256}


@pytest.mark.parametrize("target", ["cuda_sm100", "cuda_sm90"])
def test_grid_fills_two_programs_per_sm_at_v4_flash_shapes(target):
    cfg = config("gemm_decode", target)
    for name, (n, k) in V4_FLASH.items():
        bn, splits, ks = decode_grid(n, k, cfg)
        programs = triton.cdiv(n, bn) * splits
        assert programs >= SMALL.get(name, 2 * 132), (name, bn, splits, ks)
        assert ks % cfg["BLOCK_K"] == 0 and (splits - 1) * ks < k <= splits * ks  # every K column, once
        assert ks >= cfg["MIN_SPLIT_K"] and bn in cfg["N_TILES"]
    assert decode_grid(1024, 4096, cfg) == (32, 11, 384)  # q_a_proj: 352 programs where the tiled GEMM had 8


@pytest.mark.parametrize("t,n,k,bias", [(1, 96, 256, True), (7, 40, 320, False), (64, 200, 96, True),
                                        (128, 64, 64, False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_equals_reference(t, n, k, bias, dtype, close):
    x, w, g = data(t, n, k, 7 * t + n, dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    want = ref.linear(x, w.to(dtype), b)
    close(linear(x, w.to(dtype), b), want, links=1, name="linear decode", scale=scale_of(want))


@pytest.mark.parametrize("fmt", ["fp8_block", "fp8_e8m0", "fp4_group", "int_block", "int_block+offset"])
def test_decode_quantised_weights(fmt, close):
    x, w, _ = data(5, 160, 256, 11, torch.bfloat16)
    q = weight(w, fmt, torch.bfloat16)
    assert decode_grid(160, 256, config("gemm_decode"))[1] > 1  # splits cross the weights' scale blocks
    want = ref.linear(x, q)
    close(linear(x, q), want, links=2, name=f"linear decode {fmt}", scale=scale_of(want))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", [(96, 320), (48, 32)])  # K splits (with the reduction) and one split
def test_a_row_alone_equals_the_row_in_64_and_128_rows(dtype, n, k):
    x, w, g = data(128, n, k, 5, dtype)
    w, b = w.to(dtype), torch.randn(n, generator=g).to(dtype)
    full = linear(x, w, b)
    for rows in (1, 64, 127):
        assert torch.equal(linear(x[:rows], w, b), full[:rows]), rows
    # row 63 alone: bitwise on a GPU (an MMA row never depends on its place), and in the interpreter where the
    # host's BLAS promises it (tests/kernels/conftest.py), else within one rounding
    cfg = config("gemm_decode")  # the tiles this run's dots take
    check_row_moved(lambda rows: linear(rows, w, b), x, 63, full, (cfg["BLOCK_M"], cfg["BLOCK_K"], cfg["N_TILES"]),
                    "linear decode", scale_of(full))


def test_past_max_rows_and_dot_scaled_weights_take_the_tiled_gemm():
    cfg = config("gemm_decode")
    x, w, _ = data(cfg["MAX_ROWS"] + 3, 64, 128, 3, torch.bfloat16)
    w = w.to(torch.bfloat16)
    assert torch.equal(linear(x, w), linear(x, w, path="tiled"))
    q = weight(data(1, 64, 128, 4, torch.float32)[1], "fp4_e8m0", torch.bfloat16)  # ue8m0 groups of 32
    assert torch.equal(linear(x[:3], q), linear(x[:3], q, path="tiled"))
    with pytest.raises(ValueError, match="path='split'"):
        linear(x, w, path="split")
