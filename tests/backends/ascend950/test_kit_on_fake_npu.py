"""The conformance kit's quick cases (``core/qualify/cases``, what ``inferhal qualify`` runs) through the
ascend950 op table over the documented fake NPU: numerics against the reference and determinism. This is
not a qualification (nothing here is written to a report, and the level stays wired-unrun); it checks the
wrappers on the kit's shapes and dtypes, where a case outside an operator's documented limits falls back
per call. The test pins which ops reach their operators on those cases, so a silent fallback shows."""

from __future__ import annotations

import collections
import dataclasses

import pytest

from inferhal.backends.ascend950.ops import NPU_OPS, provide
from inferhal.backends.reference.ops import OPS as REF
from inferhal.core.config.schema import BackendConfig
from inferhal.core.ops.table import OpTable
from inferhal.core.profile import ExecLevel
from inferhal.core.qualify import checks
from inferhal.core.qualify.cases import op_cases
from inferhal.core.qualify.cases.base import CaseEnv
from inferhal.core.registry import BackendRegistry

#: ops whose quick cases the operators cannot take at all (fp32, kit block sizes, one EP process, hidden
#: sizes off npu_hc_pre_v2's 4096/7168): every call of these falls back on the kit's shapes
ALL_FALLBACK = {"attn.paged", "attn.sparse_topk", "moe.dispatch", "moe.combine", "mhc.pre", "mhc.head"}


@pytest.fixture(scope="module")
def reference():
    return BackendRegistry.discover().select(BackendConfig(name="reference"))


@pytest.mark.parametrize("op", list(NPU_OPS))
def test_quick_cases_on_the_fake_npu(op, reference, recorder):
    native = provide(recorder, triton=False)
    wrappers = native[op].fn.__self__
    active = dataclasses.replace(reference, ops=OpTable("ascend950", native, REF, ExecLevel.WIRED_UNRUN))
    failed, reached = [], 0
    for case in op_cases(op, "quick"):
        ctx = checks.CaseContext(fn=active.ops.entry(op).fn, ref_fn=reference.ops.entry(op).fn, torch_device="cpu",
                                 seed=0, reruns=2, batch_invariant=False, peak_bandwidth=0.0, peak_flops=0.0,
                                 measure="fake NPU: not measured", env=CaseEnv(active), ref_env=CaseEnv(reference))
        before = len(recorder.calls)
        first = checks.call(case, ctx.fn, ctx.seed, ctx.torch_device, ctx.env)
        reached += len(recorder.calls) > before
        for name, res in (("numerics", checks.numerics(case, ctx, first)),
                          ("determinism", checks.determinism(case, ctx, first))):
            if res.get("ok") is False:
                failed.append(f"{case.key} {name}: {res.get('message')}")
    assert not failed, "\n".join(failed)
    why = collections.Counter(r for _, r in wrappers.events)
    if op in ALL_FALLBACK:
        assert reached == 0 and why, f"{op} reached its operators on the kit's cases: update ALL_FALLBACK"
    else:
        assert reached > 0, f"{op}: no quick case reached an operator ({dict(why)})"
