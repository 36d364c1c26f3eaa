"""Hook implementations of the cpu_amx backend (and nothing else)."""

from __future__ import annotations

# the reference's device (this CPU, no streams or graphs) and its KV storage, as they are
from inferhal.backends.reference.plugin import inferhal_device, inferhal_graph_runner, inferhal_kv_storage  # noqa: F401
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
def inferhal_declared_ops():
    from inferhal.backends.cpu_amx.ops import OP_IDS

    return dict.fromkeys(OP_IDS, "device")


@hookimpl
def inferhal_op_batch_invariance():
    from inferhal.backends.cpu_amx.ops import batch_invariance

    return batch_invariance()


@hookimpl
def inferhal_provide_ops(profile):
    from inferhal.backends.cpu_amx import ops

    return ops.provide(profile.exec_level)


@hookimpl
def inferhal_communicator(layout):
    from inferhal.backends.cpu_amx.comm import make_communicator

    return make_communicator(layout, backend="gloo")


@hookimpl
def inferhal_backend_extra(name):
    if name == "benchmarks":  # `inferhal bench cpu_linear`: the CPU backends' products against oneDNN's
        return {"cpu_linear": "inferhal.backends.cpu_amx.bench_linear"}
    return None
