"""The environment a qualification report was made in: torch, Python and inferhal versions; the backend's own
(its distribution, version and commit, what its probe reported, and its ``environment`` extra: the kernel
compiler, driver or vendor toolkit it runs on); the hash of the resolved config; and the host CPU's model and
flags. Read from package metadata, the backend's hooks and /proc: nothing here touches a device."""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

#: CPU flags that decide which kernels and instructions a CPU run uses (shown first in the report)
SIMD_PREFIXES = ("sse4", "avx", "fma", "f16c", "amx", "vnni", "bf16")


def package_version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def backend_version(name: str) -> dict:
    """The distribution that registers backend ``name`` (its entry point), its version, and for the in-tree
    backends the source tree's git commit (``+dirty`` with uncommitted changes)."""
    dist, version = "unknown", "unknown"
    for ep in md.entry_points(group="inferhal.backends"):
        if ep.name == name:
            d = getattr(ep, "dist", None)
            dist, version = (d.metadata["Name"], d.version) if d is not None else (ep.value.split(":")[0], "unknown")
    out = {"name": name, "distribution": dist, "version": version}
    if dist == "inferhal":
        out["commit"] = _git_commit(Path(__file__).resolve().parents[2])
    return out


def _git_commit(root: Path) -> str:
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({type(exc).__name__})"
    if head.returncode:
        return "unknown (not a git checkout)"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def config_hash(cfg: Any) -> str:
    """sha256 of the resolved config as YAML (keys sorted): equal hashes, equal configurations."""
    from omegaconf import OmegaConf

    text = OmegaConf.to_yaml(cfg, resolve=True, sort_keys=True) if cfg is not None else ""
    return hashlib.sha256(text.encode()).hexdigest()


def cpu_info(path: str = "/proc/cpuinfo") -> dict:
    model, flags = "", []
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() in ("flags", "Features") and not flags:
                    flags = value.split()
    except OSError:
        pass
    model = model or platform.processor() or platform.machine()
    simd = sorted(f for f in flags if f.startswith(SIMD_PREFIXES) or any(p in f for p in ("vnni", "amx")))
    return {"model": model, "logical_cpus": os.cpu_count() or 0, "simd_flags": simd, "flags": sorted(flags)}


def manifest(backend: str, probe_details: Any, cfg: Any, toolchain: Any = None) -> dict:
    """The report's ``manifest`` section. ``probe_details``: what the backend's probe reported (e.g. a driver
    version); ``toolchain``: its ``environment`` extra (``None``: it reports none)."""
    return {
        "torch": package_version("torch"), "inferhal": package_version("inferhal"),
        "python": platform.python_version(),
        "backend": backend_version(backend),
        "probe": {str(k): str(v) for k, v in dict(probe_details or {}).items()},
        "toolchain": ({str(k): str(v) for k, v in dict(toolchain).items()} if toolchain else
                      {"(none)": "the backend reports no toolchain (no 'environment' extra)"}),
        "config_sha256": config_hash(cfg),
        "host": {"os": platform.platform(), "cpu": cpu_info()},
    }
