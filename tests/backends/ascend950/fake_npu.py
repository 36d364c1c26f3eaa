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
        for e, n in enumerate(group_list.tolist()):
            seg = xx[start:start + n].float() @ w[e].float()
            if scale is not None:
                seg = seg * scale[0][e].float()[None, :] * per_token_scale[0][start:start + n].float()[:, None]
            out[start:start + n] = seg
            start += n
        dtype = xx.dtype if output_dtype is None else {1: torch.float16, 27: torch.bfloat16}[output_dtype]
        return [out.to(dtype)]

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

    # ------------------------------------------------------------------ MC2 (single EP rank)
    def npu_moe_distribute_dispatch(self, x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *,
                                    expert_scales=None, quant_mode=0, **unused):
        assert ep_world_size == 1, "the fake emulates one EP rank"
        k = expert_ids.shape[1]
        order, src_to_dst, counts = self._route(expert_ids, moe_expert_num)
        n = order.numel()
        return (x[order // k], None, src_to_dst, counts, torch.tensor([n]), torch.tensor([n]),
                torch.zeros(n, dtype=torch.float32))

    def npu_moe_distribute_combine(self, expand_x, expert_ids, expand_idx, ep_send_counts, expert_scales, group_ep,
                                   ep_world_size, ep_rank_id, moe_expert_num, **unused):
        k = expert_ids.shape[1]
        return self.npu_moe_finalize_routing(expand_x, None, None, None, expert_scales.to(expand_x.dtype),
                                             expand_idx, None, 0, k)
