"""attn.paged kernel vs the reference, in the interpreter, over ragged batches of paged sequences.

Tolerance: fp32 runs are exact up to the online softmax's re-association (1e-5). In bf16 the kernel
rounds P to bf16 before the P·V dot (what the tensor cores take) while the oracle keeps P in fp32:
each output is sum_s p_s v_s with sum p_s <= 1, so that costs at most 2**-8 * max|v|, plus the output's
own bf16 rounding: two roundings at the scale of max|v|. Both kernels: split-KV (the default) and one
program per (token, KV head, group of at most ``BLOCK_H`` of its query heads) (``decode="single"``).
"""

import pytest
import torch

from inferhal.backends.reference.attention import attn_paged as ref_attn
from inferhal.core.ops.params import AttnBatch, AttnParams
from inferhal.kernels.attn_paged import attn_paged


def make_batch(ctx_lens, new_lens, bs, nb, g):
    """Sequences with ctx_lens total tokens, the last new_lens of them queried; random physical blocks."""
    perm = torch.randperm(nb, generator=g).tolist()
    width = max((c + bs - 1) // bs for c in ctx_lens)
    table = torch.full((len(ctx_lens), width), -1, dtype=torch.int32)
    pos, qsl = [], [0]
    for i, (c, n) in enumerate(zip(ctx_lens, new_lens)):
        need = (c + bs - 1) // bs
        table[i, :need] = torch.tensor([perm.pop() for _ in range(need)], dtype=torch.int32)
        pos.extend(range(c - n, c))
        qsl.append(qsl[-1] + n)
    return AttnBatch(torch.tensor(qsl, dtype=torch.int32), torch.tensor(ctx_lens, dtype=torch.int32),
                     torch.tensor(pos), table, torch.zeros(len(pos), dtype=torch.long))


CASES = [
    # ctx_lens, new_lens, H, Hk, D, shared_kv, window, sinks, softcap
    ([1], [1], 1, 1, 16, False, 0, False, 0.0),
    ([5, 17, 33], [1, 1, 1], 4, 1, 32, True, 0, True, 0.0),  # decode on the latent KV, sinks
    ([40, 9], [1, 1], 16, 1, 64, True, 8, True, 0.0),  # sliding window
    ([12, 30], [4, 7], 4, 2, 24, False, 0, False, 0.0),  # chunked prefill, GQA, ragged D
    ([20], [20], 8, 2, 16, False, 6, True, 30.0),  # full prefill, window, softcap
    ([3, 50], [0, 2], 2, 1, 16, True, 0, True, 0.0),  # a sequence with no new tokens
    # more query heads of a KV head than a program holds (the interpreter's BLOCK_H 16): decode=single runs groups
    ([6, 19], [1, 2], 64, 2, 16, False, 0, True, 0.0),  # 32 heads a KV head: two groups each, two KV heads
    ([7], [1], 40, 1, 16, True, 0, True, 0.0),  # 40 heads: three groups, the last one half masked
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decode", ["split", "single"])
def test_attn_paged_matches_reference(case, dtype, decode, close):
    ctx, new, h, hk, d, shared, window, with_sinks, softcap = case
    g = torch.Generator().manual_seed(sum(ctx) + h + d)
    bs, nb = 8, 24
    batch = make_batch(ctx, new, bs, nb, g)
    slot = (hk, d) if shared else (2, hk, d)
    cache = torch.randn(nb, bs, *slot, generator=g).to(dtype)
    q = torch.randn(sum(new), h, d, generator=g).to(dtype)
    sinks = torch.randn(h, generator=g) if with_sinks else None
    p = AttnParams(scale=d**-0.5, num_kv_heads=hk, window=window, softcap=softcap, shared_kv=shared)
    out, ref = attn_paged(q, cache, batch, p, sinks, decode=decode), ref_attn(q, cache, batch, p, sinks)
    vmax = float(cache.float().abs().max())
    close(out, ref, links=2 if dtype == torch.bfloat16 else 1, scale=vmax, name="attn.paged")


def test_attn_paged_rejects_bad_heads():
    g = torch.Generator().manual_seed(0)
    batch = make_batch([4], [1], 4, 2, g)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        attn_paged(torch.randn(1, 3, 8), torch.randn(2, 4, 2, 2, 8), batch, AttnParams(scale=1.0, num_kv_heads=2))
    with pytest.raises(ValueError, match="decode='fast'; known: split, single"):
        attn_paged(torch.randn(1, 2, 8), torch.randn(2, 4, 2, 2, 8), batch, AttnParams(scale=1.0, num_kv_heads=2),
                   decode="fast")
