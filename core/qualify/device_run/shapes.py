"""``v4_shapes``: the backend's ops at DeepSeek-V4 production-like shapes (64 heads on a 512-dim latent, hidden
4096, FP8 128 x 128 blocks and FP4 e2m1 groups with ue8m0 scales, sinks and the sliding window), each through
the backend's op table and every variant it offers (:func:`~.common.variants`), against the reference's op on
the same device, run twice (bitwise equal). ``reduced`` scale: the same cases on small dimensions."""

from __future__ import annotations

from typing import Any, Callable, Iterator

from inferhal.core.qualify.device_run.common import Context, error_text, log, variants

#: dimensions per scale: hidden, heads, latent, rope, experts (T, D, I, E, k), mHC streams, vocabulary slice
DIMS = {
    "full": dict(hidden=4096, heads=64, latent=512, rope=64, t=64, d=512, i=256, e=16, k=6, mhc=(16, 4, 1024),
                 vocab=32768, q_lora=1024, inter=2048, head_rows=16, ctx=(100, 250, 31), bs=16, window=128),
    "reduced": dict(hidden=256, heads=8, latent=64, rope=16, t=8, d=128, i=128, e=4, k=2, mhc=(4, 4, 128),
                    vocab=1024, q_lora=128, inter=128, head_rows=4, ctx=(20, 45, 7), bs=8, window=16),
}

Case = tuple  # (name, op_id, call(fn) -> output, rtol, atol)


def _ue8m0(q):
    import torch

    from inferhal.core.ops.quant import QuantWeight

    return QuantWeight(q.data, torch.exp2(torch.round(torch.log2(q.scale))).to(torch.float8_e8m0fnu), q.format, q.shape, q.block)


def cases(torch, dev: str, scale: str, ref_ops) -> Iterator[Case]:
    from inferhal.core.ops import params as P
    from inferhal.core.ops.quantize import dequantize, quantize_fp4_group, quantize_fp8_block

    s = DIMS[scale]
    g = torch.Generator(device="cpu").manual_seed(0)
    rnd = lambda *sh: torch.randn(*sh, generator=g).to(dev)  # noqa: E731
    bf = torch.bfloat16
    hid, heads, lat = s["hidden"], s["heads"], s["latent"]
    x, r, w = rnd(64, hid).to(bf), rnd(64, hid).to(bf), rnd(hid).to(bf)
    yield f"norm.rms [64x{hid} +residual]", "norm.rms", lambda f: f(x, w, P.RmsNormParams(), r)[0], 2**-7, 1e-2
    xr, pos = rnd(32, heads, lat).to(bf), torch.arange(32, device=dev)
    cs = torch.cat([rnd(64, s["rope"] // 2).cos(), rnd(64, s["rope"] // 2).sin()], -1)
    rp = P.RopeParams(rotary_dim=s["rope"], style="interleaved", placement="tail")
    yield (f"rope.apply [32x{heads}x{lat} tail {s['rope']}]", "rope.apply", lambda f: f(xr, pos, cs, rp), 2**-7, 1e-2)
    lg = rnd(64, 256) * 2
    pr = P.RouteParams(top_k=6, scoring="sqrtsoftplus", routed_scaling=1.5)
    yield "moe.route [64x256 top6 sqrtsoftplus]", "moe.route", lambda f: f(lg, pr)[0].sort(-1).values, 1e-5, 1e-5
    t, d, i, e, k = s["t"], s["d"], s["i"], s["e"], s["k"]
    xe = rnd(t, d).to(bf)
    wgu, wdn = rnd(e, 2 * i, d) / 16, rnd(e, d, i) / 16
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(dev)
    we = torch.rand(t, k, generator=g).to(dev)
    ep = P.ExpertsParams(swiglu_limit=10.0)
    shape = f"T{t} D{d} I{i} E{e} k{k}"
    q4 = [_ue8m0(quantize_fp4_group(wgu)), _ue8m0(quantize_fp4_group(wdn))]
    for label, a, b in (("bf16", wgu.to(bf), wdn.to(bf)), ("fp8_block", quantize_fp8_block(wgu), quantize_fp8_block(wdn)),
                        ("fp4 e2m1 ue8m0", *q4)):
        yield (f"moe.experts [{label} {shape}]", "moe.experts", (lambda f, a=a, b=b: f(xe, we, ids, a, b, ep)),
               3 * 2**-7, 0.1)
    nt, ns, nd = s["mhc"]
    st = rnd(nt, ns, nd).to(bf)
    fn, base, sc = rnd((2 + ns) * ns, ns * nd) * 0.05, rnd((2 + ns) * ns) * 0.5, torch.ones(3, device=dev)
    mp = P.MhcParams(hc_mult=ns)
    yield f"mhc.pre [{nt}x{ns}x{nd} sinkhorn 20]", "mhc.pre", lambda f: f(st, fn, base, sc, mp)[2], 1e-4, 1e-4
    post, comb = ref_ops["mhc.pre"](st, fn, base, sc, mp)[1:]
    yv = rnd(nt, nd).to(bf)
    yield f"mhc.post [{nt}x{ns}x{nd}]", "mhc.post", lambda f: f(yv, st, post, comb), 2**-7, 2e-2
    yield from _attention_cases(torch, dev, g, s, P)
    yield from _dense_cases(torch, dev, g, s, P, quantize_fp8_block, quantize_fp4_group, dequantize)


def _attention_cases(torch, dev, g, s, P) -> Iterator[Case]:
    rnd = lambda *sh: torch.randn(*sh, generator=g).to(dev)  # noqa: E731
    bf = torch.bfloat16
    heads, lat = s["heads"], s["latent"]
    vals, sm = rnd(32, 1, lat) * 3, torch.randperm(64, generator=g)[:32].to(dev)

    def kvw(f):
        c = torch.zeros(8, 8, 1, lat, dtype=torch.float8_e4m3fn, device=dev)
        sc = torch.zeros(8, 8, device=dev)
        f(vals, c, sm, P.KVWriteParams(quant="fp8"), sc)
        return c.float() * sc[..., None, None]

    yield f"kv.write [fp8 e4m3 {lat}-dim latent]", "kv.write", kvw, 2**-3, 1e-2
    bs, ctx = s["bs"], list(s["ctx"])
    per = -(-max(ctx) // bs)
    nb = per * (len(ctx) + 1)
    table = torch.arange(nb, dtype=torch.int32).view(len(ctx) + 1, -1)[: len(ctx)].contiguous().to(dev)
    batch = P.AttnBatch(torch.arange(len(ctx) + 1, dtype=torch.int32, device=dev),
                        torch.tensor(ctx, dtype=torch.int32, device=dev), torch.tensor([c - 1 for c in ctx], device=dev),
                        table, torch.zeros(len(ctx), dtype=torch.long, device=dev))
    cache, qa, sinks = rnd(nb, bs, 1, lat).to(bf), rnd(len(ctx), heads, lat).to(bf), rnd(heads)
    ap = P.AttnParams(scale=lat**-0.5, num_kv_heads=1, window=s["window"], shared_kv=True)
    yield (f"attn.paged [latent decode H{heads} D{lat} window{s['window']} sinks]", "attn.paged",
           lambda f: f(qa, cache, batch, ap, sinks), 2 * 2**-7, 2 * 2**-7 * float(cache.float().abs().max()))


def _dense_cases(torch, dev, g, s, P, quantize_fp8_block, quantize_fp4_group, dequantize) -> Iterator[Case]:
    """The dense GEMMs and the remaining row ops at V4-Flash sizes (hidden 4096, q_lora 1024, a slice of the
    129,280-token vocabulary, 4 hyper-connection streams, 3 MTP drafts)."""
    rnd = lambda *sh: torch.randn(*sh, generator=g).to(dev)  # noqa: E731
    bf = torch.bfloat16
    hid, ql, v = s["hidden"], s["q_lora"], s["vocab"]
    x = rnd(64, hid).to(bf)
    w = rnd(ql, hid) / 64
    for label, wt in (("bf16", w.to(bf)), ("fp8_block", quantize_fp8_block(w)), ("fp4 e2m1 ue8m0", _ue8m0(quantize_fp4_group(w)))):
        yield f"linear [{label} T64 {hid}->{ql}]", "linear", (lambda f, wt=wt: f(x, wt)), 2 * 2**-7, 0.05
    head = rnd(v, hid).to(bf) / 64
    xh = rnd(s["head_rows"], hid).to(bf)
    yield f"lm_head [B{s['head_rows']} V{v} K{hid} bf16]", "lm_head", lambda f: f(xh, head), 2**-7, 0.02
    yield f"lm_head.argmax [B{s['head_rows']} V{v} K{hid} bf16]", "lm_head.argmax", lambda f: f(xh, head), 0.0, 0.0
    ids = torch.randint(0, v, (64,), generator=g).to(dev)
    yield f"embed [T64 from {v}x{hid} bf16]", "embed", lambda f: f(ids, head, 2.0), 0.0, 0.0
    gt, up = (rnd(64, s["inter"]) * 3).to(bf), rnd(64, s["inter"]).to(bf)
    for kind in ("silu", "gelu_tanh"):
        ak = P.ActParams(kind)
        yield f"act.gated [{kind} T64 I{s['inter']}]", "act.gated", (lambda f, ak=ak: f(gt, up, ak)), 2 * 2**-7, 0.02
    st = rnd(16, 4, hid).to(bf)
    fn, base, sc = rnd(4, 4 * hid) / 128, rnd(4) * 0.5, torch.ones(1, device=dev)
    yield f"mhc.head [16x4x{hid}]", "mhc.head", lambda f: f(st, fn, base, sc, P.MhcParams(hc_mult=4)), 2**-7, 2e-2
    b, n = 16, 3
    lg = rnd(b, n + 1, v) * 3
    drafts = lg[:, :n].argmax(-1)
    drafts[::3, 1] = 0  # some rows reject their second draft
    sp = P.SampleBatch((0.0,) * b, (0,) * b, (1.0,) * b)
    yield (f"spec.verify [greedy B{b} S{n} V{v}]", "spec.verify",
           lambda f: torch.cat([t.view(b, -1) for t in f(drafts, None, lg, sp)], 1), 0.0, 0.0)


def v4_rows(ctx: Context, emit) -> None:
    import torch

    from inferhal.core.qualify.numerics import bitwise_equal

    active, ref = ctx.active, ctx.ref_dev
    for name, op_id, call, rtol, atol in cases(torch, ctx.dev, ctx.scale, ref.ops):
        native = active.ops.entry(op_id).native
        for vname, fn in variants(active, op_id).items():
            row = ctx.row("v4_shapes", op=op_id, shape=name, variant=vname, reference=ctx.dev, rtol=rtol, atol=atol,
                          native=native)
            if ctx.late(row, emit):
                continue
            row.update(_check(torch, call, fn, ref.ops[op_id], rtol, atol, bitwise_equal, active.device))
            log(f"{row['status']:>7} {name} [{vname}]")
            emit(row)


def _check(torch, call: Callable, fn: Any, ref_fn: Any, rtol: float, atol: float, bitwise_equal, device) -> dict:
    try:
        out, want = call(fn), call(ref_fn)
        again = call(fn)
        device.synchronize()
        err = (out.float() - want.float()).abs()
        ok = bool(torch.allclose(out.float(), want.float(), rtol=rtol, atol=atol))
        same = bitwise_equal(again, out)[0]
        return {"max_abs_err": float(err.max()) if err.numel() else 0.0, "passed": ok, "bitwise_rerun": same,
                "status": "pass" if ok and same else "fail"}
    except Exception as exc:  # a failing kernel is a result
        return {"status": "fail", "message": error_text(exc)}
