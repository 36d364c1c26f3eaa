"""Hook implementations (and nothing else), one per hook of the contract in ``inferhal.core.hookspecs``."""

from __future__ import annotations

from inferhal.core.hookspecs import API_VERSION, hookimpl
from inferhal.core.profile import Probe


@hookimpl
def inferhal_api_version():
    return API_VERSION


@hookimpl
def inferhal_probe(config):
    # side-effect free: no device is touched here
    return Probe(True, "plain PyTorch on the CPU (example backend)")


@hookimpl
def inferhal_device_profile(config):
    from inferhal_minimal.device import profile

    return profile()


@hookimpl
def inferhal_device(profile):
    from inferhal_minimal.device import MinimalDevice

    return MinimalDevice()


@hookimpl
def inferhal_declared_ops():
    from inferhal_minimal.ops import OPS

    return dict.fromkeys(OPS, "device")


@hookimpl
def inferhal_provide_ops(profile):
    from inferhal_minimal.ops import OPS

    return dict(OPS)


@hookimpl
def inferhal_kv_storage(request, profile):
    from inferhal_minimal.device import KVStorage

    return KVStorage(request)


@hookimpl
def inferhal_communicator(layout):
    from inferhal_minimal.comm import SingleRank

    return SingleRank(layout)
