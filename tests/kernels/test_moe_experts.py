"""moe.experts grouped GEMM + SwiGLU kernels vs the reference, in the interpreter.

Tolerances: the kernel rounds where the reference rounds (gate/up GEMM outputs, h, the down GEMM
output, dequantised weights: all to the activation dtype, to nearest even), so what remains is fp32
accumulation order inside the dots, which can flip a bf16 rounding of gate/up (then h moves by one
ulp) and that of the down output: ``links=3`` bf16 roundings, relative to the output's magnitude.
FP8 and FP4 weights are dequantised exactly as the reference does (e4m3 * fp32 block scale, e2m1 *
scale), so they get the same tolerance as bf16. fp32 activations use IEEE dots (no tf32).
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inferhal.backends.reference.moe import moe_experts as ref_experts
from inferhal.core.ops.quantize import quantize_fp4_group, quantize_fp8_block
from inferhal.core.ops.params import ExpertsParams
from inferhal.core.ops.quant import QuantWeight
from inferhal.kernels.moe_experts import moe_experts
from inferhal.kernels.moe_pairs import align_pairs, max_tiles


def setup(t, d, inter, e, k, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g).to(dtype)
    wgu = torch.randn(e, 2 * inter, d, generator=g) / d**0.5
    wdn = torch.randn(e, d, inter, generator=g) / inter**0.5
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k, dtype=torch.long)
    w = torch.rand(t, k, generator=g)
    return x, w, ids, wgu, wdn


def scaled_close(close, out, ref, name):
    # relative to the output scale: the sum over K choices of rounded terms
    scale = float(ref.float().abs().max()) if ref.numel() else 1.0
    close(out, ref, links=3, name=name, scale=max(scale, 1.0))


#: both tile choices (kernels/moe_experts.py: swap-AB decode tiles of few pairs, the tiled kernels)
PATHS = pytest.mark.parametrize("path", ["decode", "tiled"])


@pytest.mark.parametrize("t,d,inter,e,k", [(1, 32, 32, 4, 1), (5, 48, 40, 4, 2), (17, 64, 96, 8, 3), (0, 32, 32, 2, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("limit", [0.0, 1.0])
@PATHS
def test_bf16_experts(t, d, inter, e, k, dtype, limit, path, close):
    x, w, ids, wgu, wdn = setup(t, d, inter, e, k, t + d, dtype)
    wgu, wdn = wgu.to(dtype), wdn.to(dtype)
    if t:
        ids[0, 0] = -1  # an EP-remote expert: skipped
    p = ExpertsParams(swiglu_limit=limit)
    scaled_close(close, moe_experts(x, w, ids, wgu, wdn, p, path=path), ref_experts(x, w, ids, wgu, wdn, p),
                 f"moe.experts {dtype} {path}")


@pytest.mark.parametrize("t,d,inter,e,k", [(3, 128, 128, 2, 2), (9, 160, 96, 3, 2)])
@PATHS
def test_fp8_block_experts(t, d, inter, e, k, path, close):
    x, w, ids, wgu, wdn = setup(t, d, inter, e, k, 11 + t, torch.bfloat16)
    qgu, qdn = quantize_fp8_block(wgu), quantize_fp8_block(wdn)
    p = ExpertsParams(swiglu_limit=10.0)
    scaled_close(close, moe_experts(x, w, ids, qgu, qdn, p, path=path), ref_experts(x, w, ids, qgu, qdn, p),
                 f"moe.experts fp8_block {path}")


def test_decode_tiles_cover_few_pairs_an_expert_and_a_token_gives_the_same_bits_at_1_and_20_tokens(monkeypatch):
    """The swap-AB decode tiles take steps of at most MAX_PAIRS_PER_EXPERT pairs an expert on average, the tiled
    kernels the rest; within the decode tiles a token's result does not depend
    on the step's other tokens (prefix slices keep each pair's place in its expert's tile, which a CPU BLAS
    may care about: tests/kernels/conftest.py), and 20 tokens cross an expert's 16-pair tile edge."""
    import inferhal.kernels.moe_experts as mx
    from inferhal.kernels.tuning import config

    cap = config("moe_gemm_decode")["MAX_PAIRS_PER_EXPERT"]
    assert mx.decode_tiles(8 * cap, 8) and not mx.decode_tiles(8 * cap + 1, 8) and not mx.decode_tiles(0, 8)
    swapped, launch = [], mx.launch
    monkeypatch.setattr(mx, "launch", lambda fn, grid, *a, **kw: (swapped.append(kw["SWAP_AB"]), launch(fn, grid, *a, **kw)))
    x, w, ids, wgu, wdn = setup(32, 64, 64, 2, 2, 3, torch.bfloat16)  # 32 pairs an expert (the cap): 2 tiles each
    wgu, wdn, p = wgu.bfloat16(), wdn.bfloat16(), ExpertsParams()
    full = moe_experts(x, w, ids, wgu, wdn, p)
    for n in (1, 20):
        assert torch.equal(moe_experts(x[:n], w[:n], ids[:n], wgu, wdn, p), full[:n]), n
    moe_experts(x, w, ids, wgu, wdn, p, path="tiled")
    assert swapped == [True, True] * 3 + [False, False]  # gate/up and down: decode three times, then tiled
    with pytest.raises(ValueError, match="path='wide'; known: decode, tiled"):
        moe_experts(x, w, ids, wgu, wdn, p, path="wide")


@pytest.mark.parametrize("block", [(128, 128), (32, 16)])
def test_fp8_block_scale_rows_are_the_same_products(block, monkeypatch):
    """Scales loaded as one vector per tile row (blocks spanning whole K tiles) or gathered per element (blocks
    narrower than a K tile): the kernel gives the same result bit for bit either way."""
    import inferhal.kernels.moe_experts as mx

    x, w, ids, wgu, wdn = setup(7, 128, 96, 3, 2, 5, torch.bfloat16)
    qgu, qdn = quantize_fp8_block(wgu, block), quantize_fp8_block(wdn, block)
    p = ExpertsParams(swiglu_limit=10.0)
    rows = moe_experts(x, w, ids, qgu, qdn, p)
    monkeypatch.setattr(mx._Weight, "scale_row", lambda self, bk: False)
    gathered = moe_experts(x, w, ids, qgu, qdn, p)
    assert torch.equal(rows, gathered)
    assert torch.allclose(rows.float(), ref_experts(x, w, ids, qgu, qdn, p).float(), rtol=3 * 2**-7, atol=0.05)


def e8m0(q: QuantWeight) -> QuantWeight:
    """The same codes with scales rounded to powers of two, stored as ue8m0 (the checkpoint format)."""
    s = torch.exp2(torch.round(torch.log2(q.scale.float())))
    return QuantWeight(q.data, s.to(torch.float8_e8m0fnu), q.format, q.shape, q.block)


@pytest.mark.parametrize("scales", ["e8m0", "fp32"])
@pytest.mark.parametrize("t,d,inter,e,k", [(4, 64, 64, 2, 2), (7, 96, 160, 3, 2)])
@PATHS
def test_fp4_experts(t, d, inter, e, k, scales, path, close):
    x, w, ids, wgu, wdn = setup(t, d, inter, e, k, 5 + t, torch.bfloat16)
    qgu, qdn = quantize_fp4_group(wgu), quantize_fp4_group(wdn)
    if scales == "e8m0":  # ue8m0 scales take the tl.dot_scaled path (the packed weight its scaled lhs at decode)
        qgu, qdn = e8m0(qgu), e8m0(qdn)
    p = ExpertsParams(swiglu_limit=10.0)
    scaled_close(close, moe_experts(x, w, ids, qgu, qdn, p, path=path), ref_experts(x, w, ids, qgu, qdn, p),
                 f"moe.experts fp4 {scales} {path}")


def test_align_pairs_groups_by_expert():
    ids = torch.tensor([[2, 0], [2, 5], [-1, 0]])
    pairs, tiles = align_pairs(ids, num_experts=3, block_m=2)
    # expert 0: pairs 1, 5; expert 2: pairs 0, 2; 5 and -1 are dropped; then the bound's spare tiles
    assert max_tiles(6, 3, 2) == 6
    assert tiles.tolist() == [0, 2, -1, -1, -1, -1]
    assert pairs.tolist() == [1, 5, 0, 2] + [-1] * 8


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(-2, 9), min_size=1, max_size=4), min_size=0, max_size=40),
       st.integers(1, 8), st.sampled_from([1, 2, 4, 16]))
def test_align_pairs_matches_a_plain_grouping_within_its_bound(rows, num_experts, block_m):
    """Against a plain Python grouping: the same tiles (experts in order, each group's pairs in flat order,
    padded with -1 to block_m), then spare tiles (expert -1, rows -1) up to max_tiles, which never falls short."""
    k = len(rows[0]) if rows else 1
    ids = torch.tensor([(r * k)[:k] for r in rows], dtype=torch.long).reshape(-1, k)
    want_pairs, want_tiles = [], []
    for e in range(num_experts):
        group = [i for i, x in enumerate(ids.reshape(-1).tolist()) if x == e]
        for t0 in range(0, len(group), block_m):
            chunk = group[t0:t0 + block_m]
            want_pairs += chunk + [-1] * (block_m - len(chunk))
            want_tiles.append(e)
    bound = max_tiles(ids.numel(), num_experts, block_m)
    assert len(want_tiles) <= bound
    pairs, tiles = align_pairs(ids, num_experts, block_m)
    assert tiles.dtype == pairs.dtype == torch.int32
    assert tiles.tolist() == want_tiles + [-1] * (bound - len(want_tiles))
    assert pairs.tolist() == want_pairs + [-1] * (bound * block_m - len(want_pairs))


def test_bad_shapes():
    x, w, ids, wgu, wdn = setup(2, 32, 32, 2, 1, 0, torch.float32)
    with pytest.raises(ValueError, match="w_down"):
        moe_experts(x, w, ids, wgu, wdn[:, :, :16], ExpertsParams())
