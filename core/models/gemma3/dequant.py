"""GGML block formats → fp32 torch tensors, bit-identical to ``gguf.quants.dequantize``.

``gguf.quants`` is the oracle transformers uses when it loads a GGUF; its numpy code takes ~12 s on the
Q8_0 embedding table of Gemma 3 270M. The hot formats (Q8_0, Q5_0) are decoded here with the same
arithmetic (fp16 scale widened to fp32, one fp32 multiply per element) without the per-16-row
Python loop and the full-size temporaries, so the weights are bit-identical and loading takes ~1 s.
The other formats (Q4_K, Q6_K, the other K-quants, IQ formats, ...) go through ``gguf.quants``
directly; on this model they take ~0.3 s.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from inferhal.core.models.gemma3.gguf_file import GGUFError, GGUFFile

# ggml type ids (gguf.GGMLQuantizationType)
F32, F16, Q5_0, Q8_0, BF16 = 0, 1, 6, 8, 30


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


def _q5_0(raw: np.ndarray) -> torch.Tensor:
    b = _blocks(raw, 22)  # fp16 d | uint32 high bits (bit j = element j, little-endian) | 16 B low nibbles
    n = b.shape[0]
    q = np.empty((n, 32), dtype=np.uint8)
    np.bitwise_and(b[:, 6:], 0x0F, out=q[:, :16])  # elements 0..15: low nibbles
    np.right_shift(b[:, 6:], 4, out=q[:, 16:])  # elements 16..31: high nibbles
    q |= np.unpackbits(b[:, 2:6], axis=1, bitorder="little") << 4
    out = torch.empty((n, 32), dtype=torch.float32)
    out.copy_(torch.from_numpy(q))
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
