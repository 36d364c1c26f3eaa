"""Capability data: what a backend says about itself and its device, as frozen plain data.

Core and model code ask a :class:`DeviceProfile` for capabilities (``profile.supports("fp4_grouped_gemm")``)
and never for chip names. Generation differences live inside each backend as data.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping


class ExecLevel(str, enum.Enum):
    """How an op's result was produced. Every report carries one; only ``DEVICE`` is a hardware result."""

    DEVICE = "device"  # ran on the backend's real device
    INTERPRETER = "interpreter"  # ran for real, but in an emulator (e.g. TRITON_INTERPRET=1 on the CPU)
    COMPILED = "compiled"  # compiled ahead of time for the device; not executed
    WIRED_UNRUN = "wired-unrun"  # wired to a device operator whose contract is recorded; never executed
    FALLBACK = "fallback"  # the reference implementation stood in for a missing native op


@dataclass(frozen=True)
class Probe:
    """Result of a side-effect-free availability check."""

    available: bool
    reason: str
    details: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.reason:
            raise ValueError("a Probe needs a reason, also when available (e.g. 'CPU, always available')")
        object.__setattr__(self, "details", MappingProxyType(dict(self.details)))


@dataclass(frozen=True)
class DeviceProfile:
    """A device as data.

    ``peak_flops`` maps dtype names (``"float32"``, ``"bfloat16"``, ``"float8_e4m3fn"``, ``"fp4_e2m1"``)
    to dense peak FLOP/s; ``peak_bandwidth`` is bytes/s of device memory. ``alignment`` holds rules
    such as ``{"gemm_k": 16, "kv_page_bytes": 512}``. ``sources`` records where each number came from.
    """

    backend: str
    device_name: str
    torch_device: str
    exec_level: ExecLevel
    dtypes: frozenset[str]
    features: frozenset[str] = frozenset()
    memory_bytes: int = 0
    peak_bandwidth: float = 0.0
    peak_flops: Mapping[str, float] = field(default_factory=dict)
    alignment: Mapping[str, int] = field(default_factory=dict)
    compute_units: int = 0
    sources: Mapping[str, str] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "exec_level", ExecLevel(self.exec_level))
        object.__setattr__(self, "dtypes", frozenset(self.dtypes))
        object.__setattr__(self, "features", frozenset(self.features))
        for name in ("peak_flops", "alignment", "sources", "extra"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))

    def supports(self, feature: str) -> bool:
        return feature in self.features

    def supports_dtype(self, dtype: Any) -> bool:
        return dtype_name(dtype) in self.dtypes

    def align(self, rule: str, default: int = 1) -> int:
        return int(self.alignment.get(rule, default))


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``; strings pass through."""
    return str(dtype).removeprefix("torch.")
