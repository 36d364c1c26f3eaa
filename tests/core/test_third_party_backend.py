"""An out-of-tree backend, installed as its own package with its own entry point, is discovered and selected."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "dummy_backend"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target), str(FIXTURE)],
        check=True, capture_output=True, text=True, cwd="/",
    )
    return target


def test_dummy_backend_is_discovered_and_selected(site):
    code = (
        "from inferhal.core.registry import BackendRegistry\n"
        "from inferhal.core.config.schema import BackendConfig\n"
        "r = BackendRegistry.discover()\n"
        "rec = r.records['dummy']\n"
        "a = r.select(BackendConfig(name='dummy'))\n"
        "print(rec.origin, a.name, a.ops.provenance()['norm.rms'], a.ops.provenance()['linear'])\n"
    )
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["inferhal_dummy_backend.plugin", "dummy", "device", "fallback"]


def test_dummy_backend_shows_in_the_cli_table(site):
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "COLUMNS": "200"}
    out = subprocess.run([sys.executable, "-m", "inferhal.core.cli.main", "backends"], capture_output=True,
                         text=True, cwd="/", env=env)
    assert out.returncode == 0, out.stderr
    assert "dummy" in out.stdout and "always available" in out.stdout
