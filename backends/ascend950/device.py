"""Side-effect-free probing of an Ascend NPU, and the device profile as data."""

from __future__ import annotations

import glob
import importlib.util
import os

from inferhal.core.profile import Probe


def probe() -> Probe:
    """Checks, cheapest first, without importing torch_npu unless everything else is there."""
    if importlib.util.find_spec("torch_npu") is None:
        return Probe(False, "torch_npu is not installed (pip install 'inferhal[ascend]' on a host with CANN)")
    nodes = sorted(glob.glob("/dev/davinci[0-9]*"))
    if not nodes:
        return Probe(False, "torch_npu is installed but no /dev/davinci* device node exists: no Ascend NPU here")
    if not os.environ.get("ASCEND_HOME_PATH") and not os.path.isdir("/usr/local/Ascend"):
        return Probe(False, "no CANN toolkit found (ASCEND_HOME_PATH unset, /usr/local/Ascend absent)")
    return Probe(True, f"{len(nodes)} Ascend device node(s) and CANN present; torch_npu not yet initialised",
                 {"device_nodes": len(nodes)})
