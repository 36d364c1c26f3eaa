"""The device a plan runs on, as a :class:`~inferhal.core.profile.DeviceProfile`: a backend's ``device_catalog``
extra (datasheet numbers with their sources; no device is touched), or ``host``: the reference backend's
profile of this CPU with its read bandwidth and product rate measured now (core/bench/host.py), or a
profile built from readings a benchmark recorded (:func:`recorded_host`).

Links are ``profile.extra["links"]``: ``scale_up`` / ``scale_out`` → ``name``, ``bandwidth`` (bytes/s per
direction), ``domain`` (devices one scale-up link reaches).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from inferhal.core.errors import UserError
from inferhal.core.profile import DeviceProfile

HOST = "host"


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float  # bytes/s per direction
    domain: int = 1


def catalog() -> dict[str, DeviceProfile]:
    """Every device some installed backend's ``device_catalog`` extra names (no backend is selected)."""
    from inferhal.core.registry import BackendRegistry

    reg = BackendRegistry.discover()
    out: dict[str, DeviceProfile] = {}
    for backend in reg.names():
        for name, prof in (reg.extra(backend, "device_catalog") or {}).items():
            if name in out:
                raise UserError(f"device {name!r} is named by both {out[name].backend} and {backend}: "
                                f"rename one in its device_catalog")
            out[name] = prof
    return out


def resolve(name: str) -> DeviceProfile:
    """``plan.device``: a catalog name, or ``host`` (measured now)."""
    if name == HOST:
        return measured_host()
    devices = catalog()
    if name not in devices:
        raise UserError(f"plan.device={name!r} is not a device any backend describes; known: "
                        f"{', '.join(sorted(devices))}, {HOST} (this CPU, measured)")
    return devices[name]


def measured_host() -> DeviceProfile:
    """This CPU: the reference backend's profile, with its read bandwidth and its products' rate (fp32 and
    bf16, ``torch.nn.functional.linear``) measured now; a few seconds of CPU."""
    import torch

    from inferhal.core.bench import host as readings
    from inferhal.core.config.schema import BackendConfig
    from inferhal.core.registry import BackendRegistry

    prof = BackendRegistry.discover().call("reference", "inferhal_device_profile", config=BackendConfig())
    bw = readings.read_bandwidth()
    lin = torch.nn.functional.linear
    rates = {dt: readings.product_rate(lin, getattr(torch, dt)) for dt in ("float32", "bfloat16")}
    return with_readings(prof, bw, rates, "measured now (core/bench/host.py: read_bandwidth, product_rate of F.linear)")


def with_readings(prof: DeviceProfile, bandwidth: float, rates: dict[str, float], source: str) -> DeviceProfile:
    """``prof`` with a measured (not datasheet) bandwidth and product rates; one device, no links."""
    return replace(prof, peak_bandwidth=float(bandwidth), peak_flops={k: float(v) for k, v in rates.items() if v},
                   sources={**prof.sources, "peak_bandwidth": source, "peak_flops": source},
                   extra={**prof.extra, "links": {}})


def recorded_host(name: str, read_gbs: float, rates_gflops: dict[str, float], source: str) -> DeviceProfile:
    """A CPU host as a benchmark recorded it: read bandwidth (GB/s) and product rates (GFLOP/s) per dtype."""
    from inferhal.core.profile import ExecLevel

    base = DeviceProfile(backend="recorded", device_name=name, torch_device="cpu", exec_level=ExecLevel.DEVICE,
                         dtypes=frozenset(rates_gflops) or frozenset({"float32"}))
    return with_readings(base, read_gbs * 1e9, {k: v * 1e9 for k, v in rates_gflops.items()}, source)


def links(prof: DeviceProfile) -> tuple[Link | None, Link | None]:
    """(scale_up, scale_out) of ``prof``, None where the profile has none."""
    table = dict(prof.extra.get("links", {}) or {})

    def one(key: str) -> Link | None:
        row = table.get(key)
        if not row:
            return None
        return Link(str(row.get("name", key)), float(row.get("bandwidth", 0.0)), int(row.get("domain", 1)))

    return one("scale_up"), one("scale_out")


def rate(prof: DeviceProfile, dtype: str) -> float:
    """Peak FLOP/s of ``prof`` for products in ``dtype``; a clear error when the profile declares none."""
    value = float(prof.peak_flops.get(dtype, 0.0))
    if value <= 0:
        have = ", ".join(f"{k}" for k, v in prof.peak_flops.items() if v) or "none"
        others = sorted(n for n, p in catalog().items() if float(p.peak_flops.get(dtype, 0.0)) > 0)
        where = (f", or plan for a device that declares it: plan.device={'|'.join(others)}" if others
                 else f"; no catalogued device declares {dtype} either")
        raise UserError(f"device {prof.device_name!r} declares no peak FLOP/s for {dtype} (it declares: {have}); "
                        f"choose plan.activation_format among those{where} (`inferhal plan devices` lists every "
                        f"device and its sources; this one's: {prof.sources.get('peaks', prof.sources.get('peak_flops', '-'))})")
    return value


def bandwidth(prof: DeviceProfile) -> float:
    if prof.peak_bandwidth <= 0:
        raise UserError(f"device {prof.device_name!r} declares no memory bandwidth, so no roofline can be drawn "
                        f"({prof.sources.get('peak_bandwidth', 'no source')})")
    return float(prof.peak_bandwidth)
