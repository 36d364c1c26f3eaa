"""``perf``: the backend's kernels at DeepSeek-V4-Flash sizes beside ceilings measured in the same run at the
same shapes, every variant the op offers (old and new kernels on the same inputs) timed side by side.

Ceilings (plain torch on the same device, :func:`~.common.bench`, each call after a cache flush):

- ``copy``: a device copy moving the bytes the kernel must move (read + written);
- ``gather``: ``index_select`` of the rows a paged or sparse kernel reads (its keys), from the same pool;
- ``mm`` / ``scaled_mm``: ``torch.mm`` in bf16 and ``torch._scaled_mm`` in FP8 at the kernel's (M, N, K):
  decode M (64, 128) and prefill M; for the experts the two products of each token's choices;
- ``grouped_mm``: ``torch._grouped_mm`` over the experts' groups, where this torch has it;
- ``sdpa``: ``F.scaled_dot_product_attention`` on the same keys laid out contiguously, where it takes the shape.

A kernel row's ``ceilings`` maps each ceiling to the kernel's share of it (bandwidth for copy and gather, FLOP/s
for the products, time for SDPA); ``of_ceiling`` is the first. A ceiling torch cannot run here is a row with
status ``unavailable``, never a failure. In an interpreter the same code runs at ``reduced`` sizes, each
row saying ``interpreter`` with status ``dry-run``: not a hardware result.
"""

from __future__ import annotations

from typing import Any, Callable

from inferhal.core.qualify.device_run.common import QUICK, Context, bench, error_text, log, variants

#: sizes per scale (full: V4-Flash; reduced: what an interpreter runs in seconds)
DIMS = {
    "full": dict(norm=(8192, 4096), weights=(("q_b", 32768, 1024), ("o_b", 4096, 8192), ("q_a", 1024, 4096),
                                              ("shared gate|up", 4096, 4096)), m=(64, 128, 4096),
                 paged=((64, 4096), (128, 8192)), heads=64, latent=512, bs=64, sparse=(64, 65536, 128, 512, 4096),
                 index=(64, 65536, 64, 128), experts=(4096, 4096, 2048, 32, 6), decode_experts=(64, 64),
                 head=(32, 129280, 4096),
                 # linear at decode: V4-Flash's projections (q_a 1024x4096, kv 512x4096, q_b 32768x1024,
                 # o_b 4096x8192) at M = 1, 16, 64, 128; fp8_block weights for the first at M = 1 and 64
                 decode_linear=(("q_a", 1024, 4096), ("kv", 512, 4096), ("q_b", 32768, 1024), ("o_b", 4096, 8192)),
                 decode_m=(1, 16, 64, 128)),
    "reduced": dict(norm=(64, 256), weights=(("q_b", 256, 128),), m=(16,), paged=((2, 64),), heads=4, latent=64,
                    bs=16, sparse=(2, 256, 16, 16, 64), index=(2, 256, 4, 32), experts=(8, 128, 128, 4, 2),
                    decode_experts=(8, 4), head=(4, 1024, 128), decode_linear=(("q_a", 96, 256),), decode_m=(1, 16)),
}


class Perf:
    """Times ``fn`` and records a row; ceilings of the current case are kept to rate the kernels against."""

    def __init__(self, ctx: Context, emit) -> None:
        self.ctx, self.emit = ctx, emit
        self.device, self.prof = ctx.active.device, ctx.active.profile
        quick = not ctx.on_device
        self.timer = QUICK if quick else {}
        self.ceilings: dict[str, dict] = {}

    def case(self) -> None:
        self.ceilings = {}

    def _time(self, name: str, fn: Callable[[], Any], nbytes: float, flops: float, dtype: str, kind: str, **extra) -> dict:
        row = self.ctx.row("perf", name=name, kind=kind, dtype=dtype, bytes=nbytes, flops=flops, **extra)
        if self.ctx.left() < 0:
            row.update(status="not-run", message="the run's deadline passed")
            return row
        try:
            t = bench(fn, self.device, **self.timer)
            ms = t["ms"]
            gbs, tfs = nbytes / ms / 1e6, flops / ms / 1e9
            pb, pf = self.prof.peak_bandwidth, self.prof.peak_flops.get(dtype, 0.0)
            row.update(status="measured" if self.ctx.on_device else "dry-run", ms=ms, reps=t["reps"], timer=t["timer"],
                       GBps=gbs, TFLOPps=tfs, bandwidth_fraction=gbs * 1e9 / pb if pb and nbytes else None,
                       flops_fraction=tfs * 1e12 / pf if pf and flops else None)
        except Exception as exc:
            row.update(status="unavailable" if kind == "ceiling" else "fail", message=error_text(exc))
        return row

    def ceiling(self, ceiling: str, name: str, fn: Callable[[], Any], nbytes: float = 0, flops: float = 0,
                dtype: str = "bfloat16") -> None:
        row = self._time(f"ceiling {ceiling}: {name}", fn, nbytes, flops, dtype, "ceiling", ceiling=ceiling)
        if "ms" in row:
            self.ceilings[ceiling] = row
        log(f"{row['status']:>11} {row['name']}: {row.get('ms', 0):.4f} ms {row.get('message', '')[:120]}")
        self.emit(row)

    def kernel(self, op_id: str, name: str, call: Callable[[Any], Any], nbytes: float, flops: float, dtype: str,
               only: tuple[str, ...] = ()) -> None:
        """Every variant of ``op_id`` (or those named in ``only``) on the same inputs (``call(fn)`` runs one),
        each rated against this case's ceilings."""
        base = None
        for vname, fn in variants(self.ctx.active, op_id).items():
            if only and vname not in only:
                continue
            row = self._time(name, (lambda fn=fn: call(fn)), nbytes, flops, dtype, "kernel", op=op_id, variant=vname)
            if "ms" in row:
                shares = {}
                for cname, c in self.ceilings.items():
                    if c["ceiling"] in ("copy", "gather") and c.get("GBps"):
                        shares[cname] = row["GBps"] / c["GBps"]
                    elif c["ceiling"] == "sdpa":
                        shares[cname] = c["ms"] / row["ms"]
                    elif c.get("TFLOPps"):
                        shares[cname] = row["TFLOPps"] / c["TFLOPps"]
                row["ceilings"] = shares
                if shares:
                    row["ceiling"], row["of_ceiling"] = next(iter(shares.items()))
                try:  # the same inputs: how far each variant's output is from the default's
                    out = call(fn)
                    if base is None:
                        base = out
                    else:
                        row["max_abs_diff_vs_default"] = float((_first(out).float() - _first(base).float()).abs().max())
                except Exception as exc:
                    row["message"] = error_text(exc)
            log(f"{row['status']:>11} {name} [{vname}]: {row.get('ms', 0):.4f} ms, {row.get('GBps', 0):.0f} GB/s, "
                f"{row.get('TFLOPps', 0):.1f} TFLOP/s, of {row.get('ceiling')}: {row.get('of_ceiling') or 0:.1%}")
            self.emit(row)


def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


def perf_rows(ctx: Context, emit) -> None:
    import torch

    from inferhal.core.ops import params as P

    s, dev, bf = DIMS[ctx.scale], ctx.dev, torch.bfloat16
    pf = Perf(ctx, emit)
    t, d = s["norm"]
    x, w = torch.randn(t, d, device=dev, dtype=bf), torch.randn(d, device=dev, dtype=bf)
    pf.case()
    pf.ceiling("copy", f"{2 * x.numel() * 2} B", _copier(torch, dev, 2 * x.numel() * 2), 4 * x.numel() * 2)
    pf.kernel("norm.rms", f"norm.rms {t}x{d} bf16 +residual", lambda f: f(x, w, P.RmsNormParams(), x),
              4 * x.numel() * 2, 4 * x.numel(), "bfloat16")
    del x
    # linear at decode last: the section's time cap keeps the rows measured before it stops
    for section in (linear_perf, attention_perf, experts_perf, head_perf, linear_decode_perf):
        try:
            section(torch, ctx, pf, s, P)
        except Exception as exc:  # a set-up error must not lose the other groups
            emit(ctx.row("perf", name=section.__name__, kind="setup", status="fail", message=error_text(exc)))


def _copier(torch, dev, nbytes: int) -> Callable[[], Any]:
    """A copy moving ``nbytes`` (half read, half written)."""
    a = torch.empty(max(1, int(nbytes) // 2), dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    return lambda: b.copy_(a)


def linear_perf(torch, ctx, pf: Perf, s, P) -> None:
    from inferhal.core.ops.quantize import quantize_fp8_block

    dev, bf, f8 = ctx.dev, torch.bfloat16, torch.float8_e4m3fn
    for label, n, k in s["weights"]:
        w = torch.randn(n, k, device=dev) * k**-0.5
        wb, w8 = w.to(bf), quantize_fp8_block(w)
        w8t = w.to(f8).t()  # [K, N] column-major, as _scaled_mm takes its second operand
        del w
        one = torch.ones((), device=dev)
        for m in s["m"]:
            x = torch.randn(m, k, device=dev, dtype=bf)
            x8 = x.to(f8)
            fl, io = 2 * m * n * k, m * (k + n) * 2
            pf.case()
            pf.ceiling("copy", f"{n}x{k} bf16 weight", _copier(torch, dev, n * k * 2 * 2), n * k * 2 * 2)
            pf.ceiling("mm", f"torch.mm bf16 M{m} N{n} K{k}", lambda: torch.mm(x, wb.t()), n * k * 2 + io, fl)
            pf.ceiling("scaled_mm", f"torch._scaled_mm fp8 M{m} N{n} K{k}",
                       lambda: torch._scaled_mm(x8, w8t, one, one, out_dtype=bf), n * k + io, fl, "float8_e4m3fn")
            pf.kernel("linear", f"linear bf16 {label} M{m} N{n} K{k}", lambda f: f(x, wb), n * k * 2 + io, fl, "bfloat16")
            pf.kernel("linear", f"linear fp8_block (bf16 activations) {label} M{m} N{n} K{k}", lambda f: f(x, w8),
                      n * k + io, fl, "float8_e4m3fn")


def linear_decode_perf(torch, ctx, pf: Perf, s, P) -> None:
    """linear at decode sizes: the op's default (a backend's decode kernel, where it has one for these rows) and the
    tiled GEMM (``path=tiled``, the kernel before it), and for FP8 weights FP8 x FP8 (``fp8_matmul=w8a8``: its
    decode kernel), beside a copy of the same bytes (weight + x + y)."""
    from inferhal.core.ops.quantize import quantize_fp8_block

    dev, bf = ctx.dev, torch.bfloat16
    pick = ("default", "path=tiled")
    for i, (label, n, k) in enumerate(s["decode_linear"]):
        w = torch.randn(n, k, device=dev) * k**-0.5
        weights = [("bf16", w.to(bf), n * k * 2)] + ([("fp8_block", quantize_fp8_block(w), n * k)] if i == 0 else [])
        del w
        for m in s["decode_m"]:
            x = torch.randn(m, k, device=dev, dtype=bf)
            for wname, wt, wbytes in weights if m in (1, 64) else weights[:1]:  # fp8: M = 1 and 64
                nbytes = wbytes + m * (k + n) * 2
                pf.case()
                pf.ceiling("copy", f"{nbytes} B (decode linear {label} {wname} M{m})", _copier(torch, dev, nbytes), nbytes)
                pf.kernel("linear", f"linear decode {wname} {label} M{m} N{n} K{k}", lambda f, wt=wt: f(x, wt), nbytes,
                          2 * m * n * k, "bfloat16", only=pick + (("fp8_matmul=w8a8",) if wname == "fp8_block" else ()))


def attention_perf(torch, ctx, pf: Perf, s, P) -> None:
    import torch.nn.functional as F

    dev, bf, h, lat, bs = ctx.dev, torch.bfloat16, s["heads"], s["latent"], s["bs"]
    for nseq, ctxlen in s["paged"]:
        nb = nseq * ctxlen // bs
        cache = torch.randn(nb, bs, 1, lat, device=dev, dtype=bf)
        table = torch.randperm(nb, device=dev).to(torch.int32).view(nseq, -1)
        batch = P.AttnBatch(torch.arange(nseq + 1, dtype=torch.int32, device=dev),
                            torch.full((nseq,), ctxlen, dtype=torch.int32, device=dev),
                            torch.full((nseq,), ctxlen - 1, device=dev), table, torch.zeros(nseq, dtype=torch.long, device=dev))
        q = torch.randn(nseq, h, lat, device=dev, dtype=bf)
        ap = P.AttnParams(scale=lat**-0.5, num_kv_heads=1, shared_kv=True)
        nbytes, fl = cache.numel() * 2 + 2 * q.numel() * 2, 4 * nseq * h * ctxlen * lat
        rows = cache.view(-1, lat)
        order = (table.long()[:, :, None] * bs + torch.arange(bs, device=dev)).view(-1)
        kv = rows[order].view(nseq, 1, ctxlen, lat)
        q4 = q.view(nseq, h, 1, lat)
        pf.case()
        pf.ceiling("copy", f"{cache.numel() * 2} B of paged KV", _copier(torch, dev, 2 * cache.numel() * 2), 2 * cache.numel() * 2)
        pf.ceiling("gather", f"index_select of {order.numel()} key rows", lambda: torch.index_select(rows, 0, order),
                   2 * order.numel() * lat * 2)
        pf.ceiling("sdpa", f"scaled_dot_product_attention B{nseq} H{h}/1 ctx{ctxlen} D{lat} contiguous",
                   lambda: F.scaled_dot_product_attention(q4, kv, kv, enable_gqa=True), nbytes, fl)
        pf.kernel("attn.paged", f"attn.paged latent decode B{nseq} ctx{ctxlen} H{h} D{lat} bf16 KV",
                  lambda f: f(q, cache, batch, ap, None), nbytes, fl, "bfloat16")
        del cache, rows, kv
    sparse_perf(torch, ctx, pf, s, P)
    indexer_perf(torch, ctx, pf, s, P)


def sparse_perf(torch, ctx, pf: Perf, s, P) -> None:
    """V4's CSA decode: a window plus the top-k of the compressed entries (4:1) at long context, sinks; bytes =
    the keys each token must read. Block tables point into pools smaller than B x context (only read rows matter)."""
    dev, bf, h, lat, bs = ctx.dev, torch.bfloat16, s["heads"], s["latent"], s["bs"]
    b, ctxlen, win, topk, pool = s["sparse"]
    ratio, ncomp = 4, s["sparse"][1] // 4
    kv = torch.randn(pool, bs, lat, device=dev, dtype=bf)
    comp = torch.randn(pool, bs, lat, device=dev, dtype=bf)
    batch = P.AttnBatch(torch.arange(b + 1, dtype=torch.int32, device=dev), torch.full((b,), ctxlen, dtype=torch.int32, device=dev),
                        torch.full((b,), ctxlen - 1, device=dev),
                        torch.randint(0, pool, (b, ctxlen // bs), device=dev, dtype=torch.int32),
                        torch.zeros(b, dtype=torch.long, device=dev))
    cbatch = P.AttnBatch(batch.query_start_loc, torch.full((b,), ncomp, dtype=torch.int32, device=dev), batch.positions,
                         torch.randint(0, pool, (b, ncomp // bs), device=dev, dtype=torch.int32), batch.slot_mapping,
                         tokens_per_slot=ratio)
    idx = torch.stack([torch.randperm(ncomp, device=dev)[:topk] for _ in range(b)])
    q, sinks = torch.randn(b, h, lat, device=dev, dtype=bf), torch.randn(h, device=dev)
    ap = P.AttnParams(scale=lat**-0.5, num_kv_heads=1, window=win, shared_kv=True)
    keys = win + topk
    nbytes = b * keys * lat * 2 + 2 * q.numel() * 2 + idx.numel() * 8
    kv_rows, comp_rows = kv.view(-1, lat), comp.view(-1, lat)
    sel = (cbatch.block_table.long().gather(1, idx // bs) * bs + idx % bs).view(-1)  # the selected entries' rows
    last = ctxlen - win + torch.arange(win, device=dev)  # the window's positions
    near = (batch.block_table.long()[:, last // bs] * bs + last % bs).view(-1)
    pf.case()
    pf.ceiling("gather", f"index_select of {b}x{keys} key rows",
               lambda: (torch.index_select(kv_rows, 0, near), torch.index_select(comp_rows, 0, sel)), 2 * b * keys * lat * 2)
    pf.ceiling("copy", f"{b * keys * lat * 2} B", _copier(torch, dev, 2 * b * keys * lat * 2), 2 * b * keys * lat * 2)
    pf.kernel("attn.sparse_topk", f"attn.sparse_topk CSA decode B{b} ctx{ctxlen} window{win} top{topk} H{h} D{lat} bf16",
              lambda f: f(q, kv, batch, comp, cbatch, idx, ap, sinks), nbytes, 4 * b * h * keys * lat, "bfloat16")


def indexer_perf(torch, ctx, pf: Perf, s, P) -> None:
    """The lightning indexer at decode: every compressed entry (4:1) of a long context scored by Hi heads."""
    dev, bf, bs = ctx.dev, torch.bfloat16, s["bs"]
    b, ctxlen, hi, di = s["index"]
    n = ctxlen // 4
    nb = b * n // bs
    keys = torch.randn(nb, bs, di, device=dev, dtype=bf)
    table = torch.randperm(nb, device=dev).to(torch.int32).view(b, -1)
    batch = P.AttnBatch(torch.arange(b + 1, dtype=torch.int32, device=dev), torch.full((b,), n, dtype=torch.int32, device=dev),
                        torch.full((b,), ctxlen - 1, device=dev), table, torch.zeros(b, dtype=torch.long, device=dev),
                        tokens_per_slot=4)
    q, wts = torch.randn(b, hi, di, device=dev, dtype=bf), torch.randn(b, hi, device=dev, dtype=bf)
    ip = P.IndexerParams(di**-0.5, hi**-0.5)
    rows = keys.view(-1, di)
    order = (table.long()[:, :, None] * bs + torch.arange(bs, device=dev)).view(-1)
    nbytes = keys.numel() * 2 + b * n * 4
    pf.case()
    pf.ceiling("gather", f"index_select of {order.numel()} index-key rows", lambda: torch.index_select(rows, 0, order),
               2 * order.numel() * di * 2)
    pf.ceiling("copy", f"{keys.numel() * 2} B", _copier(torch, dev, 2 * keys.numel() * 2), 2 * keys.numel() * 2)
    pf.kernel("indexer.scores", f"indexer.scores decode B{b} ctx{ctxlen} ({n} entries) Hi{hi} Di{di} bf16",
              lambda f: f(q, keys, batch, wts, ip), nbytes, 2 * b * hi * n * di, "bfloat16")


def experts_perf(torch, ctx, pf: Perf, s, P) -> None:
    from inferhal.core.ops.quantize import quantize_fp8_block

    dev, bf, f8 = ctx.dev, torch.bfloat16, torch.float8_e4m3fn
    t, d, i, e, k = s["experts"]
    ep = P.ExpertsParams(swiglu_limit=10.0)
    xe = torch.randn(t, d, device=dev, dtype=bf)
    wgu, wdn = torch.randn(e, 2 * i, d, device=dev) * 0.02, torch.randn(e, d, i, device=dev) * 0.02
    ids = torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(t)])
    we = torch.rand(t, k, device=dev)
    flops, m = 2 * t * k * (2 * i * d + d * i), t * k
    wbf = (wgu.to(bf), wdn.to(bf))
    xs = torch.randn(m, d, device=dev, dtype=bf)  # each (token, choice) row, grouped by expert
    hs = torch.randn(m, i, device=dev, dtype=bf)
    offs = torch.cumsum(torch.bincount(ids.view(-1), minlength=e), 0).to(torch.int32)
    one = torch.ones((), device=dev)
    a8, b8 = xs.to(f8), wbf[0][0].to(f8).t()
    h8, d8 = hs.to(f8), wbf[1][0].to(f8).t()
    pf.case()
    pf.ceiling("mm", f"torch.mm bf16 M{m} N{2 * i} K{d} + M{m} N{d} K{i}",
               lambda: (torch.mm(xs, wbf[0][0].t()), torch.mm(hs, wbf[1][0].t())), 0, flops)
    pf.ceiling("grouped_mm", f"torch._grouped_mm bf16 {e} groups", lambda: (
        torch._grouped_mm(xs, wbf[0].transpose(-2, -1), offs=offs), torch._grouped_mm(hs, wbf[1].transpose(-2, -1), offs=offs)),
        0, flops)
    pf.ceiling("scaled_mm", f"torch._scaled_mm fp8 M{m} N{2 * i} K{d} + M{m} N{d} K{i}", lambda: (
        torch._scaled_mm(a8, b8, one, one, out_dtype=bf), torch._scaled_mm(h8, d8, one, one, out_dtype=bf)),
        0, flops, "float8_e4m3fn")
    shape = f"T{t} D{d} I{i} E{e} k{k}"
    prefill = ("default", "fp8_matmul=widen", "fp8_matmul=w8a8")  # path=tiled is the default at this size
    pf.kernel("moe.experts", f"moe.experts bf16 {shape}", lambda f: f(xe, we, ids, *wbf, ep),
              (wgu.numel() + wdn.numel()) * 2 + xe.numel() * 4, flops, "bfloat16", only=prefill)
    w8 = (quantize_fp8_block(wgu), quantize_fp8_block(wdn))
    del wbf, xs, hs, a8, h8
    pf.kernel("moe.experts", f"moe.experts fp8_block (bf16 activations) {shape}", lambda f: f(xe, we, ids, *w8, ep),
              (wgu.numel() + wdn.numel()) + xe.numel() * 4, flops, "float8_e4m3fn", only=prefill)
    del w8, wgu, wdn
    # decode-sized: few tokens over many experts, bound by reading the touched experts' weights; a backend's own
    # decode tiles (its default here, where it has them) beside its tiled kernels (a path=tiled variant) on the same inputs
    t, e = s["decode_experts"]
    xe = torch.randn(t, d, device=dev, dtype=bf)
    wgu = torch.randn(e, 2 * i, d, device=dev, dtype=bf) * 0.02
    wdn = torch.randn(e, d, i, device=dev, dtype=bf) * 0.02
    ids = torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(t)])
    we = torch.rand(t, k, device=dev)
    touched = int(torch.unique(ids).numel())
    wbytes = touched * (2 * i * d + d * i)
    flops = 2 * t * k * (2 * i * d + d * i)
    pf.case()
    pf.ceiling("copy", f"{touched} experts' bf16 weights", _copier(torch, dev, 2 * wbytes * 2), 2 * wbytes * 2)
    pf.kernel("moe.experts", f"moe.experts decode bf16 T{t} D{d} I{i} E{e} k{k} ({touched} experts read)",
              lambda f: f(xe, we, ids, wgu, wdn, ep), wbytes * 2 + xe.numel() * 4, flops, "bfloat16")
    w8 = (quantize_fp8_block(wgu.float()), quantize_fp8_block(wdn.float()))
    del wgu, wdn
    pf.kernel("moe.experts", f"moe.experts decode fp8_block T{t} D{d} I{i} E{e} k{k} ({touched} experts read)",
              lambda f: f(xe, we, ids, *w8, ep), wbytes * (1 + 4 / 128**2) + xe.numel() * 4, flops, "float8_e4m3fn")


def head_perf(torch, ctx, pf: Perf, s, P) -> None:
    """The LM head and its fused argmax over the whole vocabulary at decode rows."""
    dev, bf = ctx.dev, torch.bfloat16
    b, v, kd = s["head"]
    head = torch.randn(v, kd, device=dev, dtype=bf) * 0.02
    x = torch.randn(b, kd, device=dev, dtype=bf)
    out = torch.empty(b, v, device=dev)
    pf.case()
    pf.ceiling("copy", f"{v}x{kd} bf16 head", _copier(torch, dev, v * kd * 2 * 2), v * kd * 2 * 2)
    pf.ceiling("mm", f"torch.mm bf16 M{b} N{v} K{kd}", lambda: torch.mm(x, head.t()), v * kd * 2, 2 * b * v * kd)
    pf.kernel("lm_head", f"lm_head bf16 B{b} V{v} K{kd} (fp32 logits)", lambda f: f(x, head, out),
              v * kd * 2 + b * v * 4, 2 * b * v * kd, "bfloat16")
    pf.kernel("lm_head.argmax", f"lm_head.argmax bf16 B{b} V{v} K{kd} (no logits)", lambda f: f(x, head),
              v * kd * 2, 2 * b * v * kd, "bfloat16")
