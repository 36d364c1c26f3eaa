"""The cuda_sm100 device check for a lent NVIDIA GPU: one script, one JSON, every row with its level.

Sections (each written to the JSON as soon as it ends, so a run cut short keeps what it measured):

- ``env``: torch, triton, cuda-python and driver versions, the device, its SMs and memory.
- ``kernels``: every conformance case of every op the backend claims (``core/qualify/cases``, the shapes
  ``inferhal qualify`` runs) through :func:`~inferhal.core.qualify.runner.run_case`, against the
  reference backend **on the same GPU** (``backend.options.torch_device``): numerics with the case's
  tolerance and max error, determinism reruns (bitwise), batch invariance. Ops are spread over worker
  processes so Triton's first compiles overlap. A failing case is compared once more with the CPU
  reference, to tell a kernel error from a reference that misbehaves on the GPU.
- ``v4_shapes``: the kernels at DeepSeek-V4 production-like shapes (64 heads on a 512-dim latent, FP8
  block and FP4 experts, the sinks and the window), against the reference on the same GPU.
- ``e2e``: the tiny DeepSeek-V4 through the engine on ``backend=cuda_sm100`` against the reference on
  the same GPU (fp32 and bf16), greedy tokens and top logprobs; the kernel backend twice for bitwise
  determinism; the CPU golden tokens; Gemma 3 270M when its GGUF is on the machine.
- ``graphs`` and ``perf`` (:mod:`.device_timing`): a decode step eager and as a CUDA graph; measured
  ceilings and the kernels' GB/s and TFLOP/s at V4 sizes against the peaks.

Launch on the GPU machine: ``bash .ci/device_check`` (PYTHONUNBUFFERED, the repository put on the path,
``$OUT/device_check.json``). ``--interpret`` is the CPU dry run: the same code in Triton's interpreter on
reduced sections, every row saying ``interpreter``. Without a GPU and without ``--interpret`` the script
writes the probe's reason and exits 2. Exit 1 when any check failed, 0 when all passed.

An H200 is SM90: it checks numerics natively and measures the wgmma path, never tcgen05 or FP4 MMA
(those are Blackwell-only); the report's ``execution_level`` says so.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SECTIONS = ("env", "kernels", "v4_shapes", "e2e", "gemma", "graphs", "perf")
TINY_PROMPTS = [[1, 5, 9, 42, 7, 3], [11, 2, 77, 30], [1, 17, 130, 5, 99, 42, 7], [3, 3, 81, 190, 12, 60, 61, 62]]
GEMMA_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at"]


def log(msg: str) -> None:
    print(f"[device_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def level_label(profile) -> str:
    """``device: NVIDIA H200 (sm_90), not Blackwell`` or ``interpreter``: what every row of this run is."""
    if profile.exec_level.value != "device":
        return profile.exec_level.value
    arch = str(profile.extra.get("arch", "?")).rstrip("a")
    tail = "" if str(profile.extra.get("cc", "")).startswith("10.") else ", not Blackwell"
    return f"device: {profile.device_name} ({arch}){tail}"


# --------------------------------------------------------------------------------------------- backends

def select(interpret: bool):
    """(active cuda_sm100, reference on the same device, reference on the CPU)."""
    from inferhal.core.config.schema import BackendConfig
    from inferhal.core.registry import BackendRegistry

    reg = BackendRegistry.discover()
    active = reg.select(BackendConfig(name="cuda_sm100", interpret=interpret))
    dev = active.profile.torch_device
    ref_cpu = reg.select(BackendConfig(name="reference"))
    ref_dev = ref_cpu if dev == "cpu" else reg.select(BackendConfig(name="reference", options={"torch_device": dev}))
    return active, ref_dev, ref_cpu


def sync(torch) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------- kernels

def kernel_rows(ops: list[str], interpret: bool, level: str, reruns: int) -> list[dict]:
    """Every conformance case of ``ops``: numerics against the reference on the same device, determinism,
    batch invariance (no timing: the small shapes measure launches, ``perf`` measures the kernels)."""
    from inferhal.core.qualify.cases import op_cases
    from inferhal.core.qualify.runner import QualifyOptions, claimed_ops, run_case

    active, ref_dev, ref_cpu = select(interpret)
    label = level_label(active.profile)
    claimed = claimed_ops(active)
    opts = QualifyOptions(level=level, reruns=reruns, progress=False)
    rows = []
    for op in ops:
        for case in op_cases(op, level):
            t0 = time.perf_counter()
            row = run_case(case, active, ref_dev, claimed[op], opts, {}, measure="timed in the perf section")
            row["reference"] = ref_dev.profile.torch_device
            if row["status"] == "fail" and ref_dev is not ref_cpu:
                again = run_case(case, active, ref_cpu, claimed[op], opts, {}, measure="not timed")
                row["cpu_reference"] = {"status": again["status"], "numerics": again.get("numerics"),
                                        "message": again.get("message", "")}
            row["section"], row["execution_level"] = "kernels", label
            row["seconds"] = round(time.perf_counter() - t0, 3)
            rows.append(row)
            log(f"{row['status']:>7} {case.key} ({row['seconds']:.1f} s)")
    return rows


def split_ops(ops: list[str], workers: int) -> list[list[str]]:
    heavy_first = sorted(ops, key=lambda o: o not in ("moe.experts", "attn.paged", "attn.sparse_topk", "indexer.scores"))
    groups: list[list[str]] = [[] for _ in range(max(1, min(workers, len(ops))))]
    for i, op in enumerate(heavy_first):
        groups[i % len(groups)].append(op)
    return [g for g in groups if g]


def run_workers(jobs: list[tuple[str, list[str]]], args, out_dir: Path) -> list[dict]:
    """Each job (section, ops) in its own process, all at once; → their rows (a crashed worker is a row)."""
    procs = []
    for i, (section, ops) in enumerate(jobs):
        part = out_dir / f"part-{i}.json"
        cmd = [sys.executable, "-m", "inferhal.backends.cuda_sm100.device_check", "--worker", section,
               "--ops", ",".join(ops), "--part", str(part), "--level", args.level, "--reruns", str(args.reruns)]
        if args.interpret:
            cmd.append("--interpret")
        if args.gemma:
            cmd += ["--gemma", args.gemma]
        procs.append((section, ops, part, subprocess.Popen(cmd)))
    rows = []
    for section, ops, part, p in procs:
        rc = p.wait()
        if part.exists():
            rows.extend(json.loads(part.read_text()))
            part.unlink()
        else:
            rows.append({"section": section, "op": ",".join(ops), "status": "fail",
                         "message": f"worker exited {rc} without results"})
    return rows


# ------------------------------------------------------------------------------------ V4-shaped kernels

def v4_cases(torch, dev):
    """(name, kernel call, reference call, rtol, atol) at V4 production-like shapes."""
    from inferhal.backends.reference import attention as ra, mhc as rm, moe as rmoe, ops as ro
    from inferhal.core.ops.quantize import quantize_fp4_group, quantize_fp8_block
    from inferhal.core.ops import params as P
    from inferhal.core.ops.quant import QuantWeight
    from inferhal.kernels import attn_paged, kv_write, mhc, moe_experts, moe_route, norm, rope

    g = torch.Generator(device="cpu").manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dev)  # noqa: E731
    bf = torch.bfloat16
    x, r, w = rnd(64, 4096).to(bf), rnd(64, 4096).to(bf), rnd(4096).to(bf)
    yield ("norm.rms [64x4096 +residual]", lambda: norm.rms_norm(x, w, P.RmsNormParams(), r)[0],
           lambda: ro.norm_rms(x, w, P.RmsNormParams(), r)[0], 2**-7, 1e-2)
    xr, pos = rnd(32, 64, 512).to(bf), torch.arange(32, device=dev)
    cs = torch.cat([rnd(64, 32).cos(), rnd(64, 32).sin()], -1)
    rp = P.RopeParams(rotary_dim=64, style="interleaved", placement="tail")
    yield ("rope.apply [32x64x512 tail 64]", lambda: rope.rope_apply(xr, pos, cs, rp),
           lambda: ro.rope_apply(xr, pos, cs, rp), 2**-7, 1e-2)
    lg = rnd(64, 256) * 2
    pr = P.RouteParams(top_k=6, scoring="sqrtsoftplus", routed_scaling=1.5)
    yield ("moe.route [64x256 top6 sqrtsoftplus]", lambda: moe_route.moe_route(lg, pr)[0].sort(-1).values,
           lambda: rmoe.moe_route(lg, pr)[0].sort(-1).values, 1e-5, 1e-5)
    t, d, i, e, k = 64, 512, 256, 16, 6
    xe = rnd(t, d).to(bf)
    wgu, wdn = rnd(e, 2 * i, d) / 16, rnd(e, d, i) / 16
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(dev)
    we = torch.rand(t, k, generator=g).to(dev)
    ep = P.ExpertsParams(swiglu_limit=10.0)
    for label, a, b in (("bf16", wgu.to(bf), wdn.to(bf)), ("fp8_block", quantize_fp8_block(wgu), quantize_fp8_block(wdn))):
        yield (f"moe.experts [{label} T64 D512 I256 E16 k6]", (lambda a=a, b=b: moe_experts.moe_experts(xe, we, ids, a, b, ep)),
               (lambda a=a, b=b: rmoe.moe_experts(xe, we, ids, a, b, ep)), 3 * 2**-7, 0.1)
    q4 = [quantize_fp4_group(wgu), quantize_fp4_group(wdn)]
    q4 = [QuantWeight(q.data, torch.exp2(torch.round(torch.log2(q.scale))).to(torch.float8_e8m0fnu), q.format, q.shape,
                      q.block) for q in q4]
    yield ("moe.experts [fp4 e2m1 ue8m0 dot_scaled T64 D512 I256 E16 k6]",
           lambda: moe_experts.moe_experts(xe, we, ids, *q4, ep), lambda: rmoe.moe_experts(xe, we, ids, *q4, ep),
           3 * 2**-7, 0.1)
    st = rnd(16, 4, 1024).to(bf)
    fn, base, sc = rnd(24, 4096) * 0.05, rnd(24) * 0.5, torch.ones(3, device=dev)
    mp = P.MhcParams(hc_mult=4)
    yield ("mhc.pre [16x4x1024 sinkhorn 20]", lambda: mhc.mhc_pre(st, fn, base, sc, mp)[2],
           lambda: rm.mhc_pre(st, fn, base, sc, mp)[2], 1e-4, 1e-4)
    post, comb = rm.mhc_pre(st, fn, base, sc, mp)[1:]
    yv = rnd(16, 1024).to(bf)
    yield ("mhc.post [16x4x1024]", lambda: mhc.mhc_post(yv, st, post, comb), lambda: rm.mhc_post(yv, st, post, comb),
           2**-7, 2e-2)
    vals, sm = rnd(32, 1, 512) * 3, torch.randperm(64, generator=g)[:32].to(dev)

    def kvw(fnc):
        c = torch.zeros(8, 8, 1, 512, dtype=torch.float8_e4m3fn, device=dev)
        s = torch.zeros(8, 8, device=dev)
        fnc(vals, c, sm, P.KVWriteParams(quant="fp8"), s)
        return c.float() * s[..., None, None]

    yield "kv.write [fp8 e4m3 512-dim latent]", lambda: kvw(kv_write.kv_write), lambda: kvw(ro.kv_write), 2**-3, 1e-2
    bs, ctx, nb = 16, [100, 250, 31], 64
    table = torch.arange(nb, dtype=torch.int32).view(len(ctx) + 1, -1)[: len(ctx)].contiguous().to(dev)
    batch = P.AttnBatch(torch.arange(len(ctx) + 1, dtype=torch.int32, device=dev),
                        torch.tensor(ctx, dtype=torch.int32, device=dev), torch.tensor([c - 1 for c in ctx], device=dev),
                        table, torch.zeros(len(ctx), dtype=torch.long, device=dev))
    cache, qa, sinks = rnd(nb, bs, 1, 512).to(bf), rnd(len(ctx), 64, 512).to(bf), rnd(64)
    ap = P.AttnParams(scale=512**-0.5, num_kv_heads=1, window=128, shared_kv=True)
    yield ("attn.paged [latent decode H64 D512 window128 sinks]", lambda: attn_paged.attn_paged(qa, cache, batch, ap, sinks),
           lambda: ra.attn_paged(qa, cache, batch, ap, sinks), 2 * 2**-7, 2 * 2**-7 * float(cache.float().abs().max()))
    yield from v4_dense_cases(torch, dev, g)


def v4_dense_cases(torch, dev, g):
    """The dense GEMMs and the remaining row ops at V4-Flash sizes (hidden 4096, q_lora 1024, a 32,768-row
    slice of the 129,280-token vocabulary, 4 hyper-connection streams, 3 MTP drafts)."""
    from inferhal.backends.reference import mhc as rm, ops as ro, spec as rs
    from inferhal.core.ops.quantize import dequantize, quantize_fp4_group, quantize_fp8_block
    from inferhal.core.ops import params as P
    from inferhal.core.ops.quant import QuantWeight
    from inferhal.kernels import act_gated, embed, linear, linear_lowp, mhc_head, spec_verify

    rnd = lambda *s: torch.randn(*s, generator=g).to(dev)  # noqa: E731
    bf = torch.bfloat16
    x = rnd(64, 4096).to(bf)
    w = rnd(1024, 4096) / 64
    w8 = quantize_fp8_block(w)
    q4 = quantize_fp4_group(w)
    q4 = QuantWeight(q4.data, torch.exp2(torch.round(torch.log2(q4.scale))).to(torch.float8_e8m0fnu), q4.format,
                     q4.shape, q4.block)
    for label, wt in (("bf16", w.to(bf)), ("fp8_block", w8), ("fp4 e2m1 ue8m0 dot_scaled", q4)):
        yield (f"linear [{label} T64 4096->1024]", (lambda wt=wt: linear.linear(x, wt)), (lambda wt=wt: ro.linear(x, wt)),
               2 * 2**-7, 0.05)
    xq, xs = linear_lowp.act_quant(x)
    xd = (xq.float().view(64, 32, 128) * xs[..., None]).view(64, 4096)
    yield ("linear [fp8 x fp8 w8a8 T64 4096->1024]", lambda: linear_lowp.linear_w8a8(x, w8),
           lambda: (xd @ dequantize(w8).T).to(bf), 2 * 2**-7, 0.05)
    head = rnd(32768, 4096).to(bf) / 64
    xh = rnd(16, 4096).to(bf)
    yield ("lm_head [B16 V32768 K4096 bf16]", lambda: linear.lm_head(xh, head), lambda: ro.lm_head(xh, head), 2**-7, 0.02)
    yield ("lm_head.argmax [B16 V32768 K4096 bf16]", lambda: linear.lm_head_argmax(xh, head),
           lambda: ro.argmax_rows(linear.lm_head(xh, head)), 0.0, 0.0)
    ids = torch.randint(0, 32768, (64,), generator=g).to(dev)
    yield ("embed [T64 from 32768x4096 bf16]", lambda: embed.embed(ids, head, 2.0), lambda: ro.embed(ids, head, 2.0), 0.0, 0.0)
    gt, up = (rnd(64, 2048) * 3).to(bf), rnd(64, 2048).to(bf)
    for kind in ("silu", "gelu_tanh"):
        ak = P.ActParams(kind)
        yield (f"act.gated [{kind} T64 I2048]", (lambda ak=ak: act_gated.act_gated(gt, up, ak)),
               (lambda ak=ak: ro.act_gated(gt, up, ak)), 2 * 2**-7, 0.02)
    st = rnd(16, 4, 4096).to(bf)
    fn, base, sc = rnd(4, 4 * 4096) / 128, rnd(4) * 0.5, torch.ones(1, device=dev)
    mp = P.MhcParams(hc_mult=4)
    yield ("mhc.head [16x4x4096]", lambda: mhc_head.mhc_head(st, fn, base, sc, mp),
           lambda: rm.mhc_head(st, fn, base, sc, mp), 2**-7, 2e-2)
    b, s, v = 16, 3, 32768
    lg = rnd(b, s + 1, v) * 3
    drafts = lg[:, :s].argmax(-1)
    drafts[::3, 1] = 0  # some rows reject their second draft
    sp = P.SampleBatch((0.0,) * b, (0,) * b, (1.0,) * b)
    yield ("spec.verify [greedy B16 S3 V32768]", lambda: torch.cat([t.view(b, -1) for t in spec_verify.spec_verify(drafts, None, lg, sp)], 1),
           lambda: torch.cat([t.view(b, -1) for t in rs.spec_verify(drafts, None, lg, sp)], 1), 0.0, 0.0)


def v4_rows(interpret: bool) -> list[dict]:
    import torch

    from inferhal.core.qualify.numerics import bitwise_equal

    active, ref_dev, _ = select(interpret)  # fixes the interpreter mode before the kernel modules load
    label, dev = level_label(active.profile), active.profile.torch_device
    rows = []
    for name, kern, ref, rtol, atol in v4_cases(torch, dev):
        row = {"section": "v4_shapes", "op": name.split(" [")[0], "shape": name, "execution_level": label,
               "reference": dev, "rtol": rtol, "atol": atol}
        try:
            out, want = kern(), ref()
            again = kern()
            sync(torch)
            err = (out.float() - want.float()).abs()
            row.update(max_abs_err=float(err.max()), passed=bool(torch.allclose(out.float(), want.float(), rtol=rtol, atol=atol)),
                       bitwise_rerun=bitwise_equal(again, out)[0])
            row["status"] = "pass" if row["passed"] and row["bitwise_rerun"] else "fail"
        except Exception as exc:  # a failing kernel is a result
            row.update(status="fail", message=f"{type(exc).__name__}: {exc}"[:600])
        log(f"{row['status']:>7} {name}")
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------------- e2e

def _generate(llm, prompts, max_tokens: int, logprobs: int = 5):
    from inferhal.core.sampling.params import SamplingParams

    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs, ignore_eos=True))
    sec = time.perf_counter() - t0
    toks = [list(o.token_ids) for o in outs]
    lps = [[{int(k): float(v) for k, v in d.items()} for d in (o.logprobs or [])] for o in outs]
    return toks, lps, sec, [o.text for o in outs]


def _lp_diff(a, b) -> float | None:
    """Largest |logprob difference| over the tokens both runs list at each position."""
    worst = 0.0
    for ra, rb in zip(a, b):
        for da, db in zip(ra, rb):
            for t in set(da) & set(db):
                worst = max(worst, abs(da[t] - db[t]))
    return worst


def divergence(got, want, want_lp, got_lp) -> dict | None:
    """Where greedy tokens first differ, and how close a tie it was in the reference's own logprobs."""
    for i, (g, w) in enumerate(zip(got, want)):
        for j, (a, b) in enumerate(zip(g, w)):
            if a != b:
                ref_lp = want_lp[i][j] if i < len(want_lp) and j < len(want_lp[i]) else {}
                noise = _lp_diff([r[:j] for r in got_lp[i : i + 1]], [r[:j] for r in want_lp[i : i + 1]])
                gap = ref_lp[b] - ref_lp[a] if a in ref_lp and b in ref_lp else None
                return {"prompt": i, "position": j, "reference_token": b, "kernel_token": a,
                        "reference_logprob_gap": gap, "logprob_diff_before": noise,
                        "near_tie": gap is not None and gap <= max(2 * (noise or 0.0), 1e-3)}
    return None


def verdict(row: dict) -> str:
    """pass: tokens equal and deterministic; diverged: a near tie (the gap between the two tokens in the
    reference's logprobs within twice the logprob differences seen before it) and deterministic; else fail."""
    if not row.get("deterministic"):
        return "fail"
    if row.get("tokens_equal"):
        return "pass"
    d = row.get("divergence") or {}
    return "diverged" if d.get("near_tie") else "fail"


def e2e_rows(interpret: bool) -> list[dict]:
    from inferhal.core.engine.llm import LLM
    from inferhal.core.qualify import golden

    active, _, _ = select(interpret)
    dev, label = active.profile.torch_device, level_label(active.profile)
    rows = []
    gold = json.loads(golden.DATA.read_text()) if golden.DATA.exists() else {}
    for dtype in ("float32", "bfloat16"):
        row = {"section": "e2e", "model": "deepseek_v4_tiny", "dtype": dtype, "execution_level": label, "reference": dev}
        try:
            ov = [f"model.dtype={dtype}"]
            ref = LLM("deepseek_v4_tiny", backend="reference", overrides=ov + [f"+backend.options.torch_device={dev}"])
            kern = LLM("deepseek_v4_tiny", backend="cuda_sm100", overrides=ov + [f"backend.interpret={str(interpret).lower()}"])
            row["fallback_ops"] = kern.engine.backend.ops.fallbacks()
            want, want_lp, ref_s, _ = _generate(ref, TINY_PROMPTS, 16)
            got, got_lp, k1_s, _ = _generate(kern, TINY_PROMPTS, 16)
            got2, got2_lp, k2_s, _ = _generate(kern, TINY_PROMPTS, 16)
            n = sum(len(w) for w in want)
            same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
            row.update(tokens_equal=got == want, matched=f"{same}/{n}", max_logprob_diff=_lp_diff(got_lp, want_lp),
                       deterministic=got == got2 and got_lp == got2_lp, kernel_tokens=got, reference_tokens=want,
                       seconds={"reference": ref_s, "cuda_sm100": k1_s, "cuda_sm100_again": k2_s},
                       divergence=divergence(got, want, want_lp, got_lp))
            if dtype == "float32" and "deepseek_v4_tiny" in gold:
                g = gold["deepseek_v4_tiny"]
                sp_got, _, _, _ = _generate(kern, g["prompts"], g["max_tokens"], 0)
                row["golden_cpu_tokens_equal"] = sp_got == g["tokens"]
            row["status"] = verdict(row)
        except Exception as exc:
            row.update(status="fail", message=f"{type(exc).__name__}: {exc}"[:800])
        log(f"{row['status']:>7} e2e deepseek_v4_tiny {dtype}: {row.get('matched', row.get('message'))}")
        rows.append(row)
    return rows


def _dev_label(interpret: bool) -> tuple[str, str]:
    active, _, _ = select(interpret)
    return active.profile.torch_device, level_label(active.profile)


def gemma_row(path: str | None, dev: str, label: str, interpret: bool) -> dict:
    from inferhal.core.engine.llm import LLM

    row = {"section": "gemma", "model": "gemma3_270m", "dtype": "bfloat16", "execution_level": label, "reference": dev}
    if not path or not os.path.exists(path):
        row.update(status="not-run", message="the Gemma 3 270M GGUF is not on this machine (pass --gemma PATH)")
        return row
    try:
        ov = ["model.dtype=bfloat16", f"model.path={path}", "model.package=null"]
        ref = LLM("gemma3_270m", backend="reference", overrides=ov + [f"+backend.options.torch_device={dev}"])
        want, want_lp, ref_s, want_txt = _generate(ref, GEMMA_PROMPTS, 24)
        del ref
        kern = LLM("gemma3_270m", backend="cuda_sm100", overrides=ov + [f"backend.interpret={str(interpret).lower()}"])
        got, got_lp, k_s, got_txt = _generate(kern, GEMMA_PROMPTS, 24)
        got2, got2_lp, _, _ = _generate(kern, GEMMA_PROMPTS, 24)
        n = sum(len(w) for w in want)
        same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
        row.update(tokens_equal=got == want, matched=f"{same}/{n}", max_logprob_diff=_lp_diff(got_lp, want_lp),
                   deterministic=got == got2 and got_lp == got2_lp, fallback_ops=kern.engine.backend.ops.fallbacks(),
                   divergence=divergence(got, want, want_lp, got_lp),
                   kernel_text=got_txt, reference_text=want_txt, seconds={"reference": ref_s, "cuda_sm100": k_s})
        row["status"] = verdict(row)
    except Exception as exc:
        row.update(status="fail", message=f"{type(exc).__name__}: {exc}"[:800])
    log(f"{row['status']:>7} e2e gemma3_270m: {row.get('matched', row.get('message'))}")
    return row


# ---------------------------------------------------------------------------------------------- the run

def env_section(profile) -> dict:
    import torch
    import triton

    out = {"python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "triton": triton.__version__, "device": profile.device_name, "execution_level": level_label(profile),
           **{k: v for k, v in profile.extra.items() if k != "degraded"}, "degraded": profile.extra.get("degraded", {}),
           "sms": profile.compute_units, "memory_bytes": profile.memory_bytes}
    try:
        import cuda.bindings

        out["cuda_bindings"] = getattr(cuda.bindings, "__version__", "?")
    except ImportError:
        pass
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        out["nvidia_smi"] = smi.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def summarize(report: dict) -> dict:
    counts: dict[str, dict[str, int]] = {}
    failed = []
    for sec in SECTIONS[1:]:
        for row in report.get(sec, []):
            st = row.get("status", "?")
            counts.setdefault(sec, {}).setdefault(st, 0)
            counts[sec][st] += 1
            if st == "fail":
                failed.append(f"{sec}: {row.get('key') or row.get('shape') or row.get('model') or row.get('name') or row.get('op')}")
    return {"counts": counts, "failed": failed, "ok": not failed}


def print_table(report: dict) -> None:
    """A short plain table last (the end of the output is what comes back)."""
    lines = [f"execution level: {report.get('execution_level')}"]
    by_op: dict[str, list[int]] = {}
    for row in report.get("kernels", []):
        c = by_op.setdefault(row.get("op", "?"), [0, 0])
        c[0] += row.get("status") == "pass"
        c[1] += 1
    lines += [f"  kernels {op:<18} {p}/{n} pass" for op, (p, n) in sorted(by_op.items())]
    for row in report.get("v4_shapes", []):
        lines.append(f"  v4      {row['shape'][:60]:<60} {row['status']} err={row.get('max_abs_err', '-')}")
    for row in report.get("e2e", []) + report.get("gemma", []):
        lines.append(f"  e2e     {row['model']} {row.get('dtype')}: {row['status']} {row.get('matched', row.get('message', ''))[:80]}")
    for row in report.get("graphs", []):
        lines.append(f"  graphs  eager {row.get('eager_ms', '-')} ms, graph {row.get('graph_ms', '-')} ms: {row['status']}"
                     f"; first host sync: {row.get('first_host_sync', '-')}")
    for row in report.get("perf", []):
        if "ms" in row:
            bw, fl = row.get("bandwidth_fraction"), row.get("flops_fraction")
            lines.append(f"  perf    {row['name'][:58]:<58} {row['ms']:.3f} ms {row['GBps']:.0f} GB/s"
                         f" ({'-' if bw is None else f'{bw:.1%}'}) {row['TFLOPps']:.1f} TF/s ({'-' if fl is None else f'{fl:.1%}'})")
    print("\n".join(lines), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="device_check.json", help="the JSON report")
    ap.add_argument("--interpret", action="store_true", help="CPU dry run in Triton's interpreter (not a hardware result)")
    ap.add_argument("--sections", default=",".join(SECTIONS[1:]))
    ap.add_argument("--ops", default="", help="comma-separated op IDs (default: every op the backend claims)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--level", default="quick", choices=("quick", "full"))
    ap.add_argument("--reruns", type=int, default=2)
    ap.add_argument("--gemma", default=os.environ.get("INFERHAL_GEMMA_GGUF"), help="a Gemma 3 270M GGUF on this machine")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    ap.add_argument("--part", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    from inferhal.kernels.runtime import use_interpreter

    use_interpreter(args.interpret)
    from inferhal.backends.cuda_sm100 import device_timing  # after the mode is fixed: it imports kernels lazily

    if args.worker:  # a worker process: one section's rows into --part
        if args.worker == "kernels":
            rows = kernel_rows([o for o in args.ops.split(",") if o], args.interpret, args.level, args.reruns)
        elif args.worker == "v4_shapes":
            rows = v4_rows(args.interpret)
        else:
            rows = {"e2e": lambda: e2e_rows(args.interpret), "graphs": lambda: device_timing.graph_rows(args.interpret),
                    "gemma": lambda: [gemma_row(args.gemma, *_dev_label(args.interpret), args.interpret)]}[args.worker]()
        Path(args.part).write_text(json.dumps(rows, default=str))
        return 0

    from inferhal.backends.cuda_sm100.device import probe

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    pr = probe(interpret=args.interpret)
    report: dict = {"schema": 1, "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                    "probe": {"available": pr.available, "reason": pr.reason, **dict(pr.details)}}
    if not pr.available:
        report["execution_level"] = "absent"
        out.write_text(json.dumps(report, indent=1))
        print(f"device_check: no device to check: {pr.reason}", file=sys.stderr)
        return 2
    active, _, _ = select(args.interpret)
    report["execution_level"] = level_label(active.profile)
    report["env"] = env_section(active.profile)
    report["commit"] = os.environ.get("INFERHAL_COMMIT", "")
    t0 = time.time()
    secs = [s for s in args.sections.split(",") if s]
    unknown = [s for s in secs if s not in SECTIONS[1:]]
    if unknown:
        print(f"device_check: unknown section(s) {unknown}; known: {', '.join(SECTIONS[1:])}", file=sys.stderr)
        return 2

    def save():
        report["seconds"] = round(time.time() - t0, 1)
        report["summary"] = summarize(report)
        out.write_text(json.dumps(report, indent=1, default=str))

    save()
    # numerics first, in parallel processes: kernels by op groups, the V4 shapes, the e2e runs
    from inferhal.core.qualify.runner import claimed_ops

    ops = [o for o in args.ops.split(",") if o] or list(claimed_ops(active))
    jobs = []
    if "kernels" in secs:
        jobs += [("kernels", g) for g in split_ops(ops, args.workers)]
    jobs += [(s, []) for s in ("v4_shapes", "e2e", "gemma") if s in secs]
    if jobs:
        log(f"{len(jobs)} worker(s): {jobs}")
        rows = run_workers(jobs, args, out.parent)
        for sec in ("kernels", "v4_shapes", "e2e", "gemma"):
            if sec in secs:
                report[sec] = [r for r in rows if r.get("section") == sec]
        save()
    # timing alone on the device (no other worker running)
    if "graphs" in secs:
        report["graphs"] = run_workers([("graphs", [])], args, out.parent)
        save()
    if "perf" in secs:
        report["perf"] = device_timing.perf_rows(args.interpret)
        save()
    print_table(report)
    print(f"device_check: {report['seconds']} s, {'all passed' if report['summary']['ok'] else 'FAILED: ' + '; '.join(report['summary']['failed'])}; "
          f"report {out}", flush=True)
    return 0 if report["summary"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
