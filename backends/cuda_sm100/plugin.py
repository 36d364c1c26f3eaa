"""Hook implementations of the cuda_sm100 backend (and nothing else)."""

from __future__ import annotations

from inferhal.core.hookspecs import API_VERSION, hookimpl


@hookimpl
def inferhal_api_version():
    return API_VERSION


@hookimpl
def inferhal_probe(config):
    from inferhal.backends.cuda_sm100 import device

    return device.probe(config.interpret, config.device_index)


@hookimpl
def inferhal_device_profile(config):
    from inferhal.backends.cuda_sm100 import device

    if config.interpret:
        return device.interpreter_profile()
    raise NotImplementedError("cuda_sm100 on a real GPU: the SM100 profile arrives with the kernels")


@hookimpl
def inferhal_device(profile):
    from inferhal.backends.reference.device import ReferenceDevice

    if profile.exec_level.value == "interpreter":
        return ReferenceDevice("cpu")
    raise NotImplementedError("cuda_sm100 streams arrive with the kernels")


@hookimpl
def inferhal_declared_ops():
    from inferhal.backends.cuda_sm100.ops import KERNEL_OPS

    return dict.fromkeys(KERNEL_OPS, "interpreter")


@hookimpl
def inferhal_provide_ops(profile):
    from inferhal.backends.cuda_sm100 import ops

    return ops.provide(profile.exec_level)


@hookimpl
def inferhal_kv_storage(request, profile):
    from inferhal.backends.reference.device import TorchKVStorage

    return TorchKVStorage(request, profile.torch_device)


@hookimpl
def inferhal_communicator(layout, profile):
    from inferhal.backends.cuda_sm100.comm import make_communicator

    return make_communicator(layout, interpret=profile.exec_level.value == "interpreter")
