"""What a model is made of, for planning: its tensors by class, their bytes in a weight format, and what
one token of attention reads and computes at a context length. Read from the model config alone.

Tensor classes: ``experts`` (routed experts: each token uses ``top_k`` of ``n_experts`` per MoE layer),
``dense`` (every other product: attention projections, shared experts, compressor and indexer
projections), ``head`` (the LM head; a tied table counts here once), ``embed`` (an untied embedding: only
gathered), ``small`` (norms, biases, mixing parameters, routing tables: kept in their own dtypes), and the
same with an ``mtp_`` prefix for MTP draft layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from inferhal.core.errors import UserError

#: weight formats: name → (bytes of a ``[..., N, K]`` tensor, the dtype its products can run at)
WEIGHT_FORMATS = ("fp4", "nvfp4", "fp8", "bfloat16", "float32")
_PLAIN = {"bfloat16": 2, "float16": 2, "float32": 4, "int64": 8}
ACT_FORMATS = {"fp4": "fp4_e2m1", "fp8": "float8_e4m3fn", "bfloat16": "bfloat16", "float32": "float32"}


def tensor_bytes(shape: tuple[int, ...], fmt: str) -> int:
    """Bytes of a ``[..., N, K]`` weight stored as ``fmt``, scales included:
    fp4 = e2m1 codes + one ue8m0 byte per 32 along K (MXFP4); nvfp4 = e2m1 + one e4m3 byte per 16 along K
    + one fp32 per tensor; fp8 = e4m3 + one fp32 per 128x128 block; bfloat16 / float32 = 2 / 4 per element."""
    n_el = math.prod(shape)
    if fmt in _PLAIN:
        return n_el * _PLAIN[fmt]
    if len(shape) < 2:
        raise UserError(f"weight format {fmt} needs a [N, K] tensor, got shape {shape}")
    *lead, n, k = shape
    rows = math.prod(lead) * n
    if fmt == "fp4":
        return rows * ((k + 1) // 2) + rows * -(-k // 32)
    if fmt == "nvfp4":
        return rows * ((k + 1) // 2) + rows * -(-k // 16) + 4 * math.prod(lead)
    if fmt == "fp8":
        return n_el + math.prod(lead) * -(-n // 128) * -(-k // 128) * 4
    raise UserError(f"unknown weight format {fmt!r}: use one of {', '.join(WEIGHT_FORMATS)}")


@dataclass(frozen=True)
class Inventory:
    """A model as numbers. ``tensors``: class → {name: (shape, stored dtype when not quantisable)}.

    ``kv_read(n)`` / ``attn_flops(n)``: bytes of KV one decode token reads and FLOPs its attention does
    (all layers, one request) at context ``n``; ``kv_stored(n)``: bytes one request of ``n`` tokens stores.
    ``mtp_kv_read(n)`` / ``mtp_attn_flops(n)``: the same for one MTP draft layer."""

    name: str
    family: str
    dtype: str  # the model's own dtype (weights of format auto when the checkpoint is not quantised)
    hidden: int
    vocab: int
    layers: int
    kv_heads: int  # KV heads a tensor-parallel group can split (1 = every TP rank reads all KV)
    moe_layers: int
    n_experts: int
    top_k: int
    tensors: dict[str, dict[str, tuple[tuple[int, ...], str]]]
    checkpoint_formats: dict[str, str]  # class → the format the published checkpoint stores
    kv_read: Callable[[float], float]
    attn_flops: Callable[[float], float]
    kv_stored: Callable[[float], float]
    act_bytes_per_token: float  # the widest buffers one layer keeps live per token of a step (an estimate)
    mtp_kv_read: Callable[[float], float] = lambda n: 0.0
    mtp_attn_flops: Callable[[float], float] = lambda n: 0.0
    notes: list[str] = field(default_factory=list)

    def params(self, cls: str) -> int:
        return sum(math.prod(s) for s, _ in self.tensors.get(cls, {}).values())

    def bytes(self, cls: str, fmt: str) -> int:
        """Bytes of class ``cls`` in ``fmt`` (``small`` and ``table`` tensors keep their own dtypes)."""
        out = 0
        for shape, own in self.tensors.get(cls, {}).values():
            out += tensor_bytes(shape, own if cls.endswith(("small", "table")) else fmt)
        return out

    def expert_params(self) -> int:
        """Parameters of one routed expert in one layer."""
        if not self.moe_layers or not self.n_experts:
            return 0
        return self.params("experts") // (self.moe_layers * self.n_experts)


def inventory(model_cfg, kv_groups) -> Inventory:
    """The :class:`Inventory` of ``model_cfg``; ``kv_groups``: its KV layer groups in the chosen KV format."""
    family = str(model_cfg.family)
    if family == "deepseek_v4":
        return _deepseek_v4(model_cfg, kv_groups)
    if family == "gemma3":
        return _gemma3(model_cfg, kv_groups)
    if family == "llama":
        return _llama(model_cfg, kv_groups)
    raise UserError(f"model family {family!r} has no planning inventory (core/plan/inventory.py knows deepseek_v4, "
                    f"gemma3 and llama)")


def _group_bytes(groups, name: str) -> int:
    for g in groups:
        if g.name == name:
            return g.slot_bytes()
    return 0


def _kv_stored(groups) -> Callable[[float], float]:
    """Bytes one request of ``n`` tokens stores: compressed groups per token, sliding ones their window."""
    def stored(n: float) -> float:
        out = 0.0
        for g in groups:
            if g.kind == "sliding":
                out += g.bytes_per_token() * min(g.window, n)
            else:
                out += g.bytes_per_token() * n
        return out
    return stored


def _deepseek_v4(model_cfg, groups) -> Inventory:
    from inferhal.core.models.deepseek_v4 import shapes
    from inferhal.core.models.deepseek_v4.config import CSA, HCA
    from inferhal.core.models.deepseek_v4.kv import v4_config

    cfg = v4_config(model_cfg)
    tensors: dict[str, dict] = {}
    named = dict(shapes.main_tensors(cfg))
    for k in range(cfg.num_mtp):
        named.update(shapes.mtp_tensors(cfg, k))
    for name, shape in named.items():
        mtp = name.startswith("mtp.")
        if ".mlp.experts." in name:
            cls = "experts"
        elif name == "lm_head.weight" or (name == "embed_tokens.weight" and cfg.tie_word_embeddings):
            cls = "head"
        elif name == "embed_tokens.weight":
            cls = "embed"
        elif name.endswith("tid2eid"):
            cls = "table"
        elif len(shape) == 2 and name.endswith(".weight") and not name.endswith("mlp.gate.weight") \
                and "norm" not in name:
            cls = "dense"
        else:
            cls = "small"
        own = "int64" if cls == "table" else ("float32" if shapes.keep_fp32(name) else str(model_cfg.dtype))
        tensors.setdefault(("mtp_" if mtp else "") + cls, {})[name] = (tuple(shape), own)

    layers = range(cfg.num_layers)
    n_csa = sum(1 for i in layers if cfg.layer_type(i) == CSA)
    n_hca = sum(1 for i in layers if cfg.layer_type(i) == HCA)
    win, h, d = cfg.sliding_window, cfg.num_heads, cfg.head_dim
    m_csa, m_hca = cfg.compress_rates.get(CSA, 4), cfg.compress_rates.get(HCA, 128)
    swa, csa, idx, hca = (_group_bytes(groups, g) for g in ("swa", "csa", "csa_index", "hca"))

    def entries(n: float) -> tuple[float, float, float]:
        """Per decode token: window entries (every layer), CSA entries attended, HCA entries attended."""
        return min(n, win), min(n / m_csa, cfg.index_topk), n / m_hca

    def kv_read(n: float) -> float:
        w, c, e = entries(n)
        # every layer reads its window; every CSA layer (sharing readers too) scores all indexer keys of its
        # source and reads its top-k entries; every HCA layer reads all its entries
        return cfg.num_layers * w * swa + n_csa * (c * csa + (n / m_csa) * idx) + n_hca * e * hca

    def attn_flops(n: float) -> float:
        w, c, e = entries(n)
        per_entry = 4 * h * d  # q.k and p.v over head_dim for every head
        return (cfg.num_layers * w + n_csa * c + n_hca * e) * per_entry \
            + n_csa * (n / m_csa) * 2 * cfg.index_n_heads * cfg.index_head_dim

    return Inventory(
        name=str(model_cfg.name), family="deepseek_v4", dtype=str(model_cfg.dtype), hidden=cfg.hidden_size,
        vocab=cfg.vocab_size, layers=cfg.num_layers, kv_heads=1,
        moe_layers=sum(1 for t in cfg.mlp_layer_types if t in ("moe", "hash_moe")),
        n_experts=cfg.n_experts, top_k=cfg.top_k, tensors=tensors,
        # FACTS (transformers' deepseek_v4 loader): experts FP4 e2m1 in 32-element groups, the other products
        # FP8 with 128x128 block scales; embedding and head in bf16 (an assumption: not quantised there)
        checkpoint_formats=({"experts": "fp4", "dense": "fp8", "head": "bfloat16", "embed": "bfloat16"}
                            if str(model_cfg.format) != "random" else {}),  # random weights: the model's dtype
        kv_read=kv_read, attn_flops=attn_flops, kv_stored=_kv_stored(groups),
        # hc_mult fp32 residual streams in and out, q in bf16, the routed tokens' gate|up in bf16
        act_bytes_per_token=2 * cfg.hc_mult * cfg.hidden_size * 4 + h * d * 2 + cfg.top_k * 2 * cfg.moe_intermediate * 2,
        mtp_kv_read=lambda n: min(n, win) * swa, mtp_attn_flops=lambda n: min(n, win) * 4 * h * d,
        notes=["MTP layers attend their window only (V4Config.layer_type: sliding past the main layers)"],
    )


def _gemma3(model_cfg, groups) -> Inventory:
    from inferhal.core.models.gemma3.config import Gemma3Config, from_gguf_metadata

    if model_cfg.arch:
        cfg = Gemma3Config.from_mapping(dict(model_cfg.arch))
    else:
        from inferhal.core.models.gguf.reader import GGUFFile
        from inferhal.core.models.gemma3.loader import resolve_path

        path = resolve_path(model_cfg)
        cfg = from_gguf_metadata(GGUFFile(path).metadata, where=str(path))
    d, hd = cfg.hidden_size, cfg.head_dim
    norms = (("input_norm", d), ("post_attn_norm", d), ("pre_ffn_norm", d), ("post_ffn_norm", d), ("q_norm", hd), ("k_norm", hd))
    return _dense_decoder(model_cfg, "gemma3", groups, d, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, hd,
                          cfg.intermediate_size, cfg.vocab_size, True, norms)


def _llama(model_cfg, groups) -> Inventory:
    from inferhal.core.models.gguf.reader import GGUFFile
    from inferhal.core.models.llama.loader import config_of, resolve_path

    cfg = config_of(GGUFFile(resolve_path(model_cfg)))
    d = cfg.hidden_size
    return _dense_decoder(model_cfg, "llama", groups, d, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                          cfg.intermediate_size, cfg.vocab_size, cfg.tie_embeddings, (("attn_norm", d), ("ffn_norm", d)))


def _dense_decoder(model_cfg, family: str, groups, d: int, layers: int, heads: int, kv_heads: int, hd: int, inter: int,
                   vocab: int, tied: bool, norms) -> Inventory:
    """A dense decoder (q, k, v, o, gated FFN per layer) whose weights the engine holds in ``model.dtype``."""
    own = str(model_cfg.dtype)
    qw, kw = heads * hd, kv_heads * hd
    dense, small = {}, {}
    for i in range(layers):
        p = f"layers.{i}."
        for n, s in (("q", (qw, d)), ("k", (kw, d)), ("v", (kw, d)), ("o", (d, qw)), ("gate", (inter, d)),
                     ("up", (inter, d)), ("down", (d, inter))):
            dense[p + n] = (s, own)
        for n, width in norms:
            small[p + n] = ((width,), own)
    small["final_norm"] = ((d,), own)
    tensors = {"dense": dense, "small": small}
    if tied:
        tensors["head"] = {"embed_tokens (tied head)": ((vocab, d), own)}
    else:
        tensors["head"] = {"output": ((vocab, d), own)}
        tensors["embed"] = {"embed_tokens": ((vocab, d), own)}
    kinds = [(g.window if g.kind == "sliding" else 0, len(g.layers), g.slot_bytes() / g.tokens_per_slot) for g in groups]

    def kv_read(n: float) -> float:
        return sum(nl * (min(w, n) if w else n) * per_tok for w, nl, per_tok in kinds)

    def attn_flops(n: float) -> float:
        return sum(nl * (min(w, n) if w else n) for w, nl, _ in kinds) * 4 * heads * hd

    return Inventory(
        name=str(model_cfg.name), family=family, dtype=own, hidden=d, vocab=vocab, layers=layers,
        kv_heads=kv_heads, moe_layers=0, n_experts=0, top_k=0, tensors=tensors,
        checkpoint_formats={"dense": own, "head": own, "embed": own},  # the engine dequantises the GGUF to model.dtype
        kv_read=kv_read, attn_flops=attn_flops, kv_stored=_kv_stored(groups),
        # residual, q|k|v and gate|up in the model's dtype
        act_bytes_per_token=(2 * d + qw + 2 * kw + 2 * inter) * (4 if own == "float32" else 2),
    )
