"""Every kernel as data for the ahead-of-time compiler: the jit function, one representative
specialisation (argument types and constexprs at production shapes of DeepSeek-V4), whether it must use
the tensor cores, and its tuning entry. Importing this module imports no kernel; :func:`load` does.

A spec's constexprs may depend on the tuning target (block sizes come from :mod:`.tuning`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from inferhal.kernels.launch_shapes import (align, csa_split_values, csa_values, indexer_values, moe_fp8_values,
                                           moe_values)


@dataclass(frozen=True)
class KernelSpec:
    name: str  # kernel/variant name shown in reports
    op_id: str  # the op it implements
    fn: str  # "module:function" of the @triton.jit kernel
    tuning: str  # tuning entry (block sizes, num_warps, num_stages)
    ptrs: Mapping[str, str]  # pointer argument -> Triton pointer type ("*bf16", "*fp32", ...)
    floats: tuple[str, ...] = ()  # scalar fp32 arguments; all other scalars are i32
    constexprs: Callable[[Mapping[str, Any]], Mapping[str, Any]] = field(default=lambda cfg: {})
    mma: bool = False  # must use the tensor cores (tcgen05 on SM100, wgmma on SM90)
    # integer arguments at the spec's production shapes: given, the compile specialises as Triton's JIT does at
    # a launch (a 1 becomes a constexpr, a multiple of 16 is marked divisible by 16, pointers 16-byte aligned);
    # without, every integer is an unknown i32 and no pointer alignment is known (fewer vectorised loads)
    values: Mapping[str, int] | None = None

    def load(self):
        mod, fn = self.fn.split(":")
        return getattr(importlib.import_module(mod), fn)

    def specialization(self, jit_fn, constexprs: Mapping[str, Any]) -> tuple[dict[str, Any], dict]:
        """(constexprs with the unit integers of ``values``, ASTSource attrs marking divisibility by 16)."""
        if self.values is None:
            return dict(constexprs), {}
        cx = {**constexprs, **{k: 1 for k, v in self.values.items() if v == 1}}
        sig = self.signature(jit_fn, cx)
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(jit_fn.arg_names)
                 if sig[a].startswith("*") or (a in self.values and sig[a] == "i32" and self.values[a] % 16 == 0)}
        return cx, attrs

    def signature(self, jit_fn, constexprs: Mapping[str, Any]) -> dict[str, str]:
        sig = {}
        for arg in jit_fn.arg_names:
            if arg in constexprs:
                sig[arg] = "constexpr"
            elif arg in self.ptrs:
                sig[arg] = self.ptrs[arg]
            elif arg in self.floats:
                sig[arg] = "fp32"
            else:
                sig[arg] = "i32"
        return sig


def _tl():
    import triton.language as tl

    return tl


def _value_cache() -> dict:
    """The record constexprs of a kernel that reads a value cache (the ahead-of-time compiler needs every
    constexpr spelled out; a defaulted one would compile as a runtime argument)."""
    from inferhal.kernels.kv_records import record_args

    return record_args(None)


def _blocks(cfg):
    return {k: v for k, v in cfg.items() if k.startswith("BLOCK_")}


def _moe(fmt: int, wtype: str, stype: str, down: bool, swap: bool = False):
    def cx(cfg):
        tl = _tl()
        return {"W_FMT": fmt, "DTYPE": tl.bfloat16, "PREC": "tf32", "LHS_FMT": "bf16", "INTERP": False,
                "SCALE_ROW": fmt == 1, "SWAP_AB": swap, **_blocks(cfg)}

    ptrs = {"w_ptr": wtype, "ws_ptr": stype, "pair_ptr": "*i32", "tile_e_ptr": "*i32"}
    if down:
        ptrs.update({"h_ptr": "*bf16", "rw_ptr": "*fp32", "y_ptr": "*fp32"})
    else:
        ptrs.update({"x_ptr": "*bf16", "h_ptr": "*bf16"})
    return ptrs, cx


def _specs() -> list[KernelSpec]:
    out = [
        KernelSpec("rms_norm", "norm.rms", "inferhal.kernels.norm:rms_norm_kernel", "norm_rms",
                   dict.fromkeys(("x_ptr", "r_ptr", "w_ptr", "y_ptr", "h_ptr"), "*bf16"), ("eps",),
                   lambda cfg: {"HAS_RES": True, "HAS_W": True, "UNIT_OFFSET": False, "DTYPE": _tl().bfloat16,
                                "BLOCK_D": 4096, "INTERP": False}),
        KernelSpec("rope", "rope.apply", "inferhal.kernels.rope:rope_kernel", "rope",
                   {"x_ptr": "*bf16", "pos_ptr": "*i64", "cs_ptr": "*fp32", "y_ptr": "*bf16"}, (),
                   lambda cfg: {"R_HALF": 32, "BLOCK_H": 1, "BLOCK_D": 512, "BLOCK_R": 32, "INTERLEAVED": True,
                                "INVERSE": False,
                                "DTYPE": _tl().bfloat16, "INTERP": False}),
        KernelSpec("moe_route", "moe.route", "inferhal.kernels.moe_route:moe_route_kernel", "moe_route",
                   {"logit_ptr": "*fp32", "bias_ptr": "*fp32", "hash_ptr": "*i64", "w_ptr": "*fp32", "id_ptr": "*i64"},
                   ("scaling",),
                   lambda cfg: {"K": 6, "BLOCK_E": 256, "BLOCK_K": 8, "SCORING": 2, "HAS_BIAS": True,
                                "HAS_HASH": False, "RENORM": True, **_blocks(cfg)}),
    ]
    # the tiled kernels, then the decode tiles (swap-AB: moe_experts.decode_tiles) of the formats that have them
    for label, fmt, wt, st, tun in (("bf16", 0, "*bf16", "*fp32", "moe_gemm"), ("fp8_block", 1, "*fp8e4nv", "*fp32", "moe_gemm"),
                                    ("fp4_dot_scaled", 3, "*u8", "*u8", "moe_gemm_fp4"),
                                    ("bf16_decode", 0, "*bf16", "*fp32", "moe_gemm_decode"),
                                    ("fp8_block_decode", 1, "*fp8e4nv", "*fp32", "moe_gemm_decode"),
                                    ("fp4_dot_scaled_decode", 3, "*u8", "*u8", "moe_gemm_decode")):
        for down in (False, True):
            ptrs, cx = _moe(fmt, wt, st, down, swap=tun == "moe_gemm_decode")
            kern = "moe_down_kernel" if down else "moe_gate_up_kernel"
            out.append(KernelSpec(f"moe_{'down' if down else 'gate_up_swiglu'}_{label}", "moe.experts",
                                  f"inferhal.kernels.moe_experts:{kern}", tun, ptrs, ("limit",), cx, mma=True,
                                  values=moe_fp8_values(down, False) if fmt == 1 else moe_values(fmt, down)))
    out.extend(_moe_fp8_specs())
    out.extend(_later_specs())
    out.extend(_gemm_specs())
    out.extend(_dense_specs())
    out.extend(_kv_record_specs({k.name: k for k in out}))
    out.extend(_split_specs())
    out.append(KernelSpec("sample_mask", "sample.mask", "inferhal.kernels.sample_mask:sample_mask_kernel", "sample_mask",
                          {"l_ptr": "*fp32", "m_ptr": "*i32", "row_ptr": "*i64"}, (),
                          lambda cfg: {"BLOCK_V": cfg["BLOCK_V"]}))
    return out


def _moe_fp8_specs() -> list[KernelSpec]:
    """FP8 x FP8 expert GEMMs (kernels/moe_fp8.py): e4m3 activations and weights, 128 x 128 block scales."""
    fn = "inferhal.kernels.moe_fp8:"
    common = {"w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "pair_ptr": "*i32", "tile_e_ptr": "*i32"}
    out = []
    for suffix, tun, swap in (("", "moe_gemm_fp8", False), ("_decode", "moe_gemm_fp8_decode", True)):  # tiled, decode
        cx = lambda cfg, swap=swap: {"DTYPE": _tl().bfloat16, "INTERP": False, "SWAP_AB": swap, **_blocks(cfg)}  # noqa: E731
        out += [
            KernelSpec(f"moe_gate_up_swiglu_fp8_w8a8{suffix}", "moe.experts", fn + "moe_gate_up_w8a8_kernel", tun,
                       {**common, "xq_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "hq_ptr": "*fp8e4nv", "hs_ptr": "*fp32"},
                       ("limit",), cx, mma=True, values=moe_fp8_values(False, True)),
            KernelSpec(f"moe_down_fp8_w8a8{suffix}", "moe.experts", fn + "moe_down_w8a8_kernel", tun,
                       {**common, "hq_ptr": "*fp8e4nv", "hs_ptr": "*fp32", "rw_ptr": "*fp32", "y_ptr": "*fp32"}, (), cx,
                       mma=True, values=moe_fp8_values(True, True)),
        ]
    return out


def _kv_record_specs(specs: Mapping[str, KernelSpec]) -> list[KernelSpec]:
    """FP8 / FP4 KV records (cache.kv_dtype) at V4-Flash widths: 512-dim latents (64 RoPE), 128-dim indexer keys."""
    from inferhal.core.paging import formats

    def cx(fmt, write: bool):
        def make(cfg):
            from inferhal.kernels.kv_records import _constexprs, decode_constexprs, tile_args

            if not write:  # load_records, the decoder of the one-program-per-token attention kernels
                return {**decode_constexprs(fmt), "TILE": False, **tile_args(fmt, 512)}
            used = fmt.scales_at + fmt.num_scales * (4 if fmt.scale == "fp32" else 1)
            return {**_constexprs(fmt), "PAD_AT": used, "PAD": fmt.nbytes - used, "INTERP": False}
        return make

    out = []
    for kv_dtype, dims, rope, role in (("fp8", 512, 64, "main"), ("fp8", 128, 0, "index"), ("fp4", 512, 64, "main"),
                                       ("fp4", 128, 0, "index")):
        fmt = formats.record(kv_dtype, dims, rope, role=role)
        out.append(KernelSpec(f"kv_record_write_{fmt.name}", "kv.write", "inferhal.kernels.kv_records:kv_record_write_kernel",
                              "kv_write", {"v_ptr": "*bf16", "c_ptr": "*u8", "slot_ptr": "*i64"}, (), cx(fmt, True)))
        out.append(KernelSpec(f"kv_record_decode_{fmt.name}", "attn.sparse_topk",
                              "inferhal.kernels.kv_records:kv_record_decode_kernel", "kv_write",
                              {"c_ptr": "*u8", "row_ptr": "*i64", "o_ptr": "*fp32"}, (), cx(fmt, False)))

    def reading(fmt, base: str):
        def make(cfg):
            from inferhal.kernels.kv_records import record_args, tile_args

            cx = {**specs[base].constexprs(cfg), **record_args(fmt)}
            return {**cx, **tile_args(fmt, cx["BLOCK_D"]), **align(fmt)}
        return make

    # the attention kernels decoding records in their key tiles (CSA decode shapes, as their value-cache specs)
    for kv_dtype in ("fp8", "fp4"):
        main, index = formats.record(kv_dtype, 512, 64, role="main"), formats.record(kv_dtype, 128, role="index")
        base = specs["attn_sparse_topk_csa"]
        out.append(KernelSpec(f"attn_sparse_topk_csa_{main.name}", base.op_id, base.fn, "attn_sparse_records",
                              {**base.ptrs, "kv_ptr": "*u8", "c_ptr": "*u8"}, base.floats,
                              reading(main, "attn_sparse_topk_csa"), mma=True, values=csa_values(main.nbytes)))
        base = specs["indexer_scores"]
        out.append(KernelSpec(f"indexer_scores_{index.name}", base.op_id, base.fn, base.tuning,
                              {**base.ptrs, "k_ptr": "*u8"}, base.floats, reading(index, "indexer_scores"),
                              mma=True, values=indexer_values(index.nbytes)))
    return out


def _split_specs() -> list[KernelSpec]:
    """Split-KV decode (kernels/attn_split.py) at V4-Flash decode shapes: CSA (128-token window + top-512, 64
    heads on the 512-dim latent, sinks) in groups of BLOCK_H heads, bf16 and FP8 / FP4 records; the combine."""
    from inferhal.core.paging import formats

    bf16 = lambda: _tl().bfloat16  # noqa: E731
    sparse = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "c_ptr": "*bf16", "idx_ptr": "*i64", "acc_ptr": "*fp32",
              "ml_ptr": "*fp32", "bt_ptr": "*i32", "cbt_ptr": "*i32", "seq_ptr": "*i64", "pos_ptr": "*i64",
              "len_ptr": "*i32", "clen_ptr": "*i32"}

    def sparse_cx(fmt):
        def make(cfg):
            from inferhal.kernels.kv_records import record_args, tile_args

            return {"HAS_COMP": True, "DTYPE": bf16(), "PREC": "tf32", "BLOCK_D": 512, "INTERP": False,
                    **_blocks(cfg), **record_args(fmt), **tile_args(fmt, 512), **align(fmt)}
        return make

    fn = "inferhal.kernels.sparse_attn:sparse_attn_split_kernel"
    out = [KernelSpec("attn_sparse_topk_csa_split", "attn.sparse_topk", fn, "attn_sparse_split", sparse, ("scale",),
                      sparse_cx(None), mma=True, values=csa_split_values(512))]
    for kv_dtype in ("fp8", "fp4"):
        main = formats.record(kv_dtype, 512, 64, role="main")
        out.append(KernelSpec(f"attn_sparse_topk_csa_split_{main.name}", "attn.sparse_topk", fn,
                              "attn_sparse_split_records",
                              {**sparse, "kv_ptr": "*u8", "c_ptr": "*u8"}, ("scale",), sparse_cx(main), mma=True,
                              values=csa_split_values(main.nbytes)))
    paged = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "acc_ptr": "*fp32", "ml_ptr": "*fp32", "bt_ptr": "*i32",
             "seq_ptr": "*i64", "pos_ptr": "*i64", "len_ptr": "*i32"}
    fn = "inferhal.kernels.attn_paged:attn_paged_split_kernel"

    def paged_cx(shared: bool, dim: int):
        return lambda cfg: {"SHARED_KV": shared, "SOFTCAP": False, "PREC": "tf32", "BLOCK_D": dim, "INTERP": False,
                            **_blocks(cfg)}

    # V4's latent decode (64 heads on one shared 512-dim KV head) and Gemma 3's (GQA, K and V, 256 dims)
    for name, shared, dim in (("attn_paged_latent_decode_split", True, 512), ("attn_paged_gqa_d256_split", False, 256)):
        out.append(KernelSpec(name, "attn.paged", fn, "attn_paged_split", paged, ("scale", "softcap"),
                              paged_cx(shared, dim), mma=True))
    # the lightning indexer (64 heads x 128 dims) over runs of 128-entry tiles: bf16 keys, FP8 and FP4 records
    idx = {"q_ptr": "*bf16", "k_ptr": "*bf16", "w_ptr": "*fp32", "o_ptr": "*fp32", "bt_ptr": "*i32", "seq_ptr": "*i64",
           "pos_ptr": "*i64", "len_ptr": "*i32"}

    def idx_cx(fmt):
        def make(cfg):
            from inferhal.kernels.kv_records import record_args, tile_args

            return {"PREC": "tf32", "BLOCK_H": 64, "BLOCK_D": 128, "INTERP": False, **_blocks(cfg),
                    **record_args(fmt), **tile_args(fmt, 128), **align(fmt)}
        return make

    # as a launch of 64 decode tokens passes them: 128 tiles of 128 entries a token, 8 a program (split_tiles)
    fn = "inferhal.kernels.indexer:indexer_split_kernel"
    out.append(KernelSpec("indexer_scores_split", "indexer.scores", fn, "indexer_split", idx, ("scale", "weight_scale"),
                          idx_cx(None), mma=True, values={**indexer_values(128), "TILES": 8}))
    for kv_dtype in ("fp8", "fp4"):
        fmt = formats.record(kv_dtype, 128, role="index")
        out.append(KernelSpec(f"indexer_scores_split_{fmt.name}", "indexer.scores", fn, "indexer_split",
                              {**idx, "k_ptr": "*u8"}, ("scale", "weight_scale"), idx_cx(fmt), mma=True,
                              values={**indexer_values(fmt.nbytes), "TILES": 8}))
    partial = {"acc_ptr": "*fp32", "ml_ptr": "*fp32", "o_ptr": "*bf16", "sink_ptr": "*fp32"}
    out.append(KernelSpec("attn_split_combine", "attn.sparse_topk", "inferhal.kernels.attn_split:split_combine_kernel",
                          "attn_combine", partial, (),
                          lambda cfg: {"HAS_SINKS": True, "DTYPE": bf16(), "INTERP": False, **_blocks(cfg)}))
    return out


def _dense_specs() -> list[KernelSpec]:
    """embed, act.gated, mhc.head at V4-Flash / Gemma 3 widths (elementwise / row kernels: no tensor cores)."""
    bf16 = lambda: _tl().bfloat16  # noqa: E731
    return [
        KernelSpec("embed", "embed", "inferhal.kernels.embed:embed_kernel", "embed",
                   {"id_ptr": "*i64", "tab_ptr": "*bf16", "y_ptr": "*bf16"}, ("scale",),
                   lambda cfg: {"HAS_SCALE": True, "DTYPE": bf16(), "BLOCK_D": cfg["BLOCK_D"], "INTERP": False}),
        KernelSpec("act_gated_silu", "act.gated", "inferhal.kernels.act_gated:act_gated_kernel", "act_gated",
                   {"g_ptr": "*bf16", "u_ptr": "*bf16", "y_ptr": "*bf16"}, (),
                   lambda cfg: {"KIND": 0, "DTYPE": bf16(), "BLOCK_I": cfg["BLOCK_I"], "INTERP": False}),
        KernelSpec("act_gated_gelu_tanh", "act.gated", "inferhal.kernels.act_gated:act_gated_kernel", "act_gated",
                   {"g_ptr": "*bf16", "u_ptr": "*bf16", "y_ptr": "*bf16"}, (),
                   lambda cfg: {"KIND": 1, "DTYPE": bf16(), "BLOCK_I": cfg["BLOCK_I"], "INTERP": False}),
        # 3 MTP drafts against V4's 129,280-token vocabulary, with draft probabilities (MTP / DSpark)
        KernelSpec("spec_verify", "spec.verify", "inferhal.kernels.spec_verify:spec_verify_kernel", "spec_verify",
                   {"d_ptr": "*i64", "q_ptr": "*fp32", "l_ptr": "*fp32", "t_ptr": "*fp32", "k_ptr": "*i32", "p_ptr": "*fp32",
                    "mp_ptr": "*fp32", "seed_ptr": "*i64", "step_ptr": "*i64", "out_ptr": "*i64", "n_ptr": "*i64"}, (),
                   lambda cfg: {"HAS_Q": True, "BLOCK_V": cfg["BLOCK_V"]}),
        # EP bookkeeping: 64 tokens x top-6 over 8 ranks, rows of V4's hidden 4096
        KernelSpec("ep_plan", "moe.dispatch", "inferhal.kernels.moe_ep:ep_plan_kernel", "moe_ep",
                   {"id_ptr": "*i64", "src_ptr": "*i64", "loc_ptr": "*i64", "inv_ptr": "*i32", "cnt_ptr": "*i32"}, (),
                   lambda cfg: {"BLOCK_P": cfg["BLOCK_P"], "BLOCK_R": 8}),
        KernelSpec("ep_gather", "moe.dispatch", "inferhal.kernels.moe_ep:ep_gather_kernel", "moe_ep",
                   {"x_ptr": "*bf16", "src_ptr": "*i64", "o_ptr": "*bf16"}, (), lambda cfg: {"BLOCK_D": cfg["BLOCK_D"]}),
        KernelSpec("ep_combine", "moe.combine", "inferhal.kernels.moe_ep:ep_combine_kernel", "moe_ep",
                   {"b_ptr": "*bf16", "inv_ptr": "*i32", "w_ptr": "*fp32", "y_ptr": "*bf16"}, (),
                   lambda cfg: {"DTYPE": bf16(), "BLOCK_D": cfg["BLOCK_D"], "INTERP": False}),
        # 4 streams x 4096
        KernelSpec("mhc_head", "mhc.head", "inferhal.kernels.mhc_head:mhc_head_kernel", "mhc_head",
                   {"s_ptr": "*bf16", "fn_ptr": "*fp32", "base_ptr": "*fp32", "scale_ptr": "*fp32", "x_ptr": "*bf16"},
                   ("eps", "norm_eps"),
                   lambda cfg: {"BLOCK_N": 4, "BLOCK_K": cfg["BLOCK_K"], "DTYPE": bf16(), "INTERP": False}),
    ]


def _gemm_specs() -> list[KernelSpec]:
    """Dense GEMMs (kernels/linear.py) at V4-Flash shapes: bf16, FP8 128x128 blocks (dequantised in registers,
    and FP8 x FP8 with quantised activations), FP4 e2m1 with ue8m0 groups (dot_scaled), GGUF integer blocks;
    lm_head into fp32 logits and the fused argmax over V4's 129,280-token vocabulary."""
    from inferhal.kernels.linear import ARGMAX, INT_BLOCK, LINEAR, LOGITS
    from inferhal.kernels.moe_experts import FP4_SCALED, FP8_BLOCK, PLAIN

    def cx(fmt: int, mode: int, bias: bool = False, offset: bool = False):
        def make(cfg):
            return {"W_FMT": fmt, "MODE": mode, "HAS_BIAS": bias, "HAS_OFFSET": offset, "DTYPE": _tl().bfloat16,
                    "PREC": "tf32", "LHS_FMT": "bf16", "INTERP": False, "SCALE_ROW": fmt == FP8_BLOCK, **_blocks(cfg)}
        return make

    def ptrs(wtype: str, stype: str, out: str):
        return {"x_ptr": "*bf16", "w_ptr": wtype, "ws_ptr": stype, "wo_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": out,
                "pv_ptr": "*fp32", "pi_ptr": "*i32"}

    fn = "inferhal.kernels.linear:linear_kernel"
    return [
        KernelSpec("linear_bf16", "linear", fn, "gemm", ptrs("*bf16", "*fp32", "*bf16"), (), cx(PLAIN, LINEAR, True),
                   mma=True),
        KernelSpec("linear_fp8_block", "linear", fn, "gemm", ptrs("*fp8e4nv", "*fp32", "*bf16"), (),
                   cx(FP8_BLOCK, LINEAR), mma=True),
        KernelSpec("linear_fp4_dot_scaled", "linear", fn, "gemm_fp4", ptrs("*u8", "*u8", "*bf16"), (),
                   cx(FP4_SCALED, LINEAR), mma=True),
        KernelSpec("linear_int_block", "linear", fn, "gemm_int", ptrs("*i8", "*fp32", "*bf16"), (),
                   cx(INT_BLOCK, LINEAR, offset=True), mma=True),
        KernelSpec("linear_fp8_w8a8", "linear", "inferhal.kernels.linear_lowp:linear_w8a8_kernel", "gemm_fp8",
                   {"xq_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "y_ptr": "*bf16"},
                   (), lambda cfg: {"DTYPE": _tl().bfloat16, "INTERP": False, **_blocks(cfg)}, mma=True,
                   # q_a_proj at decode (fp8_matmul=w8a8 runs it at every M): 64 rows, N 1024, K 4096, 128 x 128
                   # blocks; unspecialised it reported 952 B of spill stack on sm_90a that no launch compiles
                   values={"M": 64, "N": 1024, "K": 4096, "stride_xq": 4096, "stride_xs": 32, "s_wn": 4096, "s_wk": 1,
                           "s_sn": 32, "s_sk": 1, "blk_n": 128, "stride_y": 1024}),
        KernelSpec("act_quant_fp8", "linear", "inferhal.kernels.linear_lowp:act_quant_kernel", "gemm_fp8",
                   {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}, (),
                   lambda cfg: {"BLOCK": cfg["BLOCK_K"], "INTERP": False}),
        KernelSpec("linear_mxfp4_w4a4", "linear", "inferhal.kernels.linear_lowp:linear_fp4_w4a4_kernel", "gemm_fp4",
                   {"xq_ptr": "*u8", "xs_ptr": "*u8", "w_ptr": "*u8", "ws_ptr": "*u8", "y_ptr": "*bf16"}, (),
                   lambda cfg: {"GROUP": 32, "DTYPE": _tl().bfloat16, "INTERP": False, **_blocks(cfg)}, mma=True),
        KernelSpec("linear_nvfp4_w4a4", "linear", "inferhal.kernels.linear_lowp:linear_fp4_w4a4_kernel", "gemm_fp4",
                   {"xq_ptr": "*u8", "xs_ptr": "*fp8e4nv", "w_ptr": "*u8", "ws_ptr": "*fp8e4nv", "y_ptr": "*bf16"}, (),
                   lambda cfg: {"GROUP": 16, "DTYPE": _tl().bfloat16, "INTERP": False, **_blocks(cfg)}, mma=True),
        KernelSpec("act_quant_mxfp4", "linear", "inferhal.kernels.linear_lowp:act_quant_fp4_kernel", "gemm_fp4",
                   {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*u8"}, (),
                   lambda cfg: {"GROUP": 32, "BLOCK_G": 8, "INTERP": False}),
        KernelSpec("act_quant_nvfp4", "linear", "inferhal.kernels.linear_lowp:act_quant_fp4_kernel", "gemm_fp4",
                   {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*fp8e4nv"}, (),
                   lambda cfg: {"GROUP": 16, "BLOCK_G": 8, "INTERP": False}),
        KernelSpec("lm_head_bf16", "lm_head", fn, "gemm", ptrs("*bf16", "*fp32", "*fp32"), (), cx(PLAIN, LOGITS),
                   mma=True),
        KernelSpec("lm_head_fp8_block", "lm_head", fn, "gemm", ptrs("*fp8e4nv", "*fp32", "*fp32"), (),
                   cx(FP8_BLOCK, LOGITS), mma=True),
        KernelSpec("lm_head_argmax_bf16", "lm_head.argmax", fn, "gemm", ptrs("*bf16", "*fp32", "*fp32"), (),
                   cx(PLAIN, ARGMAX), mma=True),
        KernelSpec("lm_head_argmax_fp8_block", "lm_head.argmax", fn, "gemm", ptrs("*fp8e4nv", "*fp32", "*fp32"), (),
                   cx(FP8_BLOCK, ARGMAX), mma=True),
        *_decode_specs(ptrs),
        # the partials' reduction: 129,280 / 128 = 1010 tiles per row
        KernelSpec("lm_head_argmax_reduce", "lm_head.argmax", "inferhal.kernels.linear:argmax_reduce_kernel", "gemm",
                   {"pv_ptr": "*fp32", "pi_ptr": "*i32", "out_ptr": "*i64"}, (), lambda cfg: {"BLOCK_T": 1024}),
    ]


def _decode_specs(ptrs) -> list[KernelSpec]:
    """linear at decode (kernels/linear_decode.py) at V4-Flash's projections, bf16 and FP8 128x128 blocks widened,
    each N tile of the target's ``gemm_decode`` entry (decode_grid picks them by N and K), specialised as a
    launch with contiguous rows: q_a_proj (N 1024, K 4096: 32-wide tiles, 11 splits), kv_proj (N 512: 16-wide),
    q_b_proj (N 32768, K 1024: 64-wide, one split); and the split reduction."""
    from inferhal.kernels.moe_experts import FP8_BLOCK, PLAIN

    def cx(fmt: int, split: bool, bn: int):
        def make(cfg):
            return {"W_FMT": fmt, "HAS_BIAS": False, "HAS_OFFSET": False, "DTYPE": _tl().bfloat16, "PREC": "tf32",
                    "SPLIT": split, "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": bn, "BLOCK_K": cfg["BLOCK_K"],
                    "INTERP": False, "SCALE_ROW": fmt == FP8_BLOCK}
        return make

    fn = "inferhal.kernels.linear_decode:linear_decode_kernel"
    shapes = {64: (32768, 1024, False), 32: (1024, 4096, True), 16: (512, 4096, True)}
    out = []
    for label, fmt, wt in (("bf16", PLAIN, "*bf16"), ("fp8_block", FP8_BLOCK, "*fp8e4nv")):
        for bn, (n, k, split) in shapes.items():
            blk = 128 if fmt == FP8_BLOCK else 1  # a plain weight passes block (1, 1) and a [1, 1] scale
            vals = {"M": 64, "N": n, "K": k, "KS": 384 if split else k, "stride_x": k, "s_wn": k, "s_wk": 1,
                    "blk_n": blk, "blk_k": blk, "stride_y": n, "s_sn": k // 128 if fmt == FP8_BLOCK else 1,
                    "s_sk": 1}
            out.append(KernelSpec(f"linear_decode_{label}_n{bn}", "linear", fn, "gemm_decode",
                                  {**ptrs(wt, "*fp32", "*bf16"), "part_ptr": "*fp32"}, (), cx(fmt, split, bn),
                                  mma=True, values=vals))
    # FP8 x FP8 at decode (fp8_matmul=w8a8): K blocks are the 128-wide scale blocks, so q_a_proj's 4096 columns
    # split in whole blocks (8 splits of 512); codes and scales as linear_fp8_w8a8's
    w8 = {"xq_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "y_ptr": "*bf16",
          "part_ptr": "*fp32"}
    for bn, (n, k, split) in shapes.items():
        vals = {"M": 64, "N": n, "K": k, "KS": 512 if split else k, "stride_xq": k, "stride_xs": k // 128, "s_wn": k,
                "s_wk": 1, "s_sn": k // 128, "s_sk": 1, "blk_n": 128, "stride_y": n}
        out.append(KernelSpec(f"linear_decode_fp8_w8a8_n{bn}", "linear",
                              "inferhal.kernels.linear_decode:linear_w8a8_decode_kernel", "gemm_decode", w8, (),
                              lambda cfg, bn=bn, split=split: {"DTYPE": _tl().bfloat16, "SPLIT": split,
                                                               "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": bn,
                                                               "BLOCK_K": 128, "INTERP": False},
                              mma=True, values=vals))
    out.append(KernelSpec("linear_decode_split_reduce", "linear", "inferhal.kernels.linear_decode:split_reduce_kernel",
                          "gemm_decode", {"part_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16"}, (),
                          lambda cfg: {"HAS_BIAS": False, "DTYPE": _tl().bfloat16, "BLOCK": cfg["REDUCE_BLOCK"],
                                       "INTERP": False}))
    return out


def _later_specs() -> list[KernelSpec]:
    """Kernels added after the first set (kept apart so each addition is one small edit)."""
    bf16 = lambda: _tl().bfloat16  # noqa: E731
    return [
        KernelSpec("mhc_pre", "mhc.pre", "inferhal.kernels.mhc:mhc_pre_kernel", "mhc_pre",
                   {"s_ptr": "*bf16", "fn_ptr": "*fp32", "base_ptr": "*fp32", "scale_ptr": "*fp32", "x_ptr": "*bf16",
                    "post_ptr": "*fp32", "comb_ptr": "*fp32"}, ("eps", "norm_eps"),
                   lambda cfg: {"ITERS": 20, "BLOCK_N": 4, "BLOCK_J": 32, "DTYPE": bf16(), "INTERP": False, **_blocks(cfg)}),
        KernelSpec("mhc_post", "mhc.post", "inferhal.kernels.mhc:mhc_post_kernel", "mhc_post",
                   {"y_ptr": "*bf16", "s_ptr": "*bf16", "post_ptr": "*fp32", "comb_ptr": "*fp32", "o_ptr": "*bf16"}, (),
                   lambda cfg: {"BLOCK_N": 4, "DTYPE": bf16(), "INTERP": False, **_blocks(cfg)}),
        KernelSpec("kv_write_fp8", "kv.write", "inferhal.kernels.kv_write:kv_write_kernel", "kv_write",
                   {"v_ptr": "*bf16", "c_ptr": "*fp8e4nv", "sc_ptr": "*fp32", "slot_ptr": "*i64"}, (),
                   lambda cfg: {"FP8": True, "DTYPE": _tl().float32, "BLOCK_S": 512, "INTERP": False}),
        # V4 decode: 64 query heads on one shared 512-dim latent KV head, sinks, 128-token window
        KernelSpec("attn_paged_latent_decode", "attn.paged", "inferhal.kernels.attn_paged:attn_paged_kernel",
                   "attn_paged",
                   {"q_ptr": "*bf16", "kv_ptr": "*bf16", "o_ptr": "*bf16", "sink_ptr": "*fp32", "bt_ptr": "*i32",
                    "seq_ptr": "*i64", "pos_ptr": "*i64", "len_ptr": "*i32"}, ("scale", "softcap"),
                   lambda cfg: {"SHARED_KV": True, "HAS_SINKS": True, "SOFTCAP": False, "DTYPE": bf16(), "PREC": "tf32",
                                "BLOCK_D": 512, "INTERP": False, **_blocks(cfg)}, mma=True,
                   # as a launch at 64K context passes them: 16-slot blocks of [1, 512] bf16 (no separate V)
                   values={"REP": 64, "D": 512, "BS": 16, "stride_qt": 64 * 512, "stride_qh": 512, "stride_ot": 64 * 512,
                           "stride_oh": 512, "stride_cb": 16 * 512, "stride_cs": 512, "stride_ckv": 0, "stride_ch": 512,
                           "stride_bt": 65536 // 16, "window": 128}),
    ] + _v4_specs()


def _v4_specs() -> list[KernelSpec]:
    """DeepSeek-V4 sparse-attention kernels and the sampler (V4-Flash shapes)."""
    bf16 = lambda: _tl().bfloat16  # noqa: E731
    return [
        # CSA: top-512 of up to 262144 compressed entries (1M context / 4): the multi-tile path
        KernelSpec("topk_select_512", "topk.select", "inferhal.kernels.topk:topk_select_kernel", "topk_select",
                   {"s_ptr": "*fp32", "vl_ptr": "*i64", "out_ptr": "*i64", "scratch_ptr": "*i64"}, (),
                   lambda cfg: {"HAS_VL": False, "SINGLE": False, "BLOCK_S": cfg["BLOCK_S"], "BLOCK_K": 512}),
        # lightning indexer: 64 heads x 128 dims against 128-entry tiles of bf16 keys
        KernelSpec("indexer_scores", "indexer.scores", "inferhal.kernels.indexer:indexer_scores_kernel",
                   "indexer_scores",
                   {"q_ptr": "*bf16", "k_ptr": "*bf16", "w_ptr": "*fp32", "o_ptr": "*fp32", "bt_ptr": "*i32",
                    "seq_ptr": "*i64", "pos_ptr": "*i64", "len_ptr": "*i32"}, ("scale", "weight_scale"),
                   lambda cfg: {"PREC": "tf32", "BLOCK_H": 64, "BLOCK_D": 128, "INTERP": False, **_blocks(cfg),
                                **_value_cache()},
                   mma=True, values=indexer_values(128)),
        # CSA decode: 64 heads on the 512-dim latent, 128-token window + top-512 compressed entries, sinks
        KernelSpec("attn_sparse_topk_csa", "attn.sparse_topk", "inferhal.kernels.sparse_attn:sparse_attn_kernel",
                   "attn_sparse",
                   {"q_ptr": "*bf16", "kv_ptr": "*bf16", "c_ptr": "*bf16", "idx_ptr": "*i64", "o_ptr": "*bf16",
                    "sink_ptr": "*fp32", "bt_ptr": "*i32", "cbt_ptr": "*i32", "seq_ptr": "*i64", "pos_ptr": "*i64",
                    "len_ptr": "*i32", "clen_ptr": "*i32"}, ("scale",),
                   lambda cfg: {"HAS_COMP": True, "HAS_SINKS": True, "DTYPE": bf16(), "PREC": "tf32", "BLOCK_H": 64,
                                "BLOCK_D": 512, "BLOCK_DV": 512 // cfg.get("CHANNEL_SPLIT", 1), "INTERP": False,
                                **_blocks(cfg), **_value_cache()}, mma=True,
                   values=csa_values(512)),
    ] + [
        # compressor: CSA (4-token windows with overlap, C = 2 x 512) and HCA (128-token windows, C = 512)
        KernelSpec(f"attn_compress_{name}", "attn.compress", "inferhal.kernels.compress:compress_kernel",
                   "attn_compress",
                   {"st_ptr": "*bf16", "bias_ptr": "*fp32", "nw_ptr": "*bf16", "cs_ptr": "*fp32", "o_ptr": "*bf16",
                    "bt_ptr": "*i32", "row_ptr": "*i64", "seq_ptr": "*i64", "pos_ptr": "*i64"}, ("eps",),
                   lambda cfg, bm=bm, ov=ov: {"OVERLAP": ov, "R_HALF": 32, "INTERLEAVED": True, "DTYPE": bf16(),
                                              "BLOCK_M": bm, "BLOCK_C": cfg["BLOCK_C"], "BLOCK_D": 512,
                                              "BLOCK_R": 32, "INTERP": False})
        for name, bm, ov in (("csa", 4, True), ("hca", 128, False))
    ] + [
        # sampler over V4's 129,280-token vocabulary, one row per program
        KernelSpec("sample", "sample", "inferhal.kernels.sample:sample_kernel", "sample",
                   {"l_ptr": "*fp32", "t_ptr": "*fp32", "k_ptr": "*i32", "p_ptr": "*fp32", "mp_ptr": "*fp32",
                    "seed_ptr": "*i64", "step_ptr": "*i64", "out_ptr": "*i64"}, (),
                   lambda cfg: {"BLOCK_R": cfg["BLOCK_R"], "BLOCK_V": cfg["BLOCK_V"]}),
    ]


KERNELS: list[KernelSpec] = _specs()
#: issue #46's hot ops: their kernels must hold no spill stack (tests/kernels/test_aot.py on sm_100a; .ci/run on
#: sm_90a, where the decode=single attention kernels are exempt)
HOT_OPS = ("attn.sparse_topk", "attn.paged", "indexer.scores", "linear", "moe.experts")


def by_name(name: str) -> KernelSpec:
    for k in KERNELS:
        if k.name == name:
            return k
    raise KeyError(f"no kernel named {name!r}; known: {', '.join(k.name for k in KERNELS)}")
