"""A fake ``torch_npu``: each operator computes, in plain PyTorch on the CPU, what its torch-npu 2.13.0
documentation says it computes (written from the docs, independently of backends/reference), so the
wrappers' pre/post-processing is exercised and their results can be compared with the reference ops.

It is an ordinary object injected into the wrappers; nothing imports torch_npu. Where the docs leave a
convention open (e.g. the order of init_routing's row index), the fake follows the reading documented in
backends/ascend950/ops.py; a hardware run (tests marked ``ascend``) is what settles it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _rot_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _rot_inter(x):
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((-b, a), dim=-1).flatten(-2)


class FakeNpu:
    # ------------------------------------------------------------------ norms, rope, activations
    def npu_rms_norm(self, x, gamma, epsilon=1e-6):
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
        return (xf * rstd * gamma.float()).to(x.dtype), rstd

    def npu_add_rms_norm(self, x1, x2, gamma, epsilon=1e-6):
        h = x1 + x2
        y, rstd = self.npu_rms_norm(h, gamma, epsilon)
        return y, rstd, h

    def npu_rotary_mul(self, x, r1, r2, rotary_mode="half", rotate=None):
        xf = x.float()
        rot = _rot_half(xf) if rotary_mode == "half" else _rot_inter(xf)
        return (xf * r1.float() + rot * r2.float()).to(x.dtype)

    def npu_swiglu(self, x, dim=-1):
        a, b = x.float().chunk(2, dim=dim)
        return (F.silu(a) * b).to(x.dtype)

    def npu_gelu(self, input, approximate="none"):
        return F.gelu(input.float(), approximate=approximate).to(input.dtype)

    def npu_clipped_swiglu(self, x, *, group_index=None, dim=-1, alpha=1.702, limit=7.0, bias=1.0, interleaved=True):
        xf = x.float()
        a, b = (xf[..., 0::2], xf[..., 1::2]) if interleaved else xf.chunk(2, dim=-1)
        a, b = a.clamp(max=limit), b.clamp(min=-limit, max=limit)
        return (a * torch.sigmoid(alpha * a) * (b + bias)).to(x.dtype)

    # ------------------------------------------------------------------ attention
    def _fia(self, query, key, value, atten_mask, seq_q, seq_kv, block_table, block_size, heads, kv_heads,
             scale, layout, sparse_mode, pre_tokens, next_tokens, sink):
        assert layout == "BSND" and block_table is not None
        b, s, h, d = query.shape
        kvh = kv_heads or heads
        out = torch.zeros(b, s, h, d, dtype=torch.float32)
        for i in range(b):
            n_kv = seq_kv[i]
            n_q = seq_q[i] if seq_q is not None else s
            blocks = block_table[i].long()
            pos = torch.arange(n_kv)
            k = key[blocks[pos // block_size], pos % block_size].float().view(n_kv, kvh, d)
            v = value[blocks[pos // block_size], pos % block_size].float().view(n_kv, kvh, d)
            rep = h // kvh
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            qf = query[i, :n_q].float()  # [n_q, h, d]
            logits = torch.einsum("qhd,khd->hqk", qf, k) * scale
            qpos = torch.arange(n_kv - n_q, n_kv)  # right-down alignment: queries are the last n_q positions
            if s == 1:
                vis = torch.ones(1, n_kv, dtype=torch.bool)
                if atten_mask is not None:
                    vis &= ~atten_mask[i, :n_kv].bool()[None]
            elif sparse_mode == 3:
                vis = pos[None, :] <= qpos[:, None]
            elif sparse_mode == 4:
                vis = (pos[None, :] >= qpos[:, None] - pre_tokens) & (pos[None, :] <= qpos[:, None] + next_tokens)
            else:
                raise AssertionError(f"fake FIA: sparse_mode {sparse_mode} not emulated")
            logits = logits.masked_fill(~vis[None], float("-inf"))
            if sink is not None:
                logits = torch.cat((logits, sink.float().view(h, 1, 1).expand(h, n_q, 1)), -1)
            p = torch.softmax(logits, -1)
            if sink is not None:
                p = p[..., :-1]
            out[i, :n_q] = torch.einsum("hqk,khd->qhd", p, v)
        return out.to(query.dtype), torch.zeros(1)

    def npu_fused_infer_attention_score(self, query, key, value, *, atten_mask=None, actual_seq_lengths=None,
                                        actual_seq_lengths_kv=None, block_table=None, num_heads=1, scale=1.0,
                                        pre_tokens=2147483647, next_tokens=2147483647, input_layout="BSH",
                                        num_key_value_heads=0, sparse_mode=0, block_size=0, **unused):
        return self._fia(query, key, value, atten_mask, actual_seq_lengths, actual_seq_lengths_kv, block_table,
                         block_size, num_heads, num_key_value_heads, scale, input_layout, sparse_mode,
                         pre_tokens, next_tokens, None)

    def npu_fused_infer_attention_score_v2(self, query, key, value, *, atten_mask=None, actual_seq_qlen=None,
                                           actual_seq_kvlen=None, block_table=None, learnable_sink=None,
                                           num_query_heads=1, num_key_value_heads=0, softmax_scale=1.0,
                                           pre_tokens=2147483647, next_tokens=2147483647, input_layout="BSH",
                                           sparse_mode=0, block_size=0, **unused):
        return self._fia(query, key, value, atten_mask, actual_seq_qlen, actual_seq_kvlen, block_table,
                         block_size, num_query_heads, num_key_value_heads, softmax_scale, input_layout,
                         sparse_mode, pre_tokens, next_tokens, learnable_sink)

    # ------------------------------------------------------------------ KV cache
    def npu_scatter_pa_kv_cache(self, key, value, key_cache, value_cache, slot_mapping, *, cache_mode="PA_NZ", **unused):
        n = key_cache.shape[0] * key_cache.shape[1]
        key_cache.view(n, *key_cache.shape[2:])[slot_mapping.long()] = key
        value_cache.view(n, *value_cache.shape[2:])[slot_mapping.long()] = value

    def npu_scatter_nd_update_(self, self_, indices, updates):
        self_[indices[:, 0].long()] = updates
        return self_

    # ------------------------------------------------------------------ MoE
    def npu_moe_gating_top_k(self, x, k, *, bias=None, k_group=1, group_count=1, group_select_mode=0, renorm=0,
                             norm_type=0, out_flag=False, routed_scaling_factor=1.0, eps=1e-20, **unused):
        norm = torch.softmax(x.float(), -1) if norm_type == 0 else torch.sigmoid(x.float())
        choose = norm if bias is None else norm + bias.float()
        idx = torch.topk(choose, k, dim=-1).indices
        y = norm.gather(1, idx)
        y = y / (y.sum(-1, keepdim=True) + eps) * routed_scaling_factor
        return y.to(x.dtype), idx.to(torch.int32), norm

    def _route(self, expert_idx, num_experts):
        t, k = expert_idx.shape
        flat = expert_idx.reshape(-1).long()  # row-major source order (t*K + k)
        order = torch.sort(flat, stable=True).indices  # dst → source (row-major)
        dst_of_src = torch.empty_like(order)
        dst_of_src[order] = torch.arange(order.numel())
        # index by k-major source (k*T + t), the order finalize_routing reads
        src_to_dst = dst_of_src.view(t, k).t().reshape(-1).to(torch.int32)
        counts = torch.bincount(flat, minlength=num_experts).to(torch.int64)
        return order, src_to_dst, counts

    def npu_moe_init_routing_v2(self, x, expert_idx, *, active_num=-1, expert_num=-1, active_expert_range=(),
                                **unused):
        k = expert_idx.shape[1]
        order, src_to_dst, counts = self._route(expert_idx, expert_num)
        expanded_x = x[order // k]
        return expanded_x, src_to_dst, counts, torch.zeros(order.numel(), dtype=torch.float32)

    def npu_grouped_matmul(self, x, weight, *, group_list=None, scale=None, per_token_scale=None, output_dtype=None,
                           **unused):
        xx, w = x[0], weight[0]
        out = torch.zeros(xx.shape[0], w.shape[2], dtype=torch.float32)
        start = 0
        if xx.dtype == torch.float8_e4m3fn:  # MXFP8: x [M, K] with e8m0 [M, K/64, 2], weight [E, K, N] with
            # e8m0 [E, K/64, N, 2]: each operand times 2**(byte - 127) per 32 along K, products summed in fp32
            def e8(t):
                return torch.exp2(t.view(torch.uint8).float() - 127)

            k = xx.shape[1]
            xs = e8(per_token_scale[0]).reshape(xx.shape[0], k // 32).repeat_interleave(32, -1)
            ws = e8(scale[0]).permute(0, 1, 3, 2).reshape(w.shape[0], k // 32, w.shape[2]).repeat_interleave(32, 1)
            xx, w = xx.float() * xs, w.float() * ws
            scale = per_token_scale = None
        for e, n in enumerate(group_list.tolist()):
            seg = xx[start:start + n].float() @ w[e].float()
            if scale is not None:
                seg = seg * scale[0][e].float()[None, :] * per_token_scale[0][start:start + n].float()[:, None]
            out[start:start + n] = seg
            start += n
        dtype = xx.dtype if output_dtype is None else {5: torch.float16, 15: torch.bfloat16, 6: torch.float32}[output_dtype]
        return [out.to(dtype)]

    def npu_quant_matmul(self, x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None,
                         x1_dtype=None, x2_dtype=None, pertoken_scale_dtype=None, scale_dtype=None, group_sizes=None,
                         y_scale=None):
        # MX mode (W8A8MXFP): x1 e4m3 [M, K] with e8m0 pertoken_scale [M, K/64, 2], x2 e4m3 [K, N] with e8m0 scale
        # [K/64, N, 2]: each operand times 2**(byte - 127) per 32 along K, products summed in fp32, + bias (fp32)
        def e8(t):
            return torch.exp2(t.view(torch.uint8).float() - 127)

        m, k = x1.shape
        n = x2.shape[1]
        xs = e8(pertoken_scale).reshape(m, k // 32).repeat_interleave(32, -1)
        ws = e8(scale).permute(0, 2, 1).reshape(k // 32, n).repeat_interleave(32, 0)
        out = (x1.float() * xs) @ (x2.float() * ws)
        if bias is not None:
            out = out + bias.float()
        return out.to({5: torch.float16, 15: torch.bfloat16}[output_dtype])

    def npu_moe_finalize_routing(self, rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                                 export_for_source_row, drop_pad_mode=0, k=1):
        t = rows.shape[0] // k
        idx = expanded_src_to_dst_row.long().view(k, t)  # k-major
        out = torch.zeros(t, rows.shape[1], dtype=torch.float32)
        for j in range(k):
            out += scales[:, j, None].float() * rows[idx[j]].float()
        return out.to(rows.dtype)

    def npu_dynamic_quant(self, input, *, smooth_scales=None, group_index=None, dst_type=None, **unused):
        scale = input.float().abs().amax(-1).clamp(min=1e-12) / 127.0
        return torch.round(input.float() / scale[:, None]).clamp(-128, 127).to(torch.int8), scale

    def npu_dynamic_mx_quant(self, input, *, axis=-1, round_mode="rint", dst_type, scale_alg=None, dst_type_max=0.0):
        # aclnnDynamicMxQuant, scale_alg 0: per 32 values of the last axis mxscale = 2**(floor(log2(amax)) - 8)
        # (emax of e4m3), y = x / mxscale cast to e4m3 (saturated at 448: the reading of the cast this fake takes);
        # an all-zero block gets the smallest scale. mxscale as e8m0, in pairs: [..., K/64, 2]
        x = input.float()
        blocks = x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
        amax = blocks.abs().amax(-1)
        _, ex = torch.frexp(amax)  # amax = m * 2**ex with m in [0.5, 1): floor(log2 amax) = ex - 1
        e = torch.where(amax > 0, ex - 1 - 8, torch.full_like(ex, -127)).clamp(-127, 127)
        y = (blocks / torch.exp2(e.float())[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        sc = (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
        return y.reshape(x.shape), sc.reshape(*x.shape[:-1], x.shape[-1] // 64, 2)

    # ------------------------------------------------------------------ MC2 (single EP rank)
    def npu_moe_distribute_dispatch(self, x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *,
                                    expert_scales=None, x_active_mask=None, quant_mode=0, **unused):
        # tokens grouped by expert (expert_token_nums_type 1: counts); rows left out by x_active_mask are not
        # sent: the fake gives them an expert past the last and drops them, so expand_x holds the A sent rows
        assert ep_world_size == 1, "the fake emulates one EP rank"
        k = expert_ids.shape[1]
        ids = expert_ids.long()
        if x_active_mask is not None:
            ids = torch.where(x_active_mask[:, None], ids, moe_expert_num)
        order, src_to_dst, counts = self._route(ids, moe_expert_num + 1)
        n = int(counts[:moe_expert_num].sum())
        return (x[order[:n] // k], None, src_to_dst, counts[:moe_expert_num], torch.tensor([n]), torch.tensor([n]),
                torch.zeros(n, dtype=torch.float32))

    def npu_moe_distribute_combine(self, expand_x, expert_ids, expand_idx, ep_send_counts, expert_scales, group_ep,
                                   ep_world_size, ep_rank_id, moe_expert_num, *, x_active_mask=None, **unused):
        k = expert_ids.shape[1]
        t = expert_ids.shape[0]
        rows = torch.cat((expand_x, expand_x.new_zeros(t * k - expand_x.shape[0], expand_x.shape[1])))
        scales = expert_scales if x_active_mask is None else expert_scales * x_active_mask[:, None]
        return self.npu_moe_finalize_routing(rows, None, None, None, scales.to(expand_x.dtype), expand_idx, None, 0, k)

    # ------------------------------------------------------------------ DeepSeek-V4 (contract.CITATIONS)
    def npu_lightning_indexer(self, query, key, weights, *, actual_seq_lengths_query=None, actual_seq_lengths_key=None,
                              block_table=None, layout_query="BSND", layout_key="BSND", sparse_count=2048,
                              sparse_mode=3, pre_tokens=None, next_tokens=None, return_value=False):
        # README formula: score[s] = sum_g w[g] * relu(q[g] . k[s]); top-sparse_count indices (and values) per
        # query token, -1 / -inf past the key's length. Emulated for TND query and TND key (prefix-sum lengths).
        # Not stated there: the order of equal scores (lower index first here) and the values' dtype (fp32 here).
        assert layout_query == "TND" and layout_key == "TND"
        cu_q = [0] + [int(v) for v in actual_seq_lengths_query.tolist()]
        cu_k = [0] + [int(v) for v in actual_seq_lengths_key.tolist()]
        t = query.shape[0]
        idx = torch.full((t, 1, sparse_count), -1, dtype=torch.int32)
        val = torch.full((t, 1, sparse_count), float("-inf"))
        for b in range(len(cu_q) - 1):
            q, k = query[cu_q[b]:cu_q[b + 1]].float(), key[cu_k[b]:cu_k[b + 1], 0].float()
            nq, nk = q.shape[0], k.shape[0]
            sc = (F.relu(torch.einsum("tgd,sd->tgs", q, k)) * weights[cu_q[b]:cu_q[b + 1]].float()[..., None]).sum(1)
            if sparse_mode == 3:  # rightDownCausal: query i sees keys s <= nk - nq + i
                sc = sc.masked_fill(torch.arange(nk)[None, :] > (nk - nq + torch.arange(nq))[:, None], float("-inf"))
            n = min(sparse_count, nk)
            v, i = torch.sort(sc, dim=-1, descending=True, stable=True)
            v, i = v[:, :n], i[:, :n]
            i = torch.where(torch.isinf(v), torch.full_like(i, -1), i)
            idx[cu_q[b]:cu_q[b + 1], 0, :n] = i.to(torch.int32)
            val[cu_q[b]:cu_q[b + 1], 0, :n] = v
        return idx, (val if return_value else torch.zeros(0))

    def npu_sparse_attn_sharedkv_metadata(self, num_heads_q, num_heads_kv, head_dim, **unused):
        return torch.zeros(1024, dtype=torch.int32)  # the split plan: opaque, only its shape is documented

    def npu_sparse_attn_sharedkv(self, q, *, ori_kv=None, cmp_kv=None, cmp_sparse_indices=None, ori_block_table=None,
                                 cmp_block_table=None, cu_seqlens_q=None, seqused_kv=None, sinks=None, metadata=None,
                                 softmax_scale=0.0, cmp_ratio=0, ori_win_left=128, layout_q="BSND", **unused):
        # README: O = softmax(Q K~^T * scale) V~ with K~ = V~ = the query's band of ori_kv (its own token and
        # ori_win_left before it) plus its causally closed cmp_kv entries (entry e with (e+1)*cmp_ratio <= pos+1),
        # the listed ones when cmp_sparse_indices is given; the sink joins each head's softmax denominator.
        # Queries are the last tokens of their sequence (seqused_kv tokens in all). Emulated for TND.
        assert layout_q == "TND"
        cu = cu_seqlens_q.long().tolist()
        used = seqused_kv.long().tolist()
        t, n, d = q.shape
        out = torch.zeros(t, n, d)
        bs = ori_kv.shape[1]
        for b in range(len(cu) - 1):  # the rows of one sequence at once, masked
            r0, r1 = cu[b], cu[b + 1]
            if r1 == r0:
                continue
            pos = used[b] - (r1 - r0) + torch.arange(r1 - r0)  # [R]
            kp = pos[:, None] - ori_win_left + torch.arange(ori_win_left + 1)  # [R, W]
            kpc = kp.clamp(min=0)
            parts = [ori_kv[ori_block_table[b, kpc // bs].long(), kpc % bs, 0].float()]  # [R, W, D]
            masks = [kp >= 0]
            if cmp_kv is not None:
                closed = (pos + 1) // cmp_ratio  # entry e is closed when (e + 1) * cmp_ratio <= pos + 1
                if cmp_sparse_indices is not None:
                    e = cmp_sparse_indices[r0:r1, 0].long()
                else:
                    e = torch.arange(max(1, int(closed.max()))).expand(r1 - r0, -1)
                ec, cbs = e.clamp(min=0), cmp_kv.shape[1]
                col = (ec // cbs).clamp(max=cmp_block_table.shape[1] - 1)
                parts.append(cmp_kv[cmp_block_table[b, col].long().clamp(min=0), ec % cbs, 0].float())
                masks.append((e >= 0) & (e < closed[:, None]))
            kv, mask = torch.cat(parts, 1), torch.cat(masks, 1)  # [R, S, D], [R, S]
            logits = torch.einsum("rnd,rsd->rns", q[r0:r1].float(), kv) * softmax_scale
            logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
            if sinks is not None:
                logits = torch.cat((logits, sinks.float()[None, :, None].expand(r1 - r0, n, 1)), -1)
            p = torch.softmax(logits, -1)[..., :kv.shape[1]]
            out[r0:r1] = torch.einsum("rns,rsd->rnd", p, kv)
        return out.to(q.dtype), torch.zeros(1)

    # ------------------------------------------------------------------ the 950's FP8 KV (contract.CITATIONS)
    def kv_compress_epilog(self, kv_compress_cache, x, slot_mapping, quant_group_size, quant_mode, round_scale_flag,
                           layout):
        # quant_mode 2, layout 1 (kernel header): per group of x[:, :448] scale = 2**ceil(log2(max(amax, 1e-4) *
        # fp32(1/448))), codes = x / scale clamped to +-448 as e4m3, scale byte = biased exponent; row = x[:, 448:]
        # as bf16 | codes | scales | zeros, written at row slot (slot -1: skipped)
        assert quant_mode == 2 and layout == 1 and round_scale_flag
        rows = kv_compress_cache.view(torch.uint8).view(-1, kv_compress_cache.shape[-1])
        g, nope = quant_group_size, x.shape[1] - 64
        keep = slot_mapping >= 0
        xf = x[keep].float()
        blocks = xf[:, :nope].reshape(xf.shape[0], nope // g, g)
        s = blocks.abs().amax(-1).clamp(min=1e-4) * torch.tensor(1 / 448, dtype=torch.float32)
        mant, exp = torch.frexp(s)
        e = torch.where(mant == 0.5, exp - 1, exp)  # a power of two is its own ceiling
        codes = (blocks / torch.exp2(e.float())[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        out = torch.zeros(xf.shape[0], rows.shape[1], dtype=torch.uint8)
        out[:, :128] = x[keep][:, nope:].to(torch.bfloat16).contiguous().view(torch.uint8)
        out[:, 128:128 + nope] = codes.view(torch.uint8).reshape(xf.shape[0], nope)
        out[:, 128 + nope:128 + nope + nope // g] = (e + 127).to(torch.uint8)
        rows[slot_mapping[keep].long()] = out

    def npu_kv_quant_sparse_attn_sharedkv_metadata(self, num_heads_q, num_heads_kv, head_dim, kv_quant_mode, **unused):
        return torch.zeros(1024, dtype=torch.int32)  # the AI-CPU core split: opaque, only its shape is documented

    def npu_kv_quant_sparse_attn_sharedkv(self, q, kv_quant_mode, ori_kv=None, cmp_kv=None, ori_sparse_indices=None,
                                          cmp_sparse_indices=None, ori_block_table=None, cmp_block_table=None,
                                          cu_seqlens_q=None, seqused_kv=None, sinks=None, metadata=None, tile_size=0,
                                          rope_head_dim=0, softmax_scale=0.0, cmp_ratio=0, ori_win_left=127,
                                          layout_q="BSND", **unused):
        # README: as npu_sparse_attn_sharedkv, over 640-byte rows dequantised first: rope bf16 (128 B) | e4m3 nope
        # 448 | e8m0 scales, one per tile_size; K~ = V~ = [nope * scale | rope] (q's channel order)
        def dequant(c, table):  # the blocks the table lists (the rest of the pool is never read)
            used = table[table >= 0].long().unique()
            out = torch.zeros(c.shape[0], c.shape[1], 1, 512)
            r = c[used].view(torch.uint8).reshape(len(used), c.shape[1], c.shape[-1])
            nope = 512 - rope_head_dim
            rope = r[..., :2 * rope_head_dim].contiguous().view(torch.bfloat16).float()
            codes = r[..., 2 * rope_head_dim:2 * rope_head_dim + nope].contiguous().view(torch.float8_e4m3fn).float()
            sb = r[..., 2 * rope_head_dim + nope:2 * rope_head_dim + nope + nope // tile_size].float()
            scale = torch.where(sb == 0, torch.zeros(()), torch.exp2(sb - 127))
            vals = codes.view(*codes.shape[:2], nope // tile_size, tile_size) * scale[..., None]
            out[used] = torch.cat((vals.reshape(*codes.shape), rope), -1)[:, :, None]
            return out  # [NB, BS, 1, 512]

        return self.npu_sparse_attn_sharedkv(
            q, ori_kv=dequant(ori_kv, ori_block_table),
            cmp_kv=None if cmp_kv is None else dequant(cmp_kv, cmp_block_table),
            cmp_sparse_indices=cmp_sparse_indices, ori_block_table=ori_block_table, cmp_block_table=cmp_block_table,
            cu_seqlens_q=cu_seqlens_q, seqused_kv=seqused_kv, sinks=sinks, softmax_scale=softmax_scale,
            cmp_ratio=cmp_ratio, ori_win_left=ori_win_left, layout_q=layout_q)

    def npu_hc_pre_v2(self, x, hc_fn, hc_scale, hc_base, hc_mult, hc_sinkhorn_iters, norm_eps, hc_eps):
        # mHC entry as transformers' DeepSeek-V4 computes it: RMS-normalised flat streams times hc_fn, then
        # pre = sigmoid + eps, post = 2 sigmoid, comb = softmax + eps, Sinkhorn (columns first); y = sum pre*x
        t, n, d = x.shape
        flat = x.reshape(t, n * d).float()
        flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + norm_eps)
        mixed = flat @ hc_fn.float().T
        pw, qw, cw = mixed.split([n, n, n * n], -1)
        pb, qb, cb = hc_base.float().split([n, n, n * n])
        pre = torch.sigmoid(pw * hc_scale[0] + pb) + hc_eps
        post = 2 * torch.sigmoid(qw * hc_scale[1] + qb)
        comb = torch.softmax(cw.view(t, n, n) * hc_scale[2] + cb.view(n, n), -1) + hc_eps
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
        for _ in range(hc_sinkhorn_iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
            comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
        y = (pre[..., None] * x.float()).sum(1)
        return y.to(torch.bfloat16), post, comb

    def npu_hc_post(self, x, residual, post, comb):
        # out[j] = post[j] * x + sum_i comb[i, j] * residual[i]  (comb as npu_hc_pre_v2 returns it)
        mixed = torch.einsum("bsij,bsid->bsjd", comb.float(), residual.float())
        return (post.float()[..., None] * x.float()[:, :, None] + mixed).to(residual.dtype)

    def moe_gating_top_k_hash(self, x, k, bias=None, input_ids=None, tid2eid=None, k_group=1, group_count=1,
                              routed_scaling_factor=1.0, eps=1e-20, group_select_mode=0, renorm=0, norm_type=0,
                              out_flag=False):
        # norm_type 0 softmax, 1 sigmoid, 2 sqrt(softplus); ids = tid2eid[input_ids] with a table, else the
        # top-k of norm (+ bias); y = norm[ids] / (sum + eps) * routed_scaling_factor (renorm 0)
        xf = x.float()
        norm = {0: lambda v: torch.softmax(v, -1), 1: torch.sigmoid, 2: lambda v: F.softplus(v).sqrt()}[norm_type](xf)
        if tid2eid is not None:
            idx = tid2eid[input_ids.long()].long()
        else:
            idx = torch.topk(norm if bias is None else norm + bias.float(), k, dim=-1).indices
        y = norm.gather(1, idx)
        y = y / (y.sum(-1, keepdim=True) + eps) * routed_scaling_factor
        return y.to(x.dtype), idx.to(torch.int32), norm

    # ------------------------------------------------------------------ aten operators (PyTorch's own semantics)
    def aten_linear(self, input, weight, bias=None):
        return F.linear(input, weight, bias)

    def aten_embedding(self, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
        return F.embedding(indices, weight)

    def aten_argmax(self, self_, dim=None, keepdim=False):
        return torch.argmax(self_, dim=dim, keepdim=keepdim)

    def aten_sort_stable(self, self_, *, stable, dim=-1, descending=False):
        return torch.sort(self_, stable=stable, dim=dim, descending=descending)

    def aten_multinomial(self, self_, num_samples, replacement=False, *, generator=None):
        return torch.multinomial(self_, num_samples, replacement, generator=generator)
