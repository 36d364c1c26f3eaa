"""Device profiles for planning: the backends' catalogs, recorded host readings, links and missing peaks."""

from __future__ import annotations

import pytest

from inferhal.core.errors import UserError
from inferhal.core.plan import hardware


def test_catalog_profiles_carry_their_numbers_and_sources():
    cat = hardware.catalog()
    b200 = cat["B200"]
    assert b200.backend == "cuda_sm100" and b200.peak_bandwidth == 8.0e12 and b200.peak_flops["fp4_e2m1"] == 9.0e15
    up, out = hardware.links(b200)
    assert (up.bandwidth, up.domain, out.bandwidth) == (900e9, 8, 50e9)
    assert hardware.links(cat["GB300"])[0].domain == 72
    assert cat["950DT"].backend == "ascend950" and "UNVERIFIED" in cat["950DT"].sources["links"]
    for name, prof in cat.items():
        assert prof.sources and prof.memory_bytes > 0 and prof.peak_bandwidth > 0, name


def test_recorded_host_and_missing_numbers():
    prof = hardware.recorded_host("a 2-core VM", 19.0, {"float32": 40.0}, "a recorded run")
    assert prof.peak_bandwidth == 19e9 and hardware.rate(prof, "float32") == 40e9
    assert hardware.links(prof) == (None, None)
    with pytest.raises(UserError, match="no peak FLOP/s for bfloat16 .* declares: float32"):
        hardware.rate(prof, "bfloat16")
    with pytest.raises(UserError, match="declares no memory bandwidth"):
        hardware.bandwidth(hardware.with_readings(prof, 0.0, {}, "nothing measured"))
