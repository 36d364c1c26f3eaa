"""Hook implementations of the cpu_amx backend (and nothing else)."""

from __future__ import annotations

from inferhal.core.hookspecs import API_VERSION, hookimpl


@hookimpl
def inferhal_api_version():
    return API_VERSION


@hookimpl
def inferhal_probe():
    from inferhal.backends.cpu_amx import device

    return device.probe()


@hookimpl
def inferhal_device_profile(config):
    from inferhal.backends.cpu_amx import device

    device.check_config(config)
    return device.profile()


@hookimpl
def inferhal_device(profile):
    from inferhal.backends.reference.device import ReferenceDevice

    return ReferenceDevice(profile.torch_device)


@hookimpl
def inferhal_declared_ops():
    from inferhal.backends.cpu_amx.ops import OP_IDS

    return dict.fromkeys(OP_IDS, "device")


@hookimpl
def inferhal_provide_ops(profile):
    from inferhal.backends.cpu_amx import ops

    return ops.provide(profile.exec_level)


@hookimpl
def inferhal_kv_storage(request, profile):
    from inferhal.backends.reference.device import TorchKVStorage

    return TorchKVStorage(request, profile.torch_device)


@hookimpl
def inferhal_communicator(layout):
    from inferhal.backends.cpu_amx.comm import make_communicator

    return make_communicator(layout, backend="gloo")


@hookimpl
def inferhal_graph_runner():
    return None
