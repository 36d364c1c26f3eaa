"""The ascend950 backend's named extras (``ActiveBackend.extra(name)``), for tools and tests only.

- ``"contract"``: the contract module (operator schemas, precondition checks, :class:`RecordingNpu`);
- ``"npu_call_log"``: a factory ``make() -> (RecordingNpu, NpuOps)``: wrappers whose every torch_npu
  call is validated against the contract and logged (``recorder.calls``);
- ``"generations"``: the generation capability table (:data:`device.GENERATIONS`);
- ``"tuning"``: the triton-ascend tuning table and its UB-budget check (``kernels/tuning_ascend950.py``).
- ``"environment"``: torch-npu, triton-ascend and CANN versions for a qualification report (no torch_npu import).
"""

from __future__ import annotations

from typing import Any, Callable


def lookup(name: str, torch_npu: Callable[[], Any]) -> Any:
    if name == "contract":
        from inferhal.backends.ascend950 import contract

        return contract
    if name == "npu_call_log":
        def make():
            from inferhal.backends.ascend950.contract import RecordingNpu
            from inferhal.backends.ascend950.ops import NpuOps

            rec = RecordingNpu(torch_npu())
            return rec, NpuOps(rec)

        return make
    if name == "environment":
        return environment()
    if name == "generations":
        from inferhal.backends.ascend950.device import GENERATIONS

        return GENERATIONS
    if name == "device_catalog":
        from inferhal.backends.ascend950.device import catalog

        return catalog()
    if name == "tuning":
        from inferhal.kernels import tuning_ascend950

        return tuning_ascend950
    return None


def environment() -> dict[str, str]:
    """The toolchain for a qualification report, without importing torch_npu: torch-npu and triton-ascend from
    package metadata, CANN from the toolkit that ASCEND_HOME_PATH points at (its version file), or why none."""
    import os
    from pathlib import Path

    from inferhal.core.qualify.manifest import package_version

    env = {"torch-npu": package_version("torch-npu"), "triton-ascend": package_version("triton-ascend")}
    home = os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME")
    if not home:
        env["CANN"] = "absent: ASCEND_HOME_PATH is unset"
        return env
    env["CANN"] = f"{home} (no version file found)"
    for name in ("version.cfg", "ascend_toolkit_install.info", "compiler/version.info"):
        p = Path(home) / name
        if p.is_file():
            env["CANN"] = f"{home}: " + " ".join(p.read_text(errors="replace").split())[:200]
            break
    return env
