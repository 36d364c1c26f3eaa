"""The conformance suite of the backend developer kit (collected by ``pytest --inferhal-backend=NAME``;
the fixtures come from :mod:`inferhal.core.qualify.pytest_plugin`).

``test_case`` runs one case of one claimed op exactly as ``inferhal qualify`` does (numerics against
the reference, determinism reruns, batch invariance when the backend claims it), without timing.
The other tests check the contract data: profile, declared ops, strictness.
"""

from __future__ import annotations

import pytest

from inferhal.core.profile import DeviceProfile, ExecLevel


def test_case(inferhal_backend, inferhal_reference, inferhal_case, inferhal_kit):
    from inferhal.core.qualify.runner import QualifyOptions, claimed_ops, reruns_for, run_case

    level = claimed_ops(inferhal_backend)[inferhal_case.op_id]
    reruns = reruns_for(inferhal_backend, inferhal_kit.reruns)
    opts = QualifyOptions(level=inferhal_kit.level, reruns=reruns, progress=False)
    row = run_case(inferhal_case, inferhal_backend, inferhal_reference, level, opts, baseline={},
                   measure="performance is measured by `inferhal qualify` on the device")
    if row["status"] in ("not-run", "skipped"):
        pytest.skip(row["message"])
    assert row["status"] == "pass", row["message"]


def test_profile_is_data(inferhal_backend):
    p = inferhal_backend.profile
    assert isinstance(p, DeviceProfile)
    assert p.dtypes, "the profile lists no dtypes"
    assert isinstance(p.exec_level, ExecLevel)
    if p.exec_level != ExecLevel.DEVICE:
        assert not p.peak_bandwidth or p.sources, "peaks declared for a non-device run need a source"


def test_claimed_ops_have_cases(inferhal_backend, inferhal_kit):
    from inferhal.core.qualify.cases import op_cases
    from inferhal.core.qualify.runner import claimed_ops

    missing = [op for op in claimed_ops(inferhal_backend) if not op_cases(op, "full")]
    if missing:
        pytest.skip(f"no conformance case yet for {', '.join(missing)} (not verified by the kit)")


def test_declared_ops_match_provided(inferhal_backend, inferhal_kit):
    declared = inferhal_kit.registry.call(inferhal_backend.name, "inferhal_declared_ops")
    if declared is None:
        pytest.skip("the backend declares no ops as data (inferhal_declared_ops not implemented)")
    provided = {op for op, lvl in inferhal_backend.ops.provenance().items() if lvl not in ("fallback", "absent")}
    assert set(declared) == provided, f"declared {sorted(declared)} but provides {sorted(provided)}"


def test_strict_refuses_fallbacks(inferhal_backend, inferhal_kit):
    from inferhal.core.config.schema import BackendConfig
    from inferhal.core.ops.table import StrictFallbackError

    fallbacks = inferhal_backend.ops.fallbacks()
    if not fallbacks:
        pytest.skip("the backend implements every op natively")
    cfg = BackendConfig(name=inferhal_backend.name, interpret=inferhal_backend.config.interpret, strict=True)
    strict = inferhal_kit.registry.select(cfg)
    with pytest.raises(StrictFallbackError, match=fallbacks[0]):
        strict.ops.entry(fallbacks[0])
