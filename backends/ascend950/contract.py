"""The torch_npu operators the ascend950 backend calls, their documented signatures, and a call recorder.

:data:`SCHEMAS` holds the signature of every operator the backend may call, and :data:`CITATIONS` where
each one comes from: torch_npu's own operators as torch_npu 2.13.0 declares them
(``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml`` in the ``torch-npu==2.13.0`` wheel; argument
meanings from ``torch_npu/_op_plugin_docs.py``); DeepSeek-V4's sparse attention, mHC and hash routing as
vllm-ascend's custom-op library defines them (``csrc/torch_binding.cpp`` and each operator's README, at the
commit named in the citation); aten operators as PyTorch's ``native_functions.yaml`` does.
:data:`NAMESPACES` says where each is found at run time (see ``operators.py``). Unused trailing optional
arguments of very long schemas are kept, so a misspelt keyword is caught.

:class:`RecordingNpu` wraps a ``torch_npu``-like object (the real module on an NPU host, a fake in the
tests). Every call is checked against its schema (argument names, positional/keyword split, required
arguments, argument kinds) and against the backend's own documented preconditions in :data:`CHECKS`,
then recorded as plain data (:class:`NpuCall`: operator name, per-argument shape/dtype/contiguity, and
the values of strings, ints, floats and int lists). Nothing here imports torch_npu.

What this proves without a device: that each call the wrappers make is well-formed against the
published signatures and respects the documented constraints we rely on. What it does not prove: that
the operator computes what the fake computes. That needs an Ascend device (tests marked ``ascend``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

SOURCE = "torch-npu==2.13.0 wheel: torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml (schemas), torch_npu/_op_plugin_docs.py (argument docs)"

SCHEMAS: dict[str, str] = {
    "npu_rms_norm": "npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)",
    "npu_add_rms_norm": "npu_add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor, Tensor)",
    "npu_rotary_mul": "npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half', Tensor? rotate=None) -> Tensor",
    "npu_apply_rotary_pos_emb": "npu_apply_rotary_pos_emb(Tensor query, Tensor key, Tensor cos, Tensor sin, str layout='BSND', str rotary_mode='half') -> (Tensor, Tensor)",
    "npu_fused_infer_attention_score": (
        "npu_fused_infer_attention_score(Tensor query, Tensor key, Tensor value, *, Tensor? pse_shift=None, "
        "Tensor? atten_mask=None, SymInt[]? actual_seq_lengths=None, SymInt[]? actual_seq_lengths_kv=None, "
        "Tensor? dequant_scale1=None, Tensor? quant_scale1=None, Tensor? dequant_scale2=None, Tensor? quant_scale2=None, "
        "Tensor? quant_offset2=None, Tensor? antiquant_scale=None, Tensor? antiquant_offset=None, "
        "Tensor? key_antiquant_scale=None, Tensor? key_antiquant_offset=None, Tensor? value_antiquant_scale=None, "
        "Tensor? value_antiquant_offset=None, Tensor? block_table=None, Tensor? query_padding_size=None, "
        "Tensor? kv_padding_size=None, Tensor? key_shared_prefix=None, Tensor? value_shared_prefix=None, "
        "SymInt[]? actual_shared_prefix_len=None, Tensor? query_rope=None, Tensor? key_rope=None, "
        "Tensor? key_rope_antiquant_scale=None, int num_heads=1, float scale=1.0, int pre_tokens=2147483647, "
        "int next_tokens=2147483647, str input_layout=\"BSH\", int num_key_value_heads=0, int sparse_mode=0, "
        "int inner_precise=0, int block_size=0, int antiquant_mode=0, int key_antiquant_mode=0, "
        "int value_antiquant_mode=0, bool softmax_lse_flag=False) -> (Tensor, Tensor)"
    ),
    "npu_fused_infer_attention_score_v2": (
        "npu_fused_infer_attention_score_v2(Tensor query, Tensor key, Tensor value, *, Tensor? query_rope=None, "
        "Tensor? key_rope=None, Tensor? pse_shift=None, Tensor? atten_mask=None, SymInt[]? actual_seq_qlen=None, "
        "SymInt[]? actual_seq_kvlen=None, Tensor? block_table=None, Tensor? dequant_scale_query=None, "
        "Tensor? dequant_scale_key=None, Tensor? dequant_offset_key=None, Tensor? dequant_scale_value=None, "
        "Tensor? dequant_offset_value=None, Tensor? dequant_scale_key_rope=None, Tensor? quant_scale_out=None, "
        "Tensor? quant_offset_out=None, Tensor? quant_scale_p=None, Tensor? learnable_sink=None, "
        "int num_query_heads=1, int num_key_value_heads=0, float softmax_scale=1.0, int pre_tokens=2147483647, "
        "int next_tokens=2147483647, str input_layout=\"BSH\", int sparse_mode=0, int block_size=0, "
        "int query_quant_mode=0, int key_quant_mode=0, int value_quant_mode=0, int inner_precise=0, "
        "bool return_softmax_lse=False, int? query_dtype=None, int? key_dtype=None, int? value_dtype=None, "
        "int? out_dtype=None) -> (Tensor, Tensor)"
    ),
    "npu_scatter_pa_kv_cache": (
        "npu_scatter_pa_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping, *, Tensor? compress_lens=None, Tensor? compress_seq_offsets=None, "
        "Tensor? seq_lens=None, str? cache_mode='PA_NZ') -> ()"
    ),
    "npu_scatter_nd_update_": "npu_scatter_nd_update_(Tensor(a!) self, Tensor indices, Tensor updates) -> Tensor(a!)",
    "npu_moe_gating_top_k": (
        "npu_moe_gating_top_k(Tensor x, int k, *, Tensor? bias=None, Tensor? input_ids=None, Tensor? tid2eid=None, "
        "int k_group=1, int group_count=1, int group_select_mode=0, int renorm=0, int norm_type=0, "
        "bool out_flag=False, float routed_scaling_factor=1.0, float eps=1e-20) -> (Tensor, Tensor, Tensor)"
    ),
    "npu_moe_init_routing_v2": (
        "npu_moe_init_routing_v2(Tensor x, Tensor expert_idx, *, Tensor? scale=None, Tensor? offset=None, "
        "int active_num=-1, int expert_capacity=-1, int expert_num=-1, int drop_pad_mode=0, "
        "int expert_tokens_num_type=0, bool expert_tokens_num_flag=False, int quant_mode=-1, "
        "int[2] active_expert_range=[], int row_idx_type=0, int? x_dtype=None) -> (Tensor, Tensor, Tensor, Tensor)"
    ),
    "npu_moe_finalize_routing": (
        "npu_moe_finalize_routing(Tensor expanded_permuted_rows, Tensor? skip1, Tensor? skip2, Tensor? bias, "
        "Tensor? scales, Tensor expanded_src_to_dst_row, Tensor? export_for_source_row, int? drop_pad_mode=0, "
        "int? k=1) -> Tensor"
    ),
    "npu_grouped_matmul": (
        "npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor[]? scale=None, "
        "Tensor[]? offset=None, Tensor[]? antiquant_scale=None, Tensor[]? antiquant_offset=None, "
        "Tensor[]? per_token_scale=None, Tensor? group_list=None, Tensor[]? activation_input=None, "
        "Tensor[]? activation_quant_scale=None, Tensor[]? activation_quant_offset=None, int? split_item=0, "
        "int? group_type=None, int? group_list_type=0, int? act_type=0, int[]? tuning_config=None, "
        "int? output_dtype=None, int? x_dtype=None, int? weight_dtype=None, int? scale_dtype=None, "
        "int? per_token_scale_dtype=None) -> Tensor[]"
    ),
    "npu_swiglu": "npu_swiglu(Tensor self, int dim=-1) -> Tensor",
    "npu_gelu": "npu_gelu(Tensor input, str approximate='none') -> Tensor",
    "npu_clipped_swiglu": (
        "npu_clipped_swiglu(Tensor x, *, Tensor? group_index=None, int dim=-1, float alpha=1.702, "
        "float limit=7.0, float bias=1.0, bool interleaved=True) -> Tensor"
    ),
    "npu_dynamic_quant": (
        "npu_dynamic_quant(Tensor input, *, Tensor? smooth_scales=None, Tensor? group_index=None, "
        "int? dst_type=None, str quant_mode=\"pertoken\", float dst_type_max=0.0) -> (Tensor, Tensor)"
    ),
    "npu_quant_matmul": (
        "npu_quant_matmul(Tensor x1, Tensor x2, Tensor scale, *, Tensor? offset=None, Tensor? pertoken_scale=None, "
        "Tensor? bias=None, int? output_dtype=None, int? x1_dtype=None, int? x2_dtype=None, "
        "int? pertoken_scale_dtype=None, int? scale_dtype=None, int[]? group_sizes=None, Tensor? y_scale=None) -> Tensor"
    ),
    "npu_dynamic_mx_quant": (
        "npu_dynamic_mx_quant(Tensor input, *, int axis=-1, str round_mode=\"rint\", ScalarType dst_type, "
        "int? scale_alg=None, float dst_type_max=0.0) -> (Tensor, Tensor)"
    ),
    "npu_grouped_matmul_swiglu_quant": (
        "npu_grouped_matmul_swiglu_quant(Tensor x, Tensor weight, Tensor group_list, Tensor weight_scale, "
        "Tensor x_scale, *, Tensor? bias=None, Tensor? offset=None) -> (Tensor, Tensor, Tensor)"
    ),
    "npu_moe_distribute_dispatch": (
        "npu_moe_distribute_dispatch(Tensor x, Tensor expert_ids, str group_ep, int ep_world_size, int ep_rank_id, "
        "int moe_expert_num, *, Tensor? scales=None, Tensor? x_active_mask=None, Tensor? expert_scales=None, "
        "str group_tp=\"\", int tp_world_size=0, int tp_rank_id=0, int expert_shard_type=0, int shared_expert_num=1, "
        "int shared_expert_rank_num=0, int quant_mode=0, int global_bs=0, int expert_token_nums_type=1) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
    ),
    "npu_moe_distribute_combine": (
        "npu_moe_distribute_combine(Tensor expand_x, Tensor expert_ids, Tensor expand_idx, Tensor ep_send_counts, "
        "Tensor expert_scales, str group_ep, int ep_world_size, int ep_rank_id, int moe_expert_num, *, "
        "Tensor? tp_send_counts=None, Tensor? x_active_mask=None, Tensor? activation_scale=None, "
        "Tensor? weight_scale=None, Tensor? group_list=None, Tensor? expand_scales=None, Tensor? shared_expert_x=None, "
        "str group_tp=\"\", int tp_world_size=0, int tp_rank_id=0, int expert_shard_type=0, int shared_expert_num=1, "
        "int shared_expert_rank_num=0, int global_bs=0, int out_dtype=0, int comm_quant_mode=0, "
        "int group_list_type=0) -> Tensor"
    ),
    # ---- DeepSeek-V4 operators of vllm-ascend's custom-op library (torch.ops._C_ascend, CITATIONS below)
    "npu_lightning_indexer": (
        "npu_lightning_indexer(Tensor query, Tensor key, Tensor weights, *, Tensor? actual_seq_lengths_query=None, "
        "Tensor? actual_seq_lengths_key=None, Tensor? block_table=None, str layout_query=\"BSND\", "
        "str layout_key=\"BSND\", int sparse_count=2048, int sparse_mode=3, int pre_tokens=9223372036854775807, "
        "int next_tokens=9223372036854775807, bool return_value=False) -> (Tensor sparse_indices, Tensor sparse_values)"
    ),
    "npu_sparse_attn_sharedkv": (
        "npu_sparse_attn_sharedkv(Tensor q, *, Tensor? ori_kv=None, Tensor? cmp_kv=None, "
        "Tensor? ori_sparse_indices=None, Tensor? cmp_sparse_indices=None, Tensor? ori_block_table=None, "
        "Tensor? cmp_block_table=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_ori_kv=None, "
        "Tensor? cu_seqlens_cmp_kv=None, Tensor? seqused_q=None, Tensor? seqused_kv=None, Tensor? sinks=None, "
        "Tensor? metadata=None, float softmax_scale=0, int cmp_ratio=0, int ori_mask_mode=4, int cmp_mask_mode=3, "
        "int ori_win_left=128, int ori_win_right=0, str layout_q=\"BSND\", str layout_kv=\"PA_ND\", "
        "bool return_softmax_lse=False) -> (Tensor out, Tensor softmax_lse)"
    ),
    "npu_sparse_attn_sharedkv_metadata": (
        "npu_sparse_attn_sharedkv_metadata(int num_heads_q, int num_heads_kv, int head_dim, "
        "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_ori_kv=None, Tensor? cu_seqlens_cmp_kv=None, "
        "Tensor? seqused_q=None, Tensor? seqused_kv=None, int batch_size=0, int max_seqlen_q=0, "
        "int max_seqlen_kv=0, int ori_topk=0, int cmp_topk=0, int cmp_ratio=4, int ori_mask_mode=4, "
        "int cmp_mask_mode=3, int ori_win_left=128, int ori_win_right=0, str layout_q=\"BSND\", "
        "str layout_kv=\"PA_ND\", bool has_ori_kv=True, bool has_cmp_kv=True, str device=\"npu\") -> (Tensor metadata)"
    ),
    "npu_kv_quant_sparse_attn_sharedkv": (
        "npu_kv_quant_sparse_attn_sharedkv(Tensor q, int kv_quant_mode, Tensor? ori_kv=None, Tensor? cmp_kv=None, "
        "Tensor? ori_sparse_indices=None, Tensor? cmp_sparse_indices=None, Tensor? ori_block_table=None, "
        "Tensor? cmp_block_table=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_ori_kv=None, "
        "Tensor? cu_seqlens_cmp_kv=None, Tensor? seqused_q=None, Tensor? seqused_kv=None, Tensor? sinks=None, "
        "Tensor? metadata=None, int tile_size=0, int rope_head_dim=0, float softmax_scale=0.0, int cmp_ratio=0, "
        "int ori_mask_mode=4, int cmp_mask_mode=3, int ori_win_left=127, int ori_win_right=0, "
        "str layout_q='BSND', str layout_kv='PA_ND', bool return_softmax_lse=False) -> (Tensor out, Tensor softmax_lse)"
    ),
    "npu_kv_quant_sparse_attn_sharedkv_metadata": (
        "npu_kv_quant_sparse_attn_sharedkv_metadata(int num_heads_q, int num_heads_kv, int head_dim, "
        "int kv_quant_mode, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_ori_kv=None, "
        "Tensor? cu_seqlens_cmp_kv=None, Tensor? seqused_q=None, Tensor? seqused_kv=None, int batch_size=0, "
        "int max_seqlen_q=0, int max_seqlen_kv=0, int ori_topk=0, int cmp_topk=0, int tile_size=0, "
        "int rope_head_dim=0, int cmp_ratio=-1, int ori_mask_mode=4, int cmp_mask_mode=3, int ori_win_left=127, "
        "int ori_win_right=0, str layout_q='BSND', str layout_kv='PA_ND', bool has_ori_kv=True, "
        "bool has_cmp_kv=True, str device='npu') -> Tensor"
    ),
    "kv_compress_epilog": (
        "kv_compress_epilog(Tensor(a!) kv_compress_cache, Tensor x, Tensor slot_mapping, int quant_group_size, "
        "int quant_mode, bool round_scale_flag, int layout) -> ()"
    ),
    "npu_hc_pre_v2": (
        "npu_hc_pre_v2(Tensor x, Tensor hc_fn, Tensor hc_scale, Tensor hc_base, int hc_mult, int hc_sinkhorn_iters, "
        "float norm_eps, float hc_eps) -> (Tensor out0, Tensor out1, Tensor out2)"
    ),
    "npu_hc_post": "npu_hc_post(Tensor x, Tensor residual, Tensor post, Tensor comb) -> (Tensor out)",
    "moe_gating_top_k_hash": (
        "moe_gating_top_k_hash(Tensor x, int k, Tensor? bias=None, Tensor? input_ids=None, Tensor? tid2eid=None, "
        "int k_group=1, int group_count=1, float routed_scaling_factor=1.0, float eps=1e-20, "
        "int group_select_mode=0, int renorm=0, int norm_type=0, bool out_flag=False) "
        "-> (Tensor y, Tensor expert_idx, Tensor out)"
    ),
    # ---- aten operators the backend runs on the npu device (torch_npu's op-plugin registers their NPU
    # kernels); the key is ``aten_<name>[_<overload>]``, the schema text is PyTorch's own
    "aten_linear": "linear(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor",
    "aten_embedding": ("embedding(Tensor weight, Tensor indices, SymInt padding_idx=-1, bool scale_grad_by_freq=False, "
                       "bool sparse=False) -> Tensor"),
    "aten_argmax": "argmax(Tensor self, int? dim=None, bool keepdim=False) -> Tensor",
    "aten_sort_stable": ("sort.stable(Tensor self, *, bool? stable, int dim=-1, bool descending=False) "
                         "-> (Tensor values, Tensor indices)"),
    "aten_multinomial": ("multinomial(Tensor self, SymInt num_samples, bool replacement=False, *, "
                         "Generator? generator=None) -> Tensor"),
}

_VLLM_ASCEND = "vllm-project/vllm-ascend@182b75ea84"
_BINDING = f"{_VLLM_ASCEND} csrc/torch_binding.cpp (ops.def schema)"
_ATEN = "PyTorch 2.13 aten/src/ATen/native/native_functions.yaml (schema); NPU kernel from torch_npu's op-plugin"

#: where each operator is found at run time: ``torch_npu`` (the module), ``_C_ascend`` (vllm-ascend's
#: custom-op library, ``torch.ops._C_ascend``, loaded by importing ``vllm_ascend.vllm_ascend_C``) or ``aten``
#: (``torch.ops.aten`` on npu tensors). Operators absent here live in ``torch_npu``.
NAMESPACES: dict[str, str] = {
    **{op: "_C_ascend" for op in ("npu_sparse_attn_sharedkv", "npu_sparse_attn_sharedkv_metadata",
                                  "npu_kv_quant_sparse_attn_sharedkv", "npu_kv_quant_sparse_attn_sharedkv_metadata",
                                  "kv_compress_epilog", "npu_hc_pre_v2", "npu_hc_post",
                                  "moe_gating_top_k_hash")},
    **{op: "aten" for op in SCHEMAS if op.startswith("aten_")},
}

#: where each operator's recorded signature (and the semantics its fake implements) comes from;
#: operators absent here are from :data:`SOURCE`
CITATIONS: dict[str, str] = {
    "npu_quant_matmul": (
        f"{SOURCE} for the schema. Its MX mode (950) is not in npu_quant_matmul's own doc (A2/A3 int8/int4 modes "
        f"only); used as {_VLLM_ASCEND} vllm_ascend/quantization/methods/w8a8_mxfp8.py AscendW8A8MXFP8DynamicLinear"
        f"Method.apply calls it (x1 from npu_dynamic_mx_quant, weight [K, N] and weight_scale uint8 [K/64, N, 2] as "
        f"transposed views from process_weights_after_loading, scale_dtype = pertoken_scale_dtype = "
        f"torch_npu.float8_e8m0fnu, output_dtype = x's dtype, group_sizes [1, 1, 32]; fp8.py AscendW8A8MXFP8DS"
        f"DynamicLinearMethod does the same for DeepSeek's 128x128 FP8 blocks, taking each ue8m0 scale's exponent); "
        f"scale shapes as the same wheel's _op_plugin_docs.py gives them for the 950's MX matmul of "
        f"npu_all_gather_quant_mm (x1_scale (m, ceil(k/64), 2), x2_scale (ceil(k/64), n, 2) transposed only); "
        f"torch_npu/op_plugin/meta/_meta_registrations.py npu_quant_matmul_meta / quant_matmul_group_sizes_check "
        f"(pertoken_scale_dtype float8_e8m0fnu: k at dim -2 of pertoken_scale and -3 of scale) and "
        f"TORCH_NPU_DTYPE_TO_STRING_MAP (293 = torch_npu.float8_e8m0fnu; torch dtypes as ScalarType values)"),
    "npu_lightning_indexer": (
        f"{_BINDING} for the argument list (the _C_ascend twin of torch_npu's operator); keyword use as in "
        f"{_VLLM_ASCEND} vllm_ascend/device/device_op.py indexer_select_post_process (torch_npu.npu_lightning_indexer); "
        f"semantics and limits: csrc/attention/lightning_indexer/README.md (N2=1, D=128, 950: N1 in 8/16/24/32/64, "
        f"weights not fp32; return_value 'only in training and with layout_key != PA_BSND': the wrapper's use of it "
        f"for every score is the first thing the hardware run must confirm; sparse_count 1..2048). FP8 keys "
        f"(fp8_index) go in as their e4m3 codes in the query's dtype, each score scaled after: the quantised "
        f"variants return no scores (torch-npu==2.13.0 npu_native_functions_by_codegen.yaml: "
        f"npu_quant_lightning_indexer(...) -> Tensor, indices only; {_VLLM_ASCEND} "
        f"csrc/attention/vllm_quant_lightning_indexer/README.md: sparse_values not supported, per-token-head "
        f"quantised query too)"),
    "npu_sparse_attn_sharedkv": (
        f"{_BINDING}; semantics and limits: csrc/attention/sparse_attn_sharedkv/README.md (A2/A3 only, not 950; "
        f"N1=64, KV_N=1, K2=512, ori_win_left 127, metadata required); called through device_op.py get_dsa_sparse_attn_op"),
    "npu_sparse_attn_sharedkv_metadata": f"{_BINDING}; csrc/attention/sparse_attn_sharedkv/README.md (metadata [1024] int32)",
    "npu_kv_quant_sparse_attn_sharedkv": (
        f"{_BINDING}; semantics and limits: csrc/attention/kv_quant_sparse_attn_sharedkv/README.md (950PR/DT only; q "
        f"bf16 D 512, N1 64|128; ori_kv/cmp_kv float8_e4m3fn [NB, BS, 1, 640] PA_ND, BS a multiple of 16 <= 1024, one "
        f"record = bf16 rope 64 (128 B) | e4m3 nope 448 | 7 e8m0 scales (tile 64) | zero pad to 640; kv_quant_mode 1, "
        f"tile_size 64, rope_head_dim 64; sinks fp32 required; softmax_scale required; cmp_ratio 4|128, 1 without "
        f"cmp_kv; cmp_sparse_indices int32 [T, 1, K2], K2 512|1024, valid entries first; ori_win_left 127, "
        f"ori_win_right 0, mask modes 4/3); called as in {_VLLM_ASCEND} vllm_ascend/attention/dsa_v1.py (attn_op "
        f"kwargs: cmp_ratio max(ratio, 1), cmp_sparse_indices only at ratio 4) with "
        f"vllm_ascend/device/device_op.py A5DeviceAdaptor.get_dsa_sparse_attn_base_kwargs (kv_quant_mode 1, "
        f"tile_size 64, rope_head_dim 64). The logical vector is [nope 448 | rope 64] (q's order; the rope part is "
        f"x's last 64 channels in kv_compress_epilog), stored rope first"),
    "npu_kv_quant_sparse_attn_sharedkv_metadata": (
        f"{_BINDING} (returns int32 [1024]); csrc/attention/kv_quant_sparse_attn_sharedkv_metadata/README.md; called as "
        f"in vllm_ascend/attention/dsa_v1.py (head_dim = the model's 512, cmp_ratio 1 | 4 | 128, cmp_topk = index_topk "
        f"at ratio 4 else 0, has_cmp_kv = ratio > 1) with A5DeviceAdaptor.get_dsa_sparse_attn_metadata_kwargs "
        f"(kv_quant_mode 1)"),
    "kv_compress_epilog": (
        f"{_BINDING} and its shape checks in torch_binding.cpp validate_kv_compress_epilog_inputs (x bf16 2-D, "
        f"slot_mapping int32|int64 [T], cache float8_e4m3fn|e5m2, 4-D with head dim 1 squeezed; -1 slots skipped: "
        f"op_kernel/kv_compress_epilog.h Process); called as in {_VLLM_ASCEND} vllm_ascend/device/device_op.py "
        f"A5DeviceAdaptor.dsa_kv_compress_scatter (cache.view(-1, 1, D), quant_group_size 64, quant_mode 2, "
        f"round_scale_flag True, layout 1). Semantics of that mode from op_kernel/kv_compress_epilog_common.h "
        f"(group-64 MXFP8 path): per 64 channels of x[:, :448] scale = 2**ceil(log2(max(amax, 1e-4) / 448)) "
        f"(amax times the fp32 reciprocal of 448), codes x / scale clamped to +-448 in e4m3, scale byte = its "
        f"biased exponent; row = x[:, 448:] bf16 | codes | scales | zeros, at slot * row stride"),
    "npu_hc_pre_v2": (
        f"{_BINDING}; limits from its shape check in torch_binding.cpp (hc_mult 4, d 4096 or 7168, x bf16, "
        f"hc_fn fp32 [24, 4d], hc_scale [3], hc_base [24]; outputs y bf16, post fp32, comb fp32); called as in "
        f"vllm_ascend/models/deepseek_v4/model.py hc_pre"),
    "npu_hc_post": (
        f"{_BINDING}; shapes from its check in torch_binding.cpp (x [b,s,d], residual [b,s,hc,d], post [b,s,hc], "
        f"comb [b,s,hc,hc]); called as in vllm_ascend/models/deepseek_v4/model.py hc_post (comb from npu_hc_pre_v2)"),
    "moe_gating_top_k_hash": (
        f"{_BINDING}; norm_type 2 = sqrt(softplus), renorm 0 only, group_count 1 with norm_type 2: "
        f"csrc/moe/moe_gating_top_k_hash/op_host/moe_gating_top_k_hash_tiling.cpp; called as in "
        f"vllm_ascend/ops/fused_moe/router/fused_topk_router.py (sqrtsoftplus, input_ids int64, tid2eid int32)"),
    "npu_dynamic_mx_quant": (
        "op-plugin 26.0.0 op_plugin/ops/opapi/DynamicMxQuantKernelNpuOpApi.cpp (arguments input, axis, round_mode, "
        "dst_type, block size 32 by default, scale_alg, dst_type_max; the block-size keyword is not recorded: it is "
        "never passed); semantics: CANN ops-nn quant/dynamic_mx_quant/docs/aclnnDynamicMxQuant.md (950PR/DT only; "
        "scale_alg 0: per 32 values along axis mxscale = 2**(floor(log2(amax)) - emax), emax 8 for e4m3, y = "
        "cast(x / mxscale)); called as in vllm-ascend@182b75ea84 vllm_ascend/ops/fused_moe/prepare_finalize.py "
        "(W8A8MXFP / W4A8MXFP: dst_type=torch.float8_e4m3fn) with the scale's [M, K/64, 2] layout of "
        "device_op.py A5DeviceAdaptor.maybe_normalize_mxfp_scale_layout"),
    "npu_grouped_matmul": (
        f"{SOURCE}; the MXFP8 use (W8A8MXFP) as in {_VLLM_ASCEND} vllm_ascend/device/device_op.py "
        f"A5DeviceAdaptor.npu_grouped_matmul_gmm2 (x e4m3 with per_token_scale [M, K/64, 2] e8m0, weight e4m3 "
        f"[E, K, N] (the checkpoint's [E, N, K] transposed) with scale [E, K/64, N, 2] e8m0, as "
        f"vllm_ascend/quantization/methods/w8a8_mxfp8.py process_weights_after_loading lays them out; split_item 2, "
        f"group_type 0). Like vllm_ascend/ops/fused_moe/moe_mlp.py the wrapper states scale_dtype = "
        f"per_token_scale_dtype = torch_npu.float8_e8m0fnu (293: torch-npu==2.13.0 torch_npu/op_plugin/meta/"
        f"_meta_registrations.py, whose npu_grouped_matmul_meta accepts only that value; with it the scale tensors' "
        f"own 8-bit dtype does not matter, as _op_plugin_docs.py says of npu_add_quant_gmm_'s x2_scale_dtype) and "
        f"output_dtype as a ScalarType value (gmm_get_dtype: 5 fp16, 15 bf16, 6 fp32, 3 int32)"),
    "npu_gelu": ("hiascend.com Pytorch 7.0.0 API reference, torch_npu.npu_gelu (ptaoplist_001234): approximate "
                 "'none' (erf) | 'tanh'; fp16/bf16/fp32; it notes that torch's own gelu on the NPU ignores "
                 "approximate and uses tanh, hence this operator"),
    **{op: _ATEN for op in SCHEMAS if op.startswith("aten_")},
}


class ContractError(AssertionError):
    """A torch_npu call breaks its documented signature or a documented precondition."""


# ---------------------------------------------------------------------------------------- schema parsing


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # Tensor | Tensor[] | int | float | bool | str | int[] | SymInt[]
    optional: bool  # "?" in the schema: None is accepted
    has_default: bool
    keyword_only: bool


_PARAM = re.compile(r"^(?P<type>[A-Za-z]+(?:\[\d*\])?(?:\([a-z]!\))?)(?P<opt>\?)?\s+(?P<name>\w+)(?P<default>=.*)?$")


def parse_schema(schema: str) -> tuple[str, list[Param]]:
    name, rest = schema.split("(", 1)
    args = rest.rsplit(") ->", 1)[0]
    params, kw_only = [], False
    for raw in _split_args(args):
        raw = raw.strip()
        if raw == "*":
            kw_only = True
            continue
        m = _PARAM.match(raw)
        if not m:
            raise ValueError(f"cannot parse argument {raw!r} of {name}")
        kind = re.sub(r"\([a-z]!\)", "", m["type"])
        kind = re.sub(r"\[\d+\]", "[]", kind)
        params.append(Param(m["name"], kind, bool(m["opt"]), m["default"] is not None, kw_only))
    return name.strip(), params


def _split_args(s: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in s:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur)
    return out


PARSED: dict[str, list[Param]] = {k: parse_schema(v)[1] for k, v in SCHEMAS.items()}


def citation(op: str) -> str:
    """Where ``op``'s recorded signature comes from."""
    return CITATIONS.get(op, SOURCE)


def bind(op: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Bind a call to its schema like Python would; raise :class:`ContractError` on any mismatch."""
    if op not in PARSED:
        raise ContractError(f"torch_npu.{op} is not in the documented contract table (contract.SCHEMAS)")
    params = PARSED[op]
    positional = [p for p in params if not p.keyword_only]
    if len(args) > len(positional):
        raise ContractError(f"torch_npu.{op}: {len(args)} positional arguments, the schema allows {len(positional)}")
    bound = {p.name: a for p, a in zip(positional, args)}
    names = {p.name for p in params}
    for k, v in kwargs.items():
        if k not in names:
            raise ContractError(f"torch_npu.{op}: unknown keyword {k!r}")
        if k in bound:
            raise ContractError(f"torch_npu.{op}: {k!r} given twice")
        bound[k] = v
    for p in params:
        if p.name not in bound:
            if not p.has_default and not p.optional:
                raise ContractError(f"torch_npu.{op}: required argument {p.name!r} missing")
            continue
        _check_kind(op, p, bound[p.name])
    return bound


def _check_kind(op: str, p: Param, v: Any) -> None:
    if v is None:
        if not p.optional:
            raise ContractError(f"torch_npu.{op}: {p.name} ({p.kind}) must not be None")
        return
    ok = {
        "Tensor": lambda x: isinstance(x, torch.Tensor),
        "Tensor[]": lambda x: isinstance(x, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in x),
        "int": lambda x: isinstance(x, int) and not isinstance(x, bool),
        "float": lambda x: isinstance(x, (int, float)) and not isinstance(x, bool),
        "bool": lambda x: isinstance(x, bool),
        "str": lambda x: isinstance(x, str),
        "int[]": lambda x: isinstance(x, (list, tuple)) and all(isinstance(i, int) for i in x),
        "SymInt[]": lambda x: isinstance(x, (list, tuple)) and all(isinstance(i, int) for i in x),
        "SymInt": lambda x: isinstance(x, int) and not isinstance(x, bool),
        "Generator": lambda x: isinstance(x, torch.Generator),
        "ScalarType": lambda x: isinstance(x, torch.dtype),
    }[p.kind]
    if not ok(v):
        raise ContractError(f"torch_npu.{op}: {p.name} must be {p.kind}, got {type(v).__name__}")


# ---------------------------------------------------------------------------------------- recording


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str
    contiguous: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorInfo":
        return cls(tuple(t.shape), str(t.dtype).removeprefix("torch."), t.is_contiguous())


@dataclass(frozen=True)
class NpuCall:
    """One recorded call: operator name and each bound argument as plain data."""

    op: str
    args: Mapping[str, Any] = field(default_factory=dict)

    def tensor(self, name: str) -> TensorInfo:
        return self.args[name]


def describe(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return TensorInfo.of(v)
    if isinstance(v, (list, tuple)):
        return tuple(describe(x) for x in v)
    return v


Check = Callable[[dict], None]
CHECKS: dict[str, list[Check]] = {}  # filled by preconditions.py (imported by ops.py)


def require(cond: bool, op: str, msg: str) -> None:
    if not cond:
        raise ContractError(f"torch_npu.{op}: {msg}")


class RecordingNpu:
    """A ``torch_npu`` stand-in that validates, records, then delegates each call to ``impl``.

    ``impl`` is the real ``torch_npu`` module on an NPU host (then the log shows what ran) or a fake
    module object in the tests (never a site-packages import).
    """

    def __init__(self, impl: Any, checks: Mapping[str, Sequence[Check]] | None = None) -> None:
        self._impl = impl
        self._checks = CHECKS if checks is None else checks
        self.calls: list[NpuCall] = []

    def __getattr__(self, op: str) -> Callable[..., Any]:
        if op.startswith("_"):
            raise AttributeError(op)
        fn = getattr(self._impl, op)

        def call(*args: Any, **kwargs: Any) -> Any:
            bound = bind(op, args, kwargs)
            for check in self._checks.get(op, ()):
                check(bound)
            self.calls.append(NpuCall(op, {k: describe(v) for k, v in bound.items()}))
            return fn(*args, **kwargs)

        return call

    def ops_called(self) -> list[str]:
        return [c.op for c in self.calls]
