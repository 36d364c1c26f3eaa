"""Ops of the ascend950 backend, mapped to torch_npu fused operators by op ID.

Until an op is wired it falls back to the reference implementation, visibly.
"""

from __future__ import annotations

#: op ID -> "module:function" of the torch_npu wrapper (imported lazily, on an NPU host only).
NPU_OPS: dict[str, str] = {}
