"""``bash .ci/bootstrap gpu``'s plan (``.ci/bootstrap_gpu.py``) without installing anything: where torch comes
from (the system python's CUDA build, else torch's CUDA wheel, never a local +cpu wheel), what it refuses and
why, the pip command lines, and the dry run on this GPU-less host."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bootstrap_gpu", ROOT / ".ci" / "bootstrap_gpu.py")
bg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bg)
PYPROJECT = (ROOT / "pyproject.toml").read_text()
GPUS = ["GPU 0: NVIDIA H200 (UUID: GPU-0)"]


def _plan(**kw):
    args = dict(py="python3", gpus=GPUS, driver=(13, 0), sys_torch={"error": "ModuleNotFoundError('torch')"},
                venv="absent", extras=["models"], pyproject=PYPROJECT)
    args.update(kw)
    return bg.plan(**args)


def _pip_installs(p):
    return [s for s in p["steps"] if s[1:4] == ["-m", "pip", "install"]]


def test_the_driver_cuda_version_is_read_from_nvidia_smi():
    header = "| NVIDIA-SMI 580.159.04   Driver Version: 580.159.04   CUDA Version: 13.0     |"
    assert bg.driver_cuda(header) == (13, 0)
    assert bg.driver_cuda("| NVIDIA-SMI 550.54  Driver Version: 550.54  CUDA Version: 12.4 |") == (12, 4)
    assert bg.driver_cuda("no header") is None


def test_requirements_are_inferhals_less_torch_and_triton():
    reqs = bg.requirements(PYPROJECT, ["models"])
    names = [r.split("=")[0].split(">")[0].split("<")[0] for r in reqs]
    assert "torch" not in names and "triton" not in names
    assert "pluggy>=1.5,<2" in reqs and "hydra-core>=1.3.2,<1.5" in reqs and any(r.startswith("cuda-python") for r in reqs)
    assert "fastapi>=0.110" in reqs and not any(r.startswith("pytest") for r in reqs)
    assert any(r.startswith("pytest") for r in bg.requirements(PYPROJECT, ["models", "test"]))


def test_a_system_torch_built_for_cuda_is_used_as_it_is():
    p = _plan(sys_torch={"version": "2.11.0+cu130", "cuda": "13.0", "triton": "3.6.0"})
    assert p["source"] == "system" and "2.11.0+cu130" in p["why"] and "triton 3.6.0" in p["why"]
    assert p["steps"][0] == ["python3", "-m", "venv", "--system-site-packages", ".venv"]
    assert not any(a.startswith("torch") for s in _pip_installs(p) for a in s)  # torch stays the system's
    assert ["-c", ".venv/inferhal-gpu-constraints.txt"] == _pip_installs(p)[2][5:7]
    with pytest.raises(bg.PlanError, match="without the system's site packages"):
        _plan(sys_torch={"version": "2.11.0+cu130", "cuda": "13.0"}, venv="isolated")


def test_else_torchs_cuda_wheel_from_the_index_and_never_a_local_cpu_wheel():
    from packaging.specifiers import SpecifierSet

    p = _plan(venv="isolated")  # the system python has no torch; an existing CPU .venv gets the CUDA wheel
    installs = _pip_installs(p)
    assert p["source"] == "index" and installs[1] == [".venv/bin/python", "-m", "pip", "install", "torch===2.13.0"]
    assert not SpecifierSet("===2.13.0").contains("2.13.0+cpu") and SpecifierSet("===2.13.0").contains("2.13.0")
    assert installs[2] == [".venv/bin/python", "-m", "pip", "install", "-q", "--no-deps", "-e", "."]
    assert installs[3][5:7] == ["-c", ".venv/inferhal-gpu-constraints.txt"] and "pluggy>=1.5,<2" in installs[3]
    assert p["steps"][2][:2] == [".venv/bin/python", "-c"] and "torch.version.cuda" in p["steps"][2][2]
    assert p["steps"][-1][:2] == [".venv/bin/python", "-c"]  # what torch sees, last
    other = _plan(index="https://example.invalid/whl/cu126")
    assert ["torch==2.13.0", "--index-url", "https://example.invalid/whl/cu126"] == _pip_installs(other)[1][4:]


def test_a_driver_older_than_the_wheels_cuda_is_refused_with_what_to_do():
    with pytest.raises(bg.PlanError, match=r"CUDA 12\.4 at most.*CUDA 13\.0.*INFERHAL_TORCH_INDEX"):
        _plan(driver=(12, 4))
    assert _plan(driver=(12, 4), index="https://example.invalid/whl/cu124")["source"] == "index"
    assert _plan(driver=(12, 4), sys_torch={"version": "2.9.0+cu124", "cuda": "12.4"})["source"] == "system"
    with pytest.raises(bg.PlanError, match="INFERHAL_TORCH=system"):
        _plan(force="system")
    assert "no GPU" in _plan(gpus=[])["warnings"][0]


def test_the_dry_run_prints_the_plan_and_installs_nothing(tmp_path):
    env = dict(os.environ, PATH="/usr/bin:/bin", PYTHON=sys.executable)  # no nvidia-smi on this host's PATH
    env.pop("INFERHAL_TORCH", None)
    env.pop("INFERHAL_TORCH_INDEX", None)
    before = sorted(p.name for p in (ROOT / ".venv").glob(".inferhal-gpu-*"))
    got = subprocess.run([sys.executable, str(ROOT / ".ci" / "bootstrap_gpu.py"), "--dry-run"], capture_output=True,
                         text=True, env=env, timeout=300)
    assert got.returncode in (0, 2), got.stderr
    if got.returncode == 0:
        assert "0 GPU(s)" in got.stderr and "would run:" in got.stderr and "running:" not in got.stderr
    else:  # the venv here exists without system site packages while this python's torch is a CUDA build
        assert "rm -rf .venv" in got.stderr
    assert sorted(p.name for p in (ROOT / ".venv").glob(".inferhal-gpu-*")) == before


def test_bootstrap_refuses_an_unknown_argument():
    got = subprocess.run(["bash", str(ROOT / ".ci" / "bootstrap"), "gpus"], capture_output=True, text=True, timeout=60)
    assert got.returncode == 2 and "unknown argument 'gpus'" in got.stderr


def test_the_system_steps_run_over_a_python_whose_torch_is_a_cuda_build(tmp_path):
    """The plan's steps other than pip, for real: a venv python (not the system's) with a stand-in CUDA torch;
    the new .venv sees that torch through its .pth, reports it and pins it."""
    import venv

    sysenv = tmp_path / "sys"
    venv.create(sysenv, with_pip=False)
    site = next(sysenv.glob("lib/python*/site-packages"))
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text(
        "__version__ = '2.11.0+cu130'\nclass version:\n    cuda = '13.0'\n"
        "class cuda:\n    is_available = staticmethod(lambda: False)\n")
    (site / "torch-2.11.0+cu130.dist-info").mkdir()
    (site / "torch-2.11.0+cu130.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.11.0+cu130\n")
    py = str(sysenv / "bin" / "python")
    st = bg.system_torch(py)
    assert st["cuda"] == "13.0" and st["site"] == str(site)
    p = _plan(py=py, sys_torch=st)
    work = tmp_path / "repo"
    work.mkdir()
    for step in p["steps"]:
        if step[1:3] != ["-m", "pip"]:
            got = subprocess.run(step, cwd=work, capture_output=True, text=True, timeout=300)
            assert got.returncode == 0, (step[:3], got.stderr)
    assert (work / ".venv" / "inferhal-gpu-constraints.txt").read_text() == "torch==2.11.0+cu130\n"
    assert bg.venv_state(work / ".venv") == "system"
