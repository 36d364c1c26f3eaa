"""Device helpers shared by the kernels (``@triton.jit`` functions, so importing this defines kernels).

``INTERP`` is the one interpreter switch (see :mod:`inferhal.kernels.runtime`): kernels receive it as
a ``tl.constexpr`` and pass it here. Under the interpreter:

- ``dot_operand`` upcasts bf16 to fp32 before ``tl.dot`` (the interpreter's bf16 dot is wrong);
- ``round_to`` rounds fp32 to bf16 (and to e4m3) to nearest-even with integer arithmetic (the
  interpreter's fp32->bf16 cast truncates, its fp32->e4m3 cast misrounds a few percent of values and
  loses the carry into the exponent), so interpreter results round exactly as the device does.

Compiled, both are the identity / the native cast: bf16 operands reach the tensor cores unchanged.
"""

from __future__ import annotations

from inferhal.kernels import runtime as _runtime  # noqa: F401  (the mode is fixed before the jit below)

import triton
import triton.language as tl


@triton.jit
def dot_operand(x, INTERP: tl.constexpr):
    if INTERP:
        if x.dtype == tl.bfloat16:
            return x.to(tl.float32)
    return x


@triton.jit
def query_span(seq_ptr, pos_ptr, len_ptr, t, window):
    """Flat query row ``t`` → (its sequence ``b``, its position, and the causal, window-clipped key span
    ``[first, last)`` of that sequence's paged KV). ``window`` 0 = no window."""
    b = tl.load(seq_ptr + t).to(tl.int64)
    qpos = tl.load(pos_ptr + t).to(tl.int32)
    ctx = tl.load(len_ptr + b).to(tl.int32)
    last = tl.minimum(qpos + 1, ctx)  # exclusive
    first = 0
    if window > 0:
        first = tl.maximum(qpos - window + 1, 0)
    return b, qpos, first, last


@triton.jit
def softmax_out(m_i, l_i, acc, sink_ptr, heads, hm, HAS_SINKS: tl.constexpr):
    """Close an online softmax: ``acc / l`` per head row, with each head's learned sink logit (``HAS_SINKS``)
    joining the denominator only. ``m_i, l_i``: [BLOCK_H] running max and sum; ``acc``: [BLOCK_H, BLOCK_D]."""
    if HAS_SINKS:
        sink = tl.load(sink_ptr + heads, mask=hm, other=0.0).to(tl.float32)
        m_f = tl.maximum(m_i, sink)
        corr = tl.exp(m_i - m_f)
        l_i = l_i * corr + tl.exp(sink - m_f)
        acc = acc * corr[:, None]
    return acc / tl.maximum(l_i, 1e-30)[:, None]


@triton.jit
def round_to(x, DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """fp32 ``x`` cast to ``DTYPE`` with round-to-nearest-even also in the interpreter."""
    if INTERP:
        if DTYPE == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            lsb = (bits >> 16) & 1
            rounded = (bits + 0x7FFF + lsb) & 0xFFFF0000
            # NaN / inf keep their bits (exponent all ones): no rounding carry into them
            special = (bits & 0x7F800000) == 0x7F800000
            bits = tl.where(special, bits, rounded)
            return bits.to(tl.float32, bitcast=True).to(DTYPE)
        if DTYPE == tl.float8e4nv:
            # e4m3: 3 mantissa bits for |x| >= 2**-6, a fixed 2**-9 step below; the caller clamps to +-448
            bits = x.to(tl.uint32, bitcast=True)
            lsb = (bits >> 20) & 1
            normal = ((bits + 0x7FFFF + lsb) & 0xFFF00000).to(tl.float32, bitcast=True)
            sub = ((x * 512.0 + 12582912.0) - 12582912.0) / 512.0  # round-half-even to a multiple of 2**-9
            return tl.where(tl.abs(x) >= 0.015625, normal, sub).to(DTYPE)
    return x.to(DTYPE)


_TL = {}


def tl_dtype(dtype) -> "tl.dtype":
    """torch dtype -> triton dtype (for ``DTYPE`` constexprs)."""
    import torch

    if not _TL:
        _TL.update({torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
                    torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5, torch.uint8: tl.uint8,
                    torch.int32: tl.int32, torch.int64: tl.int64})
    try:
        return _TL[dtype]
    except KeyError:
        raise TypeError(f"no Triton dtype for {dtype}") from None


def interp() -> bool:
    """The value kernels get for ``INTERP``."""
    return _runtime.interpreting()


#: (kernel, grid rank, constexprs and launch options but num_stages, argument dtypes) -> stages that fit
_FITTED_STAGES: dict = {}


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``; when the device lacks the shared memory the tuned
    ``num_stages`` needs (Triton's ``OutOfResources`` at load: a GPU with less shared memory than the
    tuning target assumed, or a dtype whose tiles are wider than the tuned one), relaunch with one stage
    fewer, down to 1, and remember the count that fits for this specialisation.

    Software-pipelining depth never changes a kernel's arithmetic or its summation order, so the result
    is the same bit for bit and batch invariance holds (seen on an H200: the FP8-block expert GEMMs asked
    245,760 B of shared memory at 3 stages against 232,448 B per block).
    """
    from triton.runtime.errors import OutOfResources

    want = int(kwargs.pop("num_stages", 1))

    def key():  # built only once some launch has needed fewer stages: launches stay cheap otherwise
        return (getattr(kernel, "fn", kernel), len(grid), tuple(sorted((k, str(v)) for k, v in kwargs.items())),
                tuple(str(getattr(a, "dtype", type(a).__name__)) for a in args))

    stages = min(want, _FITTED_STAGES.get(key(), want)) if _FITTED_STAGES else want
    while True:
        try:
            out = kernel[grid](*args, num_stages=stages, **kwargs)
        except OutOfResources as exc:
            if stages <= 1 or "shared memory" not in str(exc):
                raise
            stages -= 1
            continue
        if stages != want:
            _FITTED_STAGES[key()] = stages
        return out


@triton.jit
def e2m1(nib):
    """4-bit e2m1 codes (int32, sign in bit 3) -> fp32 values 0, .5, 1, 1.5, 2, 3, 4, 6."""
    code = nib & 7
    ex = code >> 1
    man = (code & 1).to(tl.float32)
    mag = tl.where(ex == 0, 0.5 * man, (1.0 + 0.5 * man) * tl.where(ex == 3, 4.0, tl.where(ex == 2, 2.0, 1.0)))
    return tl.where(nib >= 8, -mag, mag)


def rows(x):
    """``x [..., K]`` as a 2-D ``[M, K]`` tensor whose last dimension is contiguous (a copy only where it is not)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


# ---------------------------------------------------------------------------------- host side, no device reads
# A CUDA graph replays what a step launched; launch code that reads a device value on the host cannot be
# captured (core/engine/host_sync.py counts such reads; tests/backends/cuda_sm100/test_host_reads.py).


def host_round(x: float, dtype) -> float:
    """``float(torch.tensor(x, dtype=dtype))`` without a tensor: a Python float rounded to fp32 and then to
    ``dtype`` (bf16/fp16: nearest even), as torch converts a Python scalar."""
    import math
    import struct

    import torch

    if dtype == torch.float64:
        return float(x)
    try:
        f = struct.unpack("<f", struct.pack("<f", x))[0]
        if dtype == torch.float16:
            return struct.unpack("<e", struct.pack("<e", f))[0]
    except OverflowError:
        return math.copysign(math.inf, x)
    if dtype == torch.bfloat16 and math.isfinite(f):
        b = struct.unpack("<I", struct.pack("<f", f))[0]
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000  # nearest even on the upper 16 bits
        return struct.unpack("<f", struct.pack("<I", b))[0]
    if dtype in (torch.float32, torch.bfloat16):
        return f
    raise TypeError(f"host_round: no rounding to {dtype}")


def seq_of_token(batch, t: int, device, op: str):
    """[t] int64: the sequence of each flat token, from ``batch.query_start_loc``, sized by the host's ``t``
    (``output_size``: no read of the counts' sum)."""
    import torch

    qsl = batch.query_start_loc.long()
    try:
        return torch.repeat_interleave(torch.arange(batch.num_seqs, device=device), qsl[1:] - qsl[:-1],
                                       output_size=t)
    except RuntimeError as exc:  # the CPU checks the sum; a device trusts it
        raise ValueError(f"{op}: query_start_loc's token counts do not add up to q's {t} tokens") from exc
