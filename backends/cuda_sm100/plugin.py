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
    from inferhal.backends.cuda_sm100 import device, ops
    from inferhal.kernels.runtime import use_interpreter

    ops.check_options(config.options)
    use_interpreter(bool(config.interpret))  # before any kernel module is imported (raises on a mix)
    if config.interpret:
        return device.interpreter_profile()
    return device.device_profile(config.device_index)


@hookimpl
def inferhal_device(profile):
    if profile.exec_level.value == "interpreter":
        from inferhal.backends.reference.device import ReferenceDevice

        return ReferenceDevice("cpu")
    from inferhal.backends.cuda_sm100.device import CudaDevice

    return CudaDevice(profile.torch_device)


@hookimpl
def inferhal_declared_ops():
    # without probing: what each op would run at here (no GPU is assumed; a probed run reports
    # "device" through the profile). "interpreter" is the level the test suite verifies them at.
    from inferhal.backends.cuda_sm100.ops import KERNEL_OPS

    return dict.fromkeys(KERNEL_OPS, "interpreter")


@hookimpl
def inferhal_op_batch_invariance():
    from inferhal.backends.cuda_sm100.ops import BATCH_INVARIANCE

    return BATCH_INVARIANCE


@hookimpl
def inferhal_provide_ops(profile, config):
    from inferhal.backends.cuda_sm100 import ops

    return ops.provide(profile.exec_level, profile.extra.get("kernel_target", "cuda_sm100"), config.options,
                       bool(config.batch_invariant))


@hookimpl
def inferhal_kv_storage(request, profile):
    from inferhal.backends.reference.device import TorchKVStorage

    return TorchKVStorage(request, profile.torch_device)


@hookimpl
def inferhal_communicator(layout, profile):
    from inferhal.backends.cuda_sm100.comm import make_communicator

    return make_communicator(layout, interpret=profile.exec_level.value == "interpreter", device=profile.torch_device)


@hookimpl
def inferhal_graph_runner(profile):
    if profile.exec_level.value != "device":
        return None  # the interpreter has no graphs: the engine runs eagerly
    from inferhal.backends.cuda_sm100.device import CudaGraphRunner

    return CudaGraphRunner(profile.torch_device)


@hookimpl
def inferhal_backend_extra(name, profile):
    if name == "kernel_sources":
        from inferhal.kernels.registry import KERNELS

        return KERNELS
    if name == "aot_compiler":
        from inferhal.kernels.aot import AotCompiler

        return AotCompiler()
    if name == "environment":
        from inferhal.backends.cuda_sm100.device import environment

        return environment()
    if name == "capabilities":
        from inferhal.backends.cuda_sm100.device import ARCHS, CHIPS

        return {"archs": ARCHS, "chips": CHIPS}
    if name == "device_catalog":
        from inferhal.backends.cuda_sm100.device import catalog

        return catalog()
    if name == "op_variants":  # old and new kernels of the ops backend.options switches (the device run times both)
        from inferhal.backends.cuda_sm100 import ops

        return ops.variants(profile.extra.get("kernel_target", "cuda_sm100"))
    return None
