"""``inferhal qualify`` over the ascend950 op table on the documented fake NPU, at the level the plugin gives
the table on a probed host (``device``; the fake stands in for the operators, so nothing here is a device
result): every case whose call a wrapper handed to the reference is reported at level ``fallback``, not run,
with the wrapper's reason; every other case at the table's level."""

from __future__ import annotations

import dataclasses

import pytest

from inferhal.backends.ascend950.ops import NPU_OPS, NpuOps, provide
from inferhal.backends.reference.ops import OPS as REF
from inferhal.core.config.schema import BackendConfig
from inferhal.core.ops.table import OpTable
from inferhal.core.profile import ExecLevel
from inferhal.core.qualify import checks, runner
from inferhal.core.qualify.cases import op_cases
from inferhal.core.qualify.cases.base import CaseEnv
from inferhal.core.registry import BackendRegistry


@pytest.fixture(scope="module")
def reference():
    return BackendRegistry.discover().select(BackendConfig(name="reference"))


def _active(reference, native):
    return dataclasses.replace(reference, name="ascend950",
                               ops=OpTable("ascend950", native, REF, ExecLevel.DEVICE))


def test_cases_that_fall_back_are_reported_as_fallback(reference, recorder, tmp_path):
    native = provide(recorder, level="device", triton=False)
    rep = runner.run(_active(reference, native), reference,
                     runner.QualifyOptions(reruns=1, progress=False, output_dir=str(tmp_path)))
    rows = {r["key"]: r for r in rep["rows"]}
    assert {r["op"] for r in rows.values()} == set(NPU_OPS)
    # the oracle: each case called alone on fresh wrappers, whether the wrapper logged a fallback for its op
    expect = {}
    for op in NPU_OPS:
        for case in op_cases(op, "quick"):
            alone = provide(recorder, level="device", triton=False)
            env = CaseEnv(_active(reference, alone))
            checks.call(case, env.op(op), 0, "cpu", env)
            expect[case.key] = [why for o, why in alone[op].fallback_log if o == op]
    assert set(expect) == set(rows)
    for key, why in expect.items():
        r = rows[key]
        if why:
            assert (r["level"], r["status"]) == ("fallback", "not-run"), key
            assert why[0] in r["message"] and r["fallbacks"] == list(dict.fromkeys(why)), key
        else:
            assert (r["level"], r["status"]) == ("device", "pass"), (key, r["message"])
    fell = {op for op in NPU_OPS if any(expect[c.key] for c in op_cases(op, "quick"))}
    assert {"attn.paged", "attn.sparse_topk", "mhc.pre", "kv.write"} <= fell  # the kit's shapes reach these
    assert "norm.rms" not in fell and rep["ops"]["norm.rms"]["status"] == "pass"
    assert all(rep["ops"][op]["status"] == "not-run" and rep["ops"][op]["fallback"] for op in fell)
    s = rep["summary"]
    assert s["verdict"] == "incomplete" and s["exit_status"] == 3 and set(s["not_qualified_ops"]) == fell
    assert any("fell back per call" in n for n in s["notes"])


def test_strict_turns_a_fallback_case_into_a_failure(reference, recorder, tmp_path):
    native = provide(recorder, level="device", strict=True, triton=False)
    rep = runner.run(_active(reference, native), reference,
                     runner.QualifyOptions(ops=("attn.paged", "norm.rms"), reruns=1, progress=False,
                                           output_dir=str(tmp_path)))
    paged = [r for r in rep["rows"] if r["op"] == "attn.paged"]
    assert paged and all(r["status"] == "fail" and "StrictFallbackError" in r["message"] for r in paged)
    assert not native["attn.paged"].fallback_log
    assert rep["summary"]["failed_ops"] == ["attn.paged"]


def test_every_wrapper_shares_the_tables_log(recorder):
    native = provide(recorder, triton=False)
    ops = native["norm.rms"].fn.__self__
    assert isinstance(ops, NpuOps) and all(native[op].fallback_log is ops.events for op in NPU_OPS)
    assert native["norm.rms"].level == ExecLevel.WIRED_UNRUN
