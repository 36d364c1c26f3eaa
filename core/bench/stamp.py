"""Where a benchmark result came from, written into its JSON: the commit the run was made at, the date and
the host, and the command that made it. docs/perf/README.md indexes the recorded results by these fields, so
a result says by itself which code and machine produced it instead of leaving that to a doc's prose.

The commit is the source tree's ``git rev-parse HEAD`` with ``+dirty`` when tracked files had uncommitted
changes (the run then measured more than the commit holds); the host is the CPU's model, logical CPUs and the
SIMD flags that pick the CPU kernels (read from /proc/cpuinfo, as qualification reports do), the OS, and
whether a hypervisor runs it. Nothing here touches a device.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys
from pathlib import Path

from inferhal.core.qualify.manifest import _git_commit, cpu_info, package_version

#: the source tree whose commit a result is stamped with (the repository root is the ``inferhal`` package)
ROOT = Path(__file__).resolve().parents[2]


def cpu_ids(path: str = "/proc/cpuinfo") -> str:
    """``vendor family F model M`` of the first CPU (a VM's model name may hide the generation: AMD family 25
    model 17 is Zen 4), or "" where the file is missing."""
    ids: dict[str, str] = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("vendor_id", "cpu family", "model") and key.strip() not in ids:
                    ids[key.strip()] = value.strip()
                elif not line.strip() and ids:
                    break
    except OSError:
        return ""
    return " ".join(f"{k} {ids[k]}" for k in ("vendor_id", "cpu family", "model") if k in ids)


def host() -> dict:
    """``{cpu, cpu_ids, logical_cpus, simd_flags, virtual_machine, os}`` of this machine."""
    cpu = cpu_info()
    return {"cpu": cpu["model"], "cpu_ids": cpu_ids(), "logical_cpus": cpu["logical_cpus"],
            "simd_flags": cpu["simd_flags"], "virtual_machine": "hypervisor" in cpu["flags"],
            "os": platform.platform()}


def stamp(argv: list[str] | None = None) -> dict:
    """``{commit, date, command, host, python, torch}`` for a result made now by ``argv`` (default: this
    process's command line). ``date`` is UTC, ISO 8601 to the second."""
    argv = list(sys.argv if argv is None else argv)
    command = shlex.join([os.path.basename(argv[0]), *argv[1:]]) if argv else ""
    return {"commit": _git_commit(ROOT),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command, "host": host(), "python": platform.python_version(),
            "torch": package_version("torch")}
