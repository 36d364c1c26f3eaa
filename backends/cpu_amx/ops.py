"""Ops of the cpu_amx backend: ``linear`` on AMX tiles for bf16 dense weights, ``norm.rms`` and
``act.gated`` in one AVX-512 pass per row for bf16, ``rope.apply`` (NeoX), ``attn.paged`` and ``kv.write``
over the bf16 cache. The cpu_avx512 backend takes them all, with the products from :func:`products`
run by the AVX512-BF16 kernel instead.

``linear`` and ``lm_head`` run :mod:`inferhal.kernels.cpu.amx` when the activations and the weight are
bf16 on the CPU, the weight is a plain ``[N, K]`` tensor with K a multiple of 32 and there is no bias; they
pack each weight once into the kernel's tile layout and keep it
(:class:`~inferhal.backends.reference.matmul.PackCache`, dropped with its weight), and ``lm_head`` writes the
bf16-rounded logits straight into the fp32 buffer. With the AVX-512 product (cpu_avx512) ``linear`` also
runs int_block weights (:mod:`inferhal.kernels.cpu.int_block`). Every other call (fp32, other quantised
weights, a bias, other K) runs the reference's ``linear``, as the op's note says. ``lm_head.argmax`` is the
argmax of this ``lm_head``; with the AVX-512 product (cpu_avx512) it is :mod:`inferhal.kernels.cpu.head`'s exact int8
screen instead, which reads half the head's bytes and writes no logits. ``norm.rms``, ``act.gated`` and ``rope.apply`` run
:mod:`inferhal.kernels.cpu.elementwise`, ``attn.paged`` and ``kv.write`` :mod:`inferhal.kernels.cpu.attention`,
for bf16 (the reference's ops otherwise, and for the cases each op's note names): at decode sizes the
reference's chains of torch ops cost per-op overhead, not arithmetic. The ops not in :data:`OP_IDS` are
the reference's, visibly (``inferhal backends``).

Measured on a 2-core Intel Xeon VM with AMX (see docs/performance.md): 1.7-1.9x oneDNN's bf16 product at 32
rows for Gemma 3 270M's shapes, 1.3-1.6x at 1-8 rows, 0.8-1.4x at 256 rows; the whole backend 1.95x the
reference's bf16 engine at 32 running requests.
"""

from __future__ import annotations

import torch

from inferhal.backends.reference import matmul
from inferhal.backends.reference import ops as ref
from inferhal.backends.reference.attention import attn_paged as reference_attn_paged
from inferhal.core.ops.quantize import dequantize
from inferhal.core.ops.params import ActParams, AttnBatch, AttnParams, KVWriteParams, RmsNormParams, RopeParams
from inferhal.kernels.cpu import amx, attention, elementwise, head, int_block

#: the ops this backend provides (each falls back to the reference per call outside its kernel's cases)
OP_IDS = ("linear", "lm_head", "lm_head.argmax", "norm.rms", "act.gated", "rope.apply", "attn.paged", "kv.write")

#: packed bf16 weights in the AMX tile layout
PACKS = matmul.PackCache(amx.pack)
#: the int8 copies of LM heads that lm_head.argmax screens (kernels/cpu/head.py; None: a head the bound does not cover)
HEADS = matmul.PackCache(head.quantize)
#: int_block weights (a GGUF's integer blocks, cpu_avx512) in the in-register kernel's layout, and as the bf16
#: weight they dequantise to, packed for the product: each kept under the weight's int8 data
INT_PACKS = matmul.PackCache(int_block.pack)
INT_DENSE = matmul.PackCache(lambda w: amx.pack(dequantize(w, torch.bfloat16)))


def products(kernel: str):
    """``linear`` and ``lm_head`` over :data:`PACKS`, run by ``kernel`` (``amx``, or ``avx512`` for the
    cpu_avx512 backend, whose ``linear`` also runs int_block weights over :data:`INT_PACKS` and
    :data:`INT_DENSE`): each falls back to the reference per call outside the kernel's cases."""

    def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
        if bias is None and isinstance(w, torch.Tensor) and amx.supports(x, w):
            wp = PACKS.get(w)
            if wp is not None:
                return amx.linear(x, wp, w.shape[0], kernel=kernel)
        elif bias is None and kernel == "avx512" and int_block.supports(x, w):
            # a few rows read one byte a weight and unpack it in registers; more run its bf16 copy (both
            # bit-identical to the product over the dequantised weight)
            if x.numel() // x.shape[-1] <= int_block.FUSED_MAX_ROWS:
                wp = INT_PACKS.get(w.data, source=w)
                if wp is not None:
                    return int_block.linear(x, wp)
            wp = INT_DENSE.get(w.data, source=w)
            if wp is not None:
                return amx.linear(x, wp, w.shape[0], kernel=kernel)
        return ref.linear(x, w, bias)

    def lm_head(x: torch.Tensor, w, out: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(w, torch.Tensor) and amx.supports(x, w) and x.dim() == 2:
            if out is not None and (out.dtype != torch.float32 or tuple(out.shape) != (x.shape[0], w.shape[0])):
                return ref.lm_head(x, w, out)  # it names the wrong buffer
            wp = PACKS.get(w)
            if wp is not None:  # the bf16 sums, rounded as linear rounds them, written widened in one pass
                return amx.linear(x, wp, w.shape[0], torch.float32, out=out, bf16_values=True, kernel=kernel)
        return ref.lm_head(x, w, out)

    def lm_head_argmax(x: torch.Tensor, w) -> torch.Tensor:
        if kernel == "avx512" and isinstance(w, torch.Tensor) and amx.supports(x, w) and head.supports(x, w) \
                and head.available():
            # the int8 screen, then its candidates exactly (from w's rows), when lm_head can run the same product
            # for the rows the screen hands back: its packed copy is kept (or fits), and is made only for them
            # (or for logits), so a greedy-only process never holds it
            qh = HEADS.get(w) if PACKS.keeps(w) else None
            if qh is not None:
                tokens, overflow = head.argmax(x, w, qh)
                if bool(overflow.any()):  # too many candidates, or not screened: those rows' full logits
                    rows = overflow.nonzero()[:, 0]
                    tokens[rows] = ref.argmax_rows(lm_head(x[rows], w))
                return tokens
        return ref.argmax_rows(lm_head(x, w))

    return linear, lm_head, lm_head_argmax


linear, lm_head, lm_head_argmax = products("amx")


def norm_rms(x: torch.Tensor, weight: torch.Tensor | None, p: RmsNormParams, residual: torch.Tensor | None = None):
    scale = None if weight is None else ref.norm_scale(weight, p.unit_offset)  # fp32, kept per weight
    if elementwise.supports_norm(x, scale, residual):
        return elementwise.rms_norm(x, scale, p.eps, residual, checked=True)
    return ref.norm_rms(x, weight, p, residual)


def act_gated(gate: torch.Tensor, up: torch.Tensor, p: ActParams) -> torch.Tensor:
    if elementwise.supports_act(gate, up, p.kind):
        return elementwise.act_gated(gate, up, p.kind, checked=True)
    return ref.act_gated(gate, up, p)


def attn_paged(q: torch.Tensor, kv_cache: torch.Tensor, batch: AttnBatch, p: AttnParams,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
    if attention.supports(q, kv_cache, batch, p, sinks):
        return attention.attn_paged(q, kv_cache, batch, p, checked=True)
    return reference_attn_paged(q, kv_cache, batch, p, sinks)


def rope_apply(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, p: RopeParams) -> torch.Tensor:
    if elementwise.supports_rope(x, positions, cos_sin, p.rotary_dim, p.style):
        return elementwise.rope_neox(x, positions, cos_sin, p.inverse, checked=True)
    return ref.rope_apply(x, positions, cos_sin, p)


def kv_write(values: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, p: KVWriteParams = KVWriteParams(),
             scale_cache: torch.Tensor | None = None) -> None:
    if scale_cache is None and attention.supports_write(values, cache, p.quant):
        return attention.kv_write(values, cache, slot_mapping, checked=True)
    return ref.kv_write(values, cache, slot_mapping, p, scale_cache)


def batch_invariance() -> dict:
    """op ID -> its batch invariance (cpu_avx512 declares the same). This backend has no batch-invariant mode:
    an op whose call falls outside its kernel's cases runs the reference's default op, which depends on the
    batch (oneDNN/F.linear products, the padded attention gather), so only the ops without a reduction are
    declared invariant."""
    from inferhal.core.ops.invariance import BatchInvariance

    fallback = ("calls outside the kernel's cases (other dtypes, quantised weights, a bias, sinks, ...) run "
                "the reference's default op, whose result depends on the batch; no batch-invariant mode")
    out = {op: BatchInvariance(False, fallback) for op in OP_IDS}
    out["rope.apply"] = BatchInvariance(True, "elementwise rotation per row (no reduction), in the kernel and in "
                                              "the reference op it runs otherwise")
    out["kv.write"] = BatchInvariance(True, "each token's row copied (or quantised, by the reference op) into "
                                            "its own slot")
    return out


def provide(level, kernel: str = "amx") -> dict:
    """The op table; ``kernel`` runs the products (``amx`` here, ``avx512`` for cpu_avx512)."""
    from inferhal.core.ops.table import OpImpl

    lin, lmh, greedy = (linear, lm_head, lm_head_argmax) if kernel == "amx" else products(kernel)
    what = {"amx": "AMX bf16 kernel (kernels/cpu/amx_linear.c)",
            "avx512": "AVX512-BF16 kernel (kernels/cpu/avx512_linear.c)"}[kernel]
    note = f"{what} for bf16 dense weights with K % 32 == 0 and no bias; other calls run the reference product"
    if kernel == "avx512":
        note += ("; int_block weights (GGUF integer blocks) unpacked in registers at 1-8 rows "
                 "(kernels/cpu/int_block.py), their bf16 copy past that")
    row = "one AVX-512 pass per row (kernels/cpu/elementwise.c) for bf16; other dtypes run the reference op"
    greedy_note = ("an exact int8 screen of the head (kernels/cpu/head_argmax.c, AVX512-VNNI) and its candidates "
                   "recomputed by the product's own instruction and order, for bf16 with K % 64 == 0 and finite "
                   "x and heads (|v| <= 2^60); other calls take the argmax of lm_head" if kernel == "avx512"
                   else "the argmax of this backend's lm_head (first index on ties)")
    return {"linear": OpImpl(lin, level, note),
            "lm_head": OpImpl(lmh, level, "the kernel writes the bf16-rounded logits into the fp32 buffer in "
                              "one pass, for the linear's cases; other calls run the reference's chunked head"),
            "lm_head.argmax": OpImpl(greedy, level, greedy_note),
            "norm.rms": OpImpl(norm_rms, level, row),
            "act.gated": OpImpl(act_gated, level, row),
            "attn.paged": OpImpl(attn_paged, level, "every row of a step in one AVX-512 pass (kernels/cpu/attention.c) for "
                                 "bf16 K and V without sinks; shared-KV, sinks and other dtypes run the reference op"),
            "rope.apply": OpImpl(rope_apply, level, "NeoX rotation of whole heads (kernels/cpu/elementwise.c) for bf16; "
                                 "other styles, partial rotation and dtypes run the reference op"),
            "kv.write": OpImpl(kv_write, level, "row copies into the bf16 cache (kernels/cpu/attention.c); fp8 and "
                               "other dtypes run the reference op")}
