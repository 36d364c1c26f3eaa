"""The checks of one case: numerics, determinism, batch invariance, performance. Each returns plain data.

A check never raises for a misbehaving op: exceptions become failed results that name the op, the
shape and the error, so one broken op cannot stop a qualification run.
"""

from __future__ import annotations

import random
import statistics
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from inferhal.core.qualify.cases.base import CaseEnv, OpCase, to_device
from inferhal.core.qualify.numerics import bitwise_equal, compare


@dataclass(frozen=True)
class CaseContext:
    """What the checks of one case need to know about the run and the backend."""

    fn: Callable[..., Any]  # the backend's op
    ref_fn: Callable[..., Any]  # the reference op (the oracle)
    torch_device: str
    seed: int
    reruns: int
    batch_invariant: bool  # the op declares batch invariance as selected (runner.op_invariant)
    peak_bandwidth: float  # bytes/s, 0 = not declared
    peak_flops: float  # FLOP/s for the case's dtype, 0 = not declared
    measure: str  # "" when performance is measured, else why it is not
    synchronize: Callable[[], None] = lambda: None
    warmup: int = 2
    repeats: int = 10
    env: CaseEnv | None = None  # the backend under test, for cases that prepare inputs through it
    ref_env: CaseEnv | None = None  # the reference, likewise


class OpError(Exception):
    """The op raised; the message is ``TypeName: message (at file:line in function)``."""


def describe_exception(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" (at {'/'.join(tb[-1].filename.split('/')[-2:])}:{tb[-1].lineno} in {tb[-1].name})" if tb else ""
    return f"{type(exc).__name__}: {exc}{where}"


def call(case: OpCase, fn: Callable[..., Any], seed: int, device: str, env: CaseEnv | None = None,
         inputs: Any = None) -> Any:
    """``fn`` on the case's inputs for ``seed`` (or the given built ``inputs``), on ``device``; → CPU result."""
    inputs = case.build(seed) if inputs is None else inputs
    if device != "cpu":
        inputs = to_device(inputs, device)
    try:
        out = case.result(fn, case.ready(inputs, env))
    except Exception as exc:  # the op under test failed: report it, do not crash the run
        raise OpError(describe_exception(exc)) from exc
    return to_device(out, "cpu") if device != "cpu" else out


def numerics(case: OpCase, ctx: CaseContext, out: Any) -> dict:
    ref = call(case, ctx.ref_fn, ctx.seed, "cpu", ctx.ref_env)
    if case.validate is not None:
        args, kwargs = case.build(ctx.seed)
        msg = case.validate(out, ref, args, kwargs)
        return {"ok": not msg, "message": msg, "method": "validate", "n": 0}
    stats = compare(out, ref, case.tol).to_dict()
    stats["method"] = "elementwise"
    return stats


def determinism(case: OpCase, ctx: CaseContext, first: Any) -> dict:
    """``reruns`` reruns on fresh copies of the inputs, interleaved in a seeded random order with calls on
    other inputs (so state carried between calls shows); each rerun must be bitwise equal to the first."""
    plan = ["rerun"] * ctx.reruns + ["other"] * max(1, ctx.reruns // 2)
    random.Random(f"{ctx.seed}:{case.key}").shuffle(plan)
    done, others = 0, 0
    for step in plan:
        if step == "other":
            others += 1
            call(case, ctx.fn, ctx.seed + 7919 * others, ctx.torch_device, ctx.env)
            continue
        done += 1
        same, where = bitwise_equal(call(case, ctx.fn, ctx.seed, ctx.torch_device, ctx.env), first)
        if not same:
            return {"ok": False, "reruns": done, "order": plan, "message": f"rerun {done} of {ctx.reruns} differs "
                    f"from the first run: {where}"}
    return {"ok": True, "reruns": done, "order": plan, "message": ""}


def batch_invariance(case: OpCase, ctx: CaseContext, first: Any) -> dict:
    """The first ``n`` rows computed alone must be bitwise equal to the same rows of the full batch."""
    if not ctx.batch_invariant:
        return {"ok": None, "status": "not claimed", "message": "the op declares no batch invariance as selected"}
    if case.take is None or case.rows is None:
        return {"ok": None, "status": "not applicable", "message": "the op has no batch dimension"}
    args, kwargs = case.build(ctx.seed)
    rows = case.rows(args, kwargs)
    sizes = sorted({n for n in (1, rows // 2, rows - 1) if 0 < n < rows})
    for n in sizes:
        sub = case.take(*case.build(ctx.seed), n)  # fresh inputs: generators are stateful
        part = call(case, ctx.fn, ctx.seed, ctx.torch_device, ctx.env, inputs=sub)
        same, where = bitwise_equal(part, case.row_slice(first, args, kwargs, n))
        if not same:
            return {"ok": False, "status": "fail", "sizes": sizes,
                    "message": f"the first {n} of {rows} rows computed alone differ from the full batch: {where}"}
    return {"ok": True, "status": "pass", "sizes": sizes, "rows": rows, "message": ""}


def performance(case: OpCase, ctx: CaseContext, baseline: dict | None, threshold: float) -> dict:
    """Median wall time over ``repeats`` synchronised calls; achieved GB/s and TFLOP/s against the peaks."""
    if ctx.measure:
        return {"status": "not measured", "message": ctx.measure}
    built = to_device(case.build(ctx.seed), ctx.torch_device)
    flops, nbytes = case.cost(*built) if case.cost else (0.0, 0.0)
    args, kwargs = case.ready(built, ctx.env)
    for _ in range(ctx.warmup):
        ctx.fn(*args, **kwargs)
    times = []
    for _ in range(ctx.repeats):
        ctx.synchronize()
        t0 = time.perf_counter()
        ctx.fn(*args, **kwargs)
        ctx.synchronize()
        times.append(time.perf_counter() - t0)
    sec = statistics.median(times)
    intensity = flops / nbytes if nbytes else 0.0
    attainable = min(x for x in (ctx.peak_flops or float("inf"), intensity * ctx.peak_bandwidth or float("inf")))
    res = {"status": "measured", "seconds": sec, "flops": flops, "bytes": nbytes, "intensity": intensity,
           "gbps": nbytes / sec / 1e9, "tflops": flops / sec / 1e12,
           "bw_fraction": (nbytes / sec) / ctx.peak_bandwidth if ctx.peak_bandwidth else None,
           "flops_fraction": (flops / sec) / ctx.peak_flops if ctx.peak_flops else None,
           "roofline_fraction": (flops / sec) / attainable if flops and attainable != float("inf") else None,
           "ok": True, "message": ""}
    base = (baseline or {}).get(case.key)
    if base:
        res["baseline_seconds"] = base
        res["slowdown"] = sec / base - 1.0
        if sec > base * (1.0 + threshold):
            res["ok"] = False
            res["status"] = "regression"
            res["message"] = (f"{sec * 1e6:.1f} us vs baseline {base * 1e6:.1f} us: {res['slowdown']:+.0%} "
                              f"(threshold {threshold:+.0%})")
    return res
