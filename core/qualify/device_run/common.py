"""What every section of a device run shares: the backends it compares, the level each row carries, the
deadline it works against, the timer, and the variants an op offers.

Nothing here names a device: the backend is a parameter (``--backend NAME``), its device object does the
device-specific work (timed events, synchronisation, an optional host-sync guard) and its extras say what
else it offers (``"op_variants"``, ``"aot_compiler"``, ``"environment"``).
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

#: the sizes a section uses: ``full`` on a device (DeepSeek-V4-Flash shapes), ``reduced`` in an interpreter
#: (the same code on shapes the host runs in seconds)
SCALES = ("full", "reduced")


def log(msg: str) -> None:
    print(f"[device_run {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def level_label(profile) -> str:
    """``device: <name> (<arch>)`` (plus what the target lacks, from the profile's ``degraded`` data), or the
    execution level itself (``interpreter``): what every row of a run says it ran at."""
    level = profile.exec_level.value
    if level != "device":
        return level
    arch = str(profile.extra.get("arch") or "").rstrip("a")
    label = f"device: {profile.device_name}" + (f" ({arch})" if arch else "")
    degraded = sorted(profile.extra.get("degraded") or {})
    return label + (f", degraded target: no {', '.join(degraded)}" if degraded else "")


@dataclass
class Context:
    """One worker's view of the run: the backend under test, the reference on the same device and on the
    host, the scale, and the wall-clock deadline (epoch seconds) its section must end by."""

    backend: str
    interpret: bool = False
    deadline: float = float("inf")
    gemma: str | None = None
    size: str = ""  # "full" | "reduced"; "" = full on a device, reduced elsewhere
    _cache: dict = field(default_factory=dict, repr=False)

    def _select(self):
        if "active" not in self._cache:
            from inferhal.core.config.schema import BackendConfig
            from inferhal.core.registry import BackendRegistry

            reg = BackendRegistry.discover()
            active = reg.select(BackendConfig(name=self.backend, interpret=self.interpret))
            dev = active.profile.torch_device
            ref_cpu = reg.select(BackendConfig(name="reference"))
            ref_dev = ref_cpu if str(dev) == "cpu" else reg.select(
                BackendConfig(name="reference", options={"torch_device": str(dev)}))
            self._cache.update(active=active, ref_dev=ref_dev, ref_cpu=ref_cpu)
        return self._cache

    @property
    def active(self):
        return self._select()["active"]

    @property
    def ref_dev(self):
        """The reference backend on the device under test (the oracle every kernel row compares with)."""
        return self._select()["ref_dev"]

    @property
    def ref_cpu(self):
        return self._select()["ref_cpu"]

    @property
    def dev(self) -> str:
        return str(self.active.profile.torch_device)

    @property
    def label(self) -> str:
        return level_label(self.active.profile)

    @property
    def on_device(self) -> bool:
        return self.active.profile.exec_level.value == "device"

    @property
    def scale(self) -> str:
        return self.size or ("full" if self.on_device else "reduced")

    def left(self) -> float:
        """Seconds until the deadline."""
        return self.deadline - time.time()

    def row(self, section: str, **fields: Any) -> dict:
        return {"section": section, "execution_level": self.label, **fields}

    def late(self, row: dict, emit) -> bool:
        """True once the deadline has passed, ``row`` then emitted as not run."""
        if self.left() >= 0:
            return False
        emit(dict(row, status="not-run", message="the run's deadline passed"))
        return True


def error_text(exc: BaseException, limit: int = 600) -> str:
    return f"{type(exc).__name__}: {exc}"[:limit]


# ------------------------------------------------------------------------------------------------ timer

def bench(fn: Callable[[], Any], device, warmup_ms: float = 25.0, rep_ms: float = 100.0,
          flush_bytes: int = 256 << 20, max_reps: int = 1000, probe_calls: int = 3) -> dict:
    """Median time of ``fn`` in ms, each call after writing a buffer larger than the last-level cache (so each
    call reads its inputs from memory, as in a model step); timed with the device's events when they time
    (``elapsed_time``), else with the host clock around a synchronisation. ``{"ms", "reps", "timer"}``."""
    import torch

    flush = torch.empty(flush_bytes, dtype=torch.uint8, device=device.torch_device)
    ev = device.event()
    timed = hasattr(ev, "elapsed_time")
    fn()
    device.synchronize()
    t0 = time.perf_counter()
    flush.zero_()
    device.synchronize()
    flush_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    for _ in range(probe_calls):
        fn()
    device.synchronize()
    est_ms = max((time.perf_counter() - t0) / max(probe_calls, 1) * 1e3, 1e-3)
    for _ in range(max(0, min(int(warmup_ms / est_ms), 100))):
        fn()
    reps = max(min(3, max_reps), min(int(rep_ms / (est_ms + flush_ms)), max_reps))
    times = []
    if timed:
        marks = [(device.event(), device.event()) for _ in range(reps)]
        for a, b in marks:
            flush.zero_()
            a.record()
            fn()
            b.record()
        device.synchronize()
        times = [a.elapsed_time(b) for a, b in marks]
    else:
        for _ in range(reps):
            flush.zero_()
            device.synchronize()
            t = time.perf_counter()
            fn()
            device.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
    del flush
    return {"ms": statistics.median(times), "reps": reps, "timer": "device events" if timed else "host clock"}


# ------------------------------------------------------------------------------------------------ variants

#: the timer's settings in an interpreter (a dry run: each call once or twice, nothing to average)
QUICK = dict(warmup_ms=0.0, rep_ms=0.0, flush_bytes=1 << 20, max_reps=1, probe_calls=0)


def variants(active, op_id: str) -> dict[str, Callable[..., Any]]:
    """The implementations of ``op_id`` to time and check side by side on the same inputs: ``default`` (what
    the op table runs) and each one the backend's ``"op_variants"`` extra offers for it (a mapping op ID ->
    {variant name -> callable with the op's signature}, e.g. an old and a new decode-attention kernel)."""
    out: dict[str, Callable[..., Any]] = {"default": active.ops[op_id]}
    try:
        offered = active.extra("op_variants") or {}
    except KeyError:
        offered = {}
    for name, fn in dict(offered.get(op_id, {})).items():
        out.setdefault(str(name), fn)
    return out
