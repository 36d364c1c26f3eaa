"""The hooks every in-process test backend here shares (each imports them, and the registry finds them in
its module): the API version, and the reference's CPU device, KV storage and communicator."""

from __future__ import annotations

from inferhal.core.hookspecs import API_VERSION, hookimpl


@hookimpl
def inferhal_api_version():
    return API_VERSION


@hookimpl
def inferhal_device(profile):
    from inferhal.backends.reference.device import ReferenceDevice

    return ReferenceDevice("cpu")


@hookimpl
def inferhal_kv_storage(request, profile):
    from inferhal.backends.reference.device import TorchKVStorage

    return TorchKVStorage(request)


@hookimpl
def inferhal_communicator(layout):
    from inferhal.backends.reference.comm import make_communicator

    return make_communicator(layout)
