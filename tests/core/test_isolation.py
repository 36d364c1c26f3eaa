"""The core never imports a device library or a backend, and never names a chip or a backend."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Whole words that would mean core/ knows about a device or a device backend.
FORBIDDEN = re.compile(
    r"torch\.cuda|torch_npu|torch\.npu|\btriton\b|\bcuda\b|cuda_sm100|\bascend\b|ascend\d|\bnpu\b|\bsm_?\d{2,3}a?\b|"
    r"blackwell|hopper|\b[bh][12]00\b|\bb300\b|davinci|\bhccl\b|\bnccl\b",
    re.IGNORECASE,
)


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_import_core_pulls_in_no_device_or_backend():
    mods = json.loads(_run("import sys, json, inferhal.core; print(json.dumps(sorted(sys.modules)))"))
    bad = [m for m in mods if m.split(".")[0] in ("triton", "torch_npu") or m.startswith("inferhal.backends")]
    assert not bad, f"import inferhal.core imported {bad}"


def test_importing_every_core_module_pulls_in_no_device_or_backend():
    code = (
        "import sys, json, pkgutil, importlib, inferhal.core as c\n"
        "failed = {}\n"
        "for m in pkgutil.walk_packages(c.__path__, 'inferhal.core.'):\n"
        "    try: importlib.import_module(m.name)\n"
        "    except Exception as e: failed[m.name] = repr(e)\n"
        "print(json.dumps({'mods': sorted(sys.modules), 'failed': failed}))\n"
    )
    res = json.loads(_run(code))
    assert not res["failed"], f"core modules that fail to import: {res['failed']}"
    bad = [m for m in res["mods"] if m.split(".")[0] in ("triton", "torch_npu") or m.startswith("inferhal.backends")]
    assert not bad, f"importing inferhal.core.* imported {bad}"


@pytest.mark.parametrize("path", sorted((ROOT / "core").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_core_file_names_no_chip_or_backend(path):
    hits = [
        f"{i}: {line.strip()}"
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if FORBIDDEN.search(line)
    ]
    assert not hits, f"{path.relative_to(ROOT)} names a device or backend:\n" + "\n".join(hits)


def test_no_core_module_imports_a_backend_even_at_call_time():
    """STYLE 14: a deferred ``from inferhal.backends... import`` inside a function is still core depending on a
    backend (a bench of one backend lives with that backend; quantisation formats live in core/ops)."""
    import ast

    hits = []
    for path in sorted((ROOT / "core").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            hits += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n.startswith("inferhal.backends")]
    assert not hits, "core imports a backend:\n" + "\n".join(hits)
