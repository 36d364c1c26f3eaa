"""Numerics on the device: every conformance case, and whole models, against the reference on the same device.

- ``kernels``: each conformance case (``core/qualify/cases``, the shapes ``inferhal qualify`` runs; at reduced
  scale the first case of each op) of each op the backend claims, through
  :func:`~inferhal.core.qualify.runner.run_case`: numerics within the case's tolerance, determinism reruns
  (bitwise), batch invariance. A failing case is compared once more with the reference on the host, to tell a
  kernel error from a reference that misbehaves on the device.
- ``e2e``: the tiny DeepSeek-V4 through the engine on the backend against the reference on the same device
  (fp32 and bf16; fp32 alone at reduced scale): greedy tokens and top logprobs, the backend twice (bitwise
  determinism), the host's golden tokens. ``gemma``: Gemma 3 270M (bf16) the same way, when its GGUF is on the
  machine.
"""

from __future__ import annotations

import json
import os
import time

from inferhal.core.qualify.device_run.common import Context, error_text, log

TINY_PROMPTS = [[1, 5, 9, 42, 7, 3], [11, 2, 77, 30], [1, 17, 130, 5, 99, 42, 7], [3, 3, 81, 190, 12, 60, 61, 62]]
GEMMA_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
#: ops whose cases take longest: spread first over the workers
HEAVY = ("moe.experts", "attn.paged", "attn.sparse_topk", "indexer.scores")


def split_ops(ops: list[str], workers: int) -> list[list[str]]:
    heavy_first = sorted(ops, key=lambda o: o not in HEAVY)
    groups: list[list[str]] = [[] for _ in range(max(1, min(workers, len(ops))))]
    for i, op in enumerate(heavy_first):
        groups[i % len(groups)].append(op)
    return [g for g in groups if g]


def kernel_rows(ctx: Context, ops: list[str], level: str, reruns: int, emit) -> None:
    from inferhal.core.qualify.cases import op_cases
    from inferhal.core.qualify.runner import QualifyOptions, claimed_ops, run_case

    active, ref_dev, ref_cpu = ctx.active, ctx.ref_dev, ctx.ref_cpu
    claimed = claimed_ops(active)
    opts = QualifyOptions(level=level, reruns=reruns, progress=False)
    for op in ops:
        if op not in claimed:
            emit(ctx.row("kernels", op=op, key=op, status="skipped", message=f"{ctx.backend} does not claim {op}"))
            continue
        cases = op_cases(op, level)
        for case in cases if ctx.scale == "full" else cases[:1]:  # reduced: each op's path once
            if ctx.late(ctx.row("kernels", op=op, key=case.key), emit):
                continue
            t0 = time.perf_counter()
            row = run_case(case, active, ref_dev, claimed[op], opts, {}, measure="timed in the perf section")
            row["reference"] = str(ref_dev.profile.torch_device)
            if row["status"] == "fail" and ref_dev is not ref_cpu:
                again = run_case(case, active, ref_cpu, claimed[op], opts, {}, measure="not timed")
                row["cpu_reference"] = {"status": again["status"], "numerics": again.get("numerics"),
                                        "message": again.get("message", "")}
            row["section"], row["execution_level"] = "kernels", ctx.label
            row["seconds"] = round(time.perf_counter() - t0, 3)
            emit(row)
            log(f"{row['status']:>7} {case.key} ({row['seconds']:.1f} s)")


# ------------------------------------------------------------------------------------------------ models

def generate(llm, prompts, max_tokens: int, logprobs: int = 5):
    from inferhal.core.sampling.params import SamplingParams

    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs, ignore_eos=True))
    sec = time.perf_counter() - t0
    toks = [list(o.token_ids) for o in outs]
    lps = [[{int(k): float(v) for k, v in d.items()} for d in (o.logprobs or [])] for o in outs]
    return toks, lps, sec, [o.text for o in outs]


def lp_diff(a, b) -> float:
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
                noise = lp_diff([r[:j] for r in got_lp[i: i + 1]], [r[:j] for r in want_lp[i: i + 1]])
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


def fallbacks(llm):
    """The ops the engine's backend took from the reference (None when the engine does not say)."""
    try:
        return llm.engine.backend.ops.fallbacks()
    except AttributeError:
        return None


def _compare(row: dict, ref, kern, prompts, max_tokens: int) -> None:
    want, want_lp, ref_s, want_txt = generate(ref, prompts, max_tokens)
    got, got_lp, k1_s, got_txt = generate(kern, prompts, max_tokens)
    got2, got2_lp, k2_s, _ = generate(kern, prompts, max_tokens)
    n = sum(len(w) for w in want)
    same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
    row.update(tokens_equal=got == want, matched=f"{same}/{n}", max_logprob_diff=lp_diff(got_lp, want_lp),
               deterministic=got == got2 and got_lp == got2_lp, kernel_tokens=got, reference_tokens=want,
               seconds={"reference": ref_s, "backend": k1_s, "backend_again": k2_s},
               divergence=divergence(got, want, want_lp, got_lp))
    if isinstance(prompts[0], str):
        row.update(kernel_text=got_txt, reference_text=want_txt)


def e2e_rows(ctx: Context, emit) -> None:
    from inferhal.core.engine.llm import LLM
    from inferhal.core.qualify import golden

    gold = json.loads(golden.DATA.read_text()) if golden.DATA.exists() else {}
    interp = f"backend.interpret={str(ctx.interpret).lower()}"
    for dtype in ("float32", "bfloat16") if ctx.scale == "full" else ("float32",):
        row = ctx.row("e2e", model="deepseek_v4_tiny", dtype=dtype, reference=ctx.dev)
        try:
            ov = [f"model.dtype={dtype}"]
            ref = LLM("deepseek_v4_tiny", backend="reference", overrides=ov + [f"+backend.options.torch_device={ctx.dev}"])
            kern = LLM("deepseek_v4_tiny", backend=ctx.backend, overrides=ov + [interp])
            row["fallback_ops"] = fallbacks(kern)
            _compare(row, ref, kern, TINY_PROMPTS, 16 if ctx.scale == "full" else 3)
            if dtype == "float32" and "deepseek_v4_tiny" in gold and ctx.on_device:
                g = gold["deepseek_v4_tiny"]
                row["golden_cpu_tokens_equal"] = generate(kern, g["prompts"], g["max_tokens"], 0)[0] == g["tokens"]
            row["status"] = verdict(row)
        except Exception as exc:
            row.update(status="fail", message=error_text(exc, 800))
        log(f"{row['status']:>7} e2e deepseek_v4_tiny {dtype}: {row.get('matched', row.get('message'))}")
        emit(row)


def gemma_rows(ctx: Context, emit) -> None:
    from inferhal.core.engine.llm import LLM

    row = ctx.row("gemma", model="gemma3_270m", dtype="bfloat16", reference=ctx.dev)
    path = ctx.gemma
    if not path or not os.path.exists(path):
        emit(dict(row, status="not-run", message="the Gemma 3 270M GGUF is not on this machine (pass --gemma PATH)"))
        return
    try:
        ov = ["model.dtype=bfloat16", f"model.path={path}", "model.package=null"]
        ref = LLM("gemma3_270m", backend="reference", overrides=ov + [f"+backend.options.torch_device={ctx.dev}"])
        kern = LLM("gemma3_270m", backend=ctx.backend, overrides=ov + [f"backend.interpret={str(ctx.interpret).lower()}"])
        row["fallback_ops"] = fallbacks(kern)
        _compare(row, ref, kern, GEMMA_PROMPTS, 24 if ctx.scale == "full" else 3)
        row["status"] = verdict(row)
    except Exception as exc:
        row.update(status="fail", message=error_text(exc, 800))
    log(f"{row['status']:>7} e2e gemma3_270m: {row.get('matched', row.get('message'))}")
    emit(row)
