"""Tuning configs as data, keyed by target then kernel.

Every kernel reads its block sizes and launch options from here through :func:`config`; nothing in a
kernel module hard-codes a tile. A target is a backend's name for a chip family:

- ``cuda_sm100``: NVIDIA Blackwell (SM100/SM103);
- ``interpreter``: the Triton CPU interpreter (same kernels; smaller GEMM tiles so that test shapes
  cross tile edges, bigger row blocks so that fewer programs run);
- ``cuda_sm90``: Hopper, the degraded target (smaller shared memory budget, no tcgen05);
- ``ascend950``: filled by the Ascend backend for triton-ascend (its own tiles: the Unified Buffer is
  smaller and the cube unit prefers 16-multiples); a kernel without an entry there uses ``default``.

A config is a plain dict: ``BLOCK_*`` entries become ``tl.constexpr`` arguments, ``num_warps`` /
``num_stages`` are launch options. One fixed config per (target, kernel) keeps every kernel
batch-invariant (no split chosen from the token count) and avoids ``@triton.autotune``, which fails in
the interpreter. Another backend may register its own table with :func:`register_target`.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

#: the attention decode kernels the attn.paged / attn.sparse_topk wrappers select with ``decode=``
#: (``backend.options.attn_decode`` on cuda_sm100): split-KV with a combine (kernels/attn_split.py), or the
#: one program per token (and KV head) they replace
DECODES = ("split", "single")
#: how moe.experts and linear multiply FP8 block-scaled weights, selected with ``fp8=``
#: (``backend.options.fp8_matmul`` on cuda_sm100): widened to the activation dtype in registers (the
#: numerically closest), or FP8 x FP8 with activations quantised per token and 128 channels
FP8_PATHS = ("widen", "w8a8")
#: how moe.dispatch exchanges rows (``exchange=``, ``backend.options.ep_exchange`` on cuda_sm100): ``exact``
#: (each rank its routed rows; the split sizes read on the host), ``padded`` (a fixed capacity per rank, one
#: equal-split all-to-all, no host read: capturable), ``auto`` (padded while a CUDA graph is captured)
EP_EXCHANGES = ("auto", "exact", "padded")
#: how linear picks its kernel (``path=``): ``decode`` runs up to gemm_decode's MAX_ROWS rows through
#: kernels/linear_decode.py (N tile and K splits chosen from N and K), more through the tiled GEMM; ``tiled``
#: runs the tiled GEMM at every M (what cuda_sm100 runs under backend.batch_invariant=true)
LINEAR_PATHS = ("decode", "tiled")
#: how moe.experts picks its tiles (``path=``): ``decode`` runs steps of few pairs an expert through swap-AB tiles
#: (moe_gemm_decode, kernels/moe_experts.decode_tiles), larger ones through the tiled kernels; ``tiled``: the tiled
#: kernels at every size (what cuda_sm100 runs under backend.batch_invariant=true)
MOE_PATHS = ("decode", "tiled")

# linear at decode (kernels/linear_decode.py): BLOCK_M rows a program (a fixed tile: never chosen from M), the N
# tile the widest of N_TILES whose tiles x K splits reach PROGRAMS programs (two per SM of a 132-SM H100 / H200),
# splits of at least MIN_SPLIT_K columns (the fp32 partials [S, M, N], written and read once, are 4 M / KS of the
# weight's bytes: <= 1/4 at M = 16, <= 1 at M = 64, mostly in L2), REDUCE_BLOCK columns per program of the split reduction. Up to MAX_ROWS rows; more take the tiled GEMM.
_GEMM_DECODE = {"BLOCK_M": 64, "N_TILES": (64, 32, 16), "BLOCK_K": 128, "MIN_SPLIT_K": 256, "PROGRAMS": 264,
                "MAX_ROWS": 128, "REDUCE_BLOCK": 1024, "num_warps": 4, "num_stages": 3}

# split-KV decode (kernels/attn_split.py), the same on Hopper and Blackwell (listed in both tables below):
# BLOCK_H heads per program (the N side of the swap-AB dots), SPLIT keys per split, a key range cut into at most
# MAX_SPLITS splits (more keys: longer splits). From `inferhal kernels compile` (compiled only): 16-head groups at
# 4 warps hold the [512, 16] fp32 accumulator unspilled (sm_90a 225 registers, sm_100a 160); 32 or 64 heads
# spilled 16-80 B on one of them, 64-key tiles 600-1,200 B; FP8 / FP4 records need 16-key tiles.
_SPLIT_KV = {
    "attn_sparse_split": {"BLOCK_H": 16, "BLOCK_N": 32, "SPLIT": 128, "MAX_SPLITS": 16, "num_warps": 4,
                          "num_stages": 2},
    "attn_sparse_split_records": {"BLOCK_H": 16, "BLOCK_N": 16, "SPLIT": 128, "MAX_SPLITS": 16, "num_warps": 4,
                                  "num_stages": 2},
    # a 4K context in 8 splits of 512 keys: 512 programs at B=16 for 64 heads, 32 KB of partials per 512 KB read
    "attn_paged_split": {"BLOCK_H": 16, "BLOCK_N": 32, "SPLIT": 256, "MAX_SPLITS": 8, "num_warps": 4,
                         "num_stages": 2},
    # indexer.scores split: runs of up to MAX_TILES tiles of BLOCK_N entries per program, about PROGRAMS
    # programs a launch (two per SM of an H100 / H200)
    "indexer_split": {"BLOCK_N": 128, "MAX_TILES": 8, "PROGRAMS": 264, "num_warps": 8, "num_stages": 2},
    # the log-sum-exp merge of the splits: one program per (token, BLOCK_H heads, BLOCK_D channels)
    "attn_combine": {"BLOCK_H": 16, "BLOCK_D": 128, "num_warps": 4, "num_stages": 1},
}

# attn.sparse_topk's one program per token (decode=single): the 64 x 512 fp32 accumulator over 8 warps (128
# registers a thread) and 16-key tiles. Compiled as a V4-Flash CSA launch (registry values), registers / spill
# stack / shared: sm_90a bf16 255 / 1,880 / 131,328 B at the earlier 32-key tiles and 4 warps -> 250 / 0 / 98,432;
# sm_100a bf16 221 / 0 / 263,200 B at 64-key tiles (over the 232,448 B a block may hold) -> 204 / 0 / 115,360.
# With FP8 / FP4 records (a [16, 512] tile decoded beside the accumulator) CHANNEL_SPLIT 2 runs two programs a
# token, each scoring the whole keys and holding half the value channels: fp8_ds_mla / nvfp4 spill stack, at the
# tiles above -> halves, sm_100a 160 / 56 B -> 0 / 0 (254 / 210 registers), sm_90a 560 / 280 -> 248 / 136. On
# sm_90a CHANNEL_SPLIT 4 (four programs a token, a quarter of the channels each) at 4 warps: 32 / 0 B (255 / 226
# registers, 82,240 B shared; at 8 warps 184 / 0, 32-key tiles 416 / 112): the 64 x 512 query held for wgmma is
# most of what is left. The split kernels (the default) hold none.
_SPARSE_SINGLE = {"BLOCK_N": 16, "num_warps": 8, "num_stages": 2}
_SPARSE_SINGLE_RECORDS = {"BLOCK_N": 16, "CHANNEL_SPLIT": 2, "num_warps": 8, "num_stages": 2}
# attn.paged's program per (token, KV head) (decode=single) the same way, compiled as V4's latent decode (64 heads on
# one 512-dim head, 16-slot blocks): sm_90a 255 registers / 2,232 B of spill stack / 196,608 B shared at 64-key
# tiles and 4 warps -> 255 / 64 / 98,304; sm_100a 255 / 16 / 262,688 B (over a block's 232,448) -> 228 / 0 / 115,232
# BLOCK_H: the most query heads of one KV head a program holds (more: programs per KV head, each a group of heads).
# sm_90a keeps 64 (255 / 56 B): 32-head groups at 8 warps hold no spill (32-key tiles 182 / 0 / 67,584 B, 16-key
# 137 / 0) but wgmma needs 64 rows a warpgroup, so they compile to mma.sync; the split kernel (the default) has both.
_PAGED_SINGLE = {"BLOCK_N": 16, "BLOCK_H": 64, "num_warps": 8, "num_stages": 2}

_DEFAULT: dict[str, dict[str, Any]] = {
    "norm_rms": {"num_warps": 4},
    "rope": {"num_warps": 1},
    "moe_route": {"BLOCK_T": 4, "num_warps": 4},
    "moe_gemm": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
    "moe_gemm_fp4": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
    # expert GEMMs at decode (SWAP_AB): BLOCK_N weight rows on the MMA's M side (128: one tcgen05 / two wgmma M
    # tiles), BLOCK_M pairs on its N side (a V4-Flash decode step of 64 tokens x 6 choices over 256 experts holds
    # ~1.5 pairs an expert); up to MAX_PAIRS_PER_EXPERT pairs an expert on average, then the tiled kernels
    "moe_gemm_decode": {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 64, "MAX_PAIRS_PER_EXPERT": 32, "num_warps": 4,
                        "num_stages": 3},
    # the same for FP8 x FP8 experts (fp8_matmul=w8a8): N and K tiles stay the 128-wide quantisation blocks
    "moe_gemm_fp8_decode": {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3},
    # dense GEMMs (linear, lm_head, lm_head.argmax): bf16 / dequantised weights, ue8m0 FP4 (dot_scaled),
    # FP8 x FP8 (BLOCK_K is the 128-wide scale block of the weight and of the activations)
    "gemm": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
    "gemm_fp4": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
    "gemm_fp8": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3},
    # FP8 x FP8 expert GEMMs (kernels/moe_fp8.py): N and K tiles are the 128-wide quantisation blocks; 64-row
    # tiles (an expert at decode holds a few rows); 8 warps: unspilled where 4 spilled 128-224 B (compiled
    # with the JIT's specialisation at V4 shapes: sm_90a 171 / 128 registers, sm_100a 196 / 138)
    "moe_gemm_fp8": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3},
    "gemm_int": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
    "gemm_decode": _GEMM_DECODE,
    "mhc_pre": {"BLOCK_K": 256, "num_warps": 4},
    "mhc_post": {"BLOCK_D": 256, "num_warps": 4},
    "mhc_head": {"BLOCK_K": 256, "num_warps": 4},
    "embed": {"BLOCK_D": 1024, "num_warps": 4},
    "act_gated": {"BLOCK_I": 1024, "num_warps": 4},
    "spec_verify": {"BLOCK_V": 1024, "num_warps": 4},
    "moe_ep": {"BLOCK_P": 1024, "BLOCK_D": 1024, "num_warps": 4},
    "kv_write": {"num_warps": 4},
    "sample_mask": {"BLOCK_V": 1024, "num_warps": 4},
    # BLOCK_R rows per program (1 for real vocabularies; more for small ones); BISECT_ITERS is unused by
    # kernels/sample.py (its bisections are exact: 32 steps on int32 keys), kept for the Ascend table
    "sample": {"BLOCK_V": 1024, "BLOCK_R": 1, "BISECT_ITERS": 40, "num_warps": 4},
    # BLOCK_H: the most query heads of one KV head a program holds (a KV head's REP heads in groups of BLOCK_H)
    "attn_paged": {"BLOCK_N": 32, "BLOCK_H": 64, "num_warps": 4, "num_stages": 2},
    "topk_select": {"BLOCK_S": 1024, "BLOCK_SORT": 2048, "num_warps": 4},
    "indexer_scores": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
    "attn_sparse": {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
    "attn_sparse_records": {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
    "attn_compress": {"BLOCK_C": 64, "num_warps": 4},
    **_SPLIT_KV,
}

TUNING: dict[str, dict[str, dict[str, Any]]] = {
    "default": _DEFAULT,
    "cuda_sm100": {
        "moe_gemm_fp8": _DEFAULT["moe_gemm_fp8"],
        # tcgen05 wants 128-row tiles; 64-wide K keeps a 3-stage bf16 pipeline within ~100 KB of smem
        "moe_gemm": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
        "moe_gemm_fp4": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3},
        "gemm": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
        # dot_scaled decomposes e2m1 to bf16 in registers: a 64-wide K tile keeps it unspilled
        "gemm_fp4": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
        # the per-K-block scaled add runs in registers: 64-row tiles keep it unspilled (128 rows: 824 B)
        "gemm_fp8": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3},
        # GGUF blocks gather a scale (and offset) per element: 64-wide N tiles keep them unspilled in ~106 KB
        "gemm_int": {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
        "attn_paged": _PAGED_SINGLE,
        # tcgen05 M = 128 entries per tile against the 64 indexer heads
        "indexer_scores": {"BLOCK_N": 128, "num_warps": 8, "num_stages": 2},
        "attn_sparse": _SPARSE_SINGLE,
        "attn_sparse_records": _SPARSE_SINGLE_RECORDS,
        # HCA pools 128 tokens x BLOCK_C channels (kv and gate) in registers: 8 warps keep it unspilled
        "attn_compress": {"BLOCK_C": 32, "num_warps": 8},
        "gemm_decode": _GEMM_DECODE,
        **_SPLIT_KV,
    },
    "cuda_sm90": {
        "moe_gemm_fp8": _DEFAULT["moe_gemm_fp8"],
        "moe_gemm": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
        # dot_scaled widens e2m1 to bf16 in registers beside the gate and up accumulators: 8 warps keep the
        # gate/up kernel unspilled (compiled as a V4-Flash launch: 4 warps 255 registers / 448 B of spill stack,
        # 8 warps 243 / 0; the down kernel 236 -> 140 registers, unspilled either way)
        "moe_gemm_fp4": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 2},
        # wgmma accumulates in registers: 32-wide K tiles (4 stages) keep the bf16 GEMM unspilled (64 B at 64)
        "gemm": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "num_warps": 8, "num_stages": 4},
        "gemm_fp8": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3},
        # GGUF blocks (a scale and offset gathered per element) at the default's 64 x 64 x 64 and 4 warps: 255
        # registers / 16 B of spill stack; 32-wide K tiles over 128 x 64 at 8 warps (4 stages): 167 / 0 / 61,440 B
        # shared (128 x 128: 255 / 0; compiled for sm_90a, not run)
        "gemm_int": {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 8, "num_stages": 4},
        "attn_paged": _PAGED_SINGLE,
        "attn_sparse": _SPARSE_SINGLE,
        "attn_sparse_records": {"BLOCK_N": 16, "CHANNEL_SPLIT": 4, "num_warps": 4, "num_stages": 2},
        # the one-program-per-tile indexer (decode=single) at 8 warps: 48 / 125 / 127 registers for bf16 / fp8_index
        # / mxfp4 keys where 4 warps held 80 / 201 / 189 (16 resident warps a SM or more where 4 warps left 12)
        "indexer_scores": {"BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
        # as on sm_100: the default's 64-channel tiles at 4 warps spilled 1,008 B for HCA's 128-token windows
        "attn_compress": {"BLOCK_C": 32, "num_warps": 8},
        "gemm_decode": _GEMM_DECODE,
        **_SPLIT_KV,
    },
    "ascend950": {},  # the Ascend backend fills this (or register_target) with triton-ascend tiles
    # the interpreter runs one numpy "program" at a time: small grids of big tiles are fastest there,
    # but tests must still cross tile edges, so GEMM tiles stay at 32 (test shapes are <= ~256)
    "interpreter": {
        "moe_gemm": {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1},
        "moe_gemm_fp4": {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1},
        "moe_gemm_decode": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "MAX_PAIRS_PER_EXPERT": 32, "num_warps": 4,
                            "num_stages": 1},
        "moe_gemm_fp8_decode": {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 1},
        "gemm": {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1},
        "gemm_fp4": {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1},
        "gemm_fp8": {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 1},
        "moe_gemm_fp8": {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 1},
        "gemm_int": {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1},
        # decode linear: splits of 64 columns, ~8 programs, so that test shapes cross tile and split edges
        "gemm_decode": {"BLOCK_M": 16, "N_TILES": (32, 16), "BLOCK_K": 32, "MIN_SPLIT_K": 64, "PROGRAMS": 8,
                        "MAX_ROWS": 128, "REDUCE_BLOCK": 64, "num_warps": 4, "num_stages": 1},
        "attn_paged": {"BLOCK_N": 16, "BLOCK_H": 16, "num_warps": 4, "num_stages": 1},
        "moe_route": {"BLOCK_T": 16, "num_warps": 4},
        "sample": {"BLOCK_V": 256, "BLOCK_R": 64, "BISECT_ITERS": 40, "num_warps": 4},
        "topk_select": {"BLOCK_S": 64, "BLOCK_SORT": 256, "num_warps": 4},
        "indexer_scores": {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1},
        "attn_sparse": {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1},
        "attn_sparse_records": {"BLOCK_N": 16, "CHANNEL_SPLIT": 2, "num_warps": 4, "num_stages": 1},
        # splits of 16 keys (at most 4 to a range) so that the tests' short contexts cross split edges
        "attn_sparse_split": {"BLOCK_H": 16, "BLOCK_N": 16, "SPLIT": 16, "MAX_SPLITS": 4, "num_warps": 4,
                              "num_stages": 1},
        "attn_sparse_split_records": {"BLOCK_H": 16, "BLOCK_N": 16, "SPLIT": 16, "MAX_SPLITS": 4, "num_warps": 4,
                                      "num_stages": 1},
        "attn_paged_split": {"BLOCK_H": 16, "BLOCK_N": 16, "SPLIT": 16, "MAX_SPLITS": 4, "num_warps": 4,
                             "num_stages": 1},
        "attn_combine": {"BLOCK_H": 16, "BLOCK_D": 512, "num_warps": 4, "num_stages": 1},
        "indexer_split": {"BLOCK_N": 16, "MAX_TILES": 4, "PROGRAMS": 8, "num_warps": 4, "num_stages": 1},
        "attn_compress": {"BLOCK_C": 32, "num_warps": 4},
        "mhc_pre": {"BLOCK_K": 64, "num_warps": 4},
        "mhc_post": {"BLOCK_D": 64, "num_warps": 4},
        "mhc_head": {"BLOCK_K": 256, "num_warps": 4},
        "spec_verify": {"BLOCK_V": 256, "num_warps": 4},
        "moe_ep": {"BLOCK_P": 256, "BLOCK_D": 512, "num_warps": 4},
    },
}


def register_target(target: str, table: Mapping[str, Mapping[str, Any]]) -> None:
    """Add or extend a target's table (e.g. the Ascend backend's triton-ascend tiles)."""
    TUNING.setdefault(target, {}).update({k: dict(v) for k, v in table.items()})


def default_target() -> str:
    """The target a wrapper tunes for when none is passed: ``interpreter`` under TRITON_INTERPRET, else
    ``cuda_sm100`` (the cuda_sm100 backend always passes its device's target explicitly)."""
    from inferhal.kernels.runtime import interpreting

    return "interpreter" if interpreting() else "cuda_sm100"


def config(kernel: str, target: str | None = None) -> Mapping[str, Any]:
    """The config of ``kernel`` on ``target``: the target's entry over the default one."""
    target = target or default_target()
    if target not in TUNING:
        raise KeyError(f"unknown kernel target {target!r}; known: {', '.join(sorted(TUNING))}")
    if kernel not in _DEFAULT:
        raise KeyError(f"no tuning entry for kernel {kernel!r}; known: {', '.join(sorted(_DEFAULT))}")
    return MappingProxyType({**_DEFAULT[kernel], **TUNING[target].get(kernel, {})})


def constexprs(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in cfg.items() if k.isupper()}


def launch_options(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in cfg.items() if k in ("num_warps", "num_stages")}
