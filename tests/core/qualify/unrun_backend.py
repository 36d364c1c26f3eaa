"""A test backend whose one native op is wired to a device operator it cannot run here (wired-unrun)."""

from __future__ import annotations

from cpu_hooks import inferhal_api_version, inferhal_communicator, inferhal_device, inferhal_kv_storage  # noqa: F401 (hooks of this backend too)
from inferhal.core.hookspecs import hookimpl
from inferhal.core.ops.table import OpImpl
from inferhal.core.profile import DeviceProfile, ExecLevel, Probe


@hookimpl
def inferhal_probe():
    return Probe(True, "unrun test backend")


@hookimpl
def inferhal_device_profile(config):
    return DeviceProfile(backend="unrun", device_name="a device that is not here", torch_device="cpu",
                         exec_level=ExecLevel.WIRED_UNRUN, dtypes={"float32", "bfloat16"})


def _never(*args, **kwargs):
    raise AssertionError("a wired-unrun op was called")


@hookimpl
def inferhal_provide_ops():
    return {"norm.rms": OpImpl(_never, ExecLevel.WIRED_UNRUN, "device operator, recorded only")}
