"""triton-ascend tuning data for the shared Triton kernels (target ``ascend950``), and the UB budget.

Registered into :mod:`inferhal.kernels.tuning` under the target name ``ascend950`` on import. On Ascend a
Triton program runs on one AI core: vector work lives in the Unified Buffer (UB), ``tl.dot`` goes to
the cube unit through L1/L0. Tiles are therefore chosen (a) as multiples of 16 (the cube's fractal;
int8/fp8 want 32 along K), and (b) so that a program's vector-side working set fits in *half* the UB,
leaving the other half for the double-buffered loads the triton-ascend compiler inserts (the rule the
triton-ascend developer guide gives: keep a loop body's loads and temporaries within half the UB).
``num_warps`` has no meaning on Ascend and is kept only because the shared launch helpers pass it.

:func:`ub_bytes` estimates the on-chip bytes one program of a kernel needs for a config and problem
size; :func:`check_budget` compares it with the device's UB. These are estimates from the kernels'
tile shapes (loads, temporaries, accumulators), not compiler output: no triton-ascend compile ran here
(it needs CANN's ``bishengir-compile``), so nothing in this file is a hardware or compiler result.
"""

from __future__ import annotations

from typing import Any, Mapping

from inferhal.kernels.runtime import next_pow2
from inferhal.kernels.tuning import TUNING, register_target

TARGET = "ascend950"

TABLE: dict[str, dict[str, Any]] = {
    # cube tiles: 16-multiples; 128x64 keeps 2-stage staging + fp32 accumulator at ~96 KiB (<= UB/2);
    # 128x128 with 2 stages would need ~160 KiB by this estimate
    "moe_gemm": {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2},
    "moe_gemm_fp4": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2},
    # head dim 512 (DeepSeek-V4 latent): K/V tiles of 32 keys x 512 in one stage keep ~114 KiB < UB/2;
    # 128 keys x 2 stages would need ~568 KiB (the budget check rejects it)
    "attn_paged": {"BLOCK_N": 32, "BLOCK_H": 16, "num_warps": 4, "num_stages": 1},
    "mhc_pre": {"BLOCK_K": 512, "num_warps": 4},
    "mhc_post": {"BLOCK_D": 512, "num_warps": 4},
    "sample": {"BLOCK_V": 4096, "BISECT_ITERS": 40, "num_warps": 4},
    # the compressor pools [BLOCK_M window tokens x BLOCK_C channels] tiles: HCA's 128-token windows with
    # 16 channels keep its ~8 fp32 tiles at 64 KiB (32 channels would reach the UB/2 bound exactly)
    "attn_compress": {"BLOCK_C": 16, "num_warps": 4},
    "sample_mask": {"BLOCK_V": 4096, "num_warps": 4},
}

register_target(TARGET, TABLE)


def ub_bytes(kernel: str, cfg: Mapping[str, Any], **shape: int) -> int:
    """Vector-side on-chip bytes of one program (estimate). ``shape`` gives the sizes the kernel's tile
    depends on: ``D`` (norm_rms, rope), ``E`` (moe_route), ``D`` head dim for attn_paged, ``N`` streams
    for mhc_*, ``M`` window and ``D`` entry width for attn_compress; ``elem`` the activation element size
    (default 2, bf16)."""
    elem = shape.get("elem", 2)
    if kernel == "norm_rms":  # whole row in one block: x, r, h (fp32), w (fp32), y -> 5 fp32 rows
        return 5 * 4 * next_pow2(shape["D"])
    if kernel == "rope":  # one head row: x (fp32), cos, sin, out
        return 4 * 4 * next_pow2(shape["D"])
    if kernel == "moe_route":  # one token row of E logits: logits, scores, choose (fp32), ids (int32)
        return 4 * 4 * next_pow2(shape["E"])
    if kernel in ("moe_gemm", "moe_gemm_fp4"):  # A/B staging per stage + fp32 accumulator + bf16 epilogue
        bm, bn, bk, st = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg.get("num_stages", 1)
        a_el = 0.5 if kernel == "moe_gemm_fp4" else elem
        stage = int(bm * bk * elem + bn * bk * a_el)
        return st * stage + bm * bn * 4 + bm * bn * elem
    if kernel == "attn_paged":  # K and V tiles, scores [BH, BN] fp32, running o [BH, D] fp32, m/l
        bn, bh, d = cfg["BLOCK_N"], cfg["BLOCK_H"], shape["D"]
        st = cfg.get("num_stages", 1)
        return st * 2 * bn * d * elem + bh * bn * 4 + bh * d * 4 + 2 * bh * 4 + bh * d * elem
    if kernel == "mhc_pre":  # one K-chunk of the flattened streams and of the (2+N)N projections
        n, bk = shape["N"], cfg["BLOCK_K"]
        return bk * 4 + (2 + n) * n * bk * 4 + (2 + n) * n * 4
    if kernel == "mhc_post":  # N streams x BLOCK_D, y chunk, output chunk (fp32)
        n, bd = shape["N"], cfg["BLOCK_D"]
        return (2 * n + 1) * bd * 4
    if kernel == "sample":  # one vocab chunk of logits and probabilities (fp32)
        return 2 * cfg["BLOCK_V"] * 4
    if kernel == "attn_compress":  # phase 1: kv, gate, bias, weights tiles (x2 with CSA's previous window);
        bm, bc = next_pow2(max(2, shape["M"])), cfg["BLOCK_C"]  # phase 2: the row and the norm weight
        return 8 * bm * bc * 4 + 2 * next_pow2(shape["D"]) * 4
    if kernel == "sample_mask":  # one vocab chunk: words, bits, the -inf row (int32/fp32)
        return 3 * cfg["BLOCK_V"] * 4
    raise KeyError(f"no UB estimate for kernel {kernel!r}")


def check_budget(kernel: str, ub: int, **shape: int) -> tuple[int, int]:
    """(bytes needed, bytes allowed = ub // 2); raises ValueError when the config does not fit."""
    from inferhal.kernels.tuning import config

    need = ub_bytes(kernel, config(kernel, TARGET), **shape)
    allowed = ub // 2
    if need > allowed:
        raise ValueError(f"{kernel} on {TARGET}: ~{need} B of UB per program exceeds half the UB ({allowed} B)")
    return need, allowed


def registered() -> bool:
    return all(TUNING[TARGET].get(k) == v for k, v in TABLE.items())
