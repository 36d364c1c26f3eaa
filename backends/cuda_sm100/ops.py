"""Ops of the cuda_sm100 backend: Triton kernels from inferhal.kernels, wired by op ID.

Each entry names the kernel wrapper (``module:function``, imported lazily, after the plugin has fixed
the interpreter mode). A wrapper takes the op's vocabulary signature plus a keyword ``target`` that
selects its tuning data (:mod:`inferhal.kernels.tuning`); :func:`provide` binds it. Ops without a
kernel fall back to the reference implementation, visibly (``inferhal backends``) and refused under
``backend.strict=true``.
"""

from __future__ import annotations

import functools

#: op ID -> "module:function" of the kernel wrapper.
KERNEL_OPS: dict[str, str] = {
    "norm.rms": "inferhal.kernels.norm:rms_norm",
    "rope.apply": "inferhal.kernels.rope:rope_apply",
    "moe.route": "inferhal.kernels.moe_route:moe_route",
    "moe.experts": "inferhal.kernels.moe_experts:moe_experts",
    "mhc.pre": "inferhal.kernels.mhc:mhc_pre",
    "mhc.post": "inferhal.kernels.mhc:mhc_post",
    "kv.write": "inferhal.kernels.kv_write:kv_write",
    "attn.paged": "inferhal.kernels.attn_paged:attn_paged",
    "topk.select": "inferhal.kernels.topk:topk_select",
    "indexer.scores": "inferhal.kernels.indexer:indexer_scores",
    "attn.sparse_topk": "inferhal.kernels.sparse_attn:attn_sparse_topk",
    "attn.compress": "inferhal.kernels.compress:attn_compress",
    "sample": "inferhal.kernels.sample:sample",
    "sample.mask": "inferhal.kernels.sample_mask:sample_mask",
    "linear": "inferhal.kernels.linear:linear",
    "lm_head": "inferhal.kernels.linear:lm_head",
    "lm_head.argmax": "inferhal.kernels.linear:lm_head_argmax",
    "embed": "inferhal.kernels.embed:embed",
    "act.gated": "inferhal.kernels.act_gated:act_gated",
    "mhc.head": "inferhal.kernels.mhc_head:mhc_head",
    "spec.verify": "inferhal.kernels.spec_verify:spec_verify",
    "moe.dispatch": "inferhal.kernels.moe_ep:moe_dispatch",
    "moe.combine": "inferhal.kernels.moe_ep:moe_combine",
}

#: ``backend.options`` cuda_sm100 reads, with their meaning
OPTIONS = {
    "attn_decode": "split (default): attn.paged and attn.sparse_topk run split-KV kernels, a program per (token, "
                   "16-head group, split of the token's own keys) and a log-sum-exp combine (kernels/attn_split.py), "
                   "indexer.scores a run of tiles per program; single: the earlier program per token (and KV head) "
                   "or per tile, kept to compare on a device",
    "fp8_matmul": "widen (default): moe.experts and linear widen FP8 block-scaled weights to the activation dtype "
                  "in registers (the numerically closest); w8a8: FP8 x FP8 on the FP8 tensor cores, activations "
                  "quantised per token and 128 channels, the 128 x 128 block scales applied per K block "
                  "(kernels/moe_fp8.py; linear where the weight's K blocks are 128 wide and there is no bias)",
    "ep_exchange": "auto (default): moe.dispatch exchanges exactly the routed rows (the split sizes read on the "
                   "host) and switches to padded while a CUDA graph is being captured; exact: always that; padded: "
                   "always a fixed T x K rows per destination rank in one equal-split all-to-all, no host read "
                   "(kernels/moe_ep.py; every rank must dispatch the same T)",
}
#: the ops ``attn_decode`` selects the kernel of
DECODE_OPS = ("attn.paged", "attn.sparse_topk", "indexer.scores")
#: the ops ``fp8_matmul`` selects the FP8 path of
FP8_OPS = ("moe.experts", "linear")


def check_options(options) -> dict:
    """``backend.options`` as cuda_sm100 reads them: an unknown key or value is a UserError naming it."""
    from inferhal.core.errors import UserError
    from inferhal.kernels.tuning import DECODES, EP_EXCHANGES, FP8_PATHS  # data: importing it defines no kernel

    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        known = "; ".join(f"{k}: {v}" for k, v in OPTIONS.items())
        raise UserError(f"backend.options: unknown option(s) {unknown} for the cuda_sm100 backend; known: {known}")
    decode = str(options.get("attn_decode", "split"))
    if decode not in DECODES:
        raise UserError(f"backend.options.attn_decode={decode!r} is not one of {', '.join(DECODES)}")
    fp8 = str(options.get("fp8_matmul", "widen"))
    if fp8 not in FP8_PATHS:
        raise UserError(f"backend.options.fp8_matmul={fp8!r} is not one of {', '.join(FP8_PATHS)}")
    exchange = str(options.get("ep_exchange", "auto"))
    if exchange not in EP_EXCHANGES:
        raise UserError(f"backend.options.ep_exchange={exchange!r} is not one of {', '.join(EP_EXCHANGES)}")
    return {"attn_decode": decode, "fp8_matmul": fp8, "ep_exchange": exchange}


def _bi(why: str, mode_only: bool = False):
    from inferhal.core.ops.invariance import BatchInvariance

    return BatchInvariance(True, why, mode_only=mode_only)


_GEMM = ("one fixed tile per target (kernels/tuning.py), a program per (N-tile, M-tile), the whole K loop in "
         "order: no split-K")
#: op ID -> its batch invariance (capability data; audited against the kernel sources, checked in Triton's
#: interpreter by tests/backends/cuda_sm100/test_batch_invariance.py: a row alone = the same row in batches of
#: other sizes, bitwise). No tile, split or path of these kernels is chosen from the token or batch count.
BATCH_INVARIANCE: dict = {
    "norm.rms": _bi("one program per row, the whole row in one block (no split along D)"),
    "rope.apply": _bi("one program per (token, head), elementwise: no reduction"),
    "linear": _bi("under backend.batch_invariant=true the tiled GEMM at every M: " + _GEMM + ". Otherwise up to 128 "
                  "rows run kernels/linear_decode.py (N tile and K splits from N and K, partials summed in split "
                  "order: a row's result is the same at 1 and at 128 rows; fp8_matmul=w8a8 its FP8 x FP8 kernel "
                  "on the same grid) and more rows the tiled GEMM, whose "
                  "sums differ", mode_only=True),
    "lm_head": _bi(_GEMM),
    "lm_head.argmax": _bi(_GEMM + "; per-row argmax over the N tiles in tile order, first index on ties"),
    "embed": _bi("one program per token: a row copy"),
    "act.gated": _bi("one program per (row, I-tile), elementwise: no reduction"),
    "topk.select": _bi("one program per row; exact selection (integer keys, ties by lower index), so the sort "
                       "and bisection paths, chosen from the row width, select the same entries"),
    "kv.write": _bi("one program per token, its record encoded from its own row into its own slot"),
    "sample": _bi("a fixed BLOCK_R rows per program (1 on the GPU targets), per-row reductions, a Philox "
                  "stream keyed by the row's seed and step; a row with neither seed nor generator draws its "
                  "key from torch's default generator (deterministic=true gives every request a seed)"),
    "sample.mask": _bi("elementwise per (row, vocabulary tile): no reduction"),
    "attn.paged": _bi("split (default): a program per (token, head group, split) over its own key range cut "
                      "at lengths from the token's own key count and constants of the layer, the splits merged in "
                      "split order (empty ones add exact zeros), tokens launched in chunks sized from the "
                      "partials' bytes; single: one program per (token, KV head) over its own keys in fixed "
                      "BLOCK_N blocks aligned to absolute positions; nothing from other sequences"),
    "moe.route": _bi("fixed BLOCK_T rows per program, per-row scoring and top-k (ties by lower id)"),
    "moe.experts": _bi("under backend.batch_invariant=true the tiled kernels at every step size: " + _GEMM +
                       "; a pair's row never mixes with the other rows of its expert tile; the K choices of a token "
                       "added in order k = 0..K-1 (elementwise adds); fp8_matmul=w8a8 quantises each token's "
                       "activations per 128 channels from its own row. Otherwise steps of few pairs an expert "
                       "(kernels/moe_experts.decode_tiles: T x K <= E x 32) run swap-AB decode tiles (16 pairs on "
                       "the N side), a token's result the same at every such size, and larger steps the tiled "
                       "kernels, whose sums differ", mode_only=True),
    "mhc.head": _bi("one program per token, one pass over the flattened streams (no split-K from the token count)"),
    "mhc.pre": _bi("one program per token, one pass over the flattened streams (no split-K from the token "
                   "count: the mHC trap), Sinkhorn in registers"),
    "mhc.post": _bi("one program per (token, D-tile), elementwise mixing: no reduction over tokens"),
    "spec.verify": _bi("one program per request, the same Philox keys as sample"),
    "attn.compress": _bi("one program per compressed entry of its own sequence, fixed BLOCK_C channel tiles"),
    "indexer.scores": _bi("split (default): one program per (token, BLOCK_N-entry tiles of its own sequence "
                          "dealt round-robin), how many a program takes chosen from the launch's work but each "
                          "tile the same dot (no score sums across tiles); single: one program per tile; output "
                          "columns past the row's own entries are -inf up to the block table's reach"),
    "attn.sparse_topk": _bi("split (default): a program per (token, head group, split): the window cut at "
                            "lengths from the token's own key count, its top-k row every SPLIT entries, merged "
                            "in split order (empty splits add exact zeros); single: one program per token over "
                            "its window and its selected entries in fixed BLOCK_N blocks"),
    "moe.dispatch": _bi("integer bookkeeping (counts, prefix sums) and row copies: no arithmetic on values"),
    "moe.combine": _bi("per token, its K choices summed in order k = 0..K-1 in fp32, rounded once"),
}

#: op ID -> why its kernel is degraded on a target (shown in the op's note).
DEGRADED: dict[str, dict[str, str]] = {
    "cuda_sm90": {"moe.experts": "fp4 experts: tl.dot_scaled decomposes e2m1 to bf16 wgmma (no native FP4 MMA)",
                  "linear": "fp4 weights: tl.dot_scaled decomposes e2m1 to bf16 wgmma (no native FP4 MMA)"},
}


def provide(level, target: str, options=None, batch_invariant: bool = False) -> dict:
    """op ID -> OpImpl of each kernel, bound to ``target``'s tuning and the options; ``batch_invariant``
    (``backend.batch_invariant=true``): linear and moe.experts run their tiled kernels at every M (``path="tiled"``)."""
    import importlib

    from inferhal.core.ops.table import OpImpl

    opts = check_options(options or {})
    out = {}
    for op_id, path in KERNEL_OPS.items():
        mod, fn = path.split(":")
        kw = {"decode": opts["attn_decode"]} if op_id in DECODE_OPS else {}
        if op_id in FP8_OPS:
            kw["fp8"] = opts["fp8_matmul"]
        if op_id in ("linear", "moe.experts") and batch_invariant:
            kw["path"] = "tiled"
        if op_id == "moe.dispatch":
            kw["exchange"] = opts["ep_exchange"]
        impl = functools.partial(getattr(importlib.import_module(mod), fn), target=target, **kw)
        note = f"triton kernel {path} (tuning: {target}" + "".join(f"; {k}: {v}" for k, v in kw.items()) + ")"
        if op_id in DEGRADED.get(target, {}):
            note += f"; degraded: {DEGRADED[target][op_id]}"
        out[op_id] = OpImpl(impl, level, note)
    return out


def variants(target: str) -> dict:
    """The ``op_variants`` extra: each op the options switch, under every value of its option (``attn_decode``
    for the decode attention and indexer, ``fp8_matmul`` for the FP8 products, linear's and moe.experts' tiled path), for the device run to check
    and time side by side on the same inputs (old and new kernels). op ID -> {"option=value": callable}."""
    import importlib

    from inferhal.kernels.tuning import DECODES, FP8_PATHS

    out: dict = {}
    for op_id, path in KERNEL_OPS.items():
        mod, fn = path.split(":")
        if op_id in DECODE_OPS:
            choices = {f"attn_decode={v}": {"decode": v} for v in DECODES}
        elif op_id in FP8_OPS:
            choices = {f"fp8_matmul={v}": {"fp8": v} for v in FP8_PATHS}
            # the tiled kernels at every size (before the decode kernel or tiles; batch-invariant mode)
            choices["path=tiled"] = {"path": "tiled"}
        else:
            continue
        wrapper = getattr(importlib.import_module(mod), fn)
        out[op_id] = {name: functools.partial(wrapper, target=target, **kw) for name, kw in choices.items()}
    return out
