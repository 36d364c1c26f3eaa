"""One decode step of V4-Flash on B200 (DP8/EP8) computed by hand, and monotonicity in HBM bandwidth."""

from __future__ import annotations

from dataclasses import replace

import pytest

from inferhal.core.cli.main import compose
from inferhal.core.errors import UserError
from inferhal.core.plan import deploy, hardware, roofline
from inferhal.core.plan.inventory import inventory
from inferhal.core.plan.kv import kv_groups_for


@pytest.fixture(scope="module")
def flash_b200():
    cfg = compose(["model=deepseek_v4_flash", "parallel=dep8", "cache.kv_dtype=fp8", "plan.device=B200"], "plan")
    inv = inventory(cfg.model, kv_groups_for(cfg.model, "fp8"))
    return cfg, inv, hardware.resolve("B200")


def test_one_decode_step_by_hand(flash_b200):
    cfg, inv, prof = flash_b200
    s = deploy.setup(cfg, prof, inv)
    n = 4096
    st = roofline.step(1, 1, inv.kv_read(n), inv.attn_flops(n), s.main, s.layout, s.machine)
    bw, fp8_rate, bf16_rate, nvlink = 8.0e12, 4.5e15, 2.25e15, 900e9  # B200 datasheet rows, per direction
    dense = 6_168_444_544 / bw  # every FP8 product once (memory bound: 2 x 6.17 GFLOP take 2.7 us)
    head = 129_280 * 4096 * 2 / bw
    # attention: 43 window layers x 128 entries, 21 CSA layers x (top-512 entries + all 1024 indexer keys),
    # 20 HCA layers x 32 entries; fp8 records 584 B (entry) and 132 B (key)
    kv = 43 * 128 * 584 + 21 * (512 * 584 + 1024 * 132) + 20 * 32 * 584
    fl = (43 * 128 + 21 * 512 + 20 * 32) * 4 * 64 * 512 + 21 * 1024 * 2 * 64 * 128
    attention = max(kv / bw, fl / bf16_rate)
    # experts: 8 tokens (one per DP rank) route 6 of 256 each; a device holds 32 experts and reads those hit
    share = 1 - (1 - 6 / 256) ** 8
    per_expert = 4096 * (2048 + 128) + 4096 * (1024 + 64)  # MXFP4 gate|up [4096, 4096] + down [4096, 2048]
    experts = max(32 * share * per_expert * 43 / bw, 2 * 6 * 3 * 2048 * 4096 * 43 / fp8_rate)
    # all-to-all: 6 copies of the token, 7/8 of them leave the device, fp8 out (1 + 4/128 B) and bf16 back
    a2a = 43 * 6 * 7 / 8 * 4096 * (1 + 4 / 128 + 2) / nvlink
    assert st["s"] == pytest.approx(dense + head + attention + experts + a2a, rel=1e-9)
    assert st["phases"]["experts"]["bound"] == "memory" and st["phases"]["dense"]["bound"] == "memory"


@pytest.mark.parametrize("batch", [1, 8, 64, 512])
def test_more_hbm_bandwidth_never_slows_a_step(flash_b200, batch):
    cfg, inv, prof = flash_b200
    times = []
    for bw in (1e12, 2e12, 4e12, 8e12, 16e12, 64e12):
        s = deploy.setup(cfg, replace(prof, peak_bandwidth=bw), inv)
        st = roofline.step(batch, batch, batch * inv.kv_read(8192), batch * inv.attn_flops(8192), s.main, s.layout, s.machine)
        times.append((st["s"], any(p["bound"] == "memory" for p in st["phases"].values())))
    for (slow, mem_bound), (fast, _) in zip(times, times[1:]):
        assert fast <= slow
        if mem_bound:
            assert fast < slow  # a memory-bound phase gains from every doubling


def test_touched_experts_and_layout_checks():
    assert roofline.touched(256, 6, 1) == pytest.approx(6 / 256)
    assert roofline.touched(256, 6, 10_000) == pytest.approx(1.0)
    assert roofline.touched(0, 0, 5) == 0.0
    with pytest.raises(UserError, match="ep = dp\\*tp"):
        roofline.Layout(tp=1, dp=4, ep=8)
    with pytest.raises(UserError, match="parallel.tp must be >= 1"):
        roofline.Layout(tp=0)


def test_ep_beyond_the_scale_up_domain_uses_the_scale_out_link(flash_b200):
    cfg, inv, prof = flash_b200
    s16 = deploy.setup(cfg, prof, inv, roofline.Layout(1, 16, 16))
    t, sent, link = roofline.all_to_all_s(64, s16.main, s16.layout, s16.machine)
    assert link.startswith("InfiniBand")
    far = sent * 8 / 15  # 8 of the 15 other devices sit behind the NIC
    assert t == pytest.approx(far / 50e9)
