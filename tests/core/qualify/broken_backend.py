"""A deliberately broken backend (registered in-process by the tests): norm.rms forgets the weight for
D >= 512, and linear raises for K that is not a multiple of 128."""

from __future__ import annotations


from cpu_hooks import inferhal_api_version, inferhal_communicator, inferhal_device, inferhal_kv_storage  # noqa: F401 (hooks of this backend too)
from inferhal.core.hookspecs import hookimpl
from inferhal.core.profile import DeviceProfile, ExecLevel, Probe


@hookimpl
def inferhal_probe():
    return Probe(True, "broken test backend: always available")


@hookimpl
def inferhal_device_profile(config):
    return DeviceProfile(backend="broken", device_name="broken test device", torch_device="cpu",
                         exec_level=ExecLevel.DEVICE, dtypes={"float32", "bfloat16"})


def rms(x, weight, p, residual=None):
    from inferhal.backends.reference.ops import norm_rms

    if x.shape[-1] >= 512:  # the bug: the weight is dropped
        return norm_rms(x, None, p, residual)
    return norm_rms(x, weight, p, residual)


def linear(x, w, bias=None):
    if x.shape[-1] % 128:
        raise ValueError(f"K={x.shape[-1]} is not a multiple of the 128-wide tile")
    from inferhal.backends.reference.ops import linear as ref

    return ref(x, w, bias)


@hookimpl
def inferhal_provide_ops():
    return {"norm.rms": rms, "linear": linear}
