"""A deliberately broken backend (registered in-process by the tests): norm.rms forgets the weight for
D >= 512, and linear raises for K that is not a multiple of 128."""

from __future__ import annotations



from inferhal.core.hookspecs import API_VERSION, hookimpl
from inferhal.core.profile import DeviceProfile, ExecLevel, Probe


@hookimpl
def inferhal_api_version():
    return API_VERSION


@hookimpl
def inferhal_probe():
    return Probe(True, "broken test backend: always available")


@hookimpl
def inferhal_device_profile(config):
    return DeviceProfile(backend="broken", device_name="broken test device", torch_device="cpu",
                         exec_level=ExecLevel.DEVICE, dtypes={"float32", "bfloat16"})


@hookimpl
def inferhal_device(profile):
    from inferhal.backends.reference.device import ReferenceDevice

    return ReferenceDevice("cpu")


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


@hookimpl
def inferhal_kv_storage(request, profile):
    from inferhal.backends.reference.device import TorchKVStorage

    return TorchKVStorage(request)


@hookimpl
def inferhal_communicator(layout):
    from inferhal.backends.reference.comm import make_communicator

    return make_communicator(layout)



