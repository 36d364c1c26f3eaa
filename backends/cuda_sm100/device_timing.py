"""Timing on the lent GPU, for :mod:`.device_check`: one decode step of the tiny V4 eager and replayed
from a CUDA graph (or the host sync that stops capture), and the kernels at V4 sizes against measured
ceilings (a large device copy, torch's bf16 and fp8 products) and the device table's peaks. Every row says
``not-run`` off a device: an interpreter run is never timed."""

from __future__ import annotations

import statistics
import time

from inferhal.backends.cuda_sm100.device_check import TINY_PROMPTS, level_label, log, select, sync


# ------------------------------------------------------------------------------------------------ graphs

def graph_rows(interpret: bool) -> list[dict]:
    """One decode step of the tiny V4 (4 sequences), eager and as a CUDA graph replay."""
    import torch

    from inferhal.core.engine.llm import LLM
    from inferhal.core.sampling.params import SamplingParams

    active, _, _ = select(interpret)
    row = {"section": "graphs", "model": "deepseek_v4_tiny", "rows": len(TINY_PROMPTS), "execution_level": level_label(active.profile)}
    if active.profile.exec_level.value != "device":
        row.update(status="not-run", message="CUDA graphs need a device")
        return [row]
    try:
        llm = LLM("deepseek_v4_tiny", backend="cuda_sm100")
        model = llm.engine.runner.model
        seen = {}
        orig = model.forward

        def spy(batch, kv):
            if batch.input_ids.numel() == len(TINY_PROMPTS):  # a decode step of every sequence
                seen.setdefault("step", (batch, kv))
            return orig(batch, kv)

        model.forward = spy
        llm.generate(TINY_PROMPTS, SamplingParams(max_tokens=4, temperature=0.0, logprobs=1, ignore_eos=True))
        model.forward = orig
        batch, kv = seen["step"]
        eager_out = orig(batch, kv).clone()

        def med(fn, n=50):
            for _ in range(5):
                fn()
            ts = []
            for _ in range(n):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts)

        row["eager_ms"] = med(lambda: orig(batch, kv)) * 1e3
        row["first_host_sync"] = sync_culprit(lambda: orig(batch, kv))  # what a graph capture cannot contain
        try:
            runner = active.graph_runner()
            replay = runner.capture(lambda: orig(batch, kv))
            out = replay()
            sync(torch)
            row["graph_ms"] = med(replay) * 1e3
            row["speedup"] = row["eager_ms"] / row["graph_ms"]
            row["graph_equals_eager"] = bool(torch.equal(out, eager_out))
            row["status"] = "pass" if row["graph_equals_eager"] else "fail"
        except Exception as exc:
            row.update(status="capture-failed", message=f"{type(exc).__name__}: {exc}"[:300])
    except Exception as exc:
        row.update(status="fail", message=f"{type(exc).__name__}: {exc}"[:800])
    log(f"{row['status']:>7} graphs: eager {row.get('eager_ms')} ms, graph {row.get('graph_ms')} ms {row.get('message', '')[:200]}")
    return [row, engine_graph_row(active)]


def engine_graph_row(active) -> dict:
    """The engine's own decode graphs (core/engine/graphs.py, ``backend.graphs``) against ``backend.graphs=false``:
    same greedy tokens and logprobs, how many steps replayed, each bucket captured, or why capture failed."""
    from inferhal.core.engine.llm import LLM
    from inferhal.core.sampling.params import SamplingParams

    row = {"section": "graphs", "name": "engine decode graphs", "model": "deepseek_v4_tiny",
           "execution_level": level_label(active.profile)}
    try:
        sp = SamplingParams(max_tokens=12, temperature=0.0, logprobs=1, ignore_eos=True)
        outs = {}
        for on in (False, True):
            llm = LLM("deepseek_v4_tiny", backend="cuda_sm100", overrides=[f"backend.graphs={str(on).lower()}"])
            t0 = time.perf_counter()
            got = llm.generate(TINY_PROMPTS, sp)
            sync(__import__("torch"))
            outs[on] = ([o.token_ids for o in got], [o.logprobs for o in got], time.perf_counter() - t0)
            if on:
                g = llm.engine.runner.graphs
                row.update(replayed_steps=g.num_replays if g else 0, captures=g.num_captures if g else 0,
                           disabled=g.disabled if g else "no graph runner")
        row.update(tokens_equal=outs[True][0] == outs[False][0], seconds={"eager": outs[False][2], "graphs": outs[True][2]})
        row["status"] = ("pass" if row["tokens_equal"] and row["replayed_steps"] else
                         "eager" if row["tokens_equal"] else "fail")
    except Exception as exc:
        row.update(status="fail", message=f"{type(exc).__name__}: {exc}"[:800])
    log(f"{row['status']:>7} engine graphs: {row.get('replayed_steps')} steps replayed, {row.get('disabled') or ''}"[:300])
    return row


# -------------------------------------------------------------------------------------------------- perf

def perf_rows(interpret: bool) -> list[dict]:
    import torch

    active, _, _ = select(interpret)
    prof = active.profile
    if prof.exec_level.value != "device":
        return [{"section": "perf", "status": "not-run", "message": "timing needs a device", "execution_level": level_label(prof)}]
    import triton.testing as tt

    from inferhal.core.ops.quantize import quantize_fp8_block
    from inferhal.core.ops import params as P
    from inferhal.kernels import attn_paged, moe_experts, norm

    label, dev, tgt = level_label(prof), prof.torch_device, prof.extra["kernel_target"]
    bf = torch.bfloat16
    rows: list[dict] = []
    ceil: dict[str, float] = {}

    def bench(name, fn, nbytes, flops, dtype, kind="kernel"):
        row = {"section": "perf", "name": name, "kind": kind, "execution_level": label, "dtype": dtype}
        try:
            ms = float(tt.do_bench(fn, warmup=25, rep=100, return_mode="median"))
            gbs, tfs = nbytes / ms / 1e6, flops / ms / 1e9
            pb, pf = prof.peak_bandwidth, prof.peak_flops.get(dtype, 0.0)
            row.update(status="measured", ms=ms, bytes=nbytes, flops=flops, GBps=gbs, TFLOPps=tfs,
                       bandwidth_fraction=gbs * 1e9 / pb if pb and nbytes else None,
                       flops_fraction=tfs * 1e12 / pf if pf and flops else None,
                       of_measured_copy=gbs / ceil["copy_GBps"] if nbytes and ceil.get("copy_GBps") else None,
                       of_measured_mm=tfs / ceil[f"mm_{dtype}"] if flops and ceil.get(f"mm_{dtype}") else None)
        except Exception as exc:
            row.update(status="fail", message=f"{type(exc).__name__}: {exc}"[:600])
        log(f"{row['status']:>8} {name}: {row.get('ms', 0):.4f} ms, {row.get('GBps', 0):.0f} GB/s, {row.get('TFLOPps', 0):.1f} TFLOP/s")
        rows.append(row)
        return row

    # measured ceilings: a large copy (bytes read + written) and torch's own products
    a = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    r = bench("ceiling: device copy 2 GiB (torch)", lambda: b.copy_(a), 2 * a.numel(), 0, "uint8", "ceiling")
    ceil["copy_GBps"] = r.get("GBps", 0.0)
    del a, b
    m = torch.randn(8192, 8192, device=dev, dtype=bf)
    n = torch.randn(8192, 8192, device=dev, dtype=bf)
    r = bench("ceiling: torch.mm bf16 8192^3", lambda: torch.mm(m, n), 0, 2 * 8192**3, "bfloat16", "ceiling")
    ceil["mm_bfloat16"] = r.get("TFLOPps", 0.0)
    if hasattr(torch, "_scaled_mm"):
        m8, n8 = m.to(torch.float8_e4m3fn), n.to(torch.float8_e4m3fn).t().contiguous().t()
        one = torch.ones((), device=dev)
        r = bench("ceiling: torch._scaled_mm fp8 e4m3 8192^3", lambda: torch._scaled_mm(m8, n8, one, one, out_dtype=bf),
                  0, 2 * 8192**3, "float8_e4m3fn", "ceiling")
        ceil["mm_float8_e4m3fn"] = r.get("TFLOPps", 0.0)
        del m8, n8
    del m, n

    x = torch.randn(8192, 4096, device=dev, dtype=bf)
    w = torch.randn(4096, device=dev, dtype=bf)
    bench("norm.rms 8192x4096 bf16 +residual", lambda: norm.rms_norm(x, w, P.RmsNormParams(), x, target=tgt),
          4 * x.numel() * 2, 4 * x.numel(), "bfloat16")
    del x
    # decode paged attention: V4's 64 heads on one 512-dim latent, B sequences x ctx tokens of bf16 KV
    for nseq, ctx in ((64, 4096), (128, 8192)):
        bs = 64
        nb = nseq * ctx // bs
        cache = torch.randn(nb, bs, 1, 512, device=dev, dtype=bf)
        table = torch.randperm(nb, device=dev).to(torch.int32).view(nseq, -1)
        batch = P.AttnBatch(torch.arange(nseq + 1, dtype=torch.int32, device=dev),
                            torch.full((nseq,), ctx, dtype=torch.int32, device=dev),
                            torch.full((nseq,), ctx - 1, device=dev), table, torch.zeros(nseq, dtype=torch.long, device=dev))
        q = torch.randn(nseq, 64, 512, device=dev, dtype=bf)
        ap = P.AttnParams(scale=512**-0.5, num_kv_heads=1, shared_kv=True)
        bench(f"attn.paged latent decode B{nseq} ctx{ctx} H64 D512 bf16 KV",
              lambda: attn_paged.attn_paged(q, cache, batch, ap, None, target=tgt),
              cache.numel() * 2 + 2 * q.numel() * 2, 4 * nseq * 64 * ctx * 512, "bfloat16")
        del cache
    # MoE grouped GEMM with SwiGLU, V4-Flash-like expert sizes (hidden 4096, expert intermediate 2048)
    t, d, i, e, k = 4096, 4096, 2048, 32, 6
    xe = torch.randn(t, d, device=dev, dtype=bf)
    wgu = torch.randn(e, 2 * i, d, device=dev) * 0.02
    wdn = torch.randn(e, d, i, device=dev) * 0.02
    ids = torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(t)])
    we = torch.rand(t, k, device=dev)
    ep = P.ExpertsParams(swiglu_limit=10.0)
    flops = 2 * t * k * (2 * i * d + d * i)
    wbf = (wgu.to(bf), wdn.to(bf))
    bench(f"moe.experts bf16 T{t} D{d} I{i} E{e} k{k}", lambda: moe_experts.moe_experts(xe, we, ids, *wbf, ep, target=tgt),
          (wgu.numel() + wdn.numel()) * 2 + xe.numel() * 4, flops, "bfloat16")
    del wbf
    w8 = (quantize_fp8_block(wgu), quantize_fp8_block(wdn))
    bench(f"moe.experts fp8_block (bf16 activations) T{t} D{d} I{i} E{e} k{k}",
          lambda: moe_experts.moe_experts(xe, we, ids, *w8, ep, target=tgt),
          (wgu.numel() + wdn.numel()) + xe.numel() * 4, flops, "float8_e4m3fn")
    del w8, xe, wgu, wdn
    try:
        decode_perf(torch, dev, tgt, bench, d, i, k, ep)
        sparse_decode_perf(torch, dev, tgt, bench)
        gemm_perf(torch, dev, tgt, bench)
    except Exception as exc:  # a set-up error here must not lose the rows above
        rows.append({"section": "perf", "status": "fail", "name": "decode-sized benches",
                     "message": f"{type(exc).__name__}: {exc}"[:600], "execution_level": label})
    rows.append({"section": "perf", "kind": "ceilings", "measured": ceil, "execution_level": label,
                 "peaks": {"bandwidth": prof.peak_bandwidth, "flops": dict(prof.peak_flops), "source": prof.sources.get("peaks")}})
    return rows


def decode_perf(torch, dev, tgt, bench, d, i, k, ep) -> None:
    from inferhal.core.ops.quantize import quantize_fp8_block
    from inferhal.kernels import moe_experts

    bf = torch.bfloat16
    # decode-sized MoE: 64 tokens x top-6 over 64 V4-Flash-sized experts, bound by reading the weights
    t, e = 64, 64
    xe = torch.randn(t, d, device=dev, dtype=bf)
    wgu = torch.randn(e, 2 * i, d, device=dev, dtype=bf) * 0.02
    wdn = torch.randn(e, d, i, device=dev, dtype=bf) * 0.02
    ids = torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(t)])
    we = torch.rand(t, k, device=dev)
    touched = int(torch.unique(ids).numel())
    flops = 2 * t * k * (2 * i * d + d * i)
    bench(f"moe.experts decode bf16 T{t} D{d} I{i} E{e} k{k} ({touched} experts read)",
          lambda: moe_experts.moe_experts(xe, we, ids, wgu, wdn, ep, target=tgt),
          touched * (2 * i * d + d * i) * 2 + xe.numel() * 4, flops, "bfloat16")
    w8 = (quantize_fp8_block(wgu.float()), quantize_fp8_block(wdn.float()))
    del wgu, wdn
    bench(f"moe.experts decode fp8_block T{t} D{d} I{i} E{e} k{k} ({touched} experts read)",
          lambda: moe_experts.moe_experts(xe, we, ids, *w8, ep, target=tgt),
          touched * (2 * i * d + d * i) * (1 + 4 / 128**2) + xe.numel() * 4, flops, "float8_e4m3fn")
    del w8


def gemm_perf(torch, dev, tgt, bench) -> None:
    """Dense GEMMs (kernels/linear.py): a prefill-sized product and a decode-sized one (weight-bound) at
    V4-Flash's hidden 4096, bf16 / FP8 blocks (bf16 activations) / FP8 x FP8; the LM head and its fused argmax
    over the 129,280-token vocabulary at 32 rows."""
    from inferhal.core.ops.quantize import quantize_fp8_block
    from inferhal.kernels import linear, linear_lowp

    bf = torch.bfloat16
    n, kd = 4096, 4096
    w = torch.randn(n, kd, device=dev) * 0.02
    wb, w8 = w.to(bf), quantize_fp8_block(w)
    del w
    for m in (4096, 32):
        x = torch.randn(m, kd, device=dev, dtype=bf)
        flops = 2 * m * n * kd
        bench(f"linear bf16 M{m} N{n} K{kd}", lambda: linear.linear(x, wb, target=tgt), n * kd * 2 + m * (kd + n) * 2,
              flops, "bfloat16")
        bench(f"linear fp8_block (bf16 activations) M{m} N{n} K{kd}", lambda: linear.linear(x, w8, target=tgt),
              n * kd + m * (kd + n) * 2, flops, "float8_e4m3fn")
        bench(f"linear fp8 x fp8 (w8a8, act_quant included) M{m} N{n} K{kd}",
              lambda: linear_lowp.linear_w8a8(x, w8, target=tgt), n * kd + m * (kd + n) * 2, flops, "float8_e4m3fn")
    del wb, w8
    v, b = 129280, 32
    head = torch.randn(v, kd, device=dev, dtype=bf) * 0.02
    x = torch.randn(b, kd, device=dev, dtype=bf)
    out = torch.empty(b, v, device=dev)
    bench(f"lm_head bf16 B{b} V{v} K{kd} (fp32 logits)", lambda: linear.lm_head(x, head, out, target=tgt),
          v * kd * 2 + b * v * 4, 2 * b * v * kd, "bfloat16")
    bench(f"lm_head.argmax bf16 B{b} V{v} K{kd} (no logits)", lambda: linear.lm_head_argmax(x, head, target=tgt),
          v * kd * 2, 2 * b * v * kd, "bfloat16")
    del head, out


def sparse_decode_perf(torch, dev, tgt, bench, b=64, ctx=65536, pool=4096) -> None:
    """V4's CSA decode: 64 heads on the 512-dim latent, a 128-token window plus the top-512 of the
    compressed entries (4:1) at 64K context, sinks; bytes = the keys each token must read."""
    from inferhal.core.ops import params as P
    from inferhal.kernels import sparse_attn

    bf = torch.bfloat16
    bs, win, topk, ratio = 64, 128, 512, 4
    ncomp = ctx // ratio  # block tables point into pools smaller than B x context: only the read entries matter
    kv = torch.randn(pool, bs, 512, device=dev, dtype=bf)
    comp = torch.randn(pool, bs, 512, device=dev, dtype=bf)
    lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    batch = P.AttnBatch(torch.arange(b + 1, dtype=torch.int32, device=dev), lens, torch.full((b,), ctx - 1, device=dev),
                        torch.randint(0, pool, (b, ctx // bs), device=dev, dtype=torch.int32),
                        torch.zeros(b, dtype=torch.long, device=dev))
    cbatch = P.AttnBatch(batch.query_start_loc, torch.full((b,), ncomp, dtype=torch.int32, device=dev), batch.positions,
                         torch.randint(0, pool, (b, ncomp // bs), device=dev, dtype=torch.int32), batch.slot_mapping,
                         tokens_per_slot=ratio)
    idx = torch.stack([torch.randperm(ncomp, device=dev)[:topk] for _ in range(b)])
    q = torch.randn(b, 64, 512, device=dev, dtype=bf)
    sinks = torch.randn(64, device=dev)
    ap = P.AttnParams(scale=512**-0.5, num_kv_heads=1, window=win, shared_kv=True)
    keys = win + topk
    bench(f"attn.sparse_topk CSA decode B{b} ctx{ctx} window{win} top{topk} H64 D512 bf16",
          lambda: sparse_attn.attn_sparse_topk(q, kv, batch, comp, cbatch, idx, ap, sinks, target=tgt),
          b * keys * 512 * 2 + 2 * q.numel() * 2 + idx.numel() * 8, 4 * b * 64 * keys * 512, "bfloat16")


def sync_culprit(fn) -> str:
    """Run ``fn`` with CUDA sync debugging set to error: the first host synchronisation (what breaks graph
    capture) raises; → the inferhal frames of that traceback, innermost last."""
    import traceback

    import torch

    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return "no synchronising call"
    except Exception as exc:
        frames = [f"{'/'.join(f.filename.split('/')[-2:])}:{f.lineno} {f.name}: {(f.line or '').strip()[:120]}"
                  for f in traceback.extract_tb(exc.__traceback__) if "inferhal" in f.filename]
        return f"{type(exc).__name__}: {str(exc)[:200]} | " + " <- ".join(reversed(frames[-4:]))
    finally:
        torch.cuda.set_sync_debug_mode("default")
