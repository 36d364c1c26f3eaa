"""The example out-of-tree backend installs as its own package, registers by entry point and passes the kit."""

from __future__ import annotations

import importlib.metadata as md
import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "minimal_backend"
KIT = "inferhal.core.qualify.pytest_plugin"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(EXAMPLE)], check=True, capture_output=True, text=True, cwd="/")
    return target


#: passed on to the child: the reference's product path (``INFERHAL_PORTABLE_CPU=1`` in CI's portable run) and
#: oneDNN's CPU cap (``ONEDNN_MAX_CPU_ISA=AVX2``: an AVX2-only host), so the kit runs where this process runs
PASSED_ON = ("INFERHAL_PORTABLE_CPU", "ONEDNN_MAX_CPU_ISA")


def _env(site) -> dict:
    return {"PYTHONPATH": str(site), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "COLUMNS": "200",
            "HOME": os.environ.get("HOME", "/tmp"), **{k: os.environ[k] for k in PASSED_ON if k in os.environ}}


@pytest.mark.slow
def test_minimal_backend_passes_the_kit(site, tmp_path):
    # -p only until the installed inferhal registers the kit as a pytest11 entry point
    plugin = [] if any(ep.value == KIT for ep in md.entry_points(group="pytest11")) else ["-p", KIT]
    out = subprocess.run([sys.executable, "-m", "pytest", *plugin, "--inferhal-backend=minimal", "-q", "-rs",
                          "-p", "no:cacheprovider"], capture_output=True, text=True, cwd=tmp_path, env=_env(site),
                         timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "minimal-norm.rms[" in out.stdout or "passed" in out.stdout
    summary = out.stdout.strip().splitlines()[-1]
    assert "failed" not in summary and "passed" in summary, summary


@pytest.mark.slow
def test_minimal_backend_qualifies(site, tmp_path):
    out = subprocess.run([sys.executable, "-m", "inferhal.core.cli.main", "qualify", "backend.name=minimal",
                          "qualify.ops=[norm.rms]", "qualify.progress=false", f"qualify.output_dir={tmp_path}"],
                         capture_output=True, text=True, cwd=tmp_path, env=_env(site), timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    rep = (tmp_path / "minimal-quick" / "report.json").read_text()
    assert '"verdict": "pass"' in rep and '"level": "device"' in rep
