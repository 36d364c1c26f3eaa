"""Every tensor a DeepSeek-V4 checkpoint must hold, with its logical shape, by canonical name.

``expected(cfg)`` is what the loader checks a checkpoint against (missing, extra, mis-shaped) and what
the random generator writes. ``FP32_KEEP`` are kept in fp32 whatever the model dtype (as transformers
does); ``tid2eid`` is int64.
"""

from __future__ import annotations

from inferhal.core.models.deepseek_v4.config import CSA, HCA, V4Config

FP32_KEEP = ("attn_hc.", "ffn_hc.", "hc_head.", ".sinks", "position_bias", "e_score_correction_bias", "q_a_norm.",
             "kv_norm.", "input_layernorm.", "post_attention_layernorm.", "norm.weight")


def keep_fp32(name: str) -> bool:
    return any(k in name for k in FP32_KEEP) or name == "norm.weight"


def layer_tensors(cfg: V4Config, prefix: str, layer: int, hash_layer: bool) -> dict[str, tuple[int, ...]]:
    d, n, hd, h = cfg.hidden_size, cfg.hc_mult, cfg.head_dim, cfg.num_heads
    mix = (2 + n) * n
    t: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
        "attn_hc.fn": (mix, n * d), "attn_hc.base": (mix,), "attn_hc.scale": (3,),
        "ffn_hc.fn": (mix, n * d), "ffn_hc.base": (mix,), "ffn_hc.scale": (3,),
        "self_attn.q_a_proj.weight": (cfg.q_lora_rank, d), "self_attn.q_a_norm.weight": (cfg.q_lora_rank,),
        "self_attn.q_b_proj.weight": (h * hd, cfg.q_lora_rank), "self_attn.kv_proj.weight": (hd, d),
        "self_attn.kv_norm.weight": (hd,), "self_attn.sinks": (h,),
        "self_attn.o_a_proj.weight": (cfg.o_groups * cfg.o_lora_rank, h * hd // cfg.o_groups),
        "self_attn.o_b_proj.weight": (d, cfg.o_groups * cfg.o_lora_rank),
        "mlp.gate.weight": (cfg.n_experts, d),
        "mlp.experts.gate_up_proj": (cfg.n_experts, 2 * cfg.moe_intermediate, d),
        "mlp.experts.down_proj": (cfg.n_experts, d, cfg.moe_intermediate),
        "mlp.shared_experts.gate_proj.weight": (cfg.moe_intermediate, d),
        "mlp.shared_experts.up_proj.weight": (cfg.moe_intermediate, d),
        "mlp.shared_experts.down_proj.weight": (d, cfg.moe_intermediate),
    }
    if hash_layer:
        t["mlp.gate.tid2eid"] = (cfg.vocab_size, cfg.top_k)
    else:
        t["mlp.gate.e_score_correction_bias"] = (cfg.n_experts,)
    lt = cfg.layer_type(layer)
    if lt == CSA:
        m, di = cfg.compress_rates[CSA], cfg.index_head_dim
        c = "self_attn.compressor."
        t.update({
            c + "kv_proj.weight": (2 * hd, d), c + "gate_proj.weight": (2 * hd, d), c + "position_bias": (m, 2 * hd),
            c + "kv_norm.weight": (hd,), c + "indexer.kv_proj.weight": (2 * di, d),
            c + "indexer.gate_proj.weight": (2 * di, d), c + "indexer.position_bias": (m, 2 * di),
            c + "indexer.kv_norm.weight": (di,), c + "indexer.q_b_proj.weight": (cfg.index_n_heads * di, cfg.q_lora_rank),
            c + "indexer.scorer.weights_proj.weight": (cfg.index_n_heads, d),
        })
    elif lt == HCA:
        m = cfg.compress_rates[HCA]
        c = "self_attn.compressor."
        t.update({c + "kv_proj.weight": (hd, d), c + "gate_proj.weight": (hd, d), c + "position_bias": (m, hd),
                  c + "kv_norm.weight": (hd,)})
    return {prefix + k: v for k, v in t.items()}


def main_tensors(cfg: V4Config) -> dict[str, tuple[int, ...]]:
    d, n = cfg.hidden_size, cfg.hc_mult
    out: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (cfg.vocab_size, d), "norm.weight": (d,),
        "hc_head.hc_fn": (n, n * d), "hc_head.hc_base": (n,), "hc_head.hc_scale": (1,),
    }
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.num_layers):
        out.update(layer_tensors(cfg, f"layers.{i}.", i, cfg.mlp_layer_types[i] == "hash_moe"))
    return out


def mtp_tensors(cfg: V4Config, k: int) -> dict[str, tuple[int, ...]]:
    d, n = cfg.hidden_size, cfg.hc_mult
    p = f"mtp.{k}."
    out = {p + "e_proj.weight": (d, d), p + "h_proj.weight": (d, d), p + "enorm.weight": (d,),
           p + "hnorm.weight": (d,), p + "norm.weight": (d,), p + "hc_head.hc_fn": (n, n * d),
           p + "hc_head.hc_base": (n,), p + "hc_head.hc_scale": (1,)}
    out.update(layer_tensors(cfg, p, cfg.num_layers + k, False))
    return out


def expected(cfg: V4Config, with_mtp: bool = True) -> dict[str, tuple[int, ...]]:
    out = main_tensors(cfg)
    if with_mtp:
        for k in range(cfg.num_mtp):
            out.update(mtp_tensors(cfg, k))
    return out
