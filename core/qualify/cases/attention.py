"""Cases of attn.paged (prefill, decode, GQA/MQA, sliding window, sinks, softcap, shared latent KV) and kv.write."""

from __future__ import annotations

import torch

from inferhal.core.ops.params import AttnBatch, AttnParams, KVWriteParams
from inferhal.core.qualify.cases.base import DTYPES, OpCase, cases_for, gen, nbytes, randn
from inferhal.core.qualify.tolerances import Tolerance, ulps


def paged_batch(g: torch.Generator, ctx: list[int], new: list[int], bs: int, nb_spare: int = 3):
    """A block table over shuffled physical blocks for sequences with ``ctx`` total and ``new`` query tokens."""
    need = [-(-c // bs) for c in ctx]
    nb = sum(need) + nb_spare
    perm = torch.randperm(nb, generator=g).tolist()
    width = max(need)
    table = torch.full((len(ctx), width), -1, dtype=torch.int32)
    slots, positions, qsl = [], [], [0]
    for b, (c, q) in enumerate(zip(ctx, new)):
        blocks = [perm.pop() for _ in range(need[b])]
        table[b, : need[b]] = torch.tensor(blocks, dtype=torch.int32)
        for pos in range(c - q, c):
            positions.append(pos)
            slots.append(blocks[pos // bs] * bs + pos % bs)
        qsl.append(qsl[-1] + q)
    batch = AttnBatch(torch.tensor(qsl, dtype=torch.int32), torch.tensor(ctx, dtype=torch.int32),
                      torch.tensor(positions, dtype=torch.long), table, torch.tensor(slots, dtype=torch.long))
    return nb, batch


def first_seqs(batch: AttnBatch, n: int) -> AttnBatch:
    end = int(batch.query_start_loc[n])
    return AttnBatch(batch.query_start_loc[: n + 1], batch.seq_lens[:n], batch.positions[:end],
                     batch.block_table[:n], batch.slot_mapping[:end], batch.tokens_per_slot)


_ATTN = [
    # label, ctx, new, H, Hk, D, BS, window, sinks, softcap, shared, level
    ("decode GQA", [17, 40, 5], [1, 1, 1], 8, 2, 64, 16, 0, False, 0.0, False, "quick"),
    ("prefill+decode window sinks", [24, 9, 33], [24, 1, 6], 4, 1, 64, 8, 16, True, 0.0, False, "quick"),
    ("chunked prefill shared-latent sinks", [30, 12], [10, 12], 4, 1, 128, 16, 0, True, 0.0, True, "quick"),
    ("decode MHA softcap", [64, 3, 100, 1], [1, 1, 1, 1], 4, 4, 32, 16, 0, False, 50.0, False, "full"),
    ("prefill GQA window", [96, 50], [96, 50], 8, 2, 128, 32, 32, False, 0.0, False, "full"),
    ("decode MQA D=256", [200, 77], [1, 1], 4, 1, 256, 16, 0, False, 0.0, False, "full"),
    ("decode shared-latent D=512", [130, 64, 7], [1, 1, 1], 8, 1, 512, 64, 0, True, 0.0, True, "full"),
    # split-KV edges at the GPU tuning (256-key splits, at most 8): 256 and 512 keys end on a split boundary,
    # one key, 2049 keys in 8 splits of 288 (kernels/attn_split.py)
    ("decode split edges shared-latent", [256, 1, 512, 2049], [1, 1, 1, 1], 16, 1, 512, 64, 0, True, 0.0, True,
     "full"),
]


@cases_for("attn.paged")
def attn_paged() -> list[OpCase]:
    out = []
    for label, ctx, new, h, hk, d, bs, window, sinks, softcap, shared, level in _ATTN:
        for dtype in ("float32", "bfloat16"):
            def build(seed, ctx=ctx, new=new, h=h, hk=hk, d=d, bs=bs, window=window, sinks=sinks, softcap=softcap,
                      shared=shared, dtype=dtype):
                g = gen(seed)
                dt = DTYPES[dtype]
                nb, batch = paged_batch(g, ctx, new, bs)
                slot = (hk, d) if shared else (2, hk, d)
                cache = randn(g, nb, bs, *slot, dtype=dt)
                q = randn(g, int(batch.query_start_loc[-1]), h, d, dtype=dt)
                p = AttnParams(scale=d ** -0.5, num_kv_heads=hk, window=window, softcap=softcap, shared_kv=shared)
                s = randn(g, h) if sinks else None
                return (q, cache, batch, p), ({"sinks": s} if sinks else {})

            def take(a, k, n):
                b = first_seqs(a[2], n)
                return (a[0][: int(b.query_start_loc[-1])], a[1], b, a[3]), k

            def row_slice(o, a, k, n):
                return o[: int(a[2].query_start_loc[n])]

            def cost(a, k, d=d, h=h):
                b = a[2]
                ctx_tokens = sum(int(c) for c in b.seq_lens)
                flops = 4.0 * h * d * sum(int(b.seq_lens[i]) * (int(b.query_start_loc[i + 1]) - int(b.query_start_loc[i]))
                                          for i in range(b.num_seqs))
                kv_bytes = ctx_tokens * a[1][0, 0].numel() * a[1].element_size()
                return flops, kv_bytes + 2 * nbytes(a[0])

            n = 8 if dtype == "float32" else 4
            why = ("softmax and weighted sum in fp32 over up to a few hundred keys, in another order; one output "
                   "rounding" + ("" if dtype == "float32" else " (bf16 inputs are exact in fp32)"))
            shape = f"{label} B={len(ctx)} H={h}/{hk} D={d} BS={bs}" + (f" window={window}" if window else "")
            out.append(OpCase("attn.paged", shape, dtype, build, ulps(dtype, n if dtype != "float32" else 64, why),
                              level, rows=lambda a, k: a[2].num_seqs, take=take, row_slice=row_slice, cost=cost))
    return out


# ------------------------------------------------------------------------------------------- kv.write

def _dequant_cache(out, args, kwargs):
    cache = args[1]
    if args[3].quant == "fp8":
        scale = kwargs["scale_cache"].float()
        return cache.float() * scale.view(*scale.shape, *([1] * (cache.dim() - 2)))
    return cache


@cases_for("kv.write")
def kv_write() -> list[OpCase]:
    out = []
    for t, nb, bs, slot, quant, level in [(10, 6, 4, (2, 2, 32), "none", "quick"), (16, 8, 16, (1, 128), "none", "quick"),
                                          (12, 5, 8, (2, 1, 64), "fp8", "quick"), (40, 12, 16, (2, 4, 128), "none", "full"),
                                          (33, 9, 16, (1, 512), "fp8", "full")]:
        for dtype in ("float32", "bfloat16"):
            def build(seed, t=t, nb=nb, bs=bs, slot=slot, quant=quant, dtype=dtype):
                g = gen(seed)
                dt = DTYPES[dtype]
                vals = randn(g, t, *slot, dtype=dt)
                slots = torch.randperm(nb * bs, generator=g)[:t].long()
                slots[torch.rand(t, generator=g) < 0.2] = -1  # some tokens write nothing
                kw = {}
                if quant == "fp8":
                    cache = torch.zeros(nb, bs, *slot, dtype=torch.float8_e4m3fn)
                    kw["scale_cache"] = torch.zeros(nb, bs, dtype=torch.float32)
                else:
                    cache = torch.zeros(nb, bs, *slot, dtype=dt)
                return (vals, cache, slots, KVWriteParams(quant=quant)), kw

            if quant == "fp8":
                tol = Tolerance(rtol=2.0**-3, atol=2.0**-4, why="e4m3 stores: one ulp (2^-3 relative) where an "
                                "implementation rounds fp32 -> fp8 differently (emulators differ in 3-5 % of values)")
            else:
                tol = Tolerance(exact=True, why="a copy: bitwise equal")
            label = f"T={t} NB={nb} BS={bs} slot={'x'.join(map(str, slot))}" + (" fp8" if quant == "fp8" else "")
            out.append(OpCase("kv.write", label, dtype, build, tol, level, output=_dequant_cache,
                              cost=lambda a, k: (0.0, 2 * nbytes(a[0]))))
    # FP8 / FP4 KV records (cache.kv_dtype): the bytes are defined by the format (core/paging/formats.py), so
    # any implementation writes exactly the reference's
    from inferhal.core.paging import formats

    for kv_dtype, dims, rope, role, level in [("fp8", 64, 16, "main", "quick"), ("fp4", 64, 16, "main", "quick"),
                                              ("fp8", 128, 0, "index", "quick"), ("fp4", 128, 0, "index", "quick"),
                                              ("fp8", 512, 64, "main", "full"), ("fp4", 512, 64, "main", "full")]:
        fmt = formats.record(kv_dtype, dims, rope, role=role)
        for dtype in ("float32", "bfloat16"):
            def build(seed, fmt=fmt, dtype=dtype):
                g = gen(seed)
                vals = randn(g, 12, fmt.dims, dtype=DTYPES[dtype])
                slots = torch.randperm(6 * 4, generator=g)[:12].long()
                slots[torch.rand(12, generator=g) < 0.2] = -1
                return (vals, torch.zeros(6, 4, fmt.nbytes, dtype=torch.uint8), slots, KVWriteParams(record=fmt)), {}

            out.append(OpCase("kv.write", f"T=12 {fmt.name} {fmt.nbytes} B", dtype, build,
                              Tolerance(exact=True, why=f"{fmt.name} records: the format defines every byte"), level,
                              output=lambda r, a, k: a[1], cost=lambda a, k: (0.0, nbytes(a[0]) + nbytes(a[1]))))
    return out
