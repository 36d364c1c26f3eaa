"""A dense decoder against the op vocabulary, configured by :class:`~.config.DecoderConfig`: Gemma 3 and Llama
are settings of it. Every tensor op goes through the active backend's OpTable.

Per layer (``x`` is the residual stream; [brackets] hold only where the config says so)::

    h = rms(x) w                       -> q, k, v = linear(h, q|k|v)   q: [T, H, D], k, v: [T, Hk, D]
    [qk_norm] q, k = rms(q) w, rms(k) w      (per head)
    q|k = rope(q|k)                    neox over the whole head; base and scaling of the layer's type
    kv.write (k, v) -> attn.paged      (window on sliding layers; scale query_pre_attn_scalar**-0.5; GQA; softcap)
    x += [sandwich_norms: rms(] linear(o) [) w]
    x += [sandwich_norms: rms(] linear(act(gate) * up, down) [) w],   gate, up = linear(rms(x) w, gate|up)

``rms(.) w`` scales by ``1 + w`` with ``norm_unit_offset`` (Gemma: the weights are held minus one, so
``1 + (w - 1)`` is what transformers computes after its load-time ``- 1``). Each residual add runs inside the
pre-norm that follows it (``norm.rms`` with ``residual``: the same sum, one op fewer per add). The embedding is
scaled by sqrt(hidden) in the table dtype with ``scale_embeddings``; the LM head is the embedding table
(``tie_embeddings``) or the file's own ``output.weight``; ``final_softcap`` caps the logits; a step whose rows
are all greedy takes its tokens from ``lm_head.argmax``. KV lives in one paged group per layer type:
``sliding`` (window blocks are released as they fall out) and ``full``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Sequence

import torch

from inferhal.core.models.base import ForwardBatch, KVCache
from inferhal.core.models.gguf.config import FULL, SLIDING, DecoderConfig
from inferhal.core.ops.params import ActParams, AttnParams, KVWriteParams, RmsNormParams, RopeParams, SampleBatch
from inferhal.core.ops.quant import QuantWeight, cat_rows
from inferhal.core.paging.spec import KVGroupSpec

GROUP_OF = {SLIDING: "sliding", FULL: "full"}


def kv_groups_for(cfg: DecoderConfig, dtype: torch.dtype) -> list[KVGroupSpec]:
    slot = (2, cfg.num_kv_heads, cfg.head_dim)
    out = []
    if cfg.layers_of(SLIDING):
        out.append(KVGroupSpec("sliding", "sliding", cfg.layers_of(SLIDING), slot, dtype, window=cfg.sliding_window))
    if cfg.layers_of(FULL):
        out.append(KVGroupSpec("full", "full", cfg.layers_of(FULL), slot, dtype))
    return out


def rope_table(base: float, dim: int, max_pos: int, scaling: float = 1.0) -> torch.Tensor:
    """``[P, D] = [cos(D/2) | sin(D/2)]`` in fp32, with transformers' rounding order (inverse frequencies
    ``1 / base**(2i/D)`` in fp32, position times frequency in fp32)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    if scaling != 1.0:
        inv_freq = inv_freq / scaling
    freqs = torch.arange(max_pos, dtype=torch.float)[:, None] * inv_freq[None, :]  # [P, D/2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def split_rows(w: torch.Tensor | QuantWeight, sizes: Sequence[int]) -> list:
    """Views of consecutive output rows of a fused weight, ``sizes`` rows each."""
    if isinstance(w, torch.Tensor):
        return list(w.split(tuple(sizes)))
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [w.rows(s, s + n) for s, n in zip(starts, sizes)]


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    q: torch.Tensor  # [H*D, hidden]
    k: torch.Tensor  # [Hk*D, hidden]
    v: torch.Tensor  # [Hk*D, hidden]
    o: torch.Tensor  # [hidden, H*D]
    ffn_norm: torch.Tensor  # [hidden]
    gate: torch.Tensor  # [I, hidden]
    up: torch.Tensor  # [I, hidden]
    down: torch.Tensor  # [hidden, I]
    q_norm: torch.Tensor | None = None  # [D] (qk_norm)
    k_norm: torch.Tensor | None = None  # [D] (qk_norm)
    post_attn_norm: torch.Tensor | None = None  # [hidden] (sandwich_norms)
    post_ffn_norm: torch.Tensor | None = None  # [hidden] (sandwich_norms)


#: GGUF tensor name (``blk.{i}.`` prefix) → :class:`LayerWeights` field
WEIGHT_NAMES = {"attn_norm": "attn_norm", "attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o",
                "ffn_norm": "ffn_norm", "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down",
                "attn_q_norm": "q_norm", "attn_k_norm": "k_norm", "post_attention_norm": "post_attn_norm",
                "post_ffw_norm": "post_ffn_norm"}


class DecoderForCausalLM:
    """A :class:`~inferhal.core.models.base.CausalLM`."""

    def __init__(self, cfg: DecoderConfig, ops, embed: torch.Tensor, layers: Sequence[LayerWeights],
                 final_norm: torch.Tensor, max_model_len: int, lm_head: torch.Tensor | None = None) -> None:
        if len(layers) != cfg.num_layers:
            raise ValueError(f"{cfg.LABEL}: {len(layers)} layer weights for {cfg.num_layers} layers")
        self.cfg, self.ops = cfg, ops
        self.embed_table = embed  # [V, hidden]
        self.head = embed if lm_head is None else lm_head  # [V, hidden]
        # q|k|v and gate|up run as one GEMM each (fewer, wider products; every output column is the same dot
        # product, so the result is bit-identical). The separate fields stay, as views into the fused ones.
        self._qkv, self._gate_up, self.layers = [], [], []
        hkv = cfg.num_kv_heads * cfg.head_dim
        self._qkv_rows = (cfg.num_heads * cfg.head_dim, hkv, hkv)  # q, k, v widths of the fused product
        for w in layers:
            qkv, gate_up = cat_rows((w.q, w.k, w.v)), cat_rows((w.gate, w.up))
            q, k, v = split_rows(qkv, self._qkv_rows)
            gate, up = split_rows(gate_up, (w.gate.shape[0], w.up.shape[0]))
            self._qkv.append(qkv)
            self._gate_up.append(gate_up)
            self.layers.append(replace(w, q=q, k=k, v=v, gate=gate, up=up))
        self.final_norm = final_norm
        self.vocab_size = cfg.vocab_size
        self.max_model_len = max_model_len
        self.dtype = embed.dtype
        self.embed_scale = math.sqrt(cfg.hidden_size) if cfg.scale_embeddings else 1.0
        self._norm = RmsNormParams(eps=cfg.rms_norm_eps, unit_offset=cfg.norm_unit_offset)
        self._act = ActParams(cfg.activation)
        self._rope_p = RopeParams(rotary_dim=cfg.head_dim, style="neox")
        self._kvw = KVWriteParams()
        n, kinds = max(max_model_len, 1), set(cfg.layer_types)
        rope = {SLIDING: (cfg.rope_local_base, 1.0), FULL: (cfg.rope_global_base, cfg.rope_global_scaling)}
        self._rope = {kind: rope_table(rope[kind][0], cfg.head_dim, n, rope[kind][1]).to(embed.device) for kind in kinds}
        self._attn = {kind: AttnParams(scale=cfg.attn_scale, num_kv_heads=cfg.num_kv_heads, softcap=cfg.attn_softcap,
                                       window=cfg.sliding_window if kind == SLIDING else 0) for kind in kinds}

    def kv_groups(self) -> Sequence[KVGroupSpec]:
        return kv_groups_for(self.cfg, self.dtype)

    def step_weight_bytes(self, head: bool = True) -> int:
        """Bytes of weights one decode step reads, each once: every layer's products and norms, the final
        norm and the whole LM head (the embedding itself gathers only the step's rows). With the host's read
        bandwidth, the floor of a step that streams its weights from memory. ``head=False`` leaves the head
        out: a greedy step's ``lm_head.argmax`` may read a cheaper copy of it (cpu_avx512's int8 screen), so
        only the rest is a floor then."""
        def nbytes(t) -> int:
            return 0 if t is None else t.nbytes() if isinstance(t, QuantWeight) else t.nbytes

        # every field once: q|k|v and gate|up are views splitting the fused products, so they add up to them
        per_layer = sum(nbytes(getattr(w, f.name)) for w in self.layers for f in fields(w))
        return per_layer + nbytes(self.final_norm) + (nbytes(self.head) if head else 0)

    def token_product_flops(self, head: bool = True) -> int:
        """Floating-point operations of the weight products one decoded token costs (2 per weight of every
        layer's q, k, v, o, gate, up and down, and of the LM head): with the rate a host's products reach,
        the floor of a decode step that computes them (attention over the context, norms and the rest left
        out). ``head=False`` leaves the head out (see :meth:`step_weight_bytes`)."""
        products = ("q", "k", "v", "o", "gate", "up", "down")
        layers = sum(math.prod(getattr(w, f).shape) for w in self.layers for f in products)
        return 2 * (layers + (math.prod(self.head.shape) if head else 0))

    # -- forward -----------------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        return self._logits(self._final_hidden(batch, kv), batch)

    def forward_greedy(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Each logits row's greedy token ``[len(batch.logits_indices)]`` int64: the token ``sample``'s
        greedy rows would take from :meth:`forward`'s logits, through the ``lm_head.argmax`` op (a backend
        may find it without the logits)."""
        x = self._final_hidden(batch, kv)
        if self.cfg.final_softcap > 0:  # tanh can tie logits the head keeps apart: sample's greedy rows decide
            logits = self._logits(x, batch)
            b = logits.shape[0]
            return self.ops["sample"](logits, SampleBatch((0.0,) * b, (0,) * b, (1.0,) * b))
        return self.ops["lm_head.argmax"](x, self.head)

    def _logits(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        logits = self.ops["lm_head"](x, self.head, batch.logits_out)  # [B', V] fp32
        if self.cfg.final_softcap > 0:
            logits = logits.div_(self.cfg.final_softcap).tanh_().mul_(self.cfg.final_softcap)
        return logits

    def _final_hidden(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Write this step's KV and return the final-normed hidden states of the logits rows ``[B', hidden]``."""
        ops, cfg, norm = self.ops, self.cfg, self._norm
        h_, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        positions = batch.positions
        top = batch.max_position(-1)  # checked on the host's plan (a device read would synchronise)
        if top >= self.max_model_len:
            raise ValueError(f"position {top} is past max_model_len {self.max_model_len}")
        x = ops["embed"](batch.input_ids, self.embed_table, self.embed_scale)  # [T, hidden]
        t, last = x.shape[0], len(self.layers) - 1
        h = ops["norm.rms"](x, self.layers[0].attn_norm, norm)
        for i, w in enumerate(self.layers):
            kind = cfg.layer_types[i]
            group = GROUP_OF[kind]
            q, k, v = ops["linear"](h, self._qkv[i]).split(self._qkv_rows, dim=-1)
            if cfg.qk_norm:
                q = ops["norm.rms"](q.reshape(t * h_, d), w.q_norm, norm)
                k = ops["norm.rms"](k.reshape(t * hk, d), w.k_norm, norm)
            qk = ops["rope.apply"](torch.cat((q.reshape(t, h_, d), k.reshape(t, hk, d)), dim=1), positions,
                                   self._rope[kind], self._rope_p)
            q, k = qk[:, :h_], qk[:, h_:]
            cache = kv.layer_cache(group, i)
            ab = batch.attn[group]
            ops["kv.write"](torch.stack((k, v.reshape(t, hk, d)), dim=1), cache, ab.slot_mapping, self._kvw)
            o = ops["attn.paged"](q, cache, ab, self._attn[kind])  # [T, H, D]
            o = ops["linear"](o.reshape(t, h_ * d), w.o)
            if cfg.sandwich_norms:
                o = ops["norm.rms"](o, w.post_attn_norm, norm)
            h, x = ops["norm.rms"](o, w.ffn_norm, norm, x)  # x += o; h = rms(x)
            gate, up = ops["linear"](h, self._gate_up[i]).chunk(2, dim=-1)
            y = ops["linear"](ops["act.gated"](gate, up, self._act), w.down)
            if cfg.sandwich_norms:
                y = ops["norm.rms"](y, w.post_ffn_norm, norm)
            if i < last:  # x += y and the next layer's attention pre-norm, fused likewise
                h, x = ops["norm.rms"](y, self.layers[i + 1].attn_norm, norm, x)
            else:
                x = x + y
        return ops["norm.rms"](x[batch.logits_indices.long()], self.final_norm, norm)  # [B', hidden]
