"""Documented preconditions of the torch_npu operators the ascend950 wrappers call (torch-npu 2.13.0 docs).

Each check reads the bound arguments of one call; :class:`~inferhal.backends.ascend950.contract.RecordingNpu`
runs them on every recorded call (and on a device with ``backend.options.record_npu_calls=true``).
Importing this module registers them in :data:`~inferhal.backends.ascend950.contract.CHECKS`.
"""

from __future__ import annotations

import torch

from inferhal.backends.ascend950.contract import CHECKS, require

HALF = (torch.float16, torch.bfloat16)



def _t(b: dict, name: str) -> torch.Tensor | None:
    return b.get(name)


def _check_rms(b: dict) -> None:
    x, g = _t(b, "self") if "self" in b else _t(b, "x1"), _t(b, "gamma")
    op = "npu_rms_norm" if "self" in b else "npu_add_rms_norm"
    require(x.dtype in HALF + (torch.float32,), op, f"dtype {x.dtype} not fp16/bf16/fp32")
    require(g.dtype == x.dtype, op, "gamma must have the input's dtype")
    require(tuple(g.shape) == tuple(x.shape[-1:]), op, f"gamma {tuple(g.shape)} must be the last dim {x.shape[-1]}")
    if "x2" in b:
        require(b["x2"].shape == x.shape and b["x2"].dtype == x.dtype, op, "x2 must match x1")


def _check_rotary(b: dict) -> None:
    x, c, s = b["self"], b["r1"], b["r2"]
    op = "npu_rotary_mul"
    require(x.dim() == 4 and c.dim() == 4 and s.dim() == 4, op, "input, r1, r2 must be 4-D")
    require(c.dtype == x.dtype == s.dtype, op, "r1/r2 must have the input's dtype")
    require(b.get("rotary_mode", "half") in ("half", "interleave"), op, "rotary_mode half|interleave")
    require(c.shape[-1] == x.shape[-1], op, "r1/r2 last dim must equal the input's")


def _check_fia(b: dict) -> None:
    v2 = "num_query_heads" in b or "learnable_sink" in b or "actual_seq_kvlen" in b
    op = "npu_fused_infer_attention_score" + ("_v2" if v2 else "")
    q, k, v = b["query"], b["key"], b["value"]
    require(q.dtype in HALF, op, f"query dtype {q.dtype} (page attention: fp16/bf16)")
    for name in ("query", "key", "value"):
        require(b[name].is_contiguous(), op, f"{name} must be contiguous (不支持非连续的Tensor)")
    require(k.shape == v.shape, op, "key and value shapes must match")
    layout = b.get("input_layout", "BSH")
    require(layout in ("BSH", "BSND", "BNSD", "TND", "BNSD_BSND"), op, f"input_layout {layout!r}")
    heads = b.get("num_query_heads" if v2 else "num_heads", 1)
    kvh = b.get("num_key_value_heads", 0) or heads
    bt = b.get("block_table")
    if layout == "BSND":
        require(q.dim() == 4 and q.shape[2] == heads, op, f"BSND query [B,S,N,D] with N == num_heads ({heads})")
    if bt is not None:  # page attention
        bs = b.get("block_size", 0)
        require(bt.dtype == torch.int32 and bt.dim() == 2, op, "block_table must be 2-D int32")
        require(bt.shape[0] == q.shape[0], op, "block_table rows must equal the batch")
        require(k.dim() == 3 and k.shape[1] == bs, op, "paged key must be (blocknum, blocksize, H)")
        require(k.shape[2] == kvh * q.shape[-1], op, "paged key H must be num_key_value_heads * D")
        require(bs > 0 and bs % 16 == 0 and bs <= 512, op, f"block_size {bs} must be 16-aligned and <= 512")
        kvlen = b.get("actual_seq_kvlen" if v2 else "actual_seq_lengths_kv")
        require(kvlen is not None and len(kvlen) == q.shape[0], op, "page attention needs actual_seq_lengths_kv per batch")
        require(max(kvlen) <= bt.shape[1] * bs, op, "a KV length exceeds its block table")
        if q.shape[1] > 1:
            require(bs % 128 == 0, op, "Q_S > 1 with page attention needs block_size a multiple of 128")
    require(heads % kvh == 0 and heads // kvh <= 64, op, "num_heads % num_key_value_heads == 0 and ratio <= 64")
    mode = b.get("sparse_mode", 0)
    mask = b.get("atten_mask")
    if mode in (2, 3, 4):
        require(mask is not None and tuple(mask.shape[-2:]) == (2048, 2048), op, f"sparse_mode {mode} needs the 2048x2048 mask")
    if mask is not None:
        require(mask.dtype in (torch.bool, torch.int8, torch.uint8), op, "atten_mask must be bool/int8/uint8")
    if v2 and b.get("learnable_sink") is not None:
        ls = b["learnable_sink"]
        require(ls.dtype == torch.bfloat16 and tuple(ls.shape) == (heads,), op, "learnable_sink must be bf16 (Q_N,)")


def _check_scatter_pa(b: dict) -> None:
    op = "npu_scatter_pa_kv_cache"
    k, v, kc, vc, sm = b["key"], b["value"], b["key_cache"], b["value_cache"], b["slot_mapping"]
    for name in ("key", "value", "key_cache", "value_cache", "slot_mapping"):
        require(b[name].is_contiguous(), op, f"{name} must be contiguous (输入参数不支持非连续)")
    require(k.dtype == v.dtype == kc.dtype == vc.dtype, op, "key, value and caches must share a dtype")
    require(k.dim() == 3 and kc.dim() == 4, op, "3-D key/value with 4-D caches")
    require(k.shape[:2] == v.shape[:2], op, "key/value first two dims must match")
    require(sm.dtype in (torch.int32, torch.int64) and sm.dim() == 1 and sm.shape[0] == k.shape[0], op,
            "slot_mapping int32/int64 [T]")
    require(b.get("cache_mode") in (None, "Norm"), op, "ND caches need cache_mode None or 'Norm'")


def _check_nd_update(b: dict) -> None:
    op = "npu_scatter_nd_update_"
    s, i, u = b["self"], b["indices"], b["updates"]
    require(i.dtype in (torch.int32, torch.int64) and i.dim() == 2 and i.shape[1] == 1, op, "indices [n, 1] int")
    require(u.shape[0] == i.shape[0] and tuple(u.shape[1:]) == tuple(s.shape[1:]), op, "updates [n, *self[1:]]")
    require(u.dtype == s.dtype, op, "updates must have self's dtype")


def _check_gating(b: dict) -> None:
    op = "npu_moe_gating_top_k"
    x, k = b["x"], b["k"]
    require(x.dim() == 2 and 2 < x.shape[-1] <= 2048, op, "x [T, E] with E <= 2048")
    gc, kg = b.get("group_count", 1), b.get("k_group", 1)
    require(1 <= k <= x.shape[-1] // gc * kg, op, "1 <= k <= E / group_count * k_group")
    require(b.get("renorm", 0) == 0 and b.get("norm_type", 0) in (0, 1), op, "renorm 0, norm_type 0|1")
    if b.get("bias") is not None:
        require(b["bias"].dtype == x.dtype and tuple(b["bias"].shape) == (x.shape[-1],), op, "bias [E] in x's dtype")


def _check_init_routing(b: dict) -> None:
    op = "npu_moe_init_routing_v2"
    x, idx = b["x"], b["expert_idx"]
    require(x.dim() == 2 and idx.dim() == 2 and idx.shape[0] == x.shape[0], op, "x [T, H], expert_idx [T, K]")
    require(idx.dtype == torch.int32, op, "expert_idx must be int32")
    require(b.get("drop_pad_mode", 0) == 0, op, "drop_pad_mode: only 0 is supported")
    require(b.get("expert_tokens_num_type", 0) in (1, 2) and b.get("expert_tokens_num_flag") is True, op,
            "expert_tokens_num_type 1|2 with expert_tokens_num_flag=True (the only supported modes)")
    require(b.get("quant_mode", -1) in (-1, 1), op, "quant_mode -1|1")
    n = b.get("expert_num", -1)
    require(0 < n <= 10240, op, "expert_num in (0, 10240]")
    rng = b.get("active_expert_range", [])
    require(len(rng) == 2 and 0 <= rng[0] < rng[1] <= n, op, "active_expert_range [start, end) within expert_num")


def _check_gmm(b: dict) -> None:
    op = "npu_grouped_matmul"
    xs, ws = b["x"], b["weight"]
    require(len(xs) == 1 and len(ws) == 1, op, "one x and one stacked weight (split_item 2/3, group_type 0)")
    require(b.get("split_item") in (2, 3) and b.get("group_type") == 0, op, "split_item 2|3 with group_type 0")
    x, w, gl = xs[0], ws[0], b.get("group_list")
    require(x.dim() == 2 and w.dim() == 3 and x.shape[1] == w.shape[1], op, "x [M, K], weight [E, K, N]")
    require(gl is not None and gl.dim() == 1 and gl.shape[0] == w.shape[0] and gl.dtype == torch.int64, op,
            "group_list int64 [E]")
    require(b.get("group_list_type") == 1, op, "group_list_type 1 (per-group counts)")
    if x.dtype == torch.float8_e4m3fn:  # MXFP8 (W8A8MXFP): e8m0 scales per 32 along K, in pairs
        e8 = torch.float8_e8m0fnu
        sc, pt = b.get("scale"), b.get("per_token_scale")
        require(w.dtype == x.dtype, op, "MXFP8: weight e4m3 like x")
        require(x.shape[1] % 64 == 0, op, "MXFP8: K a multiple of 64 (scales [.., K/64, .., 2])")
        require(sc is not None and len(sc) == 1 and sc[0].dtype in (e8, torch.uint8) and
                tuple(sc[0].shape) == (w.shape[0], x.shape[1] // 64, w.shape[2], 2), op,
                "MXFP8: scale [E, K/64, N, 2] 8-bit (float8_e8m0fnu or uint8)")
        require(pt is not None and len(pt) == 1 and pt[0].dtype in (e8, torch.uint8) and
                tuple(pt[0].shape) == (x.shape[0], x.shape[1] // 64, 2), op,
                "MXFP8: per_token_scale [M, K/64, 2] 8-bit (float8_e8m0fnu or uint8)")
        require(b.get("output_dtype") in (5, 15), op, "MXFP8: output_dtype fp16 (5) | bf16 (15), ScalarType values")
        require(b.get("scale_dtype") == 293 and b.get("per_token_scale_dtype") == 293, op,
                "MXFP8: scale_dtype and per_token_scale_dtype 293 (torch_npu.float8_e8m0fnu)")
    elif x.dtype != torch.int8:
        require(w.dtype == x.dtype, op, "x and weight share a floating dtype")
    if b.get("output_dtype") is not None:  # torch_npu's gmm_get_dtype: fp16, bf16, fp32, int32 only
        require(b["output_dtype"] in (5, 15, 6, 3), op, "output_dtype a ScalarType value: 5 fp16 | 15 bf16 | 6 fp32 | "
                                                        "3 int32 (not an aclDataType code)")


def _check_quant_matmul(b: dict) -> None:
    op = "npu_quant_matmul"
    x1, x2, sc, pt = b["x1"], b["x2"], b["scale"], b.get("pertoken_scale")
    require(x1.dtype == torch.float8_e4m3fn, op, "only the MXFP8 mode (x1 float8_e4m3fn) is wired")
    require(x2.dtype == torch.float8_e4m3fn and x1.dim() == 2 and x2.dim() == 2 and x1.shape[1] == x2.shape[0], op,
            "MXFP8: x1 e4m3 [M, K], x2 e4m3 [K, N]")
    m, k = x1.shape
    n = x2.shape[1]
    require(k % 64 == 0 and k <= 65535 and n <= 65535, op, "MXFP8: K a multiple of 64, K and N <= 65535")
    require(x2.t().is_contiguous(), op, "MXFP8: x2 the transposed view of a contiguous [N, K] weight")
    require(sc.dtype in (torch.uint8, torch.float8_e8m0fnu) and tuple(sc.shape) == (k // 64, n, 2)
            and sc.transpose(0, 1).is_contiguous(), op,
            "MXFP8: scale [K/64, N, 2] 8-bit, the transposed view of a contiguous [N, K/64, 2] (transposed only)")
    require(pt is not None and pt.dtype in (torch.uint8, torch.float8_e8m0fnu) and tuple(pt.shape) == (m, k // 64, 2),
            op, "MXFP8: pertoken_scale [M, K/64, 2] 8-bit")
    require(b.get("scale_dtype") == 293 and b.get("pertoken_scale_dtype") == 293, op,
            "MXFP8: scale_dtype and pertoken_scale_dtype 293 (torch_npu.float8_e8m0fnu)")
    require(list(b.get("group_sizes") or ()) == [1, 1, 32], op, "MXFP8: group_sizes [1, 1, 32]")
    require(b.get("output_dtype") in (5, 15), op, "MXFP8: output_dtype 5 (fp16) | 15 (bf16), ScalarType values")
    bias = b.get("bias")
    require(bias is None or (bias.dtype == torch.float32 and tuple(bias.shape) == (n,)), op, "bias fp32 [N]")
    require(b.get("offset") is None and b.get("y_scale") is None, op, "no offset / y_scale in the MX mode")


def _check_swiglu(b: dict) -> None:
    x = b["self"] if "self" in b else b["x"]
    op = "npu_swiglu" if "self" in b else "npu_clipped_swiglu"
    require(x.shape[b.get("dim", -1)] % 2 == 0, op, "the split dim must be even")
    if op == "npu_clipped_swiglu":
        require(x.is_contiguous(), op, "x must be contiguous")


def _check_finalize(b: dict) -> None:
    op = "npu_moe_finalize_routing"
    rows, idx, sc = b["expanded_permuted_rows"], b["expanded_src_to_dst_row"], b.get("scales")
    k = b.get("k", 1)
    require(rows.dim() == 2 and idx.dim() == 1 and idx.shape[0] == rows.shape[0], op, "rows [T*K, H], index [T*K]")
    require(idx.dtype == torch.int32, op, "expanded_src_to_dst_row must be int32")
    if sc is not None:
        require(sc.dim() == 2 and sc.shape[0] * sc.shape[1] == rows.shape[0] and sc.shape[1] == k, op, "scales [T, K]")
        require(sc.dtype == rows.dtype, op, "scales must have the rows' dtype")
    require(b.get("drop_pad_mode", 0) in (0, 1, 2, 3), op, "drop_pad_mode")


def _check_dyn_quant(b: dict) -> None:
    require(b["input"].dtype in HALF, "npu_dynamic_quant", "input must be fp16/bf16")


def _check_dyn_mx_quant(b: dict) -> None:
    op = "npu_dynamic_mx_quant"
    x = b["input"]
    require(x.dtype in HALF + (torch.float32,) and 1 <= x.dim() <= 7, op, "input fp16/bf16/fp32, 1-7 dims")
    require(b["dst_type"] == torch.float8_e4m3fn, op, "dst_type float8_e4m3fn (the MXFP8 activations wired)")
    require(b.get("axis", -1) in (-1, x.dim() - 1), op, "axis -1 (per row, along K)")
    require(b.get("scale_alg") in (None, 0), op, "scale_alg 0 (OCP MX: floor(log2(amax)) - emax)")


def _check_gmm_swiglu_quant(b: dict) -> None:
    op = "npu_grouped_matmul_swiglu_quant"
    require(b["x"].dtype == torch.int8 and b["x"].dim() == 2, op, "x int8 [M, K]")
    require(b["weight"].dtype == torch.int8 and b["weight"].dim() == 5, op, "weight int8 FRACTAL_NZ (5-D)")
    require(b["group_list"].dtype == torch.int64 and b["group_list"].shape[0] == b["weight"].shape[0], op,
            "group_list int64 [E]")
    require(b["x_scale"].dim() == 1 and b["x_scale"].shape[0] == b["x"].shape[0], op, "x_scale [M] fp32")


# ---------------------------------------------------------------- DeepSeek-V4 operators (contract.CITATIONS)


def _check_lightning_indexer(b: dict) -> None:
    op = "npu_lightning_indexer"
    q, k, w = b["query"], b["key"], b["weights"]
    for name in ("query", "key", "weights"):
        require(b[name].is_contiguous(), op, f"{name} must be contiguous")
    require(q.dtype in HALF and k.dtype == q.dtype, op, "query and key: one dtype, fp16/bf16")
    require(w.dtype == q.dtype, op, "weights in the query's dtype (the 950 takes no fp32 weights)")
    lq, lk = b.get("layout_query", "BSND"), b.get("layout_key", "BSND")
    require(lq in ("BSND", "TND") and lk in ("BSND", "TND", "PA_BSND"), op, f"layouts {lq}/{lk}")
    require(q.shape[-1] == 128 and k.shape[-1] == 128, op, "head dim 128")
    require(k.shape[-2] == 1, op, "key heads N2 = 1")
    require(q.shape[-2] in (8, 16, 24, 32, 64), op, "query heads 8/16/24/32/64 (the 950's list; A3: <= 64)")
    if lq == "TND":
        require(q.dim() == 3 and w.dim() == 2 and w.shape == q.shape[:2], op, "TND query [T, N1, D], weights [T, N1]")
        require(b.get("actual_seq_lengths_query") is not None, op, "TND query needs actual_seq_lengths_query")
    if lk in ("TND", "PA_BSND"):
        require(b.get("actual_seq_lengths_key") is not None, op, f"{lk} key needs actual_seq_lengths_key")
    if lk == "PA_BSND":
        require(b.get("block_table") is not None and k.shape[1] % 16 == 0 and k.shape[1] <= 1024, op,
                "paged key: block_table, block_size a multiple of 16 up to 1024")
    require(not (b.get("return_value") and lk == "PA_BSND"), op, "return_value needs layout_key != PA_BSND")
    n = b.get("sparse_count", 2048)
    require(1 <= n <= 2048 or n in (3072, 4096, 5120, 6144, 7168, 8192), op, f"sparse_count {n}")
    require(b.get("sparse_mode", 3) in (0, 3), op, "sparse_mode 0 | 3")


def _check_sparse_attn(b: dict) -> None:
    op = "npu_sparse_attn_sharedkv"
    q = b["q"]
    require(q.dtype in HALF and q.is_contiguous(), op, "q fp16/bf16, contiguous")
    lq = b.get("layout_q", "BSND")
    require(lq in ("TND", "BSND") and b.get("layout_kv", "PA_ND") == "PA_ND", op, "layout_q TND|BSND, layout_kv PA_ND")
    require(q.shape[-2] == 64, op, "N1 = 64 query heads")
    if lq == "TND":
        require(q.dim() == 3 and b.get("cu_seqlens_q") is not None, op, "TND q [T, N1, D] with cu_seqlens_q")
    require(b.get("metadata") is not None and tuple(b["metadata"].shape) == (1024,), op, "metadata [1024] is required")
    require(b.get("ori_win_left", 128) == 127 and b.get("ori_win_right", 0) == 0, op, "ori_win_left 127, ori_win_right 0")
    require(b.get("ori_mask_mode", 4) == 4 and b.get("cmp_mask_mode", 3) == 3, op, "mask modes 4 (band) / 3 (causal)")
    require(not b.get("return_softmax_lse", False), op, "return_softmax_lse False")
    s = b.get("sinks")
    require(s is None or (s.dtype == torch.float32 and tuple(s.shape) == (q.shape[-2],)), op, "sinks fp32 [N1]")
    for kv, table in (("ori_kv", "ori_block_table"), ("cmp_kv", "cmp_block_table")):
        c = b.get(kv)
        if c is None:
            continue
        require(c.dim() == 4 and c.shape[2] == 1 and c.shape[3] == q.shape[-1], op, f"{kv} [NB, BS, 1, D]")
        require(c.dtype == q.dtype and c.is_contiguous(), op, f"{kv} contiguous in q's dtype")
        require(c.shape[1] % 16 == 0 and c.shape[1] <= 1024, op, f"{kv} block size a multiple of 16 up to 1024")
        t = b.get(table)
        require(t is not None and t.dtype == torch.int32 and t.dim() == 2, op, f"{table} int32 [B, M]")
    if b.get("cmp_kv") is not None:
        require(b.get("cmp_ratio") in (4, 128), op, "cmp_ratio 4 or 128")
    idx = b.get("cmp_sparse_indices")
    if idx is not None:
        require(idx.dtype == torch.int32 and idx.dim() == 3 and idx.shape[1:] == (1, 512), op,
                "cmp_sparse_indices int32 [T, 1, 512]")


def _check_sparse_meta(b: dict) -> None:
    op = "npu_sparse_attn_sharedkv_metadata"
    require(b["num_heads_q"] == 64 and b["num_heads_kv"] == 1, op, "64 query heads over 1 KV head")


def _check_kv_quant_sparse_attn(b: dict) -> None:
    op = "npu_kv_quant_sparse_attn_sharedkv"
    q = b["q"]
    require(q.dtype == torch.bfloat16 and q.is_contiguous(), op, "q bf16, contiguous")
    require(b["kv_quant_mode"] == 1, op, "kv_quant_mode 1 (per-tile e4m3 nope)")
    require(b.get("tile_size", 0) == 64 and b.get("rope_head_dim", 0) == 64, op, "tile_size 64, rope_head_dim 64")
    lq = b.get("layout_q", "BSND")
    require(lq in ("TND", "BSND") and b.get("layout_kv", "PA_ND") == "PA_ND", op, "layout_q TND|BSND, layout_kv PA_ND")
    require(q.shape[-1] == 512 and q.shape[-2] in (64, 128), op, "q D 512, N1 64|128")
    if lq == "TND":
        require(q.dim() == 3 and b.get("cu_seqlens_q") is not None, op, "TND q [T, N1, D] with cu_seqlens_q")
    require(b.get("metadata") is not None and tuple(b["metadata"].shape) == (1024,), op, "metadata [1024] is required")
    require(b.get("ori_win_left", 127) == 127 and b.get("ori_win_right", 0) == 0, op, "ori_win_left 127, ori_win_right 0")
    require(b.get("ori_mask_mode", 4) == 4 and b.get("cmp_mask_mode", 3) == 3, op, "mask modes 4 (band) / 3 (causal)")
    require(not b.get("return_softmax_lse", False), op, "return_softmax_lse False (reserved)")
    require(b.get("softmax_scale", 0.0) > 0, op, "softmax_scale is required")
    s = b.get("sinks")
    require(s is not None and s.dtype == torch.float32 and tuple(s.shape) == (q.shape[-2],), op,
            "sinks fp32 [N1] are required")
    require(b.get("ori_kv") is not None, op, "ori_kv is required (every scenario has the window)")
    for kv, table in (("ori_kv", "ori_block_table"), ("cmp_kv", "cmp_block_table")):
        c = b.get(kv)
        if c is None:
            continue
        require(c.dim() == 4 and c.shape[2] == 1 and c.shape[3] == 640, op, f"{kv} [NB, BS, 1, 640]")
        require(c.dtype == torch.float8_e4m3fn and c.is_contiguous(), op, f"{kv} contiguous float8_e4m3fn")
        require(c.shape[1] % 16 == 0 and c.shape[1] <= 1024, op, f"{kv} block size a multiple of 16 up to 1024")
        t = b.get(table)
        require(t is not None and t.dtype == torch.int32 and t.dim() == 2, op, f"{table} int32 [B, M]")
    ratio = b.get("cmp_ratio", 0)
    require(ratio in (4, 128) if b.get("cmp_kv") is not None else ratio == 1, op,
            "cmp_ratio 4|128 with cmp_kv, 1 without")
    idx = b.get("cmp_sparse_indices")
    if idx is not None:
        require(b.get("cmp_kv") is not None, op, "cmp_sparse_indices needs cmp_kv")
        require(idx.dtype == torch.int32 and idx.dim() == 3 and idx.shape[1] == 1 and idx.shape[2] in (512, 1024),
                op, "cmp_sparse_indices int32 [T, 1, 512|1024]")


def _check_kv_quant_sparse_meta(b: dict) -> None:
    op = "npu_kv_quant_sparse_attn_sharedkv_metadata"
    require(b["num_heads_q"] in (64, 128) and b["num_heads_kv"] == 1 and b["head_dim"] == 512, op,
            "64|128 query heads over 1 KV head, head_dim 512")
    require(b["kv_quant_mode"] == 1, op, "kv_quant_mode 1")
    require(b.get("cmp_ratio", -1) in ((4, 128) if b.get("has_cmp_kv", True) else (1,)), op,
            "cmp_ratio 4|128 with compressed KV, 1 without")


def _check_kv_compress_epilog(b: dict) -> None:
    op = "kv_compress_epilog"
    c, x, sm = b["kv_compress_cache"], b["x"], b["slot_mapping"]
    require(x.dim() == 2 and min(x.shape) > 0 and x.dtype == torch.bfloat16, op, "x bf16 [T, D], T and D > 0")
    require(sm.dim() == 1 and sm.shape[0] == x.shape[0] and sm.dtype in (torch.int32, torch.int64), op,
            "slot_mapping int32|int64 [T]")
    require(c.dtype in (torch.float8_e4m3fn, torch.float8_e5m2), op, "cache float8_e4m3fn|e5m2")
    require(c.dim() in (3, 4) and (c.dim() == 3 or c.shape[2] == 1), op, "cache [N, 1, W] or [NB, BS, 1, W]")
    require(b["quant_mode"] == 2 and b["quant_group_size"] == 64 and b["round_scale_flag"] is True
            and b["layout"] == 1, op, "the mode DeepSeek-V4's window/compressed KV uses: quant_mode 2 (MXFP8), "
                                      "group 64, round_scale_flag True, layout 1")
    require(x.shape[1] == 512 and c.shape[-1] == 640, op, "x [T, 512] (448 quantised + 64 rope) into 640-byte rows")
    require(c.dtype == torch.float8_e4m3fn, op, "e4m3 codes (the sparse attention reads e4m3)")


def _check_hc_pre(b: dict) -> None:
    op = "npu_hc_pre_v2"
    x, fn, sc, base = b["x"], b["hc_fn"], b["hc_scale"], b["hc_base"]
    require(x.dim() in (3, 4) and x.dtype == torch.bfloat16, op, "x bf16 [T, hc, d] or [B, S, hc, d]")
    hc, d = x.shape[-2], x.shape[-1]
    require(b["hc_mult"] == 4 and hc == 4, op, "hc_mult 4")
    require(d in (4096, 7168), op, f"d {d}: 4096 or 7168")
    require(fn.dtype == sc.dtype == base.dtype == torch.float32, op, "hc_fn, hc_scale, hc_base fp32")
    require(tuple(fn.shape) == (24, hc * d) and tuple(sc.shape) == (3,) and tuple(base.shape) == (24,), op,
            "hc_fn [24, hc*d], hc_scale [3], hc_base [24]")


def _check_hc_post(b: dict) -> None:
    op = "npu_hc_post"
    x, r, post, comb = b["x"], b["residual"], b["post"], b["comb"]
    require(x.dim() == 3 and r.dim() == 4 and post.dim() == 3 and comb.dim() == 4, op,
            "x [b,s,d], residual [b,s,hc,d], post [b,s,hc], comb [b,s,hc,hc]")
    hc = r.shape[2]
    require(r.shape[:2] == x.shape[:2] and r.shape[3] == x.shape[2] and post.shape == (*x.shape[:2], hc)
            and comb.shape == (*x.shape[:2], hc, hc), op, "shapes agree on b, s, hc, d")
    require(min(x.shape) > 0, op, "no empty tensor")
    require(x.dtype in HALF + (torch.float32,) and r.dtype == x.dtype, op, "x, residual: one dtype fp16/bf16/fp32")
    require(post.dtype in HALF + (torch.float32,) and comb.dtype == post.dtype, op, "post, comb: one dtype")


def _check_gating_hash(b: dict) -> None:
    op = "moe_gating_top_k_hash"
    x, k = b["x"], b["k"]
    require(x.dim() == 2 and 0 < k <= x.shape[-1], op, "x [T, E], 0 < k <= E")
    nt = b.get("norm_type", 0)
    require(nt in (0, 1, 2) and b.get("renorm", 0) == 0, op, "norm_type 0|1|2, renorm 0")
    require(nt != 2 or b.get("group_count", 1) == 1, op, "norm_type 2 (softplus) needs group_count 1")
    ids, table = b.get("input_ids"), b.get("tid2eid")
    require((ids is None) == (table is None), op, "input_ids and tid2eid come together")
    if ids is not None:
        require(ids.dtype == torch.int64 and ids.dim() == 1 and ids.shape[0] == x.shape[0], op, "input_ids int64 [T]")
        require(table.dtype == torch.int32 and table.dim() == 2 and table.shape[1] == k, op, "tid2eid int32 [V, k]")
    if b.get("bias") is not None:
        require(tuple(b["bias"].shape) == (x.shape[-1],), op, "bias [E]")


def _check_mc2_dispatch(b: dict) -> None:
    op = "npu_moe_distribute_dispatch"
    x, ids = b["x"], b["expert_ids"]
    require(x.dim() == 2 and x.dtype in HALF, op, "x [BS, H] fp16/bf16")
    require(x.shape[1] % 32 == 0 and x.shape[1] <= 7168, op, "H a multiple of 32 up to 7168")
    require(0 < x.shape[0] <= 512, op, "0 < BS <= 512 (A3; A2: 256)")
    require(ids.dtype == torch.int32 and ids.dim() == 2 and ids.shape[0] == x.shape[0] and 0 < ids.shape[1] <= 8, op,
            "expert_ids int32 [BS, K], 0 < K <= 8")
    n, ws = b["moe_expert_num"], b["ep_world_size"]
    require(n % ws == 0 and 0 <= b["ep_rank_id"] < ws, op, "moe_expert_num divisible by ep_world_size; rank in range")
    require(int(ids.min()) >= 0 and int(ids.max()) < n, op, "expert ids in [0, moe_expert_num)")


def _check_mc2_combine(b: dict) -> None:
    op = "npu_moe_distribute_combine"
    ids, sc = b["expert_ids"], b["expert_scales"]
    require(b["expand_x"].dim() == 2 and ids.dtype == torch.int32, op, "expand_x [A, H], expert_ids int32")
    require(sc.dtype == torch.float32 and sc.shape == ids.shape, op, "expert_scales fp32 [BS, K]")


def _check_aten_linear(b: dict) -> None:
    x, w, bias = b["input"], b["weight"], b.get("bias")
    require(w.dim() == 2 and x.shape[-1] == w.shape[1] and w.dtype == x.dtype, "aten_linear", "weight [N, K] in x's dtype")
    require(bias is None or (bias.shape == w.shape[:1] and bias.dtype == x.dtype), "aten_linear", "bias [N] in x's dtype")


def _check_aten_embedding(b: dict) -> None:
    require(b["indices"].dtype in (torch.int32, torch.int64) and b["weight"].dim() == 2, "aten_embedding",
            "int indices into a 2-D table")


def _check_aten_sort(b: dict) -> None:
    require(b.get("stable") is True, "aten_sort_stable", "stable=True (ties by lower index)")


def _check_aten_multinomial(b: dict) -> None:
    require(b["self"].dtype == torch.float32 and b["self"].dim() in (1, 2), "aten_multinomial", "fp32 probabilities")


CHECKS.update({
    "npu_lightning_indexer": [_check_lightning_indexer], "npu_sparse_attn_sharedkv": [_check_sparse_attn],
    "npu_sparse_attn_sharedkv_metadata": [_check_sparse_meta], "npu_hc_pre_v2": [_check_hc_pre],
    "npu_hc_post": [_check_hc_post], "moe_gating_top_k_hash": [_check_gating_hash],
    "npu_kv_quant_sparse_attn_sharedkv": [_check_kv_quant_sparse_attn],
    "npu_kv_quant_sparse_attn_sharedkv_metadata": [_check_kv_quant_sparse_meta],
    "kv_compress_epilog": [_check_kv_compress_epilog],
    "npu_moe_distribute_dispatch": [_check_mc2_dispatch], "npu_moe_distribute_combine": [_check_mc2_combine],
    "aten_linear": [_check_aten_linear], "aten_embedding": [_check_aten_embedding],
    "aten_sort_stable": [_check_aten_sort], "aten_multinomial": [_check_aten_multinomial],
})


CHECKS.update({
    "npu_rms_norm": [_check_rms], "npu_add_rms_norm": [_check_rms], "npu_rotary_mul": [_check_rotary],
    "npu_fused_infer_attention_score": [_check_fia], "npu_fused_infer_attention_score_v2": [_check_fia],
    "npu_scatter_pa_kv_cache": [_check_scatter_pa], "npu_scatter_nd_update_": [_check_nd_update],
    "npu_moe_gating_top_k": [_check_gating], "npu_moe_init_routing_v2": [_check_init_routing],
    "npu_grouped_matmul": [_check_gmm], "npu_swiglu": [_check_swiglu], "npu_clipped_swiglu": [_check_swiglu],
    "npu_moe_finalize_routing": [_check_finalize], "npu_dynamic_quant": [_check_dyn_quant],
    "npu_dynamic_mx_quant": [_check_dyn_mx_quant], "npu_quant_matmul": [_check_quant_matmul],
    "npu_grouped_matmul_swiglu_quant": [_check_gmm_swiglu_quant],
})
