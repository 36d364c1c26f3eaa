"""Dequantisation is bit-identical to ``gguf.quants.dequantize`` (what transformers uses): on freshly
quantised random blocks of every format decoded natively here, and on real tensors of every type in
the Gemma 3 270M file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inferhal.core.models.gguf import dequant
from inferhal.core.models.gguf.reader import GGUFFile

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as np_dequantize, quantize  # noqa: E402


class _OneTensor:
    """Just enough of a GGUFFile for dequant.dequantize."""

    def __init__(self, raw: np.ndarray, ggml_type: int, shape) -> None:
        from inferhal.core.models.gguf.reader import TensorInfo

        self.path = "mem"
        self._raw = raw
        self.tensors = {"t": TensorInfo("t", tuple(shape), ggml_type, 0, raw.size)}

    def raw(self, name):
        return self._raw


# gguf.quants cannot quantise the K-quants; the real-file test covers Q4_K and Q6_K
@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0", "F16"])
def test_random_blocks_decode_bit_identically(qtype):
    t = gguf.GGMLQuantizationType[qtype]
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((8, 512)) * rng.uniform(0.01, 5, (8, 1))).astype(np.float32)
    x[0, :64] = 0.0  # all-zero blocks (scale 0)
    raw = quantize(x, t)
    got = dequant.dequantize(_OneTensor(raw.reshape(-1).view(np.uint8), int(t), (8, 512)), "t")
    want = np_dequantize(raw, t).reshape(8, 512).astype(np.float32)
    assert got.dtype == torch.float32 and got.shape == (8, 512)
    assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))


def test_every_tensor_type_of_the_real_file_decodes_bit_identically(gemma_path):
    f = GGUFFile(gemma_path)
    smallest = {}
    for name, info in f.tensors.items():  # the smallest tensor of each type (gguf.quants is slow on big ones)
        if info.type_name not in smallest or info.nbytes < f.tensors[smallest[info.type_name]].nbytes:
            smallest[info.type_name] = name
    seen = set(smallest)
    for name in smallest.values():
        info = f.tensors[name]
        got = dequant.dequantize(f, name)
        want = np_dequantize(f.raw(name), gguf.GGMLQuantizationType(info.ggml_type)).reshape(info.shape)
        assert np.array_equal(got.numpy().view(np.uint32), np.ascontiguousarray(want, np.float32).view(np.uint32)), name
    assert {"Q8_0", "Q5_0", "Q4_K", "Q6_K", "F32"} <= seen


def test_integer_blocks_of_every_product_type_rebuild_the_dequantised_values(gemma_path):
    from inferhal.core.ops.quantize import dequantize as rebuild

    f = GGUFFile(gemma_path)
    smallest = {}
    for name, info in f.tensors.items():
        if name.startswith("blk.") and len(info.shape) == 2:
            if info.type_name not in smallest or info.nbytes < f.tensors[smallest[info.type_name]].nbytes:
                smallest[info.type_name] = name
    assert set(smallest) == {"Q8_0", "Q5_0", "Q4_K", "Q6_K"}
    for type_name, name in smallest.items():
        dense = dequant.dequantize(f, name)
        w = dequant.int_blocks(f, name, dense)
        assert w is not None and w.format == "int_block" and w.shape == tuple(dense.shape), name
        assert w.block == (1, 16 if type_name == "Q6_K" else 32) and (w.offset is not None) == (type_name == "Q4_K")
        assert torch.equal(rebuild(w).view(torch.int32), dense.view(torch.int32)), name
        assert int(w.data.abs().max()) <= (32 if type_name == "Q6_K" else 16 if type_name != "Q8_0" else 127)


def test_integer_blocks_that_do_not_rebuild_the_values_are_refused(gemma_path, caplog):
    f = GGUFFile(gemma_path)
    name = next(n for n, i in f.tensors.items() if i.type_name == "Q5_0")
    dense = dequant.dequantize(f, name)
    dense.view(-1)[5] = dense.view(-1)[5] * 1.5 + 1.0
    assert dequant.int_blocks(f, name, dense) is None
    assert "do not rebuild" in caplog.text and name in caplog.text
    norm = next(n for n, i in f.tensors.items() if i.type_name == "F32")
    assert dequant.int_blocks(f, norm, dequant.dequantize(f, norm)) is None  # no integer blocks
