"""GGML block formats → fp32 torch tensors, bit-identical to ``gguf.quants.dequantize``.

``gguf.quants`` is the oracle transformers uses when it loads a GGUF; its numpy code takes ~12 s on the
Q8_0 embedding table of Gemma 3 270M. The hot formats (Q8_0, Q5_0) are decoded here with the same
arithmetic (fp16 scale widened to fp32, one fp32 multiply per element) without the per-16-row
Python loop and the full-size temporaries, so the weights are bit-identical and loading takes ~1 s.
The other formats (Q4_K, Q6_K, the other K-quants, IQ formats, ...) go through ``gguf.quants``
directly; on this model they take ~0.3 s.
"""

from __future__ import annotations

import logging
import warnings

import numpy as np
import torch

from inferhal.core.models.gguf.reader import GGUFError, GGUFFile
from inferhal.core.ops.quant import QuantWeight, int_block, int_block_values

log = logging.getLogger("inferhal.models.gguf")

# ggml type ids (gguf.GGMLQuantizationType)
F32, F16, Q5_0, Q8_0, Q4_K, Q6_K, BF16 = 0, 1, 6, 8, 12, 14, 30


def _blocks(raw: np.ndarray, type_size: int) -> np.ndarray:
    return raw.reshape(-1, type_size)  # [n_blocks, type_size] uint8, a read-only view of the map


def _scale(b: np.ndarray, start: int) -> np.ndarray:
    # [n, 1] fp16 scale widened to fp32 (copied first: the view needs 2-byte alignment)
    return np.ascontiguousarray(b[:, start : start + 2]).view(np.float16).astype(np.float32)


def _t(a: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # a read-only view of the map: only ever read from
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


# Bytes are unpacked in numpy; the int → fp32 widening and the scale multiply run in torch into one
# fresh output, in place (numpy's mixed-type casts are ~6x slower, and full-size temporaries cost page
# faults).


def _q8_0(raw: np.ndarray) -> torch.Tensor:
    b = _blocks(raw, 34)  # fp16 d | 32 x int8
    out = torch.empty((b.shape[0], 32), dtype=torch.float32)
    out.copy_(_t(b[:, 2:].view(np.int8)))
    return out.mul_(_t(_scale(b, 0)))  # float32(q) * d, as gguf.quants does


def _q5_0_ints(b: np.ndarray) -> np.ndarray:
    """Q5_0 blocks (fp16 d | uint32 high bits, bit j = element j, little-endian | 16 B low nibbles) → the
    unsigned 5-bit q [n, 32] (the value is (q - 16) d)."""
    q = np.empty((b.shape[0], 32), dtype=np.uint8)
    np.bitwise_and(b[:, 6:], 0x0F, out=q[:, :16])  # elements 0..15: low nibbles
    np.right_shift(b[:, 6:], 4, out=q[:, 16:])  # elements 16..31: high nibbles
    q |= np.unpackbits(b[:, 2:6], axis=1, bitorder="little") << 4
    return q


def _q5_0(raw: np.ndarray) -> torch.Tensor:
    b = _blocks(raw, 22)
    out = torch.empty((b.shape[0], 32), dtype=torch.float32)
    out.copy_(torch.from_numpy(_q5_0_ints(b)))
    return out.sub_(16.0).mul_(_t(_scale(b, 0)))  # (q - 16) is exact; then * d as gguf.quants does


_FAST = {Q8_0: _q8_0, Q5_0: _q5_0}


def dequantize(file: GGUFFile, name: str) -> torch.Tensor:
    """Tensor ``name`` of ``file`` as a contiguous fp32 torch tensor of its torch-order shape."""
    info = file.tensors[name]
    raw = file.raw(name)
    if info.ggml_type == F32:
        out = torch.from_numpy(raw.view(np.float32).copy())
    elif info.ggml_type == F16:
        out = torch.from_numpy(raw.view(np.float16).astype(np.float32))
    elif info.ggml_type in _FAST:
        out = _FAST[info.ggml_type](raw)
    else:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize as np_dequantize

        try:
            arr = np_dequantize(raw, GGMLQuantizationType(info.ggml_type))
        except NotImplementedError:
            raise GGUFError(f"{file.path}: tensor {name!r} has type {info.type_name}, which cannot be dequantised") from None
        out = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
    return out.reshape(info.shape)


# -- integer blocks ------------------------------------------------------------------------------------
# Q8_0, Q5_0, Q6_K and Q4_K dequantise, per block of 32 (16 for Q6_K) values of a row, as small integers v
# times one fp32 scale a, minus one fp32 offset o for Q4_K: fl(fl(v a) - o) (gguf.quants' own two
# roundings; a and o are themselves fp32 products of the block's fp16 and 6-bit fields). int_blocks keeps
# (v, a, o), so a backend can read one byte a weight and still form the loader's exact fp32 values.


def _f16(b: np.ndarray, start: int) -> np.ndarray:
    return np.ascontiguousarray(b[:, start : start + 2]).view(np.float16).astype(np.float32)  # [n, 1]


def _ints_q8_0(raw: np.ndarray):
    b = _blocks(raw, 34)
    return b[:, 2:].view(np.int8), _f16(b, 0), None


def _ints_q5_0(raw: np.ndarray):
    b = _blocks(raw, 22)
    return (_q5_0_ints(b).astype(np.int16) - 16).astype(np.int8), _f16(b, 0), None


def _ints_q4_k(raw: np.ndarray):
    # 256 values: fp16 d | fp16 dmin | 12 B of eight 6-bit (scale, min) pairs | 128 B of 4-bit q
    b = _blocks(raw, 144)
    n = b.shape[0]
    s = b[:, 4:16]
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 6) << 4)], axis=1).astype(np.float32)  # [n, 8]
    mn = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 6) << 4)], axis=1).astype(np.float32)
    qs = b[:, 16:].reshape(n, 4, 32)  # 32 bytes per two sub-blocks: low nibbles, then high nibbles
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32).astype(np.int8)
    return q.reshape(n * 8, 32), (_f16(b, 0) * sc).reshape(-1, 1), (_f16(b, 2) * mn).reshape(-1, 1)


def _ints_q6_k(raw: np.ndarray):
    # 256 values: 128 B low nibbles | 64 B high 2-bit pairs | 16 int8 scales (one per 16 values) | fp16 d
    b = _blocks(raw, 210)
    n = b.shape[0]
    ql = b[:, :128].reshape(n, 2, 64)  # each half of 128 values: 64 bytes of low nibbles, then high ones
    qh = b[:, 128:192].reshape(n, 2, 32)  # each half: 32 bytes, four 2-bit fields a byte
    low = np.stack([ql & 0x0F, ql >> 4], axis=2).reshape(n, 2, 4, 32)
    high = np.stack([(qh >> sh) & 0x03 for sh in (0, 2, 4, 6)], axis=2)  # [n, 2, 4, 32]
    q = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).reshape(n * 16, 16)
    sc = b[:, 192:208].view(np.int8).astype(np.float32)  # [n, 16]
    return q, (_f16(b, 208) * sc).reshape(-1, 1), None


_INTS = {Q8_0: (_ints_q8_0, 32), Q5_0: (_ints_q5_0, 32), Q4_K: (_ints_q4_k, 32), Q6_K: (_ints_q6_k, 16)}


def int_blocks(file: GGUFFile, name: str, dense: torch.Tensor) -> QuantWeight | None:
    """Tensor ``name`` [N, K] as an int_block weight (:func:`~inferhal.core.ops.quant.int_block`), or None when
    its type has no integer blocks or they do not reproduce ``dense`` (its fp32 :func:`dequantize`) bit for
    bit: every weight is rebuilt with the formula and checked, so a kept weight is the dense one exactly."""
    info = file.tensors[name]
    if info.ggml_type not in _INTS or len(info.shape) != 2:
        return None
    unpack, bk = _INTS[info.ggml_type]
    n, k = info.shape
    v, a, o = unpack(file.raw(name))
    data = torch.from_numpy(np.ascontiguousarray(v)).reshape(n, k)
    scale = torch.from_numpy(np.ascontiguousarray(a)).reshape(n, k // bk)
    offset = None if o is None else torch.from_numpy(np.ascontiguousarray(o)).reshape(n, k // bk)
    w = int_block(data, scale, offset)
    if not torch.equal(int_block_values(w).view(torch.int32), dense.reshape(n, k).view(torch.int32)):
        log.warning("%s: tensor %s's %s integer blocks do not rebuild its dequantised values; kept dense",
                    file.path, name, info.type_name)
        return None
    return w
