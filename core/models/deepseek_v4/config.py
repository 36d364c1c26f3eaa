"""DeepSeek-V4 ``config.json`` → a validated, frozen :class:`V4Config`.

Field names and defaults are transformers' ``DeepseekV4Config`` (5.24), including its legacy spellings
(``compress_ratios``, ``compress_rate_csa``/``_hca``, ``num_hash_layers``, ``qk_rope_head_dim``,
``rope_scaling``). Every field is either used by the model, checked to hold a supported value, or listed
in :data:`INERT_FIELDS` (training-only or bookkeeping fields with no effect on inference). A field this
module does not know, or a value it cannot run, is a :class:`~inferhal.core.errors.UserError` naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from inferhal.core.errors import UserError

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_TYPES = ("hash_moe", "moe")
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}

DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048, "num_hidden_layers": 43,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "q_lora_rank": 1024,
    "num_experts_per_tok": 6, "n_routed_experts": 256, "n_shared_experts": 1, "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True, "routed_scaling_factor": 1.5, "max_position_embeddings": 1048576,
    "rope_theta": 10000.0, "layer_types": None, "compress_rates": None, "compress_rope_theta": 160000.0,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "mlp_layer_types": None, "swiglu_limit": 10.0,
    "sliding_window": 128, "o_groups": 8, "o_lora_rank": 1024, "index_n_heads": 64, "index_head_dim": 128,
    "index_topk": 512, "num_nextn_predict_layers": 1, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": None, "tie_word_embeddings": False,
    "rope_parameters": None, "partial_rotary_factor": None, "attention_bias": False, "mlp_bias": False,
    # inferhal's cross-layer KV sharing (V4.1-Flash's "CSA2"; no transformers field): entry i names the layer
    # whose compressed KV and indexer keys layer i reads (i itself, or -1, for a layer that keeps its own)
    "kv_sources": None,
}
#: Fields with no effect on inference (training knobs, provenance). Accepted and ignored.
INERT_FIELDS = frozenset({
    "architectures", "transformers_version", "dtype", "torch_dtype", "initializer_range", "use_cache",
    "output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "attention_dropout",
    "output_hidden_states", "output_attentions", "return_dict", "auto_map", "_name_or_path", "model_type",
    "quantization_config", "expert_dtype", "scale_fmt", "chunk_size_feed_forward", "id2label", "label2id",
    "problem_type", "tokenizer_class", "_attn_implementation_autoset",
})
_LEGACY = ("compress_ratios", "compress_rate_csa", "compress_rate_hca", "num_hash_layers", "qk_rope_head_dim",
           "rope_scaling", "topk_method")
ROPE_TYPES = ("default", "yarn")
_ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "factor", "original_max_position_embeddings",
              "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate"}


@dataclass(frozen=True)
class RopeSpec:
    """One rotary table: ``theta``, ``rotary_dim`` and (for YaRN) its scaling parameters."""

    rope_type: str
    theta: float
    rotary_dim: int
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True


@dataclass(frozen=True)
class V4Config:
    raw: Mapping[str, Any]
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    q_lora_rank: int
    rope_dim: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    compress_rates: Mapping[str, int]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    n_experts: int
    top_k: int
    moe_intermediate: int
    scoring: str
    renormalize: bool
    routed_scaling: float
    swiglu_limit: float
    rms_eps: float
    num_mtp: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    rope_main: RopeSpec
    rope_compress: RopeSpec
    kv_sources: tuple[int, ...] = ()  # per layer: the layer whose compressed KV it reads (itself when unshared)

    def kv_source(self, layer: int) -> int:
        """The layer whose compressed KV (and, for CSA, indexer keys) ``layer`` reads and writes."""
        return self.kv_sources[layer] if layer < len(self.kv_sources) else layer

    def ratio(self, layer: int) -> int:
        """Compress ratio of a layer (0 = sliding-window only). MTP layers (index >= num_layers) are sliding."""
        if layer >= self.num_layers:
            return 0
        t = self.layer_types[layer]
        return 0 if t == SLIDING else int(self.compress_rates[t])

    def layer_type(self, layer: int) -> str:
        return SLIDING if layer >= self.num_layers else self.layer_types[layer]


def _err(field: str, value: Any, why: str) -> UserError:
    return UserError(f"DeepSeek-V4 config.json: unsupported {field}={value!r}: {why}")


def _int(cfg: Mapping[str, Any], name: str, minimum: int = 1) -> int:
    v = cfg[name]
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise _err(name, v, f"must be an integer >= {minimum}")
    return v


def _float(cfg: Mapping[str, Any], name: str, minimum: float | None = None) -> float:
    v = cfg[name]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (minimum is not None and v < minimum):
        raise _err(name, v, f"must be a number{'' if minimum is None else f' >= {minimum}'}")
    return float(v)


def _rope(label: str, d: Mapping[str, Any], rotary_dim: int) -> RopeSpec:
    bad = set(d) - _ROPE_KEYS
    if bad:
        raise _err(f"rope_parameters.{label}.{sorted(bad)[0]}", d[sorted(bad)[0]], "unknown rope parameter")
    rt = d.get("rope_type", d.get("type", "default"))
    if rt not in ROPE_TYPES:
        raise _err(f"rope_parameters.{label}.rope_type", rt, f"supported: {', '.join(ROPE_TYPES)}")
    theta = float(d["rope_theta"])
    if rt == "default":
        return RopeSpec("default", theta, rotary_dim, attention_factor=float(d.get("attention_factor", 1.0)))
    for k in ("factor", "original_max_position_embeddings"):
        if d.get(k) is None:
            raise _err(f"rope_parameters.{label}.{k}", None, "yarn needs it")
    factor = float(d["factor"])
    if d.get("attention_factor") is not None:
        af = float(d["attention_factor"])
    else:  # transformers' YaRN default mscale
        import math

        def ms(s: float, m: float = 1.0) -> float:
            return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

        m, mad = d.get("mscale"), d.get("mscale_all_dim")
        af = ms(factor, m) / ms(factor, mad) if (m and mad) else ms(factor)
    return RopeSpec("yarn", theta, rotary_dim, factor, int(d["original_max_position_embeddings"]),
                    float(d.get("beta_fast") or 32), float(d.get("beta_slow") or 1), af, bool(d.get("truncate", True)))


def parse_config(raw: Mapping[str, Any]) -> V4Config:
    """Validate a ``config.json`` dict (``model_type: deepseek_v4``) the way transformers reads it."""
    mt = raw.get("model_type", "deepseek_v4")
    if mt != "deepseek_v4":
        raise _err("model_type", mt, "this loader reads deepseek_v4 only")
    unknown = sorted(set(raw) - set(DEFAULTS) - INERT_FIELDS - set(_LEGACY))
    if unknown:
        raise UserError(f"DeepSeek-V4 config.json: unknown field {unknown[0]!r} (value {raw[unknown[0]]!r}); "
                        f"inferhal honours every field and does not know what this one means")
    cfg = {**DEFAULTS, **{k: v for k, v in raw.items() if k in DEFAULTS}}
    n = _int(cfg, "num_hidden_layers")
    for name, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False),
                       ("num_key_value_heads", 1)):
        if cfg[name] != want:
            raise _err(name, cfg[name], f"DeepSeek-V4 defines only {want!r}")
    if cfg["n_shared_experts"] != 1:
        raise _err("n_shared_experts", cfg["n_shared_experts"], "transformers' layout has exactly one shared expert")
    if cfg["scoring_func"] not in ("sqrtsoftplus", "sigmoid", "softmax"):
        raise _err("scoring_func", cfg["scoring_func"], "supported: sqrtsoftplus, sigmoid, softmax")
    if raw.get("topk_method", "noaux_tc") != "noaux_tc":
        raise _err("topk_method", raw["topk_method"], "V4 routes with noaux_tc (bias-corrected top-k, no groups)")
    head_dim = _int(cfg, "head_dim")
    # compress rates (legacy scalars fold in)
    rates = dict(cfg["compress_rates"] or {CSA: 4, HCA: 128})
    if raw.get("compress_rate_csa") is not None:
        rates[CSA] = raw["compress_rate_csa"]
    if raw.get("compress_rate_hca") is not None:
        rates[HCA] = raw["compress_rate_hca"]
    for k, v in rates.items():
        if k not in (CSA, HCA):
            raise _err(f"compress_rates.{k}", v, f"keys must be {CSA} or {HCA}")
        if isinstance(v, bool) or not isinstance(v, int) or v < 2:
            raise _err(f"compress_rates.{k}", v, "must be an integer >= 2")
    # layer types
    lt = cfg["layer_types"]
    if lt is None and raw.get("compress_ratios") is not None:
        try:
            lt = [_RATIO_TO_TYPE[r] for r in raw["compress_ratios"]]
        except KeyError as e:
            raise _err("compress_ratios", raw["compress_ratios"], f"entry {e.args[0]} is not 0, 4 or 128") from None
    if lt is None:
        lt = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    extra = list(raw.get("compress_ratios") or [])[n:]  # trailing entries describe the MTP layers
    if any(r != 0 for r in extra):
        raise _err("compress_ratios", raw["compress_ratios"], "MTP layers (entries past num_hidden_layers) must be 0")
    lt = list(lt)[:n]
    mlt = cfg["mlp_layer_types"]
    if mlt is None:
        nh = raw.get("num_hash_layers", 3)
        mlt = ["hash_moe"] * min(n, nh) + ["moe"] * max(0, n - nh)
    mlt = list(mlt)[:n]
    for name, types, allowed in (("layer_types", lt, LAYER_TYPES), ("mlp_layer_types", mlt, MLP_TYPES)):
        if len(types) != n:
            raise _err(name, types, f"needs num_hidden_layers={n} entries")
        bad = [t for t in types if t not in allowed]
        if bad:
            raise _err(name, bad[0], f"entries must be one of {allowed}")
    for t in set(lt) - {SLIDING}:
        if t not in rates:
            raise _err("compress_rates", rates, f"no rate for layer type {t}")
    # rotary
    prf = cfg["partial_rotary_factor"]
    if prf is None:
        prf = raw["qk_rope_head_dim"] / head_dim if raw.get("qk_rope_head_dim") is not None else 64 / 512
    rope_dim = int(head_dim * prf)
    if rope_dim <= 0 or rope_dim % 2 or rope_dim > head_dim:
        raise _err("partial_rotary_factor", prf, f"gives rotary dim {rope_dim}; it must be even and in (0, head_dim]")
    idx_dim = _int(cfg, "index_head_dim")
    if CSA in lt and rope_dim > idx_dim:
        raise _err("index_head_dim", idx_dim, f"smaller than the rotary dim {rope_dim}")
    rp = cfg["rope_parameters"] or raw.get("rope_scaling") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main_d, comp_d = dict(rp["main"]), dict(rp["compress"])
    else:
        flat = {k: v for k, v in rp.items() if k not in ("main", "compress")}
        main_d = {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
        comp_d = {"rope_type": "default", **flat, "rope_theta": cfg["compress_rope_theta"]}
        if comp_d.get("rope_type", comp_d.get("type")) == "yarn":
            comp_d.setdefault("attention_factor", 1.0)  # V4 does not scale cos/sin by YaRN's mscale
    for label, d in (("main", main_d), ("compress", comp_d)):
        if d.get("partial_rotary_factor", prf) != prf:
            raise _err(f"rope_parameters.{label}.partial_rotary_factor", d["partial_rotary_factor"],
                       f"differs from partial_rotary_factor={prf}")
    # groups / heads
    heads = _int(cfg, "num_attention_heads")
    og = _int(cfg, "o_groups")
    if heads % og:
        raise _err("o_groups", og, f"must divide num_attention_heads={heads}")
    eos = cfg["eos_token_id"]
    eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (eos,))
    e = _int(cfg, "n_routed_experts")
    k = _int(cfg, "num_experts_per_tok")
    if k > e:
        raise _err("num_experts_per_tok", k, f"exceeds n_routed_experts={e}")
    sources = _kv_sources(cfg["kv_sources"], lt)
    return V4Config(
        raw=dict(raw), kv_sources=sources, vocab_size=_int(cfg, "vocab_size"), hidden_size=_int(cfg, "hidden_size"), num_layers=n,
        num_heads=heads, head_dim=head_dim, q_lora_rank=_int(cfg, "q_lora_rank"), rope_dim=rope_dim, o_groups=og,
        o_lora_rank=_int(cfg, "o_lora_rank"), sliding_window=_int(cfg, "sliding_window"), layer_types=tuple(lt),
        mlp_layer_types=tuple(mlt), compress_rates=dict(rates), index_n_heads=_int(cfg, "index_n_heads"),
        index_head_dim=idx_dim, index_topk=_int(cfg, "index_topk"), hc_mult=_int(cfg, "hc_mult"),
        hc_sinkhorn_iters=_int(cfg, "hc_sinkhorn_iters", 0), hc_eps=_float(cfg, "hc_eps", 0.0), n_experts=e,
        top_k=k, moe_intermediate=_int(cfg, "moe_intermediate_size"), scoring=cfg["scoring_func"],
        renormalize=bool(cfg["norm_topk_prob"]), routed_scaling=_float(cfg, "routed_scaling_factor"),
        swiglu_limit=_float(cfg, "swiglu_limit", 0.0), rms_eps=_float(cfg, "rms_norm_eps", 0.0),
        num_mtp=_int(cfg, "num_nextn_predict_layers", 0), max_position_embeddings=_int(cfg, "max_position_embeddings"),
        tie_word_embeddings=bool(cfg["tie_word_embeddings"]), bos_token_id=cfg["bos_token_id"], eos_token_ids=eos_ids,
        pad_token_id=cfg["pad_token_id"], rope_main=_rope("main", main_d, rope_dim),
        rope_compress=_rope("compress", comp_d, rope_dim),
    )


def _kv_sources(raw: Any, layer_types: list[str]) -> tuple[int, ...]:
    """``kv_sources`` checked: a compressed layer reads its own compressed KV or that of an earlier source layer
    of the same type (so the same ratio and entry layout); sliding layers keep their own."""
    n = len(layer_types)
    if raw is None:
        return tuple(range(n))
    if hasattr(raw, "__iter__") and not isinstance(raw, (str, bytes, dict)):
        raw = list(raw)  # a YAML list arrives as an omegaconf ListConfig
    if not isinstance(raw, list) or len(raw) != n:
        raise _err("kv_sources", raw, f"needs num_hidden_layers={n} entries (a source layer per layer, -1 for its own)")
    out = []
    for i, s in enumerate(raw):
        if isinstance(s, bool) or not isinstance(s, int) or s < -1 or s >= n:
            raise _err(f"kv_sources[{i}]", s, f"must be -1 or a layer index in [0, {n})")
        out.append(i if s in (-1, i) else s)
    for i, s in enumerate(out):
        if s == i:
            continue
        if layer_types[i] == SLIDING:
            raise _err(f"kv_sources[{i}]", s, f"layer {i} is {SLIDING}: it has no compressed KV to share")
        if s > i:
            raise _err(f"kv_sources[{i}]", s, f"layer {i} would read layer {s}, a later layer, whose KV does not "
                                              f"exist yet when layer {i} runs")
        if layer_types[s] != layer_types[i]:
            raise _err(f"kv_sources[{i}]", s, f"layer {i} is {layer_types[i]} but layer {s} is {layer_types[s]}")
        if out[s] != s:
            raise _err(f"kv_sources[{i}]", s, f"layer {s} is not a source: it reads layer {out[s]}'s KV itself")
    return tuple(out)
