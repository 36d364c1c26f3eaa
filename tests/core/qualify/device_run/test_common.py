"""What every device-run section shares: the row's level label, the timer (device events where the device
times them, the host clock otherwise, a cache flush before each call) and the variants an op offers."""

from __future__ import annotations

import types

import pytest
import torch

from inferhal.core.profile import DeviceProfile, ExecLevel
from inferhal.core.qualify.device_run import common


def _profile(level: ExecLevel, **extra) -> DeviceProfile:
    return DeviceProfile(backend="b", device_name="Accel X", torch_device="cpu", exec_level=level,
                         dtypes=frozenset({"float32"}), extra=extra)


def test_level_label_says_device_arch_and_what_the_target_lacks():
    assert common.level_label(_profile(ExecLevel.INTERPRETER)) == "interpreter"
    assert common.level_label(_profile(ExecLevel.DEVICE)) == "device: Accel X"
    assert common.level_label(_profile(ExecLevel.DEVICE, arch="gen7a")) == "device: Accel X (gen7)"
    label = common.level_label(_profile(ExecLevel.DEVICE, arch="gen7a", degraded={"fp4_mma": "why", "tmem": "why"}))
    assert label == "device: Accel X (gen7), degraded target: no fp4_mma, tmem"


class _Event:
    """A timed event on a fake device clock: each call of the timed function advances it by 2 ms."""

    def __init__(self, dev) -> None:
        self.dev, self.at = dev, None

    def record(self) -> None:
        self.at = self.dev.clock

    def elapsed_time(self, other) -> float:
        return other.at - self.at


class _Device:
    def __init__(self, timed: bool) -> None:
        self.torch_device, self.timed, self.clock, self.syncs = torch.device("cpu"), timed, 0.0, 0

    def synchronize(self) -> None:
        self.syncs += 1

    def event(self):
        return _Event(self) if self.timed else types.SimpleNamespace(record=lambda: None, synchronize=lambda: None)


def test_bench_times_with_device_events_when_the_device_has_them():
    dev = _Device(timed=True)
    calls = []

    def fn():
        calls.append(1)
        dev.clock += 2.0

    got = common.bench(fn, dev, warmup_ms=0.0, rep_ms=0.0, flush_bytes=1024)
    assert got["timer"] == "device events" and got["ms"] == pytest.approx(2.0) and got["reps"] == 3
    assert len(calls) == 1 + 3 + 3  # the first call, the estimate, the timed reps


def test_bench_times_with_the_host_clock_otherwise():
    dev = _Device(timed=False)
    got = common.bench(lambda: torch.ones(64).sum(), dev, warmup_ms=1.0, rep_ms=5.0, flush_bytes=1024, max_reps=20)
    assert got["timer"] == "host clock" and got["ms"] > 0 and 3 <= got["reps"] <= 20 and dev.syncs >= 2 * got["reps"]
    quick = common.bench(lambda: None, dev, **common.QUICK)
    assert quick["reps"] == 1


def test_variants_are_the_op_tables_and_the_backends_op_variants():
    table = {"linear": "table-linear", "attn.paged": "table-attn"}

    class Active:
        ops = table

        def __init__(self, offered):
            self.offered = offered

        def extra(self, name):
            if name != "op_variants" or self.offered is None:
                raise KeyError(name)
            return self.offered

    assert common.variants(Active(None), "linear") == {"default": "table-linear"}
    got = common.variants(Active({"attn.paged": {"split_kv": "new", "default": "ignored"}}), "attn.paged")
    assert got == {"default": "table-attn", "split_kv": "new"}  # the table's own stays the default
    assert common.variants(Active({"attn.paged": {"x": 1}}), "linear") == {"default": "table-linear"}


def test_context_deadline_and_rows(monkeypatch):
    ctx = common.Context("reference", deadline=100.0)
    monkeypatch.setattr(common.time, "time", lambda: 40.0)
    assert ctx.left() == 60.0
    ctx._cache.update(active=types.SimpleNamespace(profile=_profile(ExecLevel.DEVICE, arch="gen7a")))
    assert ctx.row("perf", name="n") == {"section": "perf", "execution_level": "device: Accel X (gen7)", "name": "n"}
    assert ctx.on_device and ctx.scale == "full"
    ctx.size = "reduced"  # --scale reduced
    assert ctx.scale == "reduced"
