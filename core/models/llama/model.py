"""Llama (dense) against the op vocabulary: every tensor op goes through the active backend's OpTable.

Per layer (``x`` is the residual stream)::

    h = rms(x) w                  -> q, k, v = linear(h, q|k|v)   q: [T, H, D], k, v: [T, Hk, D]
    q|k = rope(q|k)               neox (rotate halves), base ``rope_base``, over the whole head
    kv.write (k, v) -> attn.paged (causal; scale D**-0.5; GQA)
    x += linear(o)
    x += linear(silu(gate) * up, down),  gate, up = linear(rms(x) w, gate|up)

Each residual add runs inside the pre-norm that follows it (``norm.rms`` with ``residual``). The LM head
is the embedding table unless the file has its own ``output.weight``; a step whose rows are all greedy
takes its tokens from ``lm_head.argmax``. One paged KV group, ``full``.

q and k weights are held in Hugging Face's row order (llama.cpp's converter permutes them for its
interleaved RoPE; :func:`unpermute` undoes it at load), so RoPE is the neox style transformers uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Sequence

import torch

from inferhal.core.models.base import ForwardBatch, KVCache
from inferhal.core.models.gemma3.model import _split_rows, rope_table
from inferhal.core.models.llama.config import LlamaConfig
from inferhal.core.ops.params import ActParams, AttnParams, KVWriteParams, RmsNormParams, RopeParams
from inferhal.core.ops.quant import QuantWeight, cat_rows
from inferhal.core.paging.spec import KVGroupSpec


def kv_groups_for(cfg: LlamaConfig, dtype: torch.dtype) -> list[KVGroupSpec]:
    return [KVGroupSpec("full", "full", tuple(range(cfg.num_layers)), (2, cfg.num_kv_heads, cfg.head_dim), dtype)]


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's q/k row permutation undone (``[n_head * D, hidden]``): each head's rows go from
    interleaved pairs back to two halves, as transformers' GGUF loader does."""
    d = w.shape[0] // n_head // 2
    return w.reshape(n_head, d, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


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


#: GGUF tensor name (``blk.{i}.`` prefix) → :class:`LayerWeights` field
WEIGHT_NAMES = {"attn_norm": "attn_norm", "attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o",
                "ffn_norm": "ffn_norm", "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down"}


class LlamaForCausalLM:
    """A :class:`~inferhal.core.models.base.CausalLM`."""

    def __init__(self, cfg: LlamaConfig, ops, embed: torch.Tensor, layers: Sequence[LayerWeights],
                 final_norm: torch.Tensor, max_model_len: int, lm_head: torch.Tensor | None = None) -> None:
        if len(layers) != cfg.num_layers:
            raise ValueError(f"Llama: {len(layers)} layer weights for {cfg.num_layers} layers")
        self.cfg, self.ops = cfg, ops
        self.embed_table = embed  # [V, hidden]
        self.head = embed if lm_head is None else lm_head  # [V, hidden]
        # q|k|v and gate|up run as one GEMM each; the separate fields stay, as views into the fused ones
        self._qkv, self._gate_up, self.layers = [], [], []
        hkv = cfg.num_kv_heads * cfg.head_dim
        self._qkv_rows = (cfg.num_heads * cfg.head_dim, hkv, hkv)
        for w in layers:
            qkv, gate_up = cat_rows((w.q, w.k, w.v)), cat_rows((w.gate, w.up))
            q, k, v = _split_rows(qkv, self._qkv_rows)
            gate, up = _split_rows(gate_up, (w.gate.shape[0], w.up.shape[0]))
            self._qkv.append(qkv)
            self._gate_up.append(gate_up)
            self.layers.append(replace(w, q=q, k=k, v=v, gate=gate, up=up))
        self.final_norm = final_norm
        self.vocab_size = cfg.vocab_size
        self.max_model_len = max_model_len
        self.dtype = embed.dtype
        self._norm = RmsNormParams(eps=cfg.rms_norm_eps)
        self._act = ActParams("silu")
        self._rope_p = RopeParams(rotary_dim=cfg.head_dim, style="neox")
        self._rope = rope_table(cfg.rope_base, cfg.head_dim, max(max_model_len, 1), cfg.rope_scaling).to(embed.device)
        self._attn = AttnParams(scale=cfg.attn_scale, num_kv_heads=cfg.num_kv_heads)
        self._kvw = KVWriteParams()

    def kv_groups(self) -> Sequence[KVGroupSpec]:
        return kv_groups_for(self.cfg, self.dtype)

    def step_weight_bytes(self, head: bool = True) -> int:
        """Bytes of weights one decode step reads, each once (see the Gemma 3 model's)."""
        def nbytes(t) -> int:
            return t.nbytes() if isinstance(t, QuantWeight) else t.nbytes

        per_layer = sum(nbytes(getattr(w, f.name)) for w in self.layers for f in fields(w))
        return per_layer + nbytes(self.final_norm) + (nbytes(self.head) if head else 0)

    def token_product_flops(self, head: bool = True) -> int:
        products = ("q", "k", "v", "o", "gate", "up", "down")
        layers = sum(math.prod(getattr(w, f).shape) for w in self.layers for f in products)
        return 2 * (layers + (math.prod(self.head.shape) if head else 0))

    # -- forward -----------------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        return self.ops["lm_head"](self._final_hidden(batch, kv), self.head, batch.logits_out)  # [B', V] fp32

    def forward_greedy(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Each logits row's greedy token ``[len(batch.logits_indices)]`` int64, via ``lm_head.argmax``."""
        return self.ops["lm_head.argmax"](self._final_hidden(batch, kv), self.head)

    def _final_hidden(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Write this step's KV and return the final-normed hidden states of the logits rows ``[B', hidden]``."""
        ops, cfg = self.ops, self.cfg
        h_, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        positions = batch.positions
        if positions.numel() and int(positions.max()) >= self.max_model_len:
            raise ValueError(f"position {int(positions.max())} is past max_model_len {self.max_model_len}")
        x = ops["embed"](batch.input_ids, self.embed_table, 1.0)  # [T, hidden]
        t, last = x.shape[0], len(self.layers) - 1
        ab = batch.attn["full"]
        h = ops["norm.rms"](x, self.layers[0].attn_norm, self._norm)
        for i, w in enumerate(self.layers):
            q, k, v = ops["linear"](h, self._qkv[i]).split(self._qkv_rows, dim=-1)
            qk = ops["rope.apply"](torch.cat((q.reshape(t, h_, d), k.reshape(t, hk, d)), dim=1), positions,
                                   self._rope, self._rope_p)
            q, k = qk[:, :h_], qk[:, h_:]
            cache = kv.layer_cache("full", i)
            ops["kv.write"](torch.stack((k, v.reshape(t, hk, d)), dim=1), cache, ab.slot_mapping, self._kvw)
            o = ops["attn.paged"](q, cache, ab, self._attn)  # [T, H, D]
            o = ops["linear"](o.reshape(t, h_ * d), w.o)
            h, x = ops["norm.rms"](o, w.ffn_norm, self._norm, x)  # x += o; h = rms(x)
            gate, up = ops["linear"](h, self._gate_up[i]).chunk(2, dim=-1)
            y = ops["linear"](ops["act.gated"](gate, up, self._act), w.down)
            if i < last:
                h, x = ops["norm.rms"](y, self.layers[i + 1].attn_norm, self._norm, x)
            else:
                x = x + y
        return ops["norm.rms"](x[batch.logits_indices.long()], self.final_norm, self._norm)  # [B', hidden]
