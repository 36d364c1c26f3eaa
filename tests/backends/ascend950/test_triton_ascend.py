"""The shared Triton kernels with the ascend950 tuning data, in Triton's CPU interpreter (execution level:
interpreter; no triton-ascend compile ran), and the Unified Buffer budget of every Ascend tile config."""

from inferhal.kernels.runtime import use_interpreter

use_interpreter(True)  # before any kernel module is imported (@triton.jit reads it at definition)

import pytest  # noqa: E402
import torch  # noqa: E402

from inferhal.backends.ascend950.device import GENERATIONS  # noqa: E402
from inferhal.backends.reference import moe as ref_moe  # noqa: E402
from inferhal.backends.reference import ops as ref  # noqa: E402
from inferhal.core.ops.params import RmsNormParams, RopeParams, RouteParams  # noqa: E402
from inferhal.kernels import tuning, tuning_ascend950  # noqa: E402

UB_950 = GENERATIONS["950PR"].ub_bytes
UB_A2 = GENERATIONS["A2"].ub_bytes


def test_tuning_data_is_registered_for_the_target():
    assert tuning_ascend950.registered()
    assert tuning.config("moe_gemm", "ascend950")["BLOCK_N"] == 64
    for kernel, cfg in tuning_ascend950.TABLE.items():
        for k, v in cfg.items():
            if k.startswith("BLOCK_"):
                assert v % 16 == 0, f"{kernel}.{k}={v}: the cube's fractal wants 16-multiples"


# DeepSeek-V4 sizes each kernel meets: hidden 4096 (V4-Flash) / 5120 (V4.1), head dim 512, 256/384 experts, hc 4
SHAPES = {
    "norm_rms": [{"D": 4096}], "rope": [{"D": 512}], "moe_route": [{"E": 256}, {"E": 384}],
    "moe_gemm": [{}], "moe_gemm_fp4": [{}], "attn_paged": [{"D": 512}], "mhc_pre": [{"N": 4}],
    "mhc_post": [{"N": 4}], "sample": [{}],
    "attn_compress": [{"M": 4, "D": 512}, {"M": 128, "D": 512}], "sample_mask": [{}],  # CSA 4 / HCA 128, D 512
}


@pytest.mark.parametrize("kernel", sorted(SHAPES))
def test_ub_budget_fits_950(kernel):
    for shape in SHAPES[kernel]:
        need, allowed = tuning_ascend950.check_budget(kernel, UB_950, **shape)
        assert 0 < need <= allowed


def test_ub_budget_rejects_what_does_not_fit():
    # finding: the shared norm kernel keeps a whole row in one block; at V4.1's hidden 5120 (padded to
    # 8192) that is 5 x 8192 x 4 B = 160 KiB, over half the UB of the 950 (and of A2): on Ascend norm.rms
    # must stay on npu_rms_norm until the kernel gets a chunked-row variant
    for ub in (UB_950, UB_A2):
        with pytest.raises(ValueError, match="exceeds half the UB"):
            tuning_ascend950.check_budget("norm_rms", ub, D=5120)
    assert tuning_ascend950.ub_bytes("norm_rms", {}, D=5120) == 5 * 4 * 8192
    with pytest.raises(KeyError):
        tuning_ascend950.ub_bytes("nope", {})


def test_norm_kernel_in_interpreter_with_ascend_target():
    from inferhal.kernels.norm import rms_norm

    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(4, 96, generator=g).to(torch.bfloat16) for _ in range(2))
    w = torch.randn(96, generator=g).to(torch.bfloat16)
    p = RmsNormParams(eps=1e-6)
    y, h = rms_norm(x, w, p, r, target="ascend950")
    y_ref, h_ref = ref.norm_rms(x, w, p, r)
    assert torch.equal(h, h_ref)
    assert (y.float() - y_ref.float()).abs().max() <= 2 ** -7 * y_ref.float().abs().max() + 1e-2


def test_rope_kernel_in_interpreter_with_ascend_target():
    from inferhal.kernels.rope import rope_apply

    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 2, 64, generator=g)
    ang = torch.arange(8)[:, None] * torch.rand(16, generator=g)[None]
    cs = torch.cat((ang.cos(), ang.sin()), -1)
    p = RopeParams(rotary_dim=32, placement="tail")
    pos = torch.tensor([0, 3, 7, 1, 2])
    assert (rope_apply(x, pos, cs, p, target="ascend950") - ref.rope_apply(x, pos, cs, p)).abs().max() < 1e-5


def test_moe_route_kernel_covers_what_the_npu_gating_op_cannot():
    """sqrtsoftplus (DeepSeek-V4) has no npu_moe_gating_top_k norm_type: the shared kernel has it."""
    from inferhal.kernels.moe_route import moe_route

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 256, generator=g)
    bias = torch.randn(256, generator=g) * 0.01
    p = RouteParams(top_k=6, scoring="sqrtsoftplus", routed_scaling=1.5)
    w, ids = moe_route(logits, p, bias, target="ascend950")
    w_ref, ids_ref = ref_moe.moe_route(logits, p, bias)
    o, o_ref = ids.sort(-1), ids_ref.sort(-1)
    assert torch.equal(o.values, o_ref.values)
    assert (w.gather(1, o.indices) - w_ref.gather(1, o_ref.indices)).abs().max() < 1e-5


# ------------------------------------------------------------------ TRITON_OPS: the ops ascend950 runs on triton-ascend


def triton_table():
    from inferhal.backends.ascend950.ops import TRITON_OPS, provide

    table = provide(object(), triton=True)
    assert set(TRITON_OPS) <= set(table)
    return table


@pytest.mark.parametrize("ratio,overlap,c,tokens", [(4, True, 32, 8), (16, False, 40, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pad", [0, 3], ids=["exact", "padded"])
def test_attn_compress_on_the_ascend_table_in_interpreter(ratio, overlap, c, tokens, dtype, pad):
    """The shared kernel on Ascend's table against the reference; ``padded``: -1 rows past the closing ones
    (a captured step's bound, #46), zero entries there."""
    from inferhal.backends.reference.deepseek import attn_compress as ref_compress
    from inferhal.core.ops.params import AttnBatch, CompressParams

    g = torch.Generator().manual_seed(ratio + c)
    nb, bs = 4, 16
    state = torch.randn(nb, bs, 2, c, generator=g).to(dtype)
    d = c // 2 if overlap else c
    batch = AttnBatch(torch.tensor([0, tokens]), torch.tensor([tokens]), torch.arange(tokens),
                      torch.tensor([[2, 0, 3, 1]]), torch.arange(tokens))
    rows = torch.arange(ratio - 1, tokens, ratio)  # the tokens that close a window
    rows = torch.cat((rows, torch.full((pad,), -1, dtype=rows.dtype)))
    bias, w = torch.randn(ratio, c, generator=g), (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
    ang = torch.arange(64).float()[:, None] * torch.rand(4, generator=g)[None]
    cs = torch.cat((ang.cos(), ang.sin()), -1)
    p = CompressParams(ratio, overlap, RopeParams(8, "interleaved", "tail"), 1e-6)
    op = triton_table()["attn.compress"]
    assert op.level.value == "wired-unrun" and "kernels.compress" in op.note
    got, want = op(state, batch, rows, bias, w, cs, p), ref_compress(state, batch, rows, bias, w, cs, p)
    tol = 3 * 2 ** -8 if dtype == torch.bfloat16 else 1e-5
    assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()
    assert not got[rows < 0].any() and not want[rows < 0].any()


def test_sample_mask_on_the_ascend_table_in_interpreter():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 100, generator=g)
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (2, 4), generator=g, dtype=torch.int64).to(torch.int32)
    rows = torch.tensor([0, 2])
    want = logits.clone()
    ref.sample_mask(want, bitmask, rows)
    triton_table()["sample.mask"](logits, bitmask, rows)
    assert torch.equal(logits, want)
