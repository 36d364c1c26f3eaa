"""FP8 / FP4 KV record kernels (kernels/kv_records.py) vs the reference codec, in the interpreter: the bytes
written and the values decoded are identical (bit for bit), for vLLM's fp8_ds_mla layout, FP8 indexer keys,
NVFP4 and MXFP4 records, at V4-Flash widths and the tiny config's, from fp32 and bf16 values, into a strided
layer view of a shared page (as the KV storage hands out). The kernels round with integer arithmetic (e4m3
round-to-nearest-even, ue8m0 exponents from the float's bits, bf16 RoPE channels), so the interpreter's
misrounding casts never enter."""

import pytest
import torch

from inferhal.backends.reference import kv_records as ref
from inferhal.backends.reference.ops import kv_write as ref_write
from inferhal.core.ops.params import KVWriteParams
from inferhal.core.paging import formats
from inferhal.kernels.kv_records import decode_rows, kv_write_record

CASES = [("fp8", 512, 64, "main"), ("fp8", 128, 0, "index"), ("fp4", 512, 64, "main"), ("fp4", 128, 0, "index"),
         ("fp8", 32, 8, "main"), ("fp4", 32, 8, "main"), ("fp4", 16, 0, "index")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[3]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_record_bytes_and_decoded_values_equal_the_reference(case, dtype):
    fmt = formats.record(case[0], case[1], case[2], role=case[3])
    g = torch.Generator().manual_seed(case[1] + len(case[0]))
    t = 10
    x = (torch.randn(t, fmt.dims, generator=g) * torch.logspace(-2, 2, t)[:, None]).to(dtype)
    x[3] = 0
    x[5, :8] = 0.75  # e2m1 ties (0.75 / scale lands on midpoints for some blocks)
    pages = torch.zeros(6, 3, 4, fmt.nbytes, dtype=torch.uint8)  # [NB, layers, BS, nbytes]: layer 1 is strided
    want, got = pages.clone()[:, 1], pages[:, 1]
    slot = torch.tensor([0, 5, 7, 2, 9, -1, 23, 11, 4, 13])
    ref_write(x, want, slot, KVWriteParams(record=fmt))
    kv_write_record(x, got, slot, fmt)
    assert torch.equal(got, want)
    assert not pages[:, 0].any() and not pages[:, 2].any()  # other layers untouched
    rows = torch.tensor([0, 5, -1, 23, 7, 2, 1])
    expect = ref.decode(want.reshape(-1, fmt.nbytes)[rows.clamp(min=0)], fmt)
    expect[2] = 0
    assert torch.equal(decode_rows(got, rows, fmt), expect)


def test_a_cache_that_is_not_records_of_the_format_is_refused():
    fmt = formats.record("fp4", 32, 8, role="main")
    with pytest.raises(ValueError, match=r"kv.write nvfp4: cache must be uint8 \[NB, BS, 18\]"):
        kv_write_record(torch.zeros(1, 32), torch.zeros(2, 4, 18), torch.tensor([0]), fmt)
    with pytest.raises(ValueError, match=r"values must be \[T, 32\]"):
        kv_write_record(torch.zeros(1, 30), torch.zeros(2, 4, 18, dtype=torch.uint8), torch.tensor([0]), fmt)
