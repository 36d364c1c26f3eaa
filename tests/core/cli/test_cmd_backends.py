"""``inferhal backends``: the KV formats each available backend reads, from its device profile."""

from inferhal.core.cli.cmd_backends import report
from inferhal.core.paging.formats import backend_kv_dtypes
from inferhal.core.profile import DeviceProfile, ExecLevel
from inferhal.core.registry import BackendRegistry


def test_the_kv_formats_of_each_available_backend_come_from_its_profile():
    data = report(BackendRegistry.discover())
    assert data["kv_dtypes"]["reference"] == ("auto", "fp8", "fp4")
    assert set(data["kv_dtypes"]) == {n for n, p in data["probes"].items() if p.available}
    bare = DeviceProfile("x", "x", "cpu", ExecLevel.DEVICE, frozenset({"float32"}), frozenset({"kv_dtype:fp4"}))
    assert backend_kv_dtypes(bare) == ("auto", "fp4")
