"""DeepSeek-V4 wrappers of the ascend950 backend: lightning indexer, sparse attention over shared KV, mHC,
and sqrtsoftplus / hash routing (a mixin of :class:`~inferhal.backends.ascend950.ops.NpuOps`).

=================  ==============================================  =================================================
op ID              operator(s)                                     argument contract relied on (contract.CITATIONS)
=================  ==============================================  =================================================
indexer.scores     npu_lightning_indexer (torch_npu)               TND query [T, N1, 128] (Di zero-padded to 128, heads
                                                                   zero-padded to 8/16/24/32/64), TND keys [S_all, 1,
                                                                   128] gathered from the pages, prefix-sum lengths,
                                                                   sparse_mode 0, sparse_count = S (<= 2048),
                                                                   return_value=True: every entry's score comes back
                                                                   with its index and is scattered to [T, S]; the
                                                                   causal rule of compressed entries is applied after
(FP8 keys)         npu_lightning_indexer                           fp8_index records (132 B: 128 e4m3 | fp32 scale):
                                                                   the e4m3 codes widened exactly to the query's dtype
                                                                   are the keys; each returned score is multiplied by
                                                                   its key's scale (relu commutes with a scale > 0)
attn.sparse_topk   npu_sparse_attn_sharedkv_metadata →             A2/A3 only (feature ``sparse_attn_sharedkv``); TND
                   npu_sparse_attn_sharedkv (_C_ascend)            query padded to 64 heads, PA_ND caches [NB, BS, 1,
                                                                   D], window 128 (ori_win_left 127, band mask 4),
                                                                   compressed entries by cmp_sparse_indices [T, 1, 512]
                                                                   (valid first, -1 after), or none at all when the
                                                                   caller lists every closed entry (HCA: scenario 2,
                                                                   any count), cmp_ratio 4 or 128, fp32
                                                                   sinks [64]; seqused_kv = tokens per sequence
attn.sparse_topk   npu_kv_quant_sparse_attn_sharedkv_metadata →    950, FP8 records (p.kv_format): the same with
(FP8 KV)           npu_kv_quant_sparse_attn_sharedkv (_C_ascend)   640-byte e4m3 rows [NB, BS, 1, 640] (kv_quant.py),
                                                                   bf16 q padded to 64|128 heads, K2 512|1024,
                                                                   cmp_ratio 1 without compressed KV, sinks required
mhc.pre            npu_hc_pre_v2 (_C_ascend)                       hc_mult 4, D 4096 | 7168, streams bf16, fn fp32
                                                                   [24, 4D]; returns (x bf16, post fp32, comb fp32)
mhc.head           npu_hc_pre_v2 (_C_ascend)                       the head's fn [4, 4D] / base [4] / scale [1] padded
                                                                   with zero rows to the pre op's [24, 4D] / [24] / [3]:
                                                                   its x output is the head's (post/comb unused)
mhc.post           npu_hc_post (_C_ascend)                         [1, T, ...] views: out[j] = post[j] x + sum_i
                                                                   comb[i, j] residual[i]; x in the streams' dtype
moe.route          moe_gating_top_k_hash (_C_ascend)               sqrtsoftplus (norm_type 2) and hash routing:
(sqrtsoftplus,                                                     input_ids = arange(T) int64, tid2eid = the looked-up
 hash)                                                             ids [T, K] int32 (the op's table lookup then returns
                                                                   them); renorm 0 = weights renormalised x scaling
=================  ==============================================  =================================================

What the operators do not cover falls back to the reference for that call, visibly (``events``).
"""

from __future__ import annotations

import torch

from inferhal.backends.reference import deepseek as ref_ds
from inferhal.backends.reference import mhc as ref_mhc
from inferhal.backends.reference import moe as ref_moe
from inferhal.backends.reference.attention import gather_slots, token_seqs
from inferhal.backends.ascend950 import kv_quant
from inferhal.backends.ascend950.preconditions import HALF

INDEXER_HEADS = (8, 16, 24, 32, 64)  # 950's allowed query head counts (A2/A3 take any count <= 64)
INDEXER_DIM = 128
INDEXER_MAX_COUNT = 2048
SPARSE_HEADS = 64
SPARSE_TOPK = 512
SPARSE_WINDOW = 128  # ori_win_left 127 + the query's own token
SPARSE_RATIOS = (4, 128)
QUANT_HEADS = (64, 128)  # npu_kv_quant_sparse_attn_sharedkv's N1
QUANT_TOPK = (512, 1024)  # its K2
HC_MULT = 4
HC_DIMS = (4096, 7168)
HC_MIX = (2 + HC_MULT) * HC_MULT  # 24


class V4Ops:
    """DeepSeek-V4 wrappers; expects ``self.npu``, ``self._fallback``, ``self._has`` and ``self.features``."""

    # ------------------------------------------------------------------------------------ indexer.scores

    def indexer_scores(self, q: torch.Tensor, key_cache: torch.Tensor, batch, weights: torch.Tensor, p) -> torch.Tensor:
        # q: [T, Hi, Di]; key_cache: [NB, BS, Di] (or [NB, BS, 4 + Di] uint8 fp8_index records) -> scores [T, S] fp32,
        # S = the block table's reach (block_table.shape[1] * BS); the operator returns max(seq_lens) of them
        t, hi, di = q.shape
        out_w = batch.block_table.shape[1] * key_cache.shape[1]
        width = int(batch.seq_lens.max()) if batch.num_seqs else 0
        fmt = p.key_format
        why = ""
        if fmt is not None and not _fp8_index_records(fmt, key_cache, di):
            why = (f"{fmt.name} key records ({fmt.code} codes, {fmt.num_scales} {fmt.scale} scale(s) per key): the "
                   f"wrapper takes fp8_index keys (e4m3 codes, one fp32 scale per key); the quantised indexers "
                   f"(npu_quant_lightning_indexer, npu_vllm_quant_lightning_indexer) return no scores")
        elif q.dtype not in HALF or (fmt is None and key_cache.dtype != q.dtype):
            why = f"query {q.dtype} / keys {key_cache.dtype}: the operator takes one fp16/bf16 dtype"
        elif di > INDEXER_DIM or hi > INDEXER_HEADS[-1]:
            why = f"{hi} heads x {di} dims: the operator takes head dim 128 and <= 64 heads"
        elif width > INDEXER_MAX_COUNT:
            why = f"{width} entries: every score comes back through sparse_count <= {INDEXER_MAX_COUNT}"
        if why:
            self._fallback("indexer.scores", why)
            return ref_ds.indexer_scores(q, key_cache, batch, weights, p)
        if t == 0 or width == 0:
            return torch.full((t, out_w), float("-inf"), device=q.device)
        heads = next(h for h in INDEXER_HEADS if h >= hi)
        lens = batch.seq_lens.long()
        cols = torch.arange(width, device=q.device)
        nb = lens.numel()
        keys = gather_slots(key_cache, batch.block_table, torch.arange(nb, device=q.device)[:, None], cols[None, :],
                            cols[None, :] < lens[:, None])  # [B, S, Di], zero past each sequence
        keys = torch.cat([keys[b, : int(lens[b])] for b in range(nb)])  # [S_all, Di] (TND), or [S_all, nbytes]
        key_scale = None
        if fmt is not None:  # e4m3 codes widen exactly to fp16/bf16; relu(s * x) = s * relu(x) for the scale s > 0
            key_scale = keys[:, fmt.scales_at:fmt.scales_at + 4].contiguous().view(torch.float32).view(-1)  # [S_all]
            keys = keys[:, :di].contiguous().view(torch.float8_e4m3fn).to(q.dtype)
        qp = q.new_zeros(t, heads, INDEXER_DIM)
        qp[:, :hi, :di] = q
        kp = keys.new_zeros(keys.shape[0], 1, INDEXER_DIM)
        kp[:, 0, :di] = keys
        wp = q.new_zeros(t, heads)  # relu(.) * scale folds into the weight (scale > 0)
        wp[:, :hi] = (weights.float() * (p.weight_scale * p.scale)).to(q.dtype)
        cu_q = batch.query_start_loc[1:].to(torch.int32).contiguous()
        cu_k = torch.cumsum(lens, 0).to(torch.int32).contiguous()
        idx, val = self.npu.npu_lightning_indexer(
            qp, kp, wp, actual_seq_lengths_query=cu_q, actual_seq_lengths_key=cu_k, layout_query="TND",
            layout_key="TND", sparse_count=width, sparse_mode=0, return_value=True)
        idx, val = idx.view(t, width).long(), val.view(t, width).float()
        if key_scale is not None:  # each returned score times its key's fp32 scale (row start + index in TND)
            seq = token_seqs(batch.query_start_loc, t)
            start = (cu_k.long() - lens)[seq]  # [T]
            val = val * key_scale[(start[:, None] + idx.clamp(min=0)).clamp(max=key_scale.numel() - 1)]
        scores = torch.full((t, out_w + 1), float("-inf"), device=q.device)  # columns past max(seq_lens) stay -inf
        scores.scatter_(1, torch.where(idx >= 0, idx, out_w), torch.where(idx >= 0, val, float("-inf")))
        seq = token_seqs(batch.query_start_loc, t)
        n = torch.minimum((batch.positions.long() + 1) // batch.tokens_per_slot, lens[seq])  # [T] visible entries
        return scores[:, :out_w].masked_fill(torch.arange(out_w, device=q.device)[None, :] >= n[:, None], float("-inf"))

    # ------------------------------------------------------------------------------------ attn.sparse_topk

    def attn_sparse_topk(self, q, kv_cache, batch, comp_cache, comp_batch, topk_idx, p, sinks=None):
        # q: [T, H, D]; kv_cache: [NB, BS, D]; comp_cache: [NB', BS', D]; topk_idx: [T, K] -> [T, H, D]
        if p.kv_format is not None:  # FP8 records: the 950's quantised-KV variant
            return self._attn_sparse_quant(q, kv_cache, batch, comp_cache, comp_batch, topk_idx, p, sinks)
        t, h, d = q.shape
        use_cmp = comp_batch is not None and topk_idx is not None and topk_idx.shape[1] > 0
        # HCA passes every causally closed entry: the operator's scenario 2 (no indices, any count) is that
        every = use_cmp and _every_visible(topk_idx, batch.positions, comp_batch.tokens_per_slot)
        why = ""
        if "sparse_attn_sharedkv" not in self.features:
            why = ("this generation has no bf16 npu_sparse_attn_sharedkv (950: only npu_kv_quant_sparse_attn_sharedkv, "
                   "which cache.kv_dtype=fp8 uses)")
        elif not self._has("npu_sparse_attn_sharedkv"):
            why = "vllm-ascend's custom-op library (npu_sparse_attn_sharedkv) is not loadable"
        elif q.dtype not in HALF or kv_cache.dtype != q.dtype or (use_cmp and comp_cache.dtype != q.dtype):
            why = f"query {q.dtype} / caches {kv_cache.dtype}: the operator takes one fp16/bf16 dtype"
        elif p.window != SPARSE_WINDOW:
            why = f"window {p.window}: the operator's band is fixed at {SPARSE_WINDOW} (ori_win_left 127)"
        elif h > SPARSE_HEADS or p.softcap > 0:
            why = f"{h} heads / softcap {p.softcap}: the operator takes <= 64 heads (padded to 64), no softcap"
        elif kv_cache.shape[1] % 16 or kv_cache.shape[1] > 1024:
            why = f"block size {kv_cache.shape[1]}: the operator takes multiples of 16 up to 1024"
        elif use_cmp and (comp_batch.tokens_per_slot not in SPARSE_RATIOS
                          or (topk_idx.shape[1] > SPARSE_TOPK and not every)
                          or comp_cache.shape[1] % 16 or comp_cache.shape[1] > 1024):
            why = (f"compression {comp_batch.tokens_per_slot} / top-k {topk_idx.shape[1]}: the operator takes ratio "
                   f"4 or 128, <= {SPARSE_TOPK} entries, 16-aligned blocks <= 1024")
        if why:
            self._fallback("attn.sparse_topk", why)
            return ref_ds.attn_sparse_topk(q, kv_cache, batch, comp_cache, comp_batch, topk_idx, p, sinks)
        if t == 0:
            return q.new_zeros(0, h, d)
        qp = q.new_zeros(t, SPARSE_HEADS, d)
        qp[:, :h] = q
        sk = torch.zeros(SPARSE_HEADS, dtype=torch.float32, device=q.device)
        if sinks is not None:
            sk[:h] = sinks.float()
        nb = batch.num_seqs
        cu_q = batch.query_start_loc.to(torch.int32).contiguous()
        used_kv = batch.seq_lens.to(torch.int32).contiguous()
        qlens = (batch.query_start_loc[1:] - batch.query_start_loc[:-1])
        kw = dict(cu_seqlens_q=cu_q, seqused_kv=used_kv, layout_q="TND", layout_kv="PA_ND", ori_win_left=127,
                  ori_win_right=0, ori_mask_mode=4, cmp_mask_mode=3)
        meta = self.npu.npu_sparse_attn_sharedkv_metadata(
            SPARSE_HEADS, 1, d, batch_size=nb, max_seqlen_q=int(qlens.max()), max_seqlen_kv=int(used_kv.max()),
            cmp_topk=SPARSE_TOPK if use_cmp and not every else 0, cmp_ratio=comp_batch.tokens_per_slot if use_cmp else 4,
            has_ori_kv=True, has_cmp_kv=use_cmp, **kw)
        call = dict(ori_kv=kv_cache.view(*kv_cache.shape[:2], 1, d),
                    ori_block_table=batch.block_table.to(torch.int32).contiguous(), sinks=sk, metadata=meta,
                    softmax_scale=float(p.scale), **kw)
        if use_cmp:
            call.update(cmp_kv=comp_cache.view(*comp_cache.shape[:2], 1, d),
                        cmp_block_table=comp_batch.block_table.to(torch.int32).contiguous(),
                        cmp_ratio=int(comp_batch.tokens_per_slot))
            if not every:
                call["cmp_sparse_indices"] = _valid_first(topk_idx, SPARSE_TOPK).view(t, 1, SPARSE_TOPK)
        out, _lse = self.npu.npu_sparse_attn_sharedkv(qp, **call)
        return out[:, :h].contiguous()

    def _attn_sparse_quant(self, q, kv_cache, batch, comp_cache, comp_batch, topk_idx, p, sinks):
        """attn.sparse_topk over FP8 records: npu_kv_quant_sparse_attn_sharedkv(_metadata) reads the 640-byte
        rows of this backend's storage (kv_quant.py); any call outside its documented limits falls back."""
        t, h, d = q.shape
        fmt = p.kv_format
        use_cmp = comp_batch is not None and topk_idx is not None and topk_idx.shape[1] > 0
        every = use_cmp and _every_visible(topk_idx, batch.positions, comp_batch.tokens_per_slot)
        ratio = int(comp_batch.tokens_per_slot) if use_cmp else 1
        k2 = next((k for k in QUANT_TOPK if k >= topk_idx.shape[1]), 0) if use_cmp and not every else 0
        why = ""
        if "kv_quant_sparse_attn_sharedkv" not in self.features:
            why = f"{fmt.name} KV records: this generation has no quantised-KV sparse attention (950 only)"
        elif not self._has("npu_kv_quant_sparse_attn_sharedkv"):
            why = "vllm-ascend's custom-op library (npu_kv_quant_sparse_attn_sharedkv) is not loadable"
        elif not kv_quant.is_operator_record(fmt) or d != fmt.dims:
            why = (f"{fmt.name} records of {fmt.dims} dims ({fmt.raw_dims} RoPE, {fmt.block}-channel {fmt.scale} "
                   f"scales): the operator reads 448 e4m3 + 64 bf16 RoPE channels with e8m0 scales per 64")
        elif not kv_quant.arranged(kv_cache) or (use_cmp and not kv_quant.arranged(comp_cache)):
            why = "the caches are not in the operator's 640-byte rows (allocate through the ascend950 kv_storage)"
        elif q.dtype != torch.bfloat16:
            why = f"query {q.dtype}: the operator takes bf16"
        elif p.window != SPARSE_WINDOW:
            why = f"window {p.window}: the operator's band is fixed at {SPARSE_WINDOW} (ori_win_left 127)"
        elif h > QUANT_HEADS[-1] or p.softcap > 0:
            why = f"{h} heads / softcap {p.softcap}: the operator takes <= 128 heads (padded to 64|128), no softcap"
        elif kv_cache.shape[1] % 16 or kv_cache.shape[1] > 1024:
            why = f"block size {kv_cache.shape[1]}: the operator takes multiples of 16 up to 1024"
        elif use_cmp and (ratio not in SPARSE_RATIOS or (not every and (ratio != 4 or not k2))):
            why = (f"compression {ratio} / top-k {topk_idx.shape[1]}: the operator takes ratio 4 with <= "
                   f"{QUANT_TOPK[-1]} selected entries or ratio 4|128 over every closed entry")
        if why:
            self._fallback("attn.sparse_topk", why)
            kv, b = kv_quant.compact_core(kv_cache, batch, fmt)
            ckv, cb = (comp_cache, comp_batch) if comp_cache is None or comp_batch is None else \
                kv_quant.compact_core(comp_cache, comp_batch, fmt)
            return ref_ds.attn_sparse_topk(q, kv, b, ckv, cb, topk_idx, p, sinks)
        if t == 0:
            return q.new_zeros(0, h, d)
        heads = next(n for n in QUANT_HEADS if n >= h)
        qp = q.new_zeros(t, heads, d)
        qp[:, :h] = q
        sk = torch.zeros(heads, dtype=torch.float32, device=q.device)
        if sinks is not None:
            sk[:h] = sinks.float()
        else:  # the operator needs sinks: -inf adds nothing to the softmax denominator
            sk[:] = float("-inf")
        cu_q = batch.query_start_loc.to(torch.int32).contiguous()
        used_kv = batch.seq_lens.to(torch.int32).contiguous()
        qlens = batch.query_start_loc[1:] - batch.query_start_loc[:-1]
        kw = dict(cu_seqlens_q=cu_q, seqused_kv=used_kv, cmp_ratio=ratio, ori_mask_mode=4, cmp_mask_mode=3,
                  ori_win_left=127, ori_win_right=0, layout_q="TND", layout_kv="PA_ND")
        meta = self.npu.npu_kv_quant_sparse_attn_sharedkv_metadata(
            heads, 1, d, 1, batch_size=batch.num_seqs, max_seqlen_q=int(qlens.max()),
            max_seqlen_kv=int(used_kv.max()), cmp_topk=k2, has_ori_kv=True, has_cmp_kv=use_cmp, **kw)

        def rows(cache):  # [NB, BS, 1, 640] float8_e4m3fn over this backend's pages
            full = kv_quant.operator_pages(cache)
            return full.view(torch.float8_e4m3fn).view(*full.shape[:2], 1, kv_quant.ROW)

        call = dict(ori_kv=rows(kv_cache), ori_block_table=batch.block_table.to(torch.int32).contiguous(), sinks=sk,
                    metadata=meta, tile_size=kv_quant.TILE, rope_head_dim=kv_quant.ROPE, softmax_scale=float(p.scale),
                    **kw)
        if use_cmp:
            if comp_cache.shape[1] % 16 or comp_cache.shape[1] > 1024:  # e.g. HCA: one entry per 128-token block
                pages, table = kv_quant.repage(comp_cache, comp_batch)
                call.update(cmp_kv=pages.view(torch.float8_e4m3fn).view(*pages.shape[:2], 1, kv_quant.ROW),
                            cmp_block_table=table)
            else:
                call.update(cmp_kv=rows(comp_cache), cmp_block_table=comp_batch.block_table.to(torch.int32).contiguous())
            if not every:
                call["cmp_sparse_indices"] = _valid_first(topk_idx, k2).view(t, 1, k2)
        out, _lse = self.npu.npu_kv_quant_sparse_attn_sharedkv(qp, 1, **call)
        return out[:, :h].contiguous()

    # ------------------------------------------------------------------------------------ mhc

    def _hc_unsupported(self, streams: torch.Tensor) -> str:
        t, n, d = streams.shape
        if not self._has("npu_hc_pre_v2"):
            return "vllm-ascend's custom-op library (npu_hc_pre_v2) is not loadable"
        if n != HC_MULT or d not in HC_DIMS:
            return f"hc_mult {n}, hidden {d}: npu_hc_pre_v2 takes hc_mult 4 and hidden 4096 or 7168"
        if streams.dtype != torch.bfloat16:
            return f"streams {streams.dtype}: npu_hc_pre_v2 takes bf16"
        return ""

    def mhc_pre(self, streams, fn, base, scale, p):
        # streams: [T, N, D]; fn: [(2+N)N, N*D] -> x [T, D], post [T, N], comb [T, N, N]
        why = self._hc_unsupported(streams)
        if why:
            self._fallback("mhc.pre", why)
            return ref_mhc.mhc_pre(streams, fn, base, scale, p)
        x, post, comb = self.npu.npu_hc_pre_v2(streams.contiguous(), fn.float().contiguous(), scale.float().contiguous(),
                                               base.float().contiguous(), HC_MULT, int(p.sinkhorn_iters),
                                               float(p.norm_eps), float(p.eps))
        return x.to(streams.dtype), post.float(), comb.float()

    def mhc_head(self, streams, fn, base, scale, p):
        # streams: [T, N, D]; fn: [N, N*D]; base: [N]; scale: [1] -> x [T, D]
        why = self._hc_unsupported(streams)
        if why:
            self._fallback("mhc.head", why)
            return ref_mhc.mhc_head(streams, fn, base, scale, p)
        n = streams.shape[1]
        fn24 = fn.new_zeros(HC_MIX, fn.shape[1], dtype=torch.float32)
        fn24[:n] = fn.float()
        base24 = torch.zeros(HC_MIX, dtype=torch.float32, device=fn.device)
        base24[:n] = base.float()
        scale3 = torch.zeros(3, dtype=torch.float32, device=fn.device)
        scale3[0] = scale.float()[0]
        x, _post, _comb = self.npu.npu_hc_pre_v2(streams.contiguous(), fn24, scale3, base24, HC_MULT,
                                                 int(p.sinkhorn_iters), float(p.norm_eps), float(p.eps))
        return x.to(streams.dtype)

    def mhc_post(self, y, streams, post, comb):
        # y: [T, D]; streams: [T, N, D]; post: [T, N]; comb: [T, N, N] -> [T, N, D]
        why = ""
        if not self._has("npu_hc_post"):
            why = "vllm-ascend's custom-op library (npu_hc_post) is not loadable"
        elif streams.dtype not in HALF + (torch.float32,) or streams.shape[0] == 0:
            why = f"streams {streams.dtype} / {streams.shape[0]} rows: npu_hc_post takes fp16/bf16/fp32, no empty tensor"
        if why:
            self._fallback("mhc.post", why)
            return ref_mhc.mhc_post(y, streams, post, comb)
        out = self.npu.npu_hc_post(y.to(streams.dtype)[None].contiguous(), streams[None].contiguous(),
                                   post.float()[None].contiguous(), comb.float()[None].contiguous())
        return out[0]

    # ------------------------------------------------------------------------------------ moe.route (V4)

    def _route_hash(self, logits, p, bias, hash_ids):
        """sqrtsoftplus scoring and/or hash routing through ``moe_gating_top_k_hash``; None = not covered."""
        norm_type = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}[p.scoring]
        why = ""
        if not self._has("moe_gating_top_k_hash"):
            why = "vllm-ascend's custom-op library (moe_gating_top_k_hash) is not loadable"
        elif not p.renormalize:
            why = "renormalize=False: the operator renormalises the chosen weights (renorm 0)"
        elif logits.shape[-1] > 2048 or logits.dtype not in HALF + (torch.float32,):
            why = f"{logits.shape[-1]} experts / {logits.dtype}: the operator takes E <= 2048 in fp16/bf16/fp32"
        if why:
            self._fallback("moe.route", why)
            return ref_moe.moe_route(logits, p, bias, hash_ids)
        t = logits.shape[0]
        kw = {}
        if hash_ids is not None:  # the op looks ids up as tid2eid[input_ids[t]]: a table of our T rows
            kw = dict(input_ids=torch.arange(t, dtype=torch.int64, device=logits.device),
                      tid2eid=hash_ids.to(torch.int32).contiguous())
        b = None if bias is None or hash_ids is not None else bias.float().contiguous()
        y, idx, _ = self.npu.moe_gating_top_k_hash(  # fp32 x: the weights come back in x's dtype
            logits.float().contiguous(), p.top_k, bias=b, k_group=1, group_count=1,
            routed_scaling_factor=float(p.routed_scaling), eps=1e-20, group_select_mode=0, renorm=0,
            norm_type=norm_type, out_flag=False, **kw)
        return y.float(), idx.long()


def _fp8_index_records(fmt, key_cache: torch.Tensor, di: int) -> bool:
    """Whether ``key_cache`` holds ``fp8_index`` records of ``di`` channels with one fp32 scale each (e4m3 codes at
    bytes [0, di), the scale at ``scales_at``): then the codes go to the operator and the scale to its scores."""
    return (fmt.name == "fp8_index" and fmt.code == "e4m3" and fmt.scale == "fp32" and fmt.num_scales == 1
            and fmt.dims == fmt.coded == di and key_cache.dtype == torch.uint8 and key_cache.shape[-1] == fmt.nbytes)


def _every_visible(idx: torch.Tensor, positions: torch.Tensor, ratio: int) -> bool:
    """Whether row t of ``idx [T, K]`` lists exactly entries 0 .. (pos_t+1)//ratio - 1 in order, -1 after."""
    vis = (positions.long() + 1) // ratio
    cols = torch.arange(idx.shape[1], device=idx.device)
    want = torch.where(cols[None, :] < vis[:, None], cols[None, :], torch.full_like(cols, -1)[None, :])
    return bool(int(vis.max()) <= idx.shape[1]) and torch.equal(idx.long(), want)


def _valid_first(idx: torch.Tensor, width: int) -> torch.Tensor:
    """``idx [T, K]`` (-1 = none) as int32 ``[T, width]``: each row's distinct valid entries first, ascending,
    then -1 (the operator wants valid values in front; a repeated entry counts once, as in the reference)."""
    t, k = idx.shape
    s = torch.sort(idx.long(), dim=1).values
    dup = torch.zeros_like(s, dtype=torch.bool)
    dup[:, 1:] = s[:, 1:] == s[:, :-1]
    s = torch.where(dup | (s < 0), torch.full_like(s, 1 << 40), s)
    s = torch.sort(s, dim=1).values
    s = torch.where(s == (1 << 40), torch.full_like(s, -1), s)
    out = torch.full((t, width), -1, dtype=torch.int32, device=idx.device)
    out[:, :k] = s.to(torch.int32)
    return out.contiguous()
