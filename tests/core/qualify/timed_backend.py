"""A test backend that says it runs on its device and declares peaks, so qualify times its ops
(the reference's norm.rms and embed), for the baseline/regression tests."""

from __future__ import annotations

from cpu_hooks import inferhal_api_version, inferhal_communicator, inferhal_device, inferhal_kv_storage  # noqa: F401 (hooks of this backend too)
from inferhal.core.hookspecs import hookimpl
from inferhal.core.profile import DeviceProfile, ExecLevel, Probe


@hookimpl
def inferhal_probe():
    return Probe(True, "timed test backend")


@hookimpl
def inferhal_device_profile(config):
    return DeviceProfile(backend="timed", device_name="timed test device", torch_device="cpu",
                         exec_level=ExecLevel.DEVICE, dtypes={"float32", "bfloat16"}, peak_bandwidth=1e11,
                         peak_flops={"float32": 1e12, "bfloat16": 2e12}, sources={"peaks": "made up for a test"})


@hookimpl
def inferhal_provide_ops():
    from inferhal.backends.reference.ops import OPS

    return {"norm.rms": OPS["norm.rms"], "embed": OPS["embed"]}
