"""Device check for a lent NVIDIA GPU: conformance of every wired kernel run natively against the
reference on the same GPU, then kernel benchmarks with achieved GB/s and TFLOP/s against the device's
peaks (``backends/cuda_sm100/device.py`` tables). Writes one JSON; every row says ``execution_level:
device`` only because it ran there. Designed for < 8 minutes on one GPU (small conformance shapes,
a handful of benchmark shapes, ``do_bench`` with short warmup/rep).

Launch (repository root, on the GPU machine): ``bash .ci/device_check`` (it unsets TRITON_INTERPRET and
puts the repository on the path as ``inferhal``). Needs only what that machine's image has: a CUDA build
of torch, triton and cuda-python (no network there: nothing is downloaded; the lent H200 image was seen
with torch 2.11 and triton 3.6, older than the 3.9 the kernels were written and compiled against here,
so a first run may need API fixes). Without a GPU it exits 2 with the reason.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _cases(torch, dev):
    """(op, kernel call, reference call, rtol, atol) on small shapes; tolerances as in tests/kernels."""
    from inferhal.backends.reference import attention as ra, mhc as rm, moe as rmoe, ops as ro
    from inferhal.backends.reference.quant import quantize_fp4_group, quantize_fp8_block
    from inferhal.core.ops import params as P
    from inferhal.core.ops.quant import QuantWeight
    from inferhal.kernels import attn_paged, kv_write, mhc, moe_experts, moe_route, norm, rope

    g = torch.Generator(device="cpu").manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dev)  # noqa: E731
    bf = torch.bfloat16
    x = rnd(64, 1024).to(bf)
    r = rnd(64, 1024).to(bf)
    w = rnd(1024).to(bf)
    yield "norm.rms", lambda: norm.rms_norm(x, w, P.RmsNormParams(), r)[0], lambda: ro.norm_rms(x, w, P.RmsNormParams(), r)[0], 2**-7, 1e-2
    xr = rnd(32, 8, 128).to(bf)
    pos = torch.arange(32, device=dev)
    cs = torch.cat([rnd(64, 32).cos(), rnd(64, 32).sin()], -1)
    rp = P.RopeParams(rotary_dim=64, style="interleaved", placement="tail")
    yield "rope.apply", lambda: rope.rope_apply(xr, pos, cs, rp), lambda: ro.rope_apply(xr, pos, cs, rp), 2**-7, 1e-2
    lg = rnd(64, 256) * 2
    pr = P.RouteParams(top_k=6, scoring="sqrtsoftplus", routed_scaling=1.5)
    yield "moe.route", lambda: moe_route.moe_route(lg, pr)[0].sort(-1).values, lambda: rmoe.moe_route(lg, pr)[0].sort(-1).values, 1e-5, 1e-5
    t, d, i, e, k = 64, 256, 256, 8, 2
    xe = rnd(t, d).to(bf)
    wgu, wdn = rnd(e, 2 * i, d) / 16, rnd(e, d, i) / 16
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(dev)
    we = torch.rand(t, k, generator=g).to(dev)
    ep = P.ExpertsParams(swiglu_limit=10.0)
    for label, a, b in (("bf16", wgu.to(bf), wdn.to(bf)), ("fp8_block", quantize_fp8_block(wgu), quantize_fp8_block(wdn))):
        yield f"moe.experts[{label}]", (lambda a=a, b=b: moe_experts.moe_experts(xe, we, ids, a, b, ep)), \
            (lambda a=a, b=b: rmoe.moe_experts(xe, we, ids, a, b, ep)), 3 * 2**-7, 0.1
    q4 = [quantize_fp4_group(wgu), quantize_fp4_group(wdn)]
    q4 = [QuantWeight(q.data, torch.exp2(torch.round(torch.log2(q.scale))).to(torch.float8_e8m0fnu), q.format, q.shape, q.block) for q in q4]
    yield "moe.experts[fp4 dot_scaled]", lambda: moe_experts.moe_experts(xe, we, ids, *q4, ep), \
        lambda: rmoe.moe_experts(xe, we, ids, *q4, ep), 3 * 2**-7, 0.1
    st = rnd(16, 4, 256).to(bf)
    fn, base, sc = rnd(24, 1024) * 0.05, rnd(24) * 0.5, torch.ones(3, device=dev)
    mp = P.MhcParams(hc_mult=4)
    yield "mhc.pre", lambda: mhc.mhc_pre(st, fn, base, sc, mp)[2], lambda: rm.mhc_pre(st, fn, base, sc, mp)[2], 1e-5, 1e-5
    post, comb = rm.mhc_pre(st, fn, base, sc, mp)[1:]
    yv = rnd(16, 256).to(bf)
    yield "mhc.post", lambda: mhc.mhc_post(yv, st, post, comb), lambda: rm.mhc_post(yv, st, post, comb), 2**-7, 2e-2
    vals = rnd(32, 1, 512) * 3
    sm = torch.randperm(64, generator=g)[:32].to(dev)

    def kvw(fnc):
        c = torch.zeros(8, 8, 1, 512, dtype=torch.float8_e4m3fn, device=dev)
        s = torch.zeros(8, 8, device=dev)
        fnc(vals, c, sm, P.KVWriteParams(quant="fp8"), s)
        return c.float() * s[..., None, None]

    yield "kv.write[fp8]", lambda: kvw(kv_write.kv_write), lambda: kvw(ro.kv_write), 2**-3, 1e-2
    bs, ctx = 16, [100, 250, 31]  # <= 16 blocks of 16 each
    nb = 64
    table = torch.arange(nb, dtype=torch.int32).view(len(ctx) + 1, -1)[: len(ctx)].contiguous().to(dev)
    batch = P.AttnBatch(torch.arange(len(ctx) + 1, dtype=torch.int32, device=dev), torch.tensor(ctx, dtype=torch.int32, device=dev),
                        torch.tensor([c - 1 for c in ctx], device=dev), table, torch.zeros(len(ctx), dtype=torch.long, device=dev))
    cache = rnd(nb, bs, 1, 512).to(bf)
    qa = rnd(len(ctx), 64, 512).to(bf)
    sinks = rnd(64)
    ap = P.AttnParams(scale=512**-0.5, num_kv_heads=1, window=128, shared_kv=True)
    yield "attn.paged[latent decode]", lambda: attn_paged.attn_paged(qa, cache, batch, ap, sinks), \
        lambda: ra.attn_paged(qa, cache, batch, ap, sinks), 2 * 2**-7, 2 * 2**-7 * float(cache.float().abs().max())


def conformance(torch, dev):
    from inferhal.kernels.runtime import interpreting

    level = "interpreter" if interpreting() else "device"  # a CPU smoke run of this script says so
    rows = []
    for op, kern, ref, rtol, atol in _cases(torch, dev):
        row = {"op": op, "execution_level": level, "rtol": rtol, "atol": atol}
        try:
            out, want = kern(), ref()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            err = float((out.float() - want.float()).abs().max())
            ok = bool(torch.allclose(out.float(), want.float(), rtol=rtol, atol=atol))
            row.update(passed=ok, max_abs_err=err)
        except Exception as exc:  # a failing kernel is a result
            row.update(passed=False, error=f"{type(exc).__name__}: {exc}"[:500])
        rows.append(row)
    return rows


def benchmarks(torch, dev, profile):
    import triton.testing as tt

    from inferhal.core.ops import params as P
    from inferhal.kernels import attn_paged, moe_experts, norm

    bf = torch.bfloat16
    out = []

    def bench(name, fn, nbytes, flops, dtype):
        ms = tt.do_bench(fn, warmup=10, rep=50)
        gbs, tfs = nbytes / ms / 1e6, flops / ms / 1e9
        pb, pf = profile.peak_bandwidth, profile.peak_flops.get(dtype, 0.0)
        out.append({"kernel": name, "execution_level": "device", "ms": ms, "GB/s": gbs, "TFLOP/s": tfs,
                    "bandwidth_fraction": gbs * 1e9 / pb if pb else None,
                    "flops_fraction": tfs * 1e12 / pf if pf else None})

    x = torch.randn(8192, 4096, device=dev, dtype=bf)
    w = torch.randn(4096, device=dev, dtype=bf)
    bench("rms_norm 8192x4096 bf16", lambda: norm.rms_norm(x, w, P.RmsNormParams(), x, target=profile.extra["kernel_target"]),
          4 * x.numel() * 2, 4 * x.numel(), "bfloat16")
    t, d, i, e, k = 4096, 4096, 2048, 32, 6
    xe = torch.randn(t, d, device=dev, dtype=bf)
    wgu = torch.randn(e, 2 * i, d, device=dev, dtype=bf) * 0.02
    wdn = torch.randn(e, d, i, device=dev, dtype=bf) * 0.02
    ids = torch.randint(0, e, (t, k), device=dev)
    we = torch.rand(t, k, device=dev)
    ep = P.ExpertsParams(swiglu_limit=10.0)
    bench("moe.experts bf16 T4096 D4096 I2048 E32 K6",
          lambda: moe_experts.moe_experts(xe, we, ids, wgu, wdn, ep, target=profile.extra["kernel_target"]),
          (wgu.numel() + wdn.numel()) * 2 + xe.numel() * 2 * 2, 2 * t * k * (2 * i * d + d * i), "bfloat16")
    nseq, ctx, bs = 64, 4096, 64
    nb = nseq * ctx // bs
    cache = torch.randn(nb, bs, 1, 512, device=dev, dtype=bf)
    table = torch.arange(nb, dtype=torch.int32, device=dev).view(nseq, -1)
    batch = P.AttnBatch(torch.arange(nseq + 1, dtype=torch.int32, device=dev), torch.full((nseq,), ctx, dtype=torch.int32, device=dev),
                        torch.full((nseq,), ctx - 1, device=dev), table, torch.zeros(nseq, dtype=torch.long, device=dev))
    q = torch.randn(nseq, 64, 512, device=dev, dtype=bf)
    ap = P.AttnParams(scale=512**-0.5, num_kv_heads=1, shared_kv=True)
    bench("attn.paged latent decode B64 ctx4096 H64 D512",
          lambda: attn_paged.attn_paged(q, cache, batch, ap, None, target=profile.extra["kernel_target"]),
          cache.numel() * 2, 4 * nseq * 64 * ctx * 512, "bfloat16")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="device_check.json")
    ap.add_argument("--skip-bench", action="store_true")
    args = ap.parse_args(argv)
    from inferhal.kernels.runtime import use_interpreter

    use_interpreter(False)
    from inferhal.backends.cuda_sm100.device import device_profile, probe

    pr = probe(interpret=False)
    report = {"probe": {"available": pr.available, "reason": pr.reason, **dict(pr.details)}}
    if not pr.available:
        print(json.dumps(report, indent=1))
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        return 2
    import torch

    t0 = time.time()
    profile = device_profile(0)
    dev = profile.torch_device
    report["device"] = {"name": profile.device_name, "peaks_source": profile.sources.get("peaks"),
                        "peak_bandwidth": profile.peak_bandwidth, "peak_flops": dict(profile.peak_flops),
                        **{k: v for k, v in profile.extra.items() if k != "degraded"}}
    report["conformance"] = conformance(torch, dev)
    report["benchmarks"] = [] if args.skip_bench else benchmarks(torch, dev, profile)
    report["seconds"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))
    return 0 if all(r["passed"] for r in report["conformance"]) else 1


if __name__ == "__main__":
    sys.exit(main())
