"""moe.experts on FP8 x FP8 (kernels/moe_fp8.py, ``fp8="w8a8"``) in the interpreter (execution level:
interpreter; the interpreter computes e4m3 ``tl.dot`` exactly, FACTS.md), and linear's ``fp8="w8a8"``.

Oracle: the reference grouped GEMM with the activations replaced by their per-token, per-128-channel e4m3
quantisation (scale amax / 448, codes rounded to nearest even, dequantised) and the weights dequantised in fp32
(the kernel applies the fp32 block scales to fp32 partials: the widened path's rounding of the weights to the
activation dtype does not happen): x quantised before gate/up, h (rounded to the activation dtype, as the
reference does) quantised before down. Both sides round gate, up, h and the down output to the activation
dtype; products of e4m3 codes are exact in fp32, so what differs is fp32 summation order (a rounding
boundary may flip: ``links=3`` roundings at the output's magnitude, as test_moe_experts.py). The widened path
differs from this oracle by the activation quantisation itself (shown, so the comparison can tell the two apart).
"""

import pytest
import torch
import torch.nn.functional as F

from inferhal.backends.reference.moe import _expert
from inferhal.core.ops.params import ExpertsParams
from inferhal.core.ops.quantize import dequantize, quantize_fp8_block
from inferhal.kernels.moe_experts import moe_experts

from tests.kernels.test_moe_experts import scaled_close, setup


def fake_quant(a: torch.Tensor) -> torch.Tensor:
    """a [M, K] -> fp32 values of its e4m3 codes per row and 128 columns (DeepSeek's act_quant), dequantised."""
    m, k = a.shape
    af = F.pad(a.float(), (0, -k % 128)).view(m, -1, 128)
    s = af.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    return ((af / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).view(m, -1)[:, :k]


def oracle(x, weights, ids, qgu, qdn, limit):
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in torch.unique(ids).tolist():
        if not 0 <= e < qgu.shape[0]:
            continue
        tok, slot = torch.where(ids == e)
        gate, up = (fake_quant(x[tok]) @ _expert(qgu, e, torch.float32).T).to(x.dtype).float().chunk(2, dim=-1)
        if limit > 0:
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        h = (F.silu(gate) * up).to(x.dtype)
        y = (fake_quant(h) @ _expert(qdn, e, torch.float32).T).to(x.dtype).float()
        out.index_add_(0, tok, y * weights[tok, slot, None].float())
    return out.to(x.dtype)


# T, D, I, E, K: one 128 block; ragged D and I (partial quantisation blocks, an N tile past I); several K blocks
@pytest.mark.parametrize("t,d,inter,e,k", [(3, 128, 128, 2, 2), (9, 160, 96, 3, 2), (6, 384, 256, 2, 2)])
# the swap-AB decode tiles (these sizes) in both dtypes, the tiled kernels in bf16 (they take no dtype branch)
@pytest.mark.parametrize("path,dtype", [("decode", torch.bfloat16), ("decode", torch.float32), ("tiled", torch.bfloat16)])
def test_w8a8_experts_match_the_quantised_oracle(t, d, inter, e, k, dtype, path, close):
    x, w, ids, wgu, wdn = setup(t, d, inter, e, k, 11 + t, dtype)
    ids[0, 0] = -1  # an EP-remote expert: skipped
    qgu, qdn = quantize_fp8_block(wgu), quantize_fp8_block(wdn)
    p = ExpertsParams(swiglu_limit=10.0 if t % 2 else 0.0)
    out = moe_experts(x, w, ids, qgu, qdn, p, fp8="w8a8", path=path)
    want = oracle(x, w, ids, qgu, qdn, p.swiglu_limit)
    scaled_close(close, out, want, f"moe.experts w8a8 {dtype} {path}")
    widened = moe_experts(x, w, ids, qgu, qdn, p)  # the default path: activations not quantised
    assert (widened.float() - want.float()).abs().max() > (out.float() - want.float()).abs().max()


def test_w8a8_rows_are_bitwise_batch_invariant(monkeypatch):
    """Each token's activations are quantised from its own row and its rows never mix in a tile: a token alone,
    or in the batch's first rows, gives the same bits, on the decode tiles (SWAP_AB) and on the tiled kernels."""
    import inferhal.kernels.moe_fp8 as mf

    swapped, launch = set(), mf.launch
    monkeypatch.setattr(mf, "launch", lambda fn, grid, *a, **kw: (swapped.add(kw["SWAP_AB"]), launch(fn, grid, *a, **kw)))
    x, w, ids, wgu, wdn = setup(24, 256, 128, 4, 2, 3, torch.bfloat16)
    qgu, qdn = quantize_fp8_block(wgu), quantize_fp8_block(wdn)
    p = ExpertsParams(swiglu_limit=10.0)
    for path in ("decode", "tiled"):  # 48 pairs over 4 experts: the decode tiles (16 pairs) cross an edge
        full = moe_experts(x, w, ids, qgu, qdn, p, fp8="w8a8", path=path)
        for n in (1, 5, 20):
            assert torch.equal(moe_experts(x[:n], w[:n], ids[:n], qgu, qdn, p, fp8="w8a8", path=path), full[:n])
        assert swapped == {path == "decode"}
        swapped.clear()
    assert moe_experts(x[:0], w[:0], ids[:0], qgu, qdn, p, fp8="w8a8").shape == (0, 256)


def test_w8a8_is_refused_where_the_blocks_do_not_fit():
    x, w, ids, wgu, wdn = setup(2, 128, 128, 2, 1, 0, torch.bfloat16)
    p = ExpertsParams()
    with pytest.raises(ValueError, match="w_gate_up has 64-wide K blocks"):
        moe_experts(x, w, ids, quantize_fp8_block(wgu, (128, 64)), quantize_fp8_block(wdn), p, fp8="w8a8")
    with pytest.raises(ValueError, match="fp8='fp4'; known: widen, w8a8"):
        moe_experts(x, w, ids, wgu.bfloat16(), wdn.bfloat16(), p, fp8="fp4")
    # bf16 weights: fp8 selects nothing (the same kernel either way)
    assert torch.equal(moe_experts(x, w, ids, wgu.bfloat16(), wdn.bfloat16(), p, fp8="w8a8"),
                       moe_experts(x, w, ids, wgu.bfloat16(), wdn.bfloat16(), p))


def test_linear_w8a8_option(close):
    """linear(fp8="w8a8") takes an fp8_block weight with 128-wide K blocks through FP8 x FP8 (the quantised
    activations' oracle), and widens otherwise (a bias, narrower blocks)."""
    from inferhal.kernels.linear import linear

    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 256, generator=g).bfloat16()
    q = quantize_fp8_block(torch.randn(96, 256, generator=g) / 16)
    want = (fake_quant(x) @ dequantize(q, torch.float32).T).bfloat16()
    got = linear(x, q, fp8="w8a8")
    close(got, want, links=2, name="linear w8a8", scale=float(want.float().abs().max()))
    assert not torch.equal(got, linear(x, q))
    bias = torch.randn(96, generator=g).bfloat16()
    assert torch.equal(linear(x, q, bias, fp8="w8a8"), linear(x, q, bias))
    q64 = quantize_fp8_block(torch.randn(96, 256, generator=g), (128, 64))
    assert torch.equal(linear(x, q64, fp8="w8a8"), linear(x, q64))
    with pytest.raises(ValueError, match="fp8='e5m2'"):
        linear(x, q, fp8="e5m2")
