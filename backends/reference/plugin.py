"""Hook implementations of the reference backend (and nothing else)."""

from __future__ import annotations

from inferhal.core.hookspecs import API_VERSION, hookimpl
from inferhal.core.profile import Probe


@hookimpl
def inferhal_api_version():
    return API_VERSION


@hookimpl
def inferhal_probe():
    from inferhal.backends.reference.matmul import describe

    # which path runs the CPU's matrix products (oneDNN packed where its probe passes, else F.linear), and why
    return Probe(True, f"plain PyTorch on the CPU: always available; {describe()}")


@hookimpl
def inferhal_device_profile(config):
    from inferhal.backends.reference import device

    device.check_options(config.options)
    return device.profile(str(config.options.get("torch_device", "cpu")),
                          batch_invariant=config.batch_invariant)


@hookimpl
def inferhal_device(profile):
    from inferhal.backends.reference.device import ReferenceDevice

    return ReferenceDevice(profile.torch_device)


@hookimpl
def inferhal_declared_ops():
    from inferhal.backends.reference.ops import OPS

    return dict.fromkeys(OPS, "device")


@hookimpl
def inferhal_op_batch_invariance():
    from inferhal.backends.reference.ops import batch_invariance

    return batch_invariance()


@hookimpl
def inferhal_provide_ops(profile):
    from inferhal.backends.reference.ops import ops_for

    return ops_for(profile.supports("batch_invariant"))


@hookimpl
def inferhal_kv_storage(request, profile):
    from inferhal.backends.reference.device import TorchKVStorage

    return TorchKVStorage(request, profile.torch_device)


@hookimpl
def inferhal_kv_block_copier(storage):
    from inferhal.backends.reference.device import TorchKVCopier, TorchKVStorage

    return TorchKVCopier(storage) if isinstance(storage, TorchKVStorage) else None


@hookimpl
def inferhal_communicator(layout):
    from inferhal.backends.reference.comm import make_communicator

    return make_communicator(layout, backend="gloo")


@hookimpl
def inferhal_graph_runner():
    return None


@hookimpl
def inferhal_backend_extra(name):
    if name == "environment":  # for a qualification report's manifest: which path runs the CPU's products
        from inferhal.backends.reference.matmul import describe

        return {"products": describe()}
    return None
