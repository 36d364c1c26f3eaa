"""Hook implementations of the ascend950 backend (and nothing else)."""

from __future__ import annotations

from inferhal.core.hookspecs import API_VERSION, hookimpl
from inferhal.core.profile import ExecLevel


def _torch_npu():
    """The operator namespace on this host: torch_npu, vllm-ascend's custom ops when loadable, aten."""
    import importlib

    from inferhal.backends.ascend950.operators import AscendOperators, load_custom_ops

    return AscendOperators(importlib.import_module("torch_npu"), load_custom_ops())


@hookimpl
def inferhal_api_version():
    return API_VERSION


@hookimpl
def inferhal_probe(config):
    from inferhal.backends.ascend950 import device

    return device.probe(config.device_index)


@hookimpl
def inferhal_declared_ops():
    from inferhal.backends.ascend950 import ops

    return ops.declared()


@hookimpl
def inferhal_op_batch_invariance():
    from inferhal.backends.ascend950 import ops

    return ops.batch_invariance()


@hookimpl
def inferhal_device_profile(config):
    from inferhal.backends.ascend950 import device

    return device.query_profile(config.device_index)


@hookimpl
def inferhal_device(profile):
    from inferhal.backends.ascend950.device import AscendDevice

    return AscendDevice(profile)


@hookimpl
def inferhal_provide_ops(profile, config):
    from inferhal.backends.ascend950 import ops
    from inferhal.backends.ascend950.contract import RecordingNpu

    npu = _torch_npu()
    if config.options.get("record_npu_calls", False):  # validate + log every call against the contract
        npu = RecordingNpu(npu)
    # inferhal_provide_ops runs only for a selected backend, i.e. after the probe found an NPU with CANN and
    # torch_npu: every operator call below runs on that device, so the ops report level "device" (qualify
    # then runs and checks them); backend.strict=true makes a per-call fallback an error instead of a
    # reference result under that level
    return ops.provide(npu, profile.features, ExecLevel.DEVICE, strict=bool(config.strict))


@hookimpl
def inferhal_kv_storage(request, profile):
    from inferhal.backends.ascend950.device import AscendKVStorage

    return AscendKVStorage(request, profile.torch_device,
                           operator_records=profile.supports("kv_quant_sparse_attn_sharedkv"))


@hookimpl
def inferhal_communicator(layout):
    from inferhal.backends.ascend950.comm import make_communicator

    return make_communicator(layout)


@hookimpl
def inferhal_graph_runner():
    return None  # ACL graph capture (torch.npu.NPUGraph) is not wired: the engine runs eagerly


@hookimpl
def inferhal_backend_extra(name):
    from inferhal.backends.ascend950 import extras

    return extras.lookup(name, _torch_npu)
