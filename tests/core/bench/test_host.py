"""The host readings the benchmarks record: hypervisor steal from /proc/stat, the memory read bandwidth and
the rate of a product."""

from __future__ import annotations

import time

import pytest
import torch

from inferhal.core.bench import host


def _stat(tmp_path, line: str):
    p = tmp_path / "stat"
    p.write_text(line + "\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    return str(p)


def test_cpu_times_reads_steal_and_the_total_without_guest_time(tmp_path):
    # user nice system idle iowait irq softirq steal guest guest_nice
    assert host.cpu_times(_stat(tmp_path, "cpu  100 0 20 300 5 0 5 70 40 0")) == (70, 500)


@pytest.mark.parametrize("line", ["", "cpu0 1 2 3 4 5 6 7 8", "cpu 1 2 3", "cpu 1 2 x 4 5 6 7 8"])
def test_cpu_times_is_none_for_an_unreadable_stat(tmp_path, line):
    assert host.cpu_times(_stat(tmp_path, line)) is None
    assert host.cpu_times(str(tmp_path / "missing")) is None


def test_steal_share_is_the_stolen_part_of_the_time_between_readings():
    assert host.steal_share((10, 1000), (60, 1200)) == pytest.approx(0.25)
    assert host.steal_share((10, 1000), (10, 1000)) is None  # no time passed
    assert host.steal_share(None, (10, 1000)) is None


def test_read_bandwidth_is_positive_and_checks_its_arguments():
    assert host.read_bandwidth(1 << 20, passes=2) > 0
    with pytest.raises(ValueError, match="nbytes"):
        host.read_bandwidth(0)


def test_product_rate_counts_two_flops_per_multiply_add_over_the_fastest_call():
    calls = []

    def slow_linear(x, w):
        calls.append((tuple(x.shape), tuple(w.shape), x.dtype))
        time.sleep(0.01)
        return x @ w.T

    rate = host.product_rate(slow_linear, torch.bfloat16, shape=(8, 16, 32), passes=3)
    assert len(calls) == 4 and calls[0] == ((8, 32), (16, 32), torch.bfloat16)  # one first call, then the passes
    assert 0 < rate <= 2 * 8 * 16 * 32 / 0.01  # no call was faster than its sleep
    with pytest.raises(ValueError, match="passes"):
        host.product_rate(slow_linear, torch.float32, passes=0)
