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

#: op ID -> why its kernel is degraded on a target (shown in the op's note).
DEGRADED: dict[str, dict[str, str]] = {
    "cuda_sm90": {"moe.experts": "fp4 experts: tl.dot_scaled decomposes e2m1 to bf16 wgmma (no native FP4 MMA)",
                  "linear": "fp4 weights: tl.dot_scaled decomposes e2m1 to bf16 wgmma (no native FP4 MMA)"},
}


def provide(level, target: str) -> dict:
    import importlib

    from inferhal.core.ops.table import OpImpl

    out = {}
    for op_id, path in KERNEL_OPS.items():
        mod, fn = path.split(":")
        impl = functools.partial(getattr(importlib.import_module(mod), fn), target=target)
        note = f"triton kernel {path} (tuning: {target})"
        if op_id in DEGRADED.get(target, {}):
            note += f"; degraded: {DEGRADED[target][op_id]}"
        out[op_id] = OpImpl(impl, level, note)
    return out
