"""DeepSeek-V4 causal LM on HAL op IDs: mHC residual streams, hybrid attention, MoE, MTP draft heads.

Layer ``i`` (``x`` = ``hc_mult`` streams ``[T, N, D]``)::

    a, post, comb = mhc.pre(x, attn_hc)   ->  x = mhc.post(attention(rms(a)), x, post, comb)
    f, post, comb = mhc.pre(x, ffn_hc)    ->  x = mhc.post(moe(rms(f)), x, post, comb)

then ``mhc.head`` → RMSNorm → ``lm_head`` (``lm_head.argmax`` in :meth:`DeepseekV4ForCausalLM.forward_greedy`,
which the runner calls for an all-greedy step). MTP layer ``k`` (DeepSeek's ``MTPBlock``) takes the main
model's final streams at position ``p`` and the embedding of the token at ``p + 1``:
``x = e_proj(enorm(embed(next))) + h_proj(hnorm(streams))`` per stream, one sliding-window block (KV
layer ``num_layers + k`` of ``swa``), its own HC head and norm, the shared LM head → draft logits for
``p + 2``. transformers does not implement MTP; it is checked against this code's own paths only.

Expert-load statistics: pass ``recorder`` (any object with ``record(layer: int, ids: Tensor[T, K])``,
:class:`ExpertLoadRecorder`); every MoE layer reports the routed expert ids of its tokens, MTP layers
as layer ``num_layers + k``.

Expert parallelism: :meth:`DeepseekV4ForCausalLM.use_expert_runner` installs an ``expert_runner``
(``runner(layer, x[T, D], weights[T, K] fp32, logical_ids[T, K]) -> y[T, D]``, e.g.
:class:`~inferhal.core.parallel.ep_moe.EPExperts`) that computes the routed experts of every MoE layer
(MoE layer index as above) and drops the model's full routed-expert tensors; the runner then owns the
load recording too. The shared expert stays in the model. Two-batch overlap: the layers run as generators
that yield each MoE layer's request (:meth:`DeepseekV4ForCausalLM._stack`), so a runner with ``run_two``
can interleave two micro-batches of one step (:mod:`inferhal.core.parallel.tbo`).
"""

from __future__ import annotations

from typing import Any, Generator, Mapping, Protocol, Sequence, runtime_checkable

import torch

from inferhal.core.models.base import ForwardBatch, KVCache, split_batch
from inferhal.core.models.deepseek_v4.attention import attention
from inferhal.core.models.deepseek_v4.config import V4Config
from inferhal.core.models.deepseek_v4.kv import kv_groups, record_formats
from inferhal.core.models.deepseek_v4.rope import RopeCache
from inferhal.core.ops.params import ExpertsParams, KVWriteParams, MhcParams, RmsNormParams, RopeParams, RouteParams
from inferhal.core.ops.quant import QuantWeight
from inferhal.core.ops.quantize import dequantize
from inferhal.core.paging.spec import KVGroupSpec


@runtime_checkable
class ExpertLoadRecorder(Protocol):
    """Receives the routed expert ids ``[T, K]`` (int64, logical expert ids) of every MoE layer call."""

    def record(self, layer: int, ids: torch.Tensor) -> None: ...


def _rows(w: torch.Tensor | QuantWeight, start: int, end: int) -> torch.Tensor | QuantWeight:
    """Rows ``start:end`` of a ``[N, K]`` weight; a quantised one stays quantised when block aligned."""
    if not isinstance(w, QuantWeight):
        return w[start:end]
    br = w.block[0]
    if w.format != "fp8_block" or start % br or (end % br and end != w.shape[0]):
        return dequantize(w)[start:end]  # groups that cut through a scale block run dense
    return QuantWeight(w.data[start:end], w.scale[start // br:-(-end // br)], w.format, (end - start, w.shape[1]), w.block)


def _cat_rows(a: torch.Tensor | QuantWeight, b: torch.Tensor | QuantWeight) -> torch.Tensor | QuantWeight:
    """Stack two ``[N, K]`` weights along N (the shared expert's gate and up), as ``[1, 2N, K]``."""
    if isinstance(a, QuantWeight) and isinstance(b, QuantWeight) and a.format == b.format and (
            a.format == "fp4_group" or a.shape[0] % a.block[0] == 0):
        return QuantWeight(torch.cat((a.data, b.data))[None], torch.cat((a.scale, b.scale))[None], a.format,
                           (1, a.shape[0] + b.shape[0], a.shape[1]), a.block)
    return torch.cat((dequantize(a), dequantize(b)))[None]


class DeepseekV4ForCausalLM:
    """A loaded DeepSeek-V4 bound to one backend's op table (implements :class:`~inferhal.core.models.base.CausalLM`)."""

    def __init__(self, cfg: V4Config, weights: Mapping[str, Any], ops: Any, dtype: torch.dtype, max_model_len: int,
                 device: str | torch.device = "cpu", has_mtp: bool = False, recorder: ExpertLoadRecorder | None = None,
                 expert_runner: Any = None):
        self.cfg, self.ops, self.dtype = cfg, ops, dtype
        self.weights = dict(weights)
        self.vocab_size = cfg.vocab_size
        self.max_model_len = min(max_model_len, cfg.max_position_embeddings)
        self.num_mtp_layers = cfg.num_mtp if has_mtp else 0
        self.recorder = recorder
        self.expert_runner = expert_runner
        lim = cfg.max_position_embeddings
        self.rope_main = RopeCache(cfg.rope_main, min(self.max_model_len, 4096), lim, device)
        self.rope_compress = RopeCache(cfg.rope_compress, min(self.max_model_len, 4096), lim, device)
        self.rope_p = RopeParams(cfg.rope_dim, style="interleaved", placement="tail")
        self.norm_p = RmsNormParams(eps=cfg.rms_eps)
        self.mhc_p = MhcParams(cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_eps)
        self.route_p = RouteParams(cfg.top_k, cfg.scoring, cfg.renormalize, cfg.routed_scaling)
        self.experts_p = ExpertsParams(swiglu_limit=cfg.swiglu_limit)
        self.use_kv_dtype("auto")
        self.o_a_groups: dict[str, list] = {}
        self.shared: dict[str, tuple] = {}
        for pre in [f"layers.{i}." for i in range(cfg.num_layers)] + [f"mtp.{k}." for k in range(self.num_mtp_layers)]:
            self._derive(pre)
        self.lm_head = self.weights["embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]

    def _derive(self, pre: str) -> None:
        """The per-layer weights built from the loaded ones: ``o_a`` per group, the shared expert's gate+up."""
        r, w = self.cfg.o_lora_rank, self.weights
        wa = w[pre + "self_attn.o_a_proj.weight"]
        self.o_a_groups[pre] = [_rows(wa, g * r, (g + 1) * r) for g in range(self.cfg.o_groups)]
        s = pre + "mlp.shared_experts."
        gu = _cat_rows(w[s + "gate_proj.weight"], w[s + "up_proj.weight"])
        down = w[s + "down_proj.weight"]
        down = QuantWeight(down.data[None], down.scale[None], down.format, (1, *down.shape), down.block) \
            if isinstance(down, QuantWeight) else down[None]
        self.shared[pre] = (gu, down)

    def load_mtp_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Lay ``mtp.*`` tensors (e.g. a fitted draft head, ``fit_mtp``) over this model's MTP layers; every
        MTP tensor must be given with its shape. Also what a fitting loop calls after making them trainable."""
        want = {k: v for k, v in self.weights.items() if k.startswith("mtp.")}
        bad = sorted(k for k in want if k not in tensors or tuple(tensors[k].shape) != tuple(want[k].shape))
        if bad or not want:
            raise ValueError(f"MTP weights do not fit this model: {bad[:3] or 'it has no MTP layers'}")
        for k in want:
            t = tensors[k]
            self.weights[k] = t if t.requires_grad else t.to(device=want[k].device, dtype=want[k].dtype)
        for k in range(self.num_mtp_layers):
            self._derive(f"mtp.{k}.")

    # ------------------------------------------------------------------ contract

    def kv_groups(self) -> Sequence[KVGroupSpec]:
        return list(self._groups)

    def use_kv_dtype(self, kv_dtype: str) -> None:
        """Store the window, compressed and indexer-key groups as ``kv_dtype`` records (``cache.kv_dtype``:
        auto | fp8 | fp4, :mod:`inferhal.core.paging.formats`); call before the KV cache is built. The
        compressor state stays in the model's dtype."""
        self.kv_dtype = kv_dtype
        self.kv_formats = record_formats(self.cfg, kv_dtype)
        self._groups = kv_groups(self.cfg, self.dtype, kv_dtype)
        self.kv_write_p = KVWriteParams()  # values in the model's dtype (compressor state)
        self.kv_record_p = {role: KVWriteParams(record=f) for role, f in self.kv_formats.items()}

    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """fp32 logits ``[len(batch.logits_indices), vocab]``; writes this step's KV into ``kv``."""
        streams = self.forward_hidden(batch, kv)
        return self.head("", streams[batch.logits_indices.long()], batch.logits_out)

    def forward_greedy(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Each logits row's greedy token ``[len(batch.logits_indices)]`` int64 through ``lm_head.argmax``: the
        token ``sample``'s greedy rows would take from :meth:`forward`'s logits (a backend may skip them)."""
        streams = self.forward_hidden(batch, kv)
        return self.head("", streams[batch.logits_indices.long()], greedy=True)

    def forward_hidden(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """The final residual streams ``[T, hc_mult, D]`` of every token (MTP reads them). A batch the
        scheduler split (``extras["micro_batches"]``, two-batch overlap) runs as two micro-batches through
        an expert runner that overlaps them (``runner.two_batch``, ``runner.run_two``); the same rows."""
        split = batch.extras.get("micro_batches", ()) if batch.extras else ()
        if len(split) == 2 and getattr(self.expert_runner, "two_batch", False):
            a, b = split_batch(batch, split)
            got = self.expert_runner.run_two(self._stack(a, kv), self._stack(b, kv), int(a.input_ids.shape[0]))
            return torch.cat(got)
        return self._run(self._stack(batch, kv))

    def _stack(self, batch: ForwardBatch, kv: KVCache) -> Generator:
        """The main layers over ``batch`` as a generator: yields each MoE layer's routed-expert request
        ``(layer, x[T, D], weights[T, K], logical_ids[T, K])``, is sent ``y[T, D]``, returns the streams."""
        ops, cfg = self.ops, self.cfg
        ids = batch.input_ids.long()
        x = ops["embed"](ids, self.weights["embed_tokens.weight"], 1.0)
        streams = x[:, None, :].expand(x.shape[0], cfg.hc_mult, x.shape[1]).contiguous()
        for i in range(cfg.num_layers):
            streams = yield from self._block(f"layers.{i}.", i, streams, ids, batch, kv)
        return streams

    def _run(self, gen: Generator) -> Any:
        """Drive a forward generator, answering each MoE request with :meth:`routed` at once."""
        try:
            req = next(gen)
            while True:
                req = gen.send(self.routed(*req))
        except StopIteration as stop:
            return stop.value

    def forward_and_hidden(self, batch: ForwardBatch, kv: KVCache, greedy: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` (or with ``greedy`` :meth:`forward_greedy`) and the final streams ``[T, N, D]`` of
        every token, which an MTP drafter reads as its ``hidden``."""
        streams = self.forward_hidden(batch, kv)
        rows = streams[batch.logits_indices.long()]
        return (self.head("", rows, greedy=True) if greedy else self.head("", rows, batch.logits_out)), streams

    def forward_mtp(self, batch: ForwardBatch, kv: KVCache, hidden: torch.Tensor, k: int = 0) -> torch.Tensor:
        """Draft logits of MTP layer ``k``: ``batch.input_ids[t]`` is the token at ``positions[t] + 1``,
        ``hidden[t]`` the main model's final streams at ``positions[t]`` (``[T, N, D]``); returns fp32
        ``[len(batch.logits_indices), vocab]`` for position ``+ 2``. Writes layer ``num_layers + k`` of ``swa``."""
        streams = self.mtp_hidden(batch, kv, hidden, k)
        return self.head(f"mtp.{k}.", streams[batch.logits_indices.long()])

    def mtp_head(self, streams: torch.Tensor, k: int = 0, greedy: bool = True) -> torch.Tensor:
        """MTP layer ``k``'s head over rows of its output streams: greedy draft tokens ``[R]`` int64 (or with
        ``greedy=False`` fp32 logits ``[R, vocab]``); the LM head is the main model's."""
        return self.head(f"mtp.{k}.", streams, greedy=greedy)

    def mtp_hidden(self, batch: ForwardBatch, kv: KVCache, hidden: torch.Tensor, k: int = 0) -> torch.Tensor:
        """MTP layer ``k``'s output streams ``[T, N, D]`` (before its head), as :meth:`forward_mtp` computes
        them: a chained draft step feeds them back as the ``hidden`` of the next position."""
        if k >= self.num_mtp_layers:
            raise ValueError(f"MTP layer {k} is not loaded (this model has {self.num_mtp_layers})")
        ops, w, cfg = self.ops, self.weights, self.cfg
        pre = f"mtp.{k}."
        ids = batch.input_ids.long()
        t, n, d = hidden.shape
        e = ops["norm.rms"](ops["embed"](ids, w["embed_tokens.weight"], 1.0), w[pre + "enorm.weight"], self.norm_p)
        hn = ops["norm.rms"](hidden.reshape(t * n, d).to(self.dtype), w[pre + "hnorm.weight"], self.norm_p)
        x = ops["linear"](e, w[pre + "e_proj.weight"])[:, None, :] + ops["linear"](hn, w[pre + "h_proj.weight"]).view(t, n, d)
        return self.block(pre, cfg.num_layers + k, x, ids, batch, kv)

    # ------------------------------------------------------------------ expert parallelism

    @property
    def num_moe_layers(self) -> int:
        """MoE layer indices ``0 .. num_layers + num_mtp_layers - 1`` (main layers, then MTP layers)."""
        return self.cfg.num_layers + self.num_mtp_layers

    def _moe_prefix(self, layer: int) -> str:
        n = self.cfg.num_layers
        return f"layers.{layer}." if layer < n else f"mtp.{layer - n}."

    def routed_expert_weights(self) -> list[tuple[Any, Any]]:
        """Per MoE layer ``(gate_up[E, 2I, D], down[E, D, I])`` (plain or QuantWeight), by MoE layer index."""
        return [(self.weights[self._moe_prefix(l) + "mlp.experts.gate_up_proj"],
                 self.weights[self._moe_prefix(l) + "mlp.experts.down_proj"]) for l in range(self.num_moe_layers)]

    def use_expert_runner(self, runner: Any) -> None:
        """Route every MoE layer's routed experts through ``runner`` and drop the full expert tensors
        (the runner keeps what this rank needs)."""
        self.expert_runner = runner
        for l in range(self.num_moe_layers):
            for part in ("gate_up_proj", "down_proj"):
                self.weights.pop(self._moe_prefix(l) + "mlp.experts." + part, None)

    # ------------------------------------------------------------------ pieces

    def head(self, pre: str, streams: torch.Tensor, out: torch.Tensor | None = None,
             greedy: bool = False) -> torch.Tensor:
        """fp32 logits of the streams' rows (into ``out`` when given), or with ``greedy`` their greedy tokens."""
        ops, w = self.ops, self.weights
        x = ops["mhc.head"](streams, w[pre + "hc_head.hc_fn"], w[pre + "hc_head.hc_base"], w[pre + "hc_head.hc_scale"],
                            self.mhc_p)
        x = ops["norm.rms"](x, w[pre + "norm.weight"], self.norm_p)
        return ops["lm_head.argmax"](x, self.lm_head) if greedy else ops["lm_head"](x, self.lm_head, out)

    def block(self, pre: str, layer: int, streams: torch.Tensor, ids: torch.Tensor, batch: ForwardBatch,
              kv: KVCache) -> torch.Tensor:
        return self._run(self._block(pre, layer, streams, ids, batch, kv))

    def _block(self, pre: str, layer: int, streams: torch.Tensor, ids: torch.Tensor, batch: ForwardBatch,
               kv: KVCache) -> Generator:
        """:meth:`block` as a generator: yields its MoE layer's routed-expert request (see :meth:`_stack`)."""
        ops, w = self.ops, self.weights
        x, post, comb = ops["mhc.pre"](streams, w[pre + "attn_hc.fn"], w[pre + "attn_hc.base"], w[pre + "attn_hc.scale"],
                                       self.mhc_p)
        h = ops["norm.rms"](x, w[pre + "input_layernorm.weight"], self.norm_p)
        streams = ops["mhc.post"](attention(self, pre, layer, h, batch, kv), streams, post, comb)
        x, post, comb = ops["mhc.pre"](streams, w[pre + "ffn_hc.fn"], w[pre + "ffn_hc.base"], w[pre + "ffn_hc.scale"],
                                       self.mhc_p)
        h = ops["norm.rms"](x, w[pre + "post_attention_layernorm.weight"], self.norm_p)
        weights, eids = self.route(pre, h, ids)
        y = yield layer, h, weights, eids  # [T, D] routed experts
        return ops["mhc.post"](self.shared_expert(pre, h, y), streams, post, comb)

    def moe(self, pre: str, layer: int, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The MoE layer: routing, routed experts (:meth:`routed`), shared expert."""
        return self.shared_expert(pre, x, self.routed(layer, x, *self.route(pre, x, ids)))

    def route(self, pre: str, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights ``[T, K]`` fp32 and logical expert ids ``[T, K]`` of the layer at ``pre``."""
        ops, w = self.ops, self.weights
        g = pre + "mlp.gate."
        logits = ops["linear"](x, w[g + "weight"])  # [T, E]
        if g + "tid2eid" in w:
            return ops["moe.route"](logits, self.route_p, None, hash_ids=w[g + "tid2eid"][ids])
        return ops["moe.route"](logits, self.route_p, w[g + "e_score_correction_bias"])

    def routed(self, layer: int, x: torch.Tensor, weights: torch.Tensor, eids: torch.Tensor) -> torch.Tensor:
        """The routed experts' output ``[T, D]`` of MoE layer ``layer`` (through the expert runner if any)."""
        if self.expert_runner is not None:
            return self.expert_runner(layer, x, weights, eids)  # the runner records the load
        if self.recorder is not None:
            self.recorder.record(layer, eids)
        e = self._moe_prefix(layer) + "mlp.experts."
        w = self.weights
        return self.ops["moe.experts"](x, weights, eids, w[e + "gate_up_proj"], w[e + "down_proj"], self.experts_p)

    def shared_expert(self, pre: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the routed experts' output) plus the shared expert of the layer at ``pre`` on ``x``."""
        gu, down = self.shared[pre]
        one = torch.ones((x.shape[0], 1), dtype=torch.float32, device=x.device)
        zero = torch.zeros((x.shape[0], 1), dtype=torch.long, device=x.device)
        return y + self.ops["moe.experts"](x, one, zero, gu, down, self.experts_p)
