"""Dense-model and sampling wrappers of the ascend950 backend (a mixin of
:class:`~inferhal.backends.ascend950.ops.NpuOps`).

These ops have no fused torch_npu operator of their own in vllm-ascend's DeepSeek-V4 path either: it runs
them as PyTorch operators on npu tensors, whose NPU kernels torch_npu's op-plugin registers. The wrappers
call those aten operators through the same recorded contract (``aten_*`` keys, PyTorch's schemas), so each
call is checked like a torch_npu one; small index bookkeeping around them stays plain tensor code.

=================  ==============================  ================================================================
op ID              operator(s)                     what the wrapper relies on
=================  ==============================  ================================================================
linear             aten linear                     plain weights in x's dtype
(MX weights, 950)  npu_dynamic_mx_quant →          W8A8MXFP as vllm-ascend's W8A8_MXFP8 linear: fp8_block with
                   npu_quant_matmul (MX mode)      power-of-two scales and 32-multiple column blocks (DeepSeek's
                                                   ue8m0 128x128) or MXFP4 fp4_group (codes widened to e4m3): x in
                                                   e4m3 with e8m0 [T, K/64, 2], weight e4m3 [K, N] with e8m0 [K/64,
                                                   N, 2] (transposed views), scale_dtype / pertoken_scale_dtype 293,
                                                   group_sizes [1, 1, 32], bias fp32; the activations' e4m3 rounding
                                                   differs from the reference's bf16 x dequantised weight. Other
                                                   QuantWeights (fp32 amax scales, int_block): reference, visibly
lm_head            aten linear                     as linear, widened to fp32 into the lent buffer
lm_head.argmax     aten linear → aten argmax       argmax over the fp32 logits (first index on ties is torch's rule;
                                                   on NPU it is what qualification checks)
embed              aten embedding                  table rows, times scale in the table's dtype
act.gated          npu_swiglu | npu_gelu           silu: swiglu(cat(gate, up)) = silu(gate) * up; gelu_tanh:
                                                   npu_gelu(gate, approximate='tanh') * up
topk.select        aten sort.stable                descending, stable: ties by lower index; -inf → -1
sample             aten argmax / aten multinomial  greedy rows by argmax; others draw from the reference's filtered
                                                   distribution with the row's own generator
spec.verify        aten argmax                     greedy batches only (prefix match on the host); sampled rows:
                                                   reference, visibly
=================  ==============================  ================================================================
"""

from __future__ import annotations

import torch

from inferhal.backends.ascend950 import mx
from inferhal.backends.ascend950.preconditions import HALF
from inferhal.backends.reference import ops as ref
from inferhal.backends.reference import spec as ref_spec
from inferhal.core.ops.quant import QuantWeight


#: a torch dtype as the ``int? output_dtype`` / ``int? *_dtype`` arguments take it: PyTorch's ScalarType enum value
#: (torch-npu==2.13.0 torch_npu/op_plugin/meta/_meta_registrations.py TORCH_DTYPE_MAP; its gmm_get_dtype accepts 5,
#: 15, 6, 3 and maps them back through TORCH_DTYPE_ENUM_VALUE_TO_SCALAR_TYPE_MAP; vllm-ascend passes the torch
#: dtype, which the op schema turns into that value). Not aclDataType (ACL_BF16 = 27 is no ScalarType of torch's).
SCALAR_TYPE = {torch.float16: 5, torch.bfloat16: 15, torch.float32: 6}
#: torch_npu's own dtype value for e8m0 scales in those arguments (the same file: 293 = torch_npu.float8_e8m0fnu)
NPU_FLOAT8_E8M0 = 293
MX_MATMUL_MAX = 65535  # npu_quant_matmul's doc: the last dims of x1 and x2 at most 65535
QUANT_HEAD = "the MXFP8 npu_quant_matmul is wired for linear only (fp32 logits are no documented MX output)"


class DenseOps:
    """Dense and sampling wrappers; expects ``self.npu``, ``self._fallback``, ``self._has``, ``self.features`` and
    ``self._mx_cache``."""

    def linear(self, x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, K]; w: [N, K] -> [T, N]
        if isinstance(w, QuantWeight):
            mxw = self._mx_linear(w)
            why = f"{w.format} weight: {mxw}" if isinstance(mxw, str) else ""
            if not why and "mxfp8" not in self.features:
                why = f"{w.format} weight: this generation has no MXFP8 npu_quant_matmul (950 only)"
            elif not why and (x.dtype not in HALF or x.dim() != 2):
                why = f"x {x.dtype} {tuple(x.shape)}: the MXFP8 matmul is wired for 2-D fp16/bf16 activations"
            elif not why and max(w.shape) > MX_MATMUL_MAX:
                why = f"{w.format} weight {w.shape}: the MX matmul takes K and N <= {MX_MATMUL_MAX}"
            elif not why and not self._has("npu_dynamic_mx_quant"):
                why = "npu_dynamic_mx_quant is not available in this torch_npu"
            if why:
                self._fallback("linear", why)
                return ref.linear(x, w, bias)
            return self._linear_mx(x, mxw, bias)
        return self.npu.aten_linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))

    def _mx_linear(self, w: QuantWeight):
        """A linear QuantWeight's MXFP8 form (converted once per weight object), or why it has none."""
        key = ("linear", id(w))
        hit = self._mx_cache.get(key)
        if hit is None or hit[0] is not w:
            hit = self._mx_cache[key] = (w, mx.mx_linear_weight(w))
        return hit[1]

    def _linear_mx(self, x: torch.Tensor, w_mx, bias: torch.Tensor | None) -> torch.Tensor:
        # W8A8MXFP: x -> e4m3 [T, K] + e8m0 [T, K/64, 2]; weight e4m3 [K, N] + e8m0 [K/64, N, 2] -> [T, N] in x's dtype
        xq, xs = self.npu.npu_dynamic_mx_quant(x.contiguous(), dst_type=torch.float8_e4m3fn)
        if xs.dim() == 2:  # the [T, K/64, 2] pairs
            xs = xs.reshape(xs.shape[0], -1, 2)
        data, scale = w_mx
        return self.npu.npu_quant_matmul(xq, data, scale, pertoken_scale=xs,
                                         bias=None if bias is None else bias.float().contiguous(),
                                         output_dtype=SCALAR_TYPE[x.dtype], scale_dtype=NPU_FLOAT8_E8M0,
                                         pertoken_scale_dtype=NPU_FLOAT8_E8M0, group_sizes=[1, 1, 32])

    def lm_head(self, x: torch.Tensor, w, out: torch.Tensor | None = None) -> torch.Tensor:
        # x: [B, K]; w: [V, K] -> fp32 [B, V]
        if isinstance(w, QuantWeight):
            self._fallback("lm_head", f"{w.format} weight: {QUANT_HEAD}")
            return ref.lm_head(x, w, out)
        v = w.shape[0]
        if out is None:
            out = torch.empty(x.shape[0], v, dtype=torch.float32, device=x.device)
        elif tuple(out.shape) != (x.shape[0], v) or out.dtype != torch.float32:
            raise ValueError(f"lm_head: logits buffer is {out.dtype} {tuple(out.shape)}, needs float32 {(x.shape[0], v)}")
        return out.copy_(self.npu.aten_linear(x, w.to(x.dtype), None))

    def lm_head_argmax(self, x: torch.Tensor, w) -> torch.Tensor:
        if isinstance(w, QuantWeight):
            self._fallback("lm_head.argmax", f"{w.format} weight: {QUANT_HEAD}")
            return ref.lm_head_argmax(x, w)
        return self.npu.aten_argmax(self.lm_head(x, w), -1).long()

    def embed(self, ids: torch.Tensor, table: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        # ids: [T]; table: [V, D] -> [T, D]
        x = self.npu.aten_embedding(table, ids.long())
        if scale != 1.0:
            x = x * torch.tensor(scale, dtype=table.dtype)
        return x

    def act_gated(self, gate: torch.Tensor, up: torch.Tensor, p) -> torch.Tensor:
        # gate, up: [T, I] -> [T, I]
        if p.kind == "gelu_tanh":  # npu_gelu, not aten gelu: on the NPU the latter ignores approximate
            return self.npu.npu_gelu(gate, approximate="tanh") * up
        return self.npu.npu_swiglu(torch.cat((gate, up.to(gate.dtype)), dim=-1), dim=-1)

    def topk_select(self, scores: torch.Tensor, k: int, valid_len: torch.Tensor | None = None) -> torch.Tensor:
        # scores: [T, S] -> idx [T, k] int64, larger first, ties by lower index, -1 padding
        t, s = scores.shape
        sc = scores.float()
        if valid_len is not None:
            cols = torch.arange(s, device=scores.device)
            sc = sc.masked_fill(cols[None, :] >= valid_len[:, None], float("-inf"))
        kk = min(k, s)
        values, order = self.npu.aten_sort_stable(sc, stable=True, dim=-1, descending=True)
        values, order = values[:, :kk], order[:, :kk].long()
        idx = torch.where(torch.isinf(values) & (values < 0), torch.full_like(order, -1), order)
        if kk < k:
            idx = torch.cat((idx, idx.new_full((t, k - kk), -1)), dim=1)
        return idx

    def sample(self, logits: torch.Tensor, p) -> torch.Tensor:
        # logits: [B, V] fp32 -> tokens [B]
        if all(t <= 0.0 for t in p.temperature):
            return self.npu.aten_argmax(logits.float(), -1).long()
        out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        for i in range(logits.shape[0]):
            if p.temperature[i] <= 0.0:
                out[i] = self.npu.aten_argmax(logits[i].float(), -1)
                continue
            gen = p.generators[i] if p.generators else None
            kw = {} if gen is None else {"generator": gen}
            out[i] = self.npu.aten_multinomial(ref.filtered_probs(logits[i], p, i), 1, **kw)[0]
        return out

    def spec_verify(self, draft_ids, draft_probs, target_logits, p):
        # draft_ids: [B, S]; target_logits: [B, S+1, V] -> (tokens [B, S+1], n_emitted [B])
        if not all(t <= 0.0 for t in p.temperature):
            self._fallback("spec.verify", "sampled rows: rejection sampling is not wired (greedy batches are)")
            return ref_spec.spec_verify(draft_ids, draft_probs, target_logits, p)
        b, s = draft_ids.shape
        best = self.npu.aten_argmax(target_logits.reshape(b * (s + 1), -1).float(), -1).view(b, s + 1).long()
        out = torch.full((b, s + 1), -1, dtype=torch.long, device=draft_ids.device)
        n = torch.zeros(b, dtype=torch.long, device=draft_ids.device)
        drafts, top = draft_ids.tolist(), best.tolist()
        for r in range(b):
            k = 0
            while k < s and drafts[r][k] == top[r][k]:
                out[r, k] = drafts[r][k]
                k += 1
            out[r, k] = top[r][k]  # the first mismatch's argmax, or the bonus token
            n[r] = k + 1
        return out, n
