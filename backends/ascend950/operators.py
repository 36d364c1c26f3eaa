"""The operator namespace the ascend950 wrappers call on an Ascend host.

The wrappers (:mod:`.ops`) call every device operator as an attribute of one injected object, by the
name it has in the recorded contract (:data:`~.contract.SCHEMAS`). On a host that object is an
:class:`AscendOperators`, which finds each name where :data:`~.contract.NAMESPACES` says it lives:

- ``torch_npu``: the ``torch_npu`` module's own operators (``npu_rms_norm``, ``npu_grouped_matmul``, ...);
- ``_C_ascend``: vllm-ascend's custom-op library (``torch.ops._C_ascend``: DeepSeek-V4's sparse attention,
  mHC, hash routing), present when ``vllm_ascend.vllm_ascend_C`` imports; absent, those names raise
  ``AttributeError`` and the wrappers fall back to the reference, visibly;
- ``aten``: PyTorch operators on npu tensors (``torch.ops.aten.<name>.<overload>``), whose NPU kernels
  torch_npu's op-plugin registers.

In the tests the injected object is the fake of ``tests/backends/ascend950/fake_npu.py`` instead. Nothing
here imports torch_npu or vllm-ascend at import time.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from inferhal.backends.ascend950.contract import NAMESPACES, SCHEMAS


def aten_overload(op: str) -> tuple[str, str]:
    """``"aten_sort_stable"`` → ``("sort", "stable")``: the aten name and overload of a contract key."""
    name = SCHEMAS[op].split("(", 1)[0]
    base, _, overload = name.partition(".")
    return base, overload or "default"


def load_custom_ops() -> Any | None:
    """``torch.ops._C_ascend`` when vllm-ascend's custom-op library loads on this host, else None."""
    try:
        importlib.import_module("vllm_ascend.vllm_ascend_C")
    except Exception:  # noqa: BLE001  (absent, or built for another CANN: the wrappers fall back)
        return None
    import torch

    return torch.ops._C_ascend


class AscendOperators:
    """Resolves contract operator names to callables: ``ops.npu_hc_post(...)``."""

    def __init__(self, torch_npu: Any, custom_ops: Any | None = None) -> None:
        self._torch_npu = torch_npu
        self._custom = custom_ops

    def __getattr__(self, op: str) -> Callable[..., Any]:
        if op.startswith("_"):
            raise AttributeError(op)
        where = NAMESPACES.get(op, "torch_npu")
        if where == "aten":
            import torch

            base, overload = aten_overload(op)
            return getattr(getattr(torch.ops.aten, base), overload)
        if where == "_C_ascend":
            if self._custom is None:
                raise AttributeError(f"{op} lives in vllm-ascend's custom-op library (torch.ops._C_ascend), which "
                                     f"is not loadable here: install vllm-ascend built for this CANN")
            return getattr(self._custom, op)
        return getattr(self._torch_npu, op)
