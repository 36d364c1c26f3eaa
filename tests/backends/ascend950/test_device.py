"""ascend950 probe, generation profiles, reporting and parallel layouts, without an Ascend device."""

from __future__ import annotations

import importlib.resources as res
import subprocess
import sys
import types

import pytest
from omegaconf import OmegaConf

from inferhal.backends.ascend950 import device
from inferhal.backends.ascend950.device import GENERATIONS, Host, generation_of, probe, profile_for
from inferhal.backends.ascend950.ops import NPU_OPS, TRITON_OPS
from inferhal.core.config.schema import ParallelConfig
from inferhal.core.registry import BackendRegistry


def fake_torch_npu(count=1, name="Ascend950PR_9589", fail=None):
    def device_count():
        if fail:
            raise RuntimeError(fail)
        return count

    npu = types.SimpleNamespace(device_count=device_count, get_device_name=lambda i: name)
    return types.SimpleNamespace(npu=npu)


def host(spec=True, nodes=("/dev/davinci0",), cann=True, mod=None):
    return Host(find_spec=lambda n: object() if spec else None, device_nodes=lambda: list(nodes),
                environ={"ASCEND_HOME_PATH": "/opt/cann"} if cann else {}, isdir=lambda p: False,
                import_torch_npu=lambda: mod or fake_torch_npu())


@pytest.mark.parametrize("h,reason", [
    (host(spec=False), "torch_npu is not installed"),
    (host(nodes=()), "no /dev/davinci"),
    (host(cann=False), "no CANN toolkit"),
    (host(mod=fake_torch_npu(fail="libhccl.so: cannot open")), "libhccl.so"),
    (host(mod=fake_torch_npu(count=0)), "device_count() == 0"),
    (host(mod=fake_torch_npu(name="Ascend310P3")), "unknown Ascend SoC 'Ascend310P3'"),
])
def test_probe_says_why(h, reason):
    pr = probe(0, h)
    assert not pr.available and reason in pr.reason


def test_probe_available_maps_the_soc():
    pr = probe(0, host(mod=fake_torch_npu(count=8, name="Ascend910_9392")))
    assert pr.available and pr.details["generation"] == "A3" and pr.details["device_count"] == 8
    assert not probe(8, host(mod=fake_torch_npu(count=8))).available


def test_probe_here_is_unavailable_and_imports_nothing():
    code = ("import sys; from inferhal.core.registry import BackendRegistry; r = BackendRegistry.discover();"
            "p = r.probe('ascend950'); r.coverage();"
            "import inferhal.backends.ascend950.ops, inferhal.backends.ascend950.comm;"
            "assert 'torch_npu' not in sys.modules; print(p.available, p.reason)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/tmp", timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("False")


@pytest.mark.parametrize("soc,gen", [("Ascend950PR_9589", "950PR"), ("Ascend950DT_9691", "950DT"),
                                     ("Ascend910B2", "A2"), ("Ascend910B4", "A2"), ("Ascend910_9382", "A3")])
def test_generation_of(soc, gen):
    assert generation_of(soc).name == gen


def test_bare_950_is_refused():
    with pytest.raises(ValueError, match="unknown Ascend SoC"):
        generation_of("Ascend950")


@pytest.mark.parametrize("gen", sorted(GENERATIONS))
def test_every_number_has_a_source(gen):
    g = GENERATIONS[gen]
    for field in ("memory_bytes", "peak_bandwidth", "peak_flops", "cube_cores", "vector_cores", "ub_bytes"):
        assert g.sources.get(field), f"{gen}.{field} has no source"
    assert "mxfp8/mxfp4" in g.sources
    for field in ("peak_bandwidth", "peak_flops"):
        if not getattr(g, field):
            assert "absent" in g.sources[field]
    if gen.startswith("950"):
        assert "press" in g.sources["peak_bandwidth"]


def test_profiles_carry_capabilities_as_data():
    pr = profile_for("Ascend950PR_9589")
    assert pr.exec_level.value == "wired-unrun" and pr.torch_device == "npu:0"
    assert pr.supports("mxfp4") and pr.supports("mxfp8") and pr.supports_dtype("fp4_e2m1")
    assert pr.peak_bandwidth == 1.6e12 and pr.peak_flops["fp4_e2m1"] == 2e15 and "bfloat16" not in pr.peak_flops
    assert pr.extra["ub_bytes"] == 256 * 1024 and pr.extra["vector_cores"] == 2 * pr.extra["cube_cores"]
    a2 = profile_for("Ascend910B2")
    assert not a2.supports("mxfp4") and a2.extra["ub_bytes"] == 192 * 1024
    assert a2.peak_flops["bfloat16"] == pytest.approx(353.89e12, rel=1e-3)  # 24 x 1.8 GHz x 4096 MAC x 2
    b4 = profile_for("Ascend910B4", memory_bytes=34359738368)
    assert b4.compute_units == 20 and "Ascend910B4.ini" in b4.sources["cube_cores"]
    assert "torch.npu" in b4.sources["memory_bytes"]
    assert profile_for("Ascend950DT_9691").memory_bytes > pr.memory_bytes


def test_coverage_reports_wired_unrun_never_device():
    reg = BackendRegistry.discover()
    row = reg.coverage()["ascend950"]
    assert set(row.values()) <= {"wired-unrun", "fallback", "absent"}
    wired = {op for op, lvl in row.items() if lvl == "wired-unrun"}
    assert wired == set(NPU_OPS) | set(TRITON_OPS) and len(wired) >= 20
    assert not set(NPU_OPS) & set(TRITON_OPS)
    from inferhal.core.cli.cmd_backends import report

    data = report(reg)
    assert not data["probes"]["ascend950"].available
    assert data["coverage"]["ascend950"] == row


def test_provided_ops_are_tagged_wired_unrun(recorder):
    from inferhal.backends.ascend950.ops import provide
    from inferhal.core.ops.table import OpTable
    from inferhal.backends.reference.ops import OPS as REF

    table = OpTable("ascend950", provide(recorder), REF, device.ExecLevel.WIRED_UNRUN)
    prov = table.provenance()
    assert prov["attn.paged"] == "wired-unrun" and prov["attn.compress"] == "wired-unrun"
    assert "triton-ascend" in table.entry("attn.compress").note
    assert "npu_fused_infer_attention_score" in table.entry("attn.paged").note


def test_extras():
    from inferhal.backends.ascend950 import extras

    assert extras.lookup("generations", lambda: None) is GENERATIONS
    assert extras.lookup("contract", lambda: None).SCHEMAS
    assert extras.lookup("nope", lambda: None) is None


LAYOUTS = {"ascend_dsv4_colocated_dp4tp4": (4, 4, "any"), "ascend_dsv4_prefill_dp4tp4": (4, 4, "prefill"),
           "ascend_dsv4_decode_dp8tp2": (8, 2, "decode")}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_parallel_layouts_match_vllm_ascend(name):
    text = (res.files("inferhal.conf") / "parallel" / f"{name}.yaml").read_text()
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ParallelConfig), OmegaConf.create(text)))
    dp, tp, role = LAYOUTS[name]
    assert (cfg.dp, cfg.tp, cfg.role) == (dp, tp, role)
    assert cfg.ep == dp * tp == 16  # one A3 node: 16 dies, experts over all of them


def ascend_layouts():
    return sorted(p.name[:-5] for p in (res.files("inferhal.conf") / "parallel").iterdir()
                  if p.name.startswith("ascend_") and p.name.endswith(".yaml"))


@pytest.mark.parametrize("name", ascend_layouts())
def test_every_ascend_layout_runs_or_is_refused_before_a_process_starts(name):
    from inferhal.core.errors import UserError
    from inferhal.core.parallel.launch import check_layout

    text = (res.files("inferhal.conf") / "parallel" / f"{name}.yaml").read_text()
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ParallelConfig), OmegaConf.create(text)))
    if name in LAYOUTS:  # vllm-ascend's DP x TP layouts: refused by the config check alone (no spawn, no env)
        with pytest.raises(UserError, match="parallel.tp|parallel.role"):
            check_layout(cfg, env={})
    else:  # the EP layout this engine runs: 16 ranks, every one an expert shard
        assert check_layout(cfg, env={}) == 16 and cfg.ep == 16 and cfg.tp == cfg.dp == 1


@pytest.mark.ascend
def test_on_hardware_probe_and_one_op():
    """Runs only on an Ascend host with CANN and torch_npu."""
    pr = probe()
    if not pr.available:
        pytest.skip(f"needs an Ascend NPU with CANN and torch_npu: {pr.reason}")
    import torch
    import torch_npu  # noqa: F401

    from inferhal.backends.ascend950.ops import NpuOps
    from inferhal.backends.reference import ops as ref
    from inferhal.core.ops.params import RmsNormParams

    x = torch.randn(4, 64, dtype=torch.bfloat16)
    y = NpuOps(torch_npu).norm_rms(x.npu(), torch.ones(64).npu(), RmsNormParams())
    assert (y.cpu().float() - ref.norm_rms(x, torch.ones(64), RmsNormParams()).float()).abs().max() < 0.05


def test_on_a_probed_host_the_plugin_tags_ops_device_and_strict_refuses_per_call_fallbacks(monkeypatch, recorder):
    """The plugin's op table (built only after a successful probe) runs its operators on the NPU: level
    "device", so qualify runs them there; with backend.strict=true a call outside an operator's documented
    limits raises instead of reporting a reference result under that level. (Here the fake stands in for
    torch_npu; the level claim is the plugin's, for a real host.)"""
    import torch

    from inferhal.backends.ascend950 import plugin
    from inferhal.core.config.schema import BackendConfig
    from inferhal.core.ops.table import StrictFallbackError

    monkeypatch.setattr(plugin, "_torch_npu", lambda: recorder)
    prof = profile_for("Ascend950PR_9589")
    table = plugin.inferhal_provide_ops(prof, BackendConfig(name="ascend950"))
    assert {impl.level.value for impl in table.values()} == {"device"}
    assert set(table) == set(NPU_OPS) | set(TRITON_OPS)
    x = torch.randn(2, 8, 64)  # hc_mult 8: outside npu_hc_pre_v2's hc_mult 4
    fn, base, scale = torch.zeros(80, 512), torch.zeros(80), torch.ones(3)
    from inferhal.core.ops.params import MhcParams

    table["mhc.pre"](x, fn, base, scale, MhcParams(hc_mult=8))  # not strict: falls back for this call
    strict = plugin.inferhal_provide_ops(prof, BackendConfig(name="ascend950", strict=True))
    with pytest.raises(StrictFallbackError, match="mhc.pre"):
        strict["mhc.pre"](x, fn, base, scale, MhcParams(hc_mult=8))
