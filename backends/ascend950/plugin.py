"""Hook implementations of the ascend950 backend (and nothing else)."""

from __future__ import annotations

from inferhal.core.hookspecs import API_VERSION, hookimpl


@hookimpl
def inferhal_api_version():
    return API_VERSION


@hookimpl
def inferhal_probe():
    from inferhal.backends.ascend950 import device

    return device.probe()


@hookimpl
def inferhal_declared_ops():
    from inferhal.backends.ascend950.ops import NPU_OPS

    return dict.fromkeys(NPU_OPS, "wired-unrun")


@hookimpl
def inferhal_device_profile(config):
    raise NotImplementedError("ascend950 device profile arrives with the torch_npu wiring")


@hookimpl
def inferhal_device(profile):
    raise NotImplementedError("ascend950 device arrives with the torch_npu wiring")


@hookimpl
def inferhal_provide_ops(profile):
    return {}


@hookimpl
def inferhal_kv_storage(request, profile):
    from inferhal.backends.reference.device import TorchKVStorage

    return TorchKVStorage(request, profile.torch_device)


@hookimpl
def inferhal_communicator(layout):
    from inferhal.backends.ascend950.comm import make_communicator

    return make_communicator(layout)
