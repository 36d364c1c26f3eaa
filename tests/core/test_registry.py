"""Discovery, validation, selection, fallback, strictness and failure messages of the backend registry."""

from __future__ import annotations

import types

import pytest
import torch

from inferhal.core.config.schema import BackendConfig
from inferhal.core.hookspecs import API_VERSION, hookimpl
from inferhal.core.ops.params import RmsNormParams
from inferhal.core.ops.table import StrictFallbackError
from inferhal.core.ops.vocabulary import OPS
from inferhal.core.profile import DeviceProfile, ExecLevel, Probe
from inferhal.core.registry import BackendRegistry, BackendSelectionError


def make_plugin(name="fake", available=True, version=API_VERSION, ops=None, omit=(), extra_hooks=None):
    """A backend as a plain namespace of hookimpls."""

    def api_version():
        return version

    def probe():
        return Probe(available, "fake device present" if available else "fake device missing: plug it in")

    def device_profile(config):
        return DeviceProfile(backend=name, device_name="fake", torch_device="cpu",
                             exec_level=ExecLevel.DEVICE, dtypes={"float32"})

    def device(profile):
        from inferhal.backends.reference.device import ReferenceDevice

        return ReferenceDevice()

    def provide_ops():
        return dict(ops or {})

    def kv_storage(request, profile):
        return None

    def communicator(layout):
        return None

    hooks = {
        "inferhal_api_version": api_version,
        "inferhal_probe": probe,
        "inferhal_device_profile": device_profile,
        "inferhal_device": device,
        "inferhal_provide_ops": provide_ops,
        "inferhal_kv_storage": kv_storage,
        "inferhal_communicator": communicator,
        **(extra_hooks or {}),
    }
    ns = types.ModuleType(f"fake_backend_{name}")
    for hook, fn in hooks.items():
        if hook not in omit:
            fn.__name__ = hook
            setattr(ns, hook, hookimpl(fn))
    return ns


def double_rms(x, weight, p, residual=None):
    return x * 2


@pytest.fixture(scope="module")
def registry():
    return BackendRegistry.discover(extra={
        "fake": make_plugin(ops={"norm.rms": double_rms}),
        "gone": make_plugin("gone", available=False),
        "old": make_plugin("old", version=API_VERSION + 1),
        "partial": make_plugin("partial", omit=("inferhal_kv_storage",)),
        "typo": make_plugin("typo", extra_hooks={"inferhal_porbe": lambda: None}),
    })


def test_in_tree_backends_are_discovered_by_entry_point(registry):
    for name in ("reference", "cuda_sm100", "ascend950"):
        assert name in registry.names()
        assert registry.records[name].origin == f"inferhal.backends.{name}.plugin"
        assert registry.records[name].registered, registry.records[name].error


def test_check_pending_passes_for_every_registered_backend(registry):
    registry.pm.check_pending()  # raises PluginValidationError on a hookimpl that matches no spec


def test_a_hookimpl_matching_no_spec_is_refused_with_its_name(registry):
    assert "inferhal_porbe" in registry.probe("typo").reason
    assert not registry.probe("typo").available


def test_api_version_mismatch_and_missing_hooks_make_a_backend_unavailable(registry):
    assert f"version {API_VERSION + 1}" in registry.probe("old").reason
    assert "inferhal_kv_storage" in registry.probe("partial").reason


def test_reference_is_available_and_device_backends_are_not_here(registry):
    assert registry.probe("reference").available
    for name in ("cuda_sm100", "ascend950"):
        probe = registry.probe(name)
        assert not probe.available
        assert len(probe.reason) > 20  # a reason a person can act on


def test_unknown_backend_lists_every_backend_and_why(registry):
    with pytest.raises(BackendSelectionError) as err:
        registry.select(BackendConfig(name="cuda_sm1OO"))
    msg = str(err.value)
    assert "unknown backend 'cuda_sm1OO'" in msg and "Did you mean 'cuda_sm100'" in msg
    for name in registry.names():
        assert name in msg
    assert registry.probe("ascend950").reason in msg


def test_unavailable_backend_fails_with_its_reason(registry):
    with pytest.raises(BackendSelectionError, match="fake device missing: plug it in"):
        registry.select(BackendConfig(name="gone"))


def test_a_selection_failure_is_a_user_error(registry):
    from inferhal.core.errors import UserError

    with pytest.raises(UserError):  # the CLI prints it and exits 2, without a traceback
        registry.select(BackendConfig(name="gone"))
    with pytest.raises(BackendSelectionError, match="fake device missing"):
        registry.require(BackendConfig(name="gone"))  # the same answer from the probe alone
    registry.require(BackendConfig(name="fake"))


def test_batch_invariance_is_refused_by_a_backend_that_does_not_declare_it(registry):
    with pytest.raises(BackendSelectionError, match="backend.batch_invariant=true: backend 'fake' does not declare"):
        registry.select(BackendConfig(name="fake", batch_invariant=True))
    ref = registry.select(BackendConfig(name="reference", batch_invariant=True))
    assert ref.profile.supports("batch_invariant")


def test_interpret_is_refused_by_a_backend_without_an_interpreter(registry):
    with pytest.raises(BackendSelectionError, match="backend.interpret=true: backend 'reference' has no interpreter"):
        registry.select(BackendConfig(name="reference", interpret=True))


def test_fallbacks_of_a_batch_invariant_backend_are_batch_invariant():
    from dataclasses import replace

    from inferhal.backends.reference.matmul import tiled_linear

    plugin = make_plugin("inv")
    plain_profile = plugin.inferhal_device_profile  # hookimpl marks the function, it does not wrap it

    def device_profile(config):
        p = plain_profile(config)
        return replace(p, features=p.features | {"batch_invariant"})

    device_profile.__name__ = "inferhal_device_profile"
    plugin.inferhal_device_profile = hookimpl(device_profile)
    reg = BackendRegistry.discover(extra={"inv": plugin})
    fallback = reg.select(BackendConfig(name="inv", batch_invariant=True)).ops.entry("linear").fn
    assert getattr(fallback, "keywords", {}).get("mm") is tiled_linear


def test_selection_gives_exactly_one_active_backend_with_per_op_fallback(registry, caplog):
    active = registry.select(BackendConfig(name="fake"))
    assert active.name == "fake"
    prov = active.ops.provenance()
    assert prov["norm.rms"] == "device"
    assert prov["linear"] == "fallback"
    x = torch.ones(2, 4)
    assert torch.equal(active.ops["norm.rms"](x, None, RmsNormParams()), x * 2)  # native, not the reference
    with caplog.at_level("WARNING", logger="inferhal.ops"):
        y = active.ops["linear"](x, torch.eye(4))
    assert torch.equal(y, x)
    assert "linear falls back to the reference" in caplog.text


def test_strict_refuses_fallback_but_allows_native(registry):
    active = registry.select(BackendConfig(name="fake", strict=True))
    active.ops["norm.rms"]
    with pytest.raises(StrictFallbackError, match="'linear'.*'fake'.*backend.strict=true"):
        active.ops["linear"]


def test_an_op_outside_the_vocabulary_is_refused():
    reg = BackendRegistry.discover(extra={"odd": make_plugin("odd", ops={"norm.rsm": double_rms})})
    with pytest.raises(BackendSelectionError, match="norm.rsm"):
        reg.select(BackendConfig(name="odd"))


def test_duplicate_names_are_refused(registry):
    with pytest.raises(BackendSelectionError, match="already registered"):
        registry.register("fake", make_plugin())


def test_reference_covers_the_whole_vocabulary(registry):
    cov = registry.coverage()["reference"]
    missing = [op for op, level in cov.items() if level != "device"]
    assert not missing, f"reference lacks {missing}"
    assert set(cov) == set(OPS)


def test_coverage_matrix_marks_fallbacks_for_unavailable_backends(registry):
    cov = registry.coverage()
    assert set(cov["ascend950"]) == set(OPS)
    assert all(level in {"device", "interpreter", "compiled", "wired-unrun", "fallback", "absent"}
               for row in cov.values() for level in row.values())


def test_probe_has_no_side_effects_on_import():
    import subprocess
    import sys

    code = ("import sys; from inferhal.core.registry import BackendRegistry; r = BackendRegistry.discover(); "
            "r.probe_all(); print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch_npu', 'triton')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True)
    assert "torch_npu" not in out.stdout
