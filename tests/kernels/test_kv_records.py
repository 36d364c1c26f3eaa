"""FP8 / FP4 KV record kernels (kernels/kv_records.py) vs the reference codec, in the interpreter: the bytes
written and the values decoded are identical (bit for bit), for vLLM's fp8_ds_mla layout, FP8 indexer keys,
NVFP4 and MXFP4 records, at V4-Flash widths and the tiny config's, from fp32 and bf16 values, into a strided
layer view of a shared page (as the KV storage hands out). The kernels round with integer arithmetic (e4m3
round-to-nearest-even, ue8m0 exponents from the float's bits, bf16 RoPE channels), so the interpreter's
misrounding casts never enter."""

from unittest import mock

import pytest
import torch

from inferhal.backends.reference import kv_records as ref
from inferhal.backends.reference.ops import kv_write as ref_write
from inferhal.core.ops.params import KVWriteParams
from inferhal.core.paging import formats
from inferhal.kernels import tuning
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
    assert torch.equal(decode_rows(got, rows, fmt, tile=True), expect)  # the split-KV kernels' decoder


def test_a_cache_that_is_not_records_of_the_format_is_refused():
    fmt = formats.record("fp4", 32, 8, role="main")
    with pytest.raises(ValueError, match=r"kv.write nvfp4: cache must be uint8 \[NB, BS, 18\]"):
        kv_write_record(torch.zeros(1, 32), torch.zeros(2, 4, 18), torch.tensor([0]), fmt)
    with pytest.raises(ValueError, match=r"values must be \[T, 32\]"):
        kv_write_record(torch.zeros(1, 30), torch.zeros(2, 4, 18, dtype=torch.uint8), torch.tensor([0]), fmt)


# ---- the attention kernels reading records (attn.sparse_topk, indexer.scores) ------------------------------

def _records(values: torch.Tensor, fmt) -> torch.Tensor:
    """``values [NB, BS, D]`` as a record cache ``uint8 [NB, BS, nbytes]`` (the reference's kv.write)."""
    nb, bs, d = values.shape
    cache = torch.zeros(nb, bs, fmt.nbytes, dtype=torch.uint8)
    ref_write(values.reshape(-1, d), cache, torch.arange(nb * bs), KVWriteParams(record=fmt))
    return cache


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_attention_and_indexer_kernels_read_records_as_the_reference_does(kv_dtype, dtype, close):
    """The kernels decode records inside their key tiles; against the reference reading the same records, the
    tolerances are the value-cache kernels' own (test_deepseek_v4.py): decoded main records are exact in bf16."""
    from inferhal.backends.reference.deepseek import attn_sparse_topk as ref_sparse
    from inferhal.backends.reference.deepseek import indexer_scores as ref_indexer
    from inferhal.core.ops.params import AttnParams, IndexerParams
    from inferhal.kernels.indexer import indexer_scores
    from inferhal.kernels.sparse_attn import attn_sparse_topk

    from tests.kernels.test_deepseek_v4 import BLOCK, _topk_rows, v4_batch

    g = torch.Generator().manual_seed(5 if kv_dtype == "fp8" else 6)
    m, h, d, rope, hi, di = 4, 8, 64, 16, 4, 32
    main, index = formats.record(kv_dtype, d, rope, role="main"), formats.record(kv_dtype, di, role="index")
    pos, qsl, attn, nb = v4_batch([23, 40, 6], [1, 5, 6], m, g)
    kv = _records(torch.randn(nb, BLOCK, d, generator=g), main)
    cc = _records(torch.randn(nb, BLOCK // m, d, generator=g), main)
    keys = _records(torch.randn(nb, BLOCK // m, di, generator=g), index)
    q = torch.randn(len(pos), h, d, generator=g).to(dtype)
    sinks = torch.randn(h, generator=g)
    p = AttnParams(scale=d ** -0.5, window=8, shared_kv=True, kv_format=main)
    args = (cc, attn["comp"], _topk_rows(pos, attn, m, 5, "csa", g))
    expect = ref_sparse(q, kv, attn["swa"], *args, p, sinks)
    vmax = float(max(ref.decode(kv, main).abs().max(), ref.decode(cc, main).abs().max()))
    for decode in ("split", "single"):  # both decode records with kv_records.decode_tile
        out = attn_sparse_topk(q, kv, attn["swa"], *args, p, sinks, decode=decode)
        close(out, expect, links=2 if dtype == torch.bfloat16 else 1, scale=vmax,
              name=f"attn.sparse_topk {main.name} {decode}")
    # the single kernel's value channels in quarters (cuda_sm90's CHANNEL_SPLIT; the interpreter's entry: halves):
    # each program scores every key and stores 16 of the 64 channels
    quarters = {**tuning.config("attn_sparse_records", "interpreter"), "CHANNEL_SPLIT": 4}
    with mock.patch.dict(tuning.TUNING["interpreter"], {"attn_sparse_records": quarters}):
        out = attn_sparse_topk(q, kv, attn["swa"], *args, p, sinks, decode="single")
    close(out, expect, links=2 if dtype == torch.bfloat16 else 1, scale=vmax,
          name=f"attn.sparse_topk {main.name} single, CHANNEL_SPLIT 4")
    iq, w = torch.randn(len(pos), hi, di, generator=g).to(dtype), torch.randn(len(pos), hi, generator=g)
    ip = IndexerParams(di ** -0.5, hi ** -0.5, index)
    want = ref_indexer(iq, keys, attn["comp"], w, ip)
    fin = ~torch.isinf(want)
    mag = float(ref_indexer(iq.abs(), ref.decode(keys, index).abs(), attn["comp"], w.abs(),
                            IndexerParams(di ** -0.5, hi ** -0.5))[fin].max())
    for decode in ("split", "single"):
        got = indexer_scores(iq, keys, attn["comp"], w, ip, decode=decode)
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        close(got[fin], want[fin], scale=mag, name=f"indexer.scores {index.name} {decode}")

