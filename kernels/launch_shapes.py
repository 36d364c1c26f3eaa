"""The integers a launch passes the kernels at DeepSeek-V4-Flash's production shapes, for the ahead-of-time
compiler (:mod:`.registry` specs' ``values``): Triton's JIT specialises a launch on them (a 1 becomes a
constexpr, a multiple of 16 is marked divisible by 16), which changes registers, spills and shared memory; a
spec compiled without them sees every integer as an unknown i32."""

from __future__ import annotations

import math


def moe_fp8_values(down: bool, w8a8: bool) -> dict[str, int]:
    """FP8-block expert GEMMs at V4-Flash's shapes (hidden 4096, expert intermediate 2048, top-6; 128 x 128
    blocks, fp32 block scales), as a launch passes them: contiguous weights, codes and activations."""
    d, i = 4096, 2048
    rows, cols = (d, i) if down else (2 * i, d)
    vals = {"D": d, "I": i, "s_we": rows * cols, "s_wn": cols, "s_wk": 1, "s_se": (rows // 128) * (cols // 128),
            "s_sn": cols // 128, "s_sk": 1, "blk_n": 128}
    if w8a8:  # h's codes and scales (written by gate/up, read by down); x's codes and scales
        vals.update({"stride_hq": i, "stride_hs": i // 128})
        if not down:
            vals.update({"TOPK": 6, "stride_xq": d, "stride_xs": d // 128})
        return vals
    return {**vals, "blk_k": 128, **({} if down else {"TOPK": 6, "stride_x": d})}


def moe_values(fmt: int, down: bool) -> dict[str, int]:
    """bf16 (``fmt`` 0) and FP4 e2m1 with ue8m0 scales per 32 (``fmt`` 3) expert GEMMs at V4-Flash's shapes as a
    launch passes them: a plain weight comes with a [1, 1, 1] scale and block (1, 1), an FP4 one packs two codes
    a byte with block (1, 32). Unspecialised, the bf16 kernels gathered their tiles element by element and
    reported 880 / 176 B of spill stack on sm_90a that no launch compiles."""
    d, i = 4096, 2048
    rows, cols = (d, i) if down else (2 * i, d)
    if fmt == 0:
        vals = {"s_we": rows * cols, "s_wn": cols, "s_se": 1, "s_sn": 1, "blk_k": 1}
    else:
        vals = {"s_we": rows * cols // 2, "s_wn": cols // 2, "s_se": rows * cols // 32, "s_sn": cols // 32, "blk_k": 32}
    vals.update({"D": d, "I": i, "s_wk": 1, "s_sk": 1, "blk_n": 1})
    return vals if down else {**vals, "TOPK": 6, "stride_x": d}


def csa_values(row: int) -> dict[str, int]:
    """The one-program-per-token CSA decode (sparse_attn_kernel) as a V4-Flash launch at 64K context passes its
    integers: 64 heads x 512 channels, 16-slot blocks of ``row`` elements per entry (512 bf16, or a record's
    bytes) in both caches, the top-512 row, compression ratio 4, a 128-token window. Unspecialised, the bf16
    kernel reported 197,648 B of shared memory on sm_100a where the launch compiles 263,200 (over the 232,448 a
    block may hold)."""
    return {"H": 64, "D": 512, "BS": 16, "CBS": 16, "NK": 512, "RATIO": 4, "stride_qt": 64 * 512, "stride_qh": 512,
            "stride_ot": 64 * 512, "stride_oh": 512, "stride_kb": 16 * row, "stride_ks": row, "stride_cb": 16 * row,
            "stride_cs": row, "stride_it": 512, "stride_bt": 65536 // 16, "stride_cbt": 65536 // 4 // 16, "window": 128}


def csa_split_values(row: int) -> dict[str, int]:
    """The split CSA decode kernel's integers at V4-Flash's decode shapes (as :func:`csa_values`): the window's
    128 keys in one split of 128 (NSW = WS = 1), the top-512 row in four; fp32 partials [T, 5, 64, 512]."""
    vals = {k: v for k, v in csa_values(row).items() if k not in ("stride_ot", "stride_oh")}
    return {**vals, "t0": 0, "NSW": 1, "WS": 1, "SPLIT": 128, "stride_at": 5 * 64 * 512, "stride_as": 64 * 512,
            "stride_ah": 512, "stride_mt": 5 * 64 * 2, "stride_ms": 64 * 2}


def align(fmt) -> dict[str, int]:
    """decode_tile's ALIGN as the wrappers derive it from a contiguous cache of ``fmt`` records (tile_args)."""
    return {} if fmt is None else {"ALIGN": math.gcd(16, fmt.nbytes)}


def indexer_values(row: int) -> dict[str, int]:
    """The one-program-per-tile lightning indexer (indexer_scores_kernel) as a V4-Flash launch at 64K context
    passes its integers: 64 heads x 128 channels, 16-slot blocks of ``row`` elements per key (128 bf16, or a
    record's bytes), compression ratio 4, a 16,384-column score row."""
    return {"H": 64, "D": 128, "BS": 16, "M_RATIO": 4, "W": 65536 // 4, "stride_qt": 64 * 128, "stride_qh": 128,
            "stride_kb": 16 * row, "stride_ks": row, "stride_wt": 64, "stride_ot": 65536 // 4,
            "stride_bt": 65536 // 4 // 16}
