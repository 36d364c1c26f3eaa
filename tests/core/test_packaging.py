"""The repository root is the `inferhal` package; no top-level core/kernels/backends module is installed."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE_DIRS = ("core", "backends", "kernels", "conf")


def _declared() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])


def test_every_package_directory_is_declared_in_pyproject():
    found = {"inferhal"}
    for top in PACKAGE_DIRS:
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT)
            found.add(".".join(("inferhal", *rel.parts)))
    missing = sorted(found - _declared())
    assert not missing, f"add these to [tool.setuptools] packages in pyproject.toml (or `pip install .` misses them): {missing}"


def _data_dirs() -> set[str]:
    """Directories of tracked files under the package directories that hold no ``__init__.py`` (conf/'s config
    groups, fitted weights): Python can import them (namespace packages), so setuptools prints a 40-line warning
    for each one that ships files without being declared."""
    files = subprocess.run(["git", "ls-files", *PACKAGE_DIRS], capture_output=True, text=True, cwd=ROOT,
                           check=True).stdout.split()
    dirs = {pathlib.PurePosixPath(f).parent for f in files}
    return {".".join(("inferhal", *d.parts)) for d in dirs if not (ROOT / d / "__init__.py").is_file()}


def test_every_data_directory_is_declared_so_the_install_is_quiet():
    found = _data_dirs()
    assert "inferhal.conf.model" in found and "inferhal.core.models.deepseek_v4.fitted" in found, found
    missing = sorted(found - _declared())
    assert not missing, f"add these data directories to [tool.setuptools] packages in pyproject.toml: {missing}"


def test_declared_packages_exist():
    for pkg in _declared() - {"inferhal"}:
        d = ROOT.joinpath(*pkg.split(".")[1:])
        if pkg in _data_dirs():  # data only, no __init__.py
            assert not any(f.suffix == ".py" for f in d.iterdir()), pkg
        else:
            assert (d / "__init__.py").is_file(), pkg


def test_torch_is_pinned_and_npu_is_an_extra_only():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "torch==2.13.0" in meta["dependencies"]
    assert not any("torch-npu" in d or "torch_npu" in d for d in meta["dependencies"])
    assert any("torch-npu" in d for d in meta["optional-dependencies"]["ascend"])


def test_no_top_level_core_kernels_or_backends_module_is_importable():
    code = "import importlib.util as u; print([n for n in ('core', 'kernels', 'backends') if u.find_spec(n)])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_configs_ship_as_package_data():
    import importlib.resources as res

    conf = res.files("inferhal.conf")
    assert (conf / "config.yaml").is_file()
    assert (conf / "backend" / "reference.yaml").is_file()
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert {"*.yaml", "**/*.yaml"} <= set(meta["inferhal.conf"]) and "*.c" in meta["inferhal.kernels.cpu"]
