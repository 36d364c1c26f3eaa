"""Ops of the ascend950 backend: op IDs mapped to torch_npu fused operators.

Every wrapper converts the op signature of :mod:`inferhal.core.ops.vocabulary` (semantics: the
reference implementations in ``backends/reference``) into one documented torch_npu call sequence, and
falls back to the reference, *visibly* (a ``fallback`` entry in :attr:`NpuOps.events`, a log line),
for the cases the operator does not cover. The torch_npu module is injected (:class:`NpuOps` takes it),
so the contract tests drive the wrappers with a fake; nothing here imports torch_npu.

=================  =============================================  ==================================================
op ID              torch_npu operator(s)                           argument contract relied on (torch-npu 2.13.0 docs)
=================  =============================================  ==================================================
norm.rms           npu_rms_norm / npu_add_rms_norm                 gamma has x's dtype and shape [D]; returns (y, rstd)
                                                                   / (y, rstd, x1+x2); eps as ``epsilon``
rope.apply         npu_rotary_mul                                  4-D input [1,T,H,R], r1=cos, r2=sin [1,T,1,R] full
                                                                   width in x's dtype; 'half' = rotate halves (neox),
                                                                   'interleave' = even/odd pairs
attn.paged         npu_fused_infer_attention_score (no sinks)      page attention: key/value (blocknum, blocksize, H)
                   npu_fused_infer_attention_score_v2 (sinks)      contiguous, block_table int32 [B, M],
                                                                   actual_seq_lengths_kv required, block_size 16-
                                                                   aligned (128-multiple when Q_S > 1), BSND query,
                                                                   sparse_mode 3 (rightDownCausal) / 4 (band) with
                                                                   the 2048x2048 mask; v2 adds learnable_sink (Q_N,)
                                                                   bf16; decode windows via a (B, KV_S) bool mask
kv.write           npu_scatter_pa_kv_cache (K,V planes)            key/value [T,Hk,D], caches [NB,BS,Hk,D] contiguous,
                   npu_scatter_nd_update_ (other slots)            cache_mode='Norm' (ND), slot_mapping int32 in
                                                                   [0, NB*BS) unique; nd_update: self [NB*BS, F],
                                                                   indices [n,1] int64, updates [n, F]
(FP8 records)      kv_compress_epilog (_C_ascend, 950)             bf16 [T, 512] -> 640-byte rows (kv_quant.py):
                                                                   group 64, quant_mode 2, round scale, layout 1
moe.route          npu_moe_gating_top_k                            x [T,E] E <= 2048, norm_type 0 softmax / 1 sigmoid,
                                                                   x and bias [E] in fp32 (y_out takes x's dtype),
                                                                   returns (y_out x.dtype, expert_idx int32, norm_out)
                                                                   with y_out = norm[idx] / (sum + eps) * scaling
moe.experts        npu_moe_init_routing_v2 → npu_grouped_matmul    init: expert_idx int32 [T,K], expert_tokens_num_type
                   → npu_swiglu | npu_clipped_swiglu →             1 (counts), flag True, quant_mode -1, row_idx_type 0
                   npu_grouped_matmul → npu_moe_finalize_routing   (src→dst index, as finalize consumes); gmm:
                                                                   split_item 2/3, group_type 0 (m-axis), group_list
                                                                   counts (group_list_type 1), weight [E, K, N];
                                                                   clipped_swiglu alpha 1, bias 0, interleaved False;
                                                                   finalize scales [T,K], k=K
(MX weights)       npu_dynamic_mx_quant → npu_grouped_matmul       W8A8MXFP (950): e4m3 activations with e8m0 [M,
                   (MXFP8) → swiglu → again → finalize             K/64, 2], weight e4m3 [E, K, N] with e8m0 [E,
                                                                   K/64, N, 2] (mx.py), output_dtype 15 | 5 (the
                                                                   ScalarType values of bf16 | fp16, SCALAR_TYPE),
                                                                   scale_dtype = per_token_scale_dtype = 293 (e8m0)
(W8A8, extra)      npu_dynamic_quant, npu_grouped_matmul_swiglu_   see :meth:`NpuOps.experts_w8a8`; int8 weights in the
                   quant                                           FRACTAL_NZ layout vllm-ascend's w8a8 checkpoints use
=================  =============================================  ==================================================

DeepSeek-V4's own ops (indexer.scores, attn.sparse_topk, mhc.*, sqrtsoftplus / hash moe.route) are in
:mod:`.v4`, MC2 moe.dispatch / moe.combine in :mod:`.ep`, the dense and sampling ops (linear, lm_head,
embed, act.gated, topk.select, sample, spec.verify) in :mod:`.dense`. Every operator's signature and its
source are in :mod:`.contract`. attn.compress and sample.mask run the shared Triton kernels through
triton-ascend (:data:`TRITON_OPS`): vllm-ascend's ``compressor`` operator fuses the kv/gate projections and
the state write, which the vocabulary's attn.compress receives already done, and torch_npu has no bitmask op.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from inferhal.backends.ascend950 import preconditions  # noqa: F401  (registers the call checks)
from inferhal.backends.ascend950.dense import NPU_FLOAT8_E8M0, SCALAR_TYPE, DenseOps
from inferhal.backends.ascend950.ep import EpOps
from inferhal.backends.ascend950.v4 import V4Ops
from inferhal.backends.ascend950.preconditions import HALF
from inferhal.backends.reference import ops as ref
from inferhal.backends.reference import attention as ref_attn
from inferhal.backends.reference import moe as ref_moe
from inferhal.backends.reference import kv_records
from inferhal.backends.ascend950 import kv_quant, mx
from inferhal.core.ops.params import AttnBatch, AttnParams, ExpertsParams, KVWriteParams, RmsNormParams, RopeParams, RouteParams
from inferhal.core.ops.quant import QuantWeight
from inferhal.core.ops.table import FallbackLog, OpImpl

log = logging.getLogger("inferhal.ascend950")

#: op ID → the torch_npu operators its wrapper calls (the `inferhal backends` / qualification rows)
NPU_OPS: dict[str, tuple[str, ...]] = {
    "norm.rms": ("npu_rms_norm", "npu_add_rms_norm"),
    "rope.apply": ("npu_rotary_mul",),
    "linear": ("aten_linear", "npu_dynamic_mx_quant", "npu_quant_matmul"),
    "lm_head": ("aten_linear",),
    "lm_head.argmax": ("aten_linear", "aten_argmax"),
    "attn.paged": ("npu_fused_infer_attention_score", "npu_fused_infer_attention_score_v2"),
    "attn.sparse_topk": ("npu_sparse_attn_sharedkv_metadata", "npu_sparse_attn_sharedkv",
                         "npu_kv_quant_sparse_attn_sharedkv_metadata", "npu_kv_quant_sparse_attn_sharedkv"),
    "indexer.scores": ("npu_lightning_indexer",),
    "topk.select": ("aten_sort_stable",),
    "kv.write": ("npu_scatter_pa_kv_cache", "npu_scatter_nd_update_", "kv_compress_epilog"),
    "moe.route": ("npu_moe_gating_top_k", "moe_gating_top_k_hash"),
    "moe.experts": ("npu_moe_init_routing_v2", "npu_grouped_matmul", "npu_swiglu", "npu_clipped_swiglu",
                    "npu_moe_finalize_routing", "npu_dynamic_mx_quant"),
    "moe.dispatch": ("npu_moe_distribute_dispatch",),
    "moe.combine": ("npu_moe_distribute_combine",),
    "mhc.pre": ("npu_hc_pre_v2",),
    "mhc.head": ("npu_hc_pre_v2",),
    "mhc.post": ("npu_hc_post",),
    "sample": ("aten_argmax", "aten_multinomial"),
    "spec.verify": ("aten_argmax",),
    "act.gated": ("npu_swiglu", "npu_gelu"),
    "embed": ("aten_embedding",),
}

#: op ID → the shared Triton kernel that triton-ascend builds for it, for what torch_npu and vllm-ascend lack
#: (kernels/tuning_ascend950.py holds their Ascend tiles and Unified Buffer budget). Verified against the
#: reference in Triton's CPU interpreter with the Ascend tuning (tests/backends/ascend950/test_triton_ascend.py);
#: never compiled for Ascend here (triton-ascend's final step needs CANN's bishengir-compile)
TRITON_OPS: dict[str, str] = {
    "attn.compress": "inferhal.kernels.compress:attn_compress",  # vllm-ascend's compressor op fuses projections
    "sample.mask": "inferhal.kernels.sample_mask:sample_mask",
}
TRITON_TARGET = "ascend950"

#: every feature a wrapper asks about (a profile without one makes that wrapper fall back)
ALL_FEATURES = frozenset({"sparse_attn_sharedkv", "kv_quant_sparse_attn_sharedkv", "mxfp8"})

CAUSAL_MASK_SIZE = 2048  # sparse_mode 2/3/4 take an optimised (2048, 2048) mask



class NpuOps(V4Ops, DenseOps, EpOps):
    """The wrappers, bound to one operator namespace (:class:`~.operators.AscendOperators` on a host, a fake
    in the tests). ``features`` are the device profile's (generation differences as data; None = all).
    ``events`` lists the fallbacks taken (the newest :attr:`FallbackLog.keep <inferhal.core.ops.table.FallbackLog>`;
    a warning is logged the first time each reason is met)."""

    def __init__(self, npu: Any, features: Any = None, group_name: Callable[[Any], str | None] | None = None,
                 strict: bool = False) -> None:
        self.npu = npu
        self.features = ALL_FEATURES if features is None else frozenset(features)
        self.strict = strict
        if group_name is not None:
            self.group_name = group_name
        self.events = FallbackLog()  # the newest fallbacks, bounded; every wrapper's fallback_log
        self._mx_cache: dict[int, tuple[Any, Any]] = {}
        self._masks: dict[tuple[str, str], torch.Tensor] = {}

    def table(self) -> dict[str, Callable[..., Any]]:
        names = {"norm.rms": "norm_rms", "rope.apply": "rope_apply", "attn.paged": "attn_paged",
                 "kv.write": "kv_write", "moe.route": "moe_route", "moe.experts": "moe_experts",
                 "lm_head.argmax": "lm_head_argmax"}
        return {op: getattr(self, names.get(op, op.replace(".", "_"))) for op in NPU_OPS}

    def _has(self, op: str) -> bool:
        """Whether this host can call ``op`` (vllm-ascend's custom ops may be absent)."""
        try:
            getattr(self.npu, op)
        except AttributeError:
            return False
        return True

    def _fallback(self, op_id: str, reason: str) -> None:
        """Record a per-call fallback; under ``backend.strict=true`` refuse it instead, so that no result the
        reference computed can be reported under this backend's level."""
        if self.strict:
            from inferhal.core.ops.table import StrictFallbackError

            raise StrictFallbackError(f"ascend950 {op_id}: this call needs the reference ({reason}), and "
                                      f"backend.strict=true forbids it")
        self.events.append((op_id, reason))
        if self.events.counts[(op_id, reason)] == 1:  # once per reason: a server may take it every step
            log.warning("ascend950: %s falls back to the reference for calls like this one: %s", op_id, reason)

    # ------------------------------------------------------------------------------------ norm.rms

    def norm_rms(self, x: torch.Tensor, weight: torch.Tensor | None, p: RmsNormParams,
                 residual: torch.Tensor | None = None):
        # x: [T, D]; gamma must have x's dtype (npu_rms_norm doc)
        if x.dtype not in HALF + (torch.float32,):
            self._fallback("norm.rms", f"dtype {x.dtype} not in fp16/bf16/fp32")
            return ref.norm_rms(x, weight, p, residual)
        d = x.shape[-1]
        if weight is None:
            gamma = torch.ones(d, dtype=x.dtype, device=x.device)
        else:
            gamma = ((1.0 + weight.float()) if p.unit_offset else weight.float()).to(x.dtype)
        if residual is None:
            y, _rstd = self.npu.npu_rms_norm(x, gamma, epsilon=p.eps)
            return y
        y, _rstd, h = self.npu.npu_add_rms_norm(x, residual.to(x.dtype), gamma, epsilon=p.eps)
        return y, h

    # ------------------------------------------------------------------------------------ rope.apply

    def rope_apply(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, p: RopeParams) -> torch.Tensor:
        # x: [T, H, D]; cos_sin: [P, R] = [cos(R/2) | sin(R/2)]
        r = p.rotary_dim
        cs = cos_sin[positions.long()].float()  # [T, R]
        cos, sin = cs[:, : r // 2], cs[:, r // 2:]
        if p.inverse:
            sin = -sin
        if p.style == "neox":  # npu 'half': x*cos + rotate_half(x)*sin with full-width cos/sin
            cos_f, sin_f, mode = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1), "half"
        else:  # 'interleave': pairs (2i, 2i+1) share angle i
            cos_f, sin_f, mode = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1), "interleave"
        rot = (x[..., :r] if p.placement == "head" else x[..., -r:]).contiguous()
        t, h = x.shape[0], x.shape[1]
        out = self.npu.npu_rotary_mul(rot.view(1, t, h, r),
                                      cos_f.to(x.dtype).view(1, t, 1, r).contiguous(),
                                      sin_f.to(x.dtype).view(1, t, 1, r).contiguous(), rotary_mode=mode)
        out = out.view(t, h, r)
        if p.placement == "head":
            return torch.cat((out, x[..., r:]), dim=-1)
        return torch.cat((x[..., :-r], out), dim=-1)

    # ------------------------------------------------------------------------------------ attn.paged

    def _mask(self, kind: str, device: torch.device) -> torch.Tensor:
        key = (kind, str(device))
        if key not in self._masks:  # True = masked out (strictly upper triangle)
            n = CAUSAL_MASK_SIZE
            self._masks[key] = torch.triu(torch.ones(n, n, dtype=torch.bool, device=device), diagonal=1)
        return self._masks[key]

    def attn_paged(self, q: torch.Tensor, kv_cache: torch.Tensor, batch: AttnBatch, p: AttnParams,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
        # q: [T, H, D]; kv_cache: [NB, BS, 2, Hk, D] (K/V planes) or [NB, BS, Hk, D] (p.shared_kv)
        why = self._attn_unsupported(q, kv_cache, batch, p)
        if why:
            self._fallback("attn.paged", why)
            return ref_attn.attn_paged(q, kv_cache, batch, p, sinks)
        nb, bs = kv_cache.shape[:2]
        if p.shared_kv:
            hk, d = kv_cache.shape[2], kv_cache.shape[3]
            key = value = kv_cache.view(nb, bs, hk * d)
        else:
            hk, d = kv_cache.shape[3], kv_cache.shape[4]
            key, value = kv_cache[:, :, 0].view(nb, bs, hk * d), kv_cache[:, :, 1].view(nb, bs, hk * d)
        h = q.shape[1]
        qsl = batch.query_start_loc.tolist()
        lens = [int(v) for v in batch.seq_lens.tolist()]
        nq = [qsl[b + 1] - qsl[b] for b in range(batch.num_seqs)]
        table = batch.block_table.to(torch.int32).contiguous()
        common = dict(num_heads=h, num_key_value_heads=hk, scale=float(p.scale), block_size=int(bs), block_table=table)
        if all(n == 1 for n in nq):  # decode: one call, BSND with S = 1
            mask = None
            if p.window > 0:  # sparse_mode is ignored for Q_S = 1: a (B, KV_S) bool mask (True = masked)
                kv_s = table.shape[1] * bs
                kpos = torch.arange(kv_s, device=q.device)
                qpos = torch.tensor(lens, device=q.device) - 1
                mask = (kpos[None, :] <= (qpos[:, None] - p.window)).contiguous()
            out = self._fia(q.view(len(lens), 1, h, d).contiguous(), key, value, sinks, atten_mask=mask,
                            actual_seq_lengths_kv=lens, input_layout="BSND", **common)
            return out.view(len(lens), h, d)
        if bs % 128:
            self._fallback("attn.paged", f"prefill page attention needs block_size % 128 == 0, got {bs}")
            return ref_attn.attn_paged(q, kv_cache, batch, p, sinks)
        outs = []
        for b in range(batch.num_seqs):  # prefill / mixed: one call per sequence, causal to the right-down corner
            s, e = qsl[b], qsl[b + 1]
            if e == s:
                continue
            band = dict(sparse_mode=4, pre_tokens=p.window - 1, next_tokens=0) if p.window > 0 else dict(sparse_mode=3)
            o = self._fia(q[s:e].view(1, e - s, h, d).contiguous(), key, value, sinks,
                          atten_mask=self._mask("causal", q.device), actual_seq_lengths=[e - s],
                          actual_seq_lengths_kv=[lens[b]], input_layout="BSND",
                          **{**common, "block_table": table[b:b + 1].contiguous()}, **band)
            outs.append(o.view(e - s, h, d))
        if not outs:
            return q.new_zeros(0, h, d)
        return torch.cat(outs, dim=0)

    def _fia(self, q, key, value, sinks, **kw):
        if sinks is None:
            out, _lse = self.npu.npu_fused_infer_attention_score(q, key, value, **kw)
            return out
        # v2 renames: actual_seq_lengths → actual_seq_qlen, _kv → actual_seq_kvlen, num_heads → num_query_heads,
        # scale → softmax_scale; learnable_sink is bf16 (Q_N,)
        ren = {"actual_seq_lengths": "actual_seq_qlen", "actual_seq_lengths_kv": "actual_seq_kvlen",
               "num_heads": "num_query_heads", "scale": "softmax_scale"}
        kw2 = {ren.get(k, k): v for k, v in kw.items()}
        out, _lse = self.npu.npu_fused_infer_attention_score_v2(
            q, key, value, learnable_sink=sinks.to(torch.bfloat16).contiguous(), **kw2)
        return out

    @staticmethod
    def _attn_unsupported(q, kv_cache, batch, p) -> str:
        if q.dtype not in HALF:
            return f"query dtype {q.dtype}: page attention takes fp16/bf16"
        if kv_cache.dtype != q.dtype:
            return f"KV dtype {kv_cache.dtype} differs from query dtype {q.dtype} (quantised KV is not wired)"
        if p.softcap > 0:
            return "softcap has no npu_fused_infer_attention_score argument"
        nb, bs = kv_cache.shape[:2]
        if bs % 16 or bs > 512:
            return f"page attention needs block_size 16-aligned and <= 512, got {bs}"
        if p.shared_kv:
            if kv_cache.dim() != 4 or not kv_cache.is_contiguous():
                return "shared latent cache must be a contiguous [NB, BS, Hk, D] tensor"
            hk, d = kv_cache.shape[2:]
        else:
            if kv_cache.dim() != 5 or kv_cache.shape[2] != 2:
                return "K/V cache must be [NB, BS, 2, Hk, D]"
            if not (kv_cache[:, :, 0].is_contiguous() and kv_cache[:, :, 1].is_contiguous()):
                return "K and V planes are not contiguous (allocate through the ascend950 kv_storage)"
            hk, d = kv_cache.shape[3:]
        if q.shape[-1] != d:
            return f"query head dim {q.shape[-1]} differs from the KV head dim {d}"
        if d % 16:
            return f"head dim {d} is not 16-aligned"
        if q.shape[1] % hk or q.shape[1] // hk > 64:
            return f"{q.shape[1]} query heads over {hk} KV heads: needs H % Hk == 0 and H / Hk <= 64"
        if hk * d >= 65535:
            return f"(blocknum, blocksize, H) layout needs Hk*D < 65535, got {hk * d}"
        return ""

    # ------------------------------------------------------------------------------------ kv.write

    def kv_write(self, values: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                 p: KVWriteParams = KVWriteParams(), scale_cache: torch.Tensor | None = None) -> None:
        # values: [T, *slot]; cache: [NB, BS, *slot]; slot_mapping: [T], -1 = skip
        if p.record is not None:
            return self._kv_write_records(values, cache, slot_mapping, p)
        if p.quant != "none":
            self._fallback("kv.write", f"quant={p.quant!r}: the per-entry fp32-scale FP8 scatter is not wired")
            return ref.kv_write(values, cache, slot_mapping, p, scale_cache)
        keep = slot_mapping >= 0
        slots, v = slot_mapping[keep], values[keep].to(cache.dtype)
        if slots.numel() == 0:
            return None
        nb, bs = cache.shape[:2]
        kv_planes = cache.dim() == 5 and cache.shape[2] == 2
        if kv_planes and cache[:, :, 0].is_contiguous() and cache[:, :, 1].is_contiguous():
            self.npu.npu_scatter_pa_kv_cache(v[:, 0].contiguous(), v[:, 1].contiguous(), cache[:, :, 0],
                                             cache[:, :, 1], slots.to(torch.int32), cache_mode="Norm")
            return None
        if not cache.is_contiguous():
            self._fallback("kv.write", "cache is neither K/V planes nor contiguous")
            return ref.kv_write(values, cache, slot_mapping, p, scale_cache)
        flat = cache.view(nb * bs, -1)
        self.npu.npu_scatter_nd_update_(flat, slots.long().view(-1, 1), v.reshape(v.shape[0], -1).contiguous())
        return None

    def _kv_write_records(self, values, cache, slot_mapping, p: KVWriteParams) -> None:
        """kv.write of FP8 records: kv_compress_epilog quantises and scatters into the 950's 640-byte rows
        (kv_quant.py); outside its limits the reference encodes, in the rows' byte order when the cache has them."""
        fmt = p.record
        why = ""
        if "kv_quant_sparse_attn_sharedkv" not in self.features:
            why = f"{fmt.name} records: this generation has no quantising KV scatter (950 only)"
        elif not self._has("kv_compress_epilog"):
            why = "vllm-ascend's custom-op library (kv_compress_epilog) is not loadable"
        elif not kv_quant.is_operator_record(fmt):
            why = (f"{fmt.name} records of {fmt.dims} dims ({fmt.raw_dims} RoPE): kv_compress_epilog writes 448 e4m3 "
                   f"+ 64 bf16 RoPE channels with e8m0 scales per 64")
        elif not kv_quant.arranged(cache) or cache.shape[2] != fmt.nbytes:
            why = "the cache is not in the operator's 640-byte rows (allocate through the ascend950 kv_storage)"
        elif values.dtype != torch.bfloat16:
            why = f"values {values.dtype}: kv_compress_epilog takes bf16"
        if why:
            self._fallback("kv.write", why)
            if not kv_quant.arranged(cache) or cache.shape[2] != fmt.nbytes:
                return ref.kv_write(values, cache, slot_mapping, p)
            keep = slot_mapping >= 0  # the reference's bytes, laid out as the operator's rows
            slots = slot_mapping[keep].long()
            full = kv_quant.operator_pages(cache)
            recs = kv_records.encode(values[keep].reshape(int(keep.sum()), -1), fmt)
            full[slots // full.shape[1], slots % full.shape[1]] = kv_quant.from_core(recs, fmt)
            return None
        if values.shape[0] == 0:
            return None
        full = kv_quant.operator_pages(cache)
        rows = full.view(torch.float8_e4m3fn).view(-1, 1, kv_quant.ROW)  # as vllm-ascend's cache.view(-1, 1, D)
        self.npu.kv_compress_epilog(rows, values.reshape(values.shape[0], -1).contiguous(),
                                    slot_mapping.to(torch.int32).contiguous(), 64, 2, True, 1)
        return None

    # ------------------------------------------------------------------------------------ moe.route

    def moe_route(self, logits: torch.Tensor, p: RouteParams, bias: torch.Tensor | None = None,
                  hash_ids: torch.Tensor | None = None):
        # logits: [T, E] -> weights [T, K] fp32, ids [T, K] int64
        if p.scoring == "sqrtsoftplus" or hash_ids is not None:  # V4: the hash-capable gating op (norm_type 2)
            return self._route_hash(logits, p, bias, hash_ids)
        norm_type = {"softmax": 0, "sigmoid": 1}.get(p.scoring)
        why = ""
        if norm_type is None:
            why = f"scoring {p.scoring!r}: npu_moe_gating_top_k has softmax (0) and sigmoid (1) only"
        elif not p.renormalize:
            why = "renormalize=False: npu_moe_gating_top_k always renormalises the chosen weights"
        elif logits.shape[-1] > 2048 or logits.shape[-1] <= 2:
            why = f"{logits.shape[-1]} experts: the op takes 2 < E <= 2048"
        elif logits.dtype not in HALF + (torch.float32,):
            why = f"dtype {logits.dtype}"
        if why:
            self._fallback("moe.route", why)
            return ref_moe.moe_route(logits, p, bias, hash_ids)
        x = logits.float().contiguous()  # y_out comes back in x's dtype: fp32 weights, as the vocabulary's
        y, idx, _norm = self.npu.npu_moe_gating_top_k(
            x, p.top_k, bias=None if bias is None else bias.float(), k_group=1, group_count=1,
            group_select_mode=0, renorm=0, norm_type=norm_type, out_flag=False,
            routed_scaling_factor=float(p.routed_scaling), eps=1e-20)
        return y.float(), idx.long()

    # ------------------------------------------------------------------------------------ moe.experts

    def moe_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up, w_down,
                    p: ExpertsParams) -> torch.Tensor:
        # x: [T, D]; w_gate_up: [E, 2I, D]; w_down: [E, D, I]
        quant = isinstance(w_gate_up, QuantWeight) or isinstance(w_down, QuantWeight)
        why = ""
        if x.dtype not in HALF:
            why = f"dtype {x.dtype}: grouped matmul is wired for fp16/bf16"
        elif quant:
            mx13, mx2 = self._mx(w_gate_up), self._mx(w_down)
            why = next((f"{name}: {m}" for name, m in (("gate/up", mx13), ("down", mx2)) if isinstance(m, str)), "")
            if not why and "mxfp8" not in self.features:
                why = "MX experts: this generation has no MXFP8 grouped matmul (950 only)"
            elif not why and not self._has("npu_dynamic_mx_quant"):
                why = "npu_dynamic_mx_quant is not available in this torch_npu"
        if why:
            self._fallback("moe.experts", why)
            return ref_moe.moe_experts(x, weights, ids, w_gate_up, w_down, p)
        t, k = ids.shape
        e = w_gate_up.shape[0]
        valid = (ids >= 0) & (ids < e)  # EP-remote experts: route to expert 0 with weight 0 (exact skip)
        ids32 = torch.where(valid, ids, torch.zeros_like(ids)).to(torch.int32).contiguous()
        scales = torch.where(valid, weights.float(), torch.zeros_like(weights, dtype=torch.float32))
        expanded_x, src_to_dst, counts, _ = self.npu.npu_moe_init_routing_v2(
            x, ids32, active_num=t * k, expert_num=e, drop_pad_mode=0, expert_tokens_num_type=1,
            expert_tokens_num_flag=True, quant_mode=-1, active_expert_range=[0, e], row_idx_type=0)
        gmm = dict(group_list=counts, split_item=2, group_type=0, group_list_type=1)
        if quant:  # W8A8MXFP: activations MX-quantised per 32 along K, weights MXFP8 [E, K, N]
            gu = self._gmm_mx(expanded_x, mx13, gmm)
        else:
            gu = self.npu.npu_grouped_matmul([expanded_x], [w_gate_up.to(x.dtype).transpose(1, 2)], **gmm)[0]
        if p.swiglu_limit > 0:
            act = self.npu.npu_clipped_swiglu(gu, dim=-1, alpha=1.0, limit=float(p.swiglu_limit), bias=0.0,
                                              interleaved=False)
        else:
            act = self.npu.npu_swiglu(gu, dim=-1)
        if quant:
            y = self._gmm_mx(act, mx2, gmm)
        else:
            y = self.npu.npu_grouped_matmul([act], [w_down.to(x.dtype).transpose(1, 2)], **gmm)[0]
        return self.npu.npu_moe_finalize_routing(y, None, None, None, scales.to(x.dtype), src_to_dst, ids32,
                                                 drop_pad_mode=0, k=k)

    def _mx(self, w):
        """A QuantWeight's MXFP8 form (converted once per weight object), or why it has none."""
        if not isinstance(w, QuantWeight):
            return "a bf16 weight beside a quantised one (the MX path takes both quantised)"
        hit = self._mx_cache.get(id(w))
        if hit is None or hit[0] is not w:
            hit = self._mx_cache[id(w)] = (w, mx.mx_weight(w))
        return hit[1]

    def _gmm_mx(self, h: torch.Tensor, w_mx, gmm: dict) -> torch.Tensor:
        # h: [M, K] fp16/bf16 -> npu_dynamic_mx_quant -> e4m3 [M, K] + e8m0 [M, K/64, 2] -> [M, N] in h's dtype
        hq, hs = self.npu.npu_dynamic_mx_quant(h.contiguous(), dst_type=torch.float8_e4m3fn)
        if hs.dim() == 2:  # the [M, K/64, 2] pairs, as vllm-ascend's maybe_normalize_mxfp_scale_layout
            hs = hs.reshape(hs.shape[0], -1, 2)
        data, scale = w_mx
        # the scales' dtype stated as vllm-ascend's moe_mlp.py states it for MX (scale_dtype / per_token_scale_dtype
        # torch_npu.float8_e8m0fnu); with them given, the tensors' own 8-bit dtype does not matter
        return self.npu.npu_grouped_matmul([hq], [data], scale=[scale], per_token_scale=[hs],
                                           output_dtype=SCALAR_TYPE[h.dtype], scale_dtype=NPU_FLOAT8_E8M0,
                                           per_token_scale_dtype=NPU_FLOAT8_E8M0, **gmm)[0]

    def experts_w8a8(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13_nz: torch.Tensor,
                     w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor) -> torch.Tensor:
        """W8A8 experts as vllm-ascend's int8 checkpoints run them (not reachable from the op table:
        :class:`QuantWeight` has no int8 format). ``w13_nz``: int8 gate/up weights in FRACTAL_NZ (5-D),
        ``w13_scale`` [E, 2I]; ``w2`` int8 [E, I, D], ``w2_scale`` [E, D]. Per-token dynamic int8
        activations (``npu_dynamic_quant``), fused grouped matmul + SwiGLU + requantisation, then an
        int8 grouped matmul dequantised to x's dtype (``output_dtype``)."""
        t, k = ids.shape
        e = w13_nz.shape[0]
        ids32 = ids.to(torch.int32).contiguous()
        expanded_x, src_to_dst, counts, _ = self.npu.npu_moe_init_routing_v2(
            x, ids32, active_num=t * k, expert_num=e, drop_pad_mode=0, expert_tokens_num_type=1,
            expert_tokens_num_flag=True, quant_mode=-1, active_expert_range=[0, e], row_idx_type=0)
        xq, xs = self.npu.npu_dynamic_quant(expanded_x)
        hq, hs, _ = self.npu.npu_grouped_matmul_swiglu_quant(xq, w13_nz, counts, w13_scale, xs)
        y = self.npu.npu_grouped_matmul([hq], [w2], scale=[w2_scale], per_token_scale=[hs], group_list=counts,
                                        split_item=2, group_type=0, group_list_type=1,
                                        output_dtype=SCALAR_TYPE[x.dtype])[0]
        return self.npu.npu_moe_finalize_routing(y, None, None, None, weights.to(x.dtype), src_to_dst, ids32,
                                                 drop_pad_mode=0, k=k)


@dataclass(frozen=True)
class WiredOp(OpImpl):
    """A wrapper in the op table with its per-call fallback log (the :attr:`NpuOps.events` it shares with every
    wrapper of its table): ``inferhal qualify`` reads it and reports a case whose call fell back at level
    ``fallback``, not at the operator's level."""

    fallback_log: list = field(default_factory=FallbackLog, compare=False, repr=False)


def declared() -> dict[str, str]:
    """op ID → execution level, without touching a device: every native op is wired, never run here."""
    return {op: "wired-unrun" for op in (*NPU_OPS, *TRITON_OPS)}


def batch_invariance() -> dict:
    """op ID -> its batch invariance. The torch_npu / vllm-ascend operators state no batch invariance (CANN
    picks their tiling and core split from the shapes it is given; vllm-ascend lists batch invariance on A5 as
    future work) and none was verified here, so none is claimed; the shared Triton kernels keep their fixed
    Ascend tiles (kernels/tuning_ascend950.py) and per-row programs."""
    from inferhal.core.ops.invariance import BatchInvariance

    npu = BatchInvariance(False, "a torch_npu operator (see NPU_OPS): no batch invariance stated by CANN, none "
                                 "verified")
    out = {op: npu for op in NPU_OPS}
    out["attn.compress"] = BatchInvariance(True, "shared Triton kernel: one program per compressed entry, fixed "
                                                 "Ascend channel tile")
    out["sample.mask"] = BatchInvariance(True, "shared Triton kernel: elementwise per (row, vocabulary tile)")
    return out


def triton_op(path: str) -> Callable[..., Any]:
    """The kernel wrapper at ``module:function`` with the Ascend tuning, imported at its first call (importing
    a kernel module imports triton, which on an Ascend host must be triton-ascend)."""
    import importlib

    mod, name = path.split(":")

    def run(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(mod), name)(*args, target=TRITON_TARGET, **kwargs)

    return run


def provide(npu: Any, features: Any = None, level: Any = None, strict: bool = False,
            triton: bool = True) -> dict[str, Any]:
    """The op table for ``inferhal_provide_ops``, each op tagged with ``level`` and its operators.

    ``level`` defaults to ``wired-unrun`` (a fake or recorder stands in for the device); the plugin passes
    ``device`` only when the operators are torch_npu's on a probed NPU, where every call runs there. A call
    a wrapper cannot map still falls back per call (``NpuOps.events``, every wrapper's ``fallback_log``, so that
    qualify reports such a case at level ``fallback``), or fails under ``strict``. ``triton``
    adds the :data:`TRITON_OPS` kernels (they need triton-ascend and npu tensors, or Triton's interpreter)."""
    from inferhal.core.profile import ExecLevel

    ops = NpuOps(npu, features, strict=strict)
    lvl = ExecLevel.WIRED_UNRUN if level is None else ExecLevel(level)
    table = {op: WiredOp(fn, lvl, " / ".join(NPU_OPS[op]), fallback_log=ops.events) for op, fn in ops.table().items()}
    if triton:
        table.update({op: OpImpl(triton_op(path), lvl, f"triton-ascend: {path} (tuning: {TRITON_TARGET})")
                      for op, path in TRITON_OPS.items()})
    return table
