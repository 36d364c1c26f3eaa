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


def test_an_unavailable_backends_coverage_column_says_so(capsys, monkeypatch):
    """Its declared levels ("device" for a CPU backend this CPU cannot run) must not read as results here."""
    from inferhal.core.cli.main import main
    from inferhal.core.registry import Probe

    real = BackendRegistry.probe
    monkeypatch.setattr(BackendRegistry, "probe", lambda self, name, config=None: Probe(False, "not on this test host")
                        if name == "cpu_avx512" else real(self, name, config))
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "(unavailable)" in out and "An (unavailable) column is what that backend declares" in out
