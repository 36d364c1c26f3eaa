"""Hook implementations of the CPU kernel backends (and nothing else): one class, :class:`CpuPlugin`, whose
instances are cpu_amx (here) and cpu_avx512 (``backends/cpu_avx512/plugin.py``). They differ only in the
package whose ``device``, ``ops`` and ``comm`` modules they construct from; the device (this CPU, no streams
or graphs), its KV storage and the communicator (torch.distributed on gloo) are the reference's.
"""

from __future__ import annotations

import importlib

from inferhal.core.hookspecs import API_VERSION, hookimpl


class CpuPlugin:
    """The hooks of the CPU backend whose modules live in ``package`` (e.g. ``inferhal.backends.cpu_amx``)."""

    def __init__(self, package: str) -> None:
        self.package = package

    def _module(self, leaf: str):
        return importlib.import_module(f"{self.package}.{leaf}")

    @hookimpl
    def inferhal_api_version(self):
        return API_VERSION

    @hookimpl
    def inferhal_probe(self):
        return self._module("device").probe()

    @hookimpl
    def inferhal_device_profile(self, config):
        device = self._module("device")
        device.check_config(config)
        return device.profile()

    @hookimpl
    def inferhal_device(self, profile):
        from inferhal.backends.reference.device import ReferenceDevice

        return ReferenceDevice(profile.torch_device)

    @hookimpl
    def inferhal_kv_storage(self, request, profile):
        from inferhal.backends.reference.device import TorchKVStorage

        return TorchKVStorage(request, profile.torch_device)

    @hookimpl
    def inferhal_graph_runner(self):
        return None

    @hookimpl
    def inferhal_declared_ops(self):
        return dict.fromkeys(self._module("ops").OP_IDS, "device")

    @hookimpl
    def inferhal_op_batch_invariance(self):
        from inferhal.backends.cpu_amx.ops import batch_invariance  # the same kernels' invariance for both

        return batch_invariance()

    @hookimpl
    def inferhal_provide_ops(self, profile):
        return self._module("ops").provide(profile.exec_level)

    @hookimpl
    def inferhal_communicator(self, layout):
        return self._module("comm").make_communicator(layout, backend="gloo")


plugin = CpuPlugin("inferhal.backends.cpu_amx")
