"""The fixed vocabulary of semantic op IDs, with the signature every backend implements.

Shapes use ``T`` tokens in the batch, ``B`` sequences, ``H`` query heads, ``Hk`` KV heads, ``D`` head dim,
``E`` experts, ``K`` top-k. Every op is a pure function of tensors and one frozen params dataclass from
:mod:`inferhal.core.ops.params`; it reads no global state. Unless stated, outputs have the dtype of the
first input and reductions accumulate in fp32.

A backend implements any subset (``inferhal_provide_ops``); the rest fall back to ``reference``, visibly.
Adding an op: add an :class:`OpSpec` here, its reference implementation in
``backends/reference/ops.py`` and its conformance case in ``tests/conformance/``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OpSpec:
    id: str
    signature: str
    doc: str


def _spec(id: str, signature: str, doc: str) -> OpSpec:
    return OpSpec(id, signature, " ".join(doc.split()))


OPS: dict[str, OpSpec] = {
    s.id: s
    for s in (
        _spec(
            "norm.rms",
            "(x[T,D], weight[D]|None, p: RmsNormParams, residual[T,D]|None=None) -> y | (y, h)",
            """RMSNorm over the last dim in fp32: y = x/rms(x) * w (or * (1+w) when p.unit_offset).
            With a residual, h = x + residual is normalised and (y, h) is returned (fused residual add).""",
        ),
        _spec(
            "rope.apply",
            "(x[T,H,D], positions[T] int64, cos_sin[P, R] fp32, p: RopeParams) -> x'[T,H,D]",
            """Rotary embedding on the R rotary channels of each head (p.rotary_dim, at the head's start
            or end per p.placement), with cos_sin[pos] = [cos(R/2) | sin(R/2)] precomputed by core
            (YaRN and other scalings live there). p.style 'neox' rotates halves, 'interleaved' rotates
            even/odd pairs. p.inverse applies the conjugate rotation (DeepSeek-V4 attention output).""",
        ),
        _spec(
            "linear",
            "(x[T,K], w[N,K] | QuantWeight, bias[N]|None=None) -> y[T,N]",
            """y = x @ w.T (+ bias). w is a plain tensor, or a QuantWeight in format fp8_block (e4m3
            with one fp32/ue8m0 scale per 128x128 block) or fp4_group (e2m1 packed two per uint8, one
            scale per 32-element group along K). The reference dequantises then matmuls in x's dtype.""",
        ),
        _spec(
            "lm_head",
            "(x[B,K], w[V,K] | QuantWeight, out[B,V] fp32|None=None) -> logits[B,V] fp32",
            """Next-token logits from the final hidden states: linear(x, w) in x's dtype (the model's own
            rounding), widened to fp32, written into out when given (the runner lends one buffer it
            reuses every step) and returned. A backend may write the fp32 values straight from its
            product instead of materialising the [B,V] result in x's dtype.""",
        ),
        _spec(
            "lm_head.argmax",
            "(x[B,K], w[V,K] | QuantWeight) -> tokens[B] int64",
            """Greedy tokens from the final hidden states: each row's argmax of lm_head(x, w) (first index on
            ties, NaN the largest, as sample's greedy rows), the very token this backend's own lm_head and
            sample would give. A backend may find it without materialising the logits; the runner calls it
            for a step whose every row is greedy and none wants logprobs.""",
        ),
        _spec(
            "attn.paged",
            "(q[T,H,D], kv_cache[NB,BS,*slot], batch: AttnBatch, p: AttnParams, sinks[H]|None=None) -> o[T,H,Dv]",
            """Causal attention of each sequence's new query tokens over its paged KV (already written by
            kv.write). slot = (K[Hk,D], V[Hk,Dv]) stacked as [2,Hk,D], or one shared latent [Hk,D] when
            p.shared_kv (K = V). GQA/MQA by H % Hk. p.window > 0 keeps keys with pos > q_pos - window.
            Optional learned sinks join the softmax denominator only. p.softcap tanh-caps logits.""",
        ),
        _spec(
            "attn.sparse_topk",
            "(q[T,H,D], kv_cache[NB,BS,D], batch: AttnBatch, comp_cache[NB',BS',D]|None, comp_batch: AttnBatch|None, topk_idx[T,K] int64|None, p: AttnParams, sinks[H]|None=None) -> o[T,H,D]",
            """DeepSeek-V4 hybrid attention, one softmax (sinks join the denominator only) per query over
            (a) its sliding-window keys in kv_cache (the shared latent K = V of a sliding group,
            pos > q_pos - p.window, causal) and (b) the compressed entries topk_idx[t] (logical entry
            indices of its sequence, -1 = none) of comp_cache, restricted to causally closed entries
            (e < (q_pos+1) // comp_batch.tokens_per_slot). CSA passes the indexer's top-k; HCA passes every
            visible entry. comp_* None = window only (sliding layers). With p.kv_format both caches hold
            uint8 records of that format (written by kv.write with p.record) and are read decoded.""",
        ),
        _spec(
            "attn.compress",
            "(state_cache[NB,BS,2,C], batch: AttnBatch, rows[N] int64, position_bias[m,C], norm_weight[D], cos_sin[P,R], p: CompressParams) -> entries[N,D]",
            """CSA/HCA compressor over the paged per-token state (slot = [kv | gate], written by kv.write
            in a sliding group). For each flat row (a token at position (e+1)m-1 that closes window e):
            entry = sum_j softmax_j(gate_j + position_bias) * kv_j per channel over the window's tokens
            (CSA, p.overlap: window e-1's first half C[:D] and window e's second half C[D:], D = C/2;
            HCA: [e m, (e+1) m), D = C), then RMSNorm(norm_weight) and RoPE (p.rope) at position e*m.
            A row of -1 is padding: its entry is zeros and nothing of it is read or checked (a captured
            step passes a host-known bound of rows, the closing rows in order and then -1s, with slot -1
            for kv.write, so no row count is read on the host). The caller writes the entries into its
            compressed group with kv.write.""",
        ),
        _spec(
            "indexer.scores",
            "(q[T,Hi,Di], key_cache[NB,BS,Di], batch: AttnBatch, weights[T,Hi], p: IndexerParams) -> scores[T,S] fp32",
            """Lightning indexer over the paged compressed keys of batch (a compressed group):
            score[t,s] = sum_h weights[t,h] * p.weight_scale * relu(q[t,h] . key[s]) * p.scale;
            -inf where entry s is not causally closed for token t (s >= (pos+1)//m) or past its sequence
            (s >= seq_len), so topk.select pads those with -1. S = block_table.shape[1] * BS, the block
            table's reach (>= max seq_lens), known from shapes on the host, so a captured step keeps it.
            With p.key_format the keys are uint8 records of that format.""",
        ),
        _spec(
            "topk.select",
            "(scores[T,S], k: int, valid_len[T]|None=None) -> idx[T,k] int64",
            """Indices of the k largest scores per row, ties broken by lower index; positions
            >= valid_len[t] are excluded and padded with -1 when fewer than k remain.""",
        ),
        _spec(
            "moe.route",
            "(logits[T,E], p: RouteParams, bias[E]|None=None, hash_ids[T,K]|None=None) -> (weights[T,K] fp32, ids[T,K] int64)",
            """Expert choice: scores = sqrtsoftplus|sigmoid|softmax(logits); ids = top-k of scores + bias
            (bias only chooses), or the hash table's ids when given; weights = scores[ids], renormalised
            when p.renormalize, times p.routed_scaling.""",
        ),
        _spec(
            "moe.experts",
            "(x[T,D], weights[T,K], ids[T,K], w_gate_up[E,2I,D]|QuantWeight, w_down[E,D,I]|QuantWeight, p: ExpertsParams) -> y[T,D]",
            """Grouped expert GEMMs with SwiGLU: for each (t, k), silu(clamp(g)) * clamp(u) through
            w_down, scaled by weights[t,k] and summed over k. Gate clamps above at p.swiglu_limit, up
            clamps to +-limit (0 = no clamp). ids outside [0, E) are skipped (EP-remote experts).""",
        ),
        _spec(
            "moe.dispatch",
            "(x[T,D], ids[T,K], comm: Communicator, p: EPParams) -> DispatchResult",
            """EP all-to-all: send each (token, choice) to the rank owning its physical expert; return the
            received tokens, their local expert ids and the handle combine needs.""",
        ),
        _spec(
            "moe.combine",
            "(y_local[R,D], weights[T,K], handle, comm: Communicator, p: EPParams) -> y[T,D]",
            """Inverse of moe.dispatch: return expert outputs to their source ranks and sum them, in a fixed
            order, weighted by the routing weights.""",
        ),
        _spec(
            "mhc.pre",
            "(streams[T,N,D], fn[(2+N)N, N*D], base[(2+N)N], scale[3], p: MhcParams) -> (x[T,D], post[T,N], comb[T,N,N])",
            """Manifold-constrained hyper-connection, entry side: mixing weights from the normalised
            flattened streams (pre = sigmoid + eps, post = 2 sigmoid, comb = softmax + eps projected by
            p.sinkhorn_iters Sinkhorn-Knopp steps); x = sum_n pre[n] streams[n].""",
        ),
        _spec(
            "mhc.head",
            "(streams[T,N,D], fn[N, N*D], base[N], scale[1], p: MhcParams) -> x[T,D]",
            """Final hyper-connection head: pre = sigmoid(scale * (rmsnorm(flat streams) @ fn.T) + base)
            + p.eps; x = sum_n pre[n] streams[n] (before the final norm and LM head).""",
        ),
        _spec(
            "mhc.post",
            "(y[T,D], streams[T,N,D], post[T,N], comb[T,N,N]) -> streams'[T,N,D]",
            """Exit side: streams' = post (x) y + comb^T @ streams (each output stream mixes the inputs).""",
        ),
        _spec(
            "kv.write",
            "(values[T,*slot], cache[NB,BS,*slot], slot_mapping[T] int64, p: KVWriteParams) -> None",
            """Scatter one entry per token into its page slot (flat slot = block*BS + offset; -1 skips).
            With p.quant 'fp8' the cache is e4m3 with one fp32 scale per entry in p.scale_cache. With p.record
            (a KVFormat, core/paging/formats.py) the cache is uint8 [NB, BS, nbytes] and each entry is encoded
            as one record (FP8 / NVFP4 / MXFP4 codes, block scales, bf16 RoPE part).""",
        ),
        _spec(
            "sample",
            "(logits[B,V] fp32, p: SampleBatch) -> tokens[B] int64",
            """Per row: greedy when temperature == 0, otherwise temperature, top-k, top-p (min-p) filtering
            then a draw from the row's own torch.Generator (so a seeded row does not depend on the batch).""",
        ),
        _spec(
            "sample.mask",
            "(logits[B,V] fp32, bitmask[B',ceil(V/32)] int32, rows[B'] int64) -> None",
            """Grammar-constrained decoding (structured outputs): in place, logits[rows[i], v] = -inf wherever
            bit v % 32 of word v // 32 of bitmask[i] is 0 (xgrammar's token bitmask, little-endian bits);
            other rows untouched. A backend may fuse it into sample.""",
        ),
        _spec(
            "spec.verify",
            "(draft_ids[B,S], draft_probs[B,S,V]|None, target_logits[B,S+1,V], p: SampleBatch) -> (accepted[B,S+1], n_accepted[B])",
            """Speculative rejection sampling (exact for temperature > 0, prefix match when greedy).""",
        ),
        _spec(
            "act.gated",
            "(gate[T,I], up[T,I], p: ActParams) -> y[T,I]",
            """Gated activation of a dense MLP: y = act(gate) * up in the input dtype, act = p.kind
            ('silu', or 'gelu_tanh': the tanh approximation of GELU that Gemma uses).""",
        ),
        _spec(
            "embed",
            "(ids[T] int64, table[V,D], scale: float) -> x[T,D]",
            """Embedding lookup times scale (Gemma multiplies by sqrt(D) in the table dtype).""",
        ),
    )
}


def op_ids() -> tuple[str, ...]:
    return tuple(OPS)


def check_op_id(op_id: str) -> None:
    if op_id not in OPS:
        import difflib

        close = difflib.get_close_matches(op_id, OPS, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise KeyError(f"unknown op id {op_id!r}{hint} (known: {', '.join(OPS)})")
