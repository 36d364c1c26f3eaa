"""The DP ranks' ``/metrics`` series (core/server/dp_metrics.py) with stand-in gauges: after elastic EP goes on
without a rank, none of its series stays at its last value, the survivors keep their ``dp_rank`` labels, and the
balance figures (expert load included) are taken over the survivors; a restart shows the lost rank again."""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402

from inferhal.core.server.dp_metrics import DPMetrics  # noqa: E402


def gauges(rank: int, expert_rows: list, kv_blocks: int = 0) -> dict:
    """One rank's gauges as ServeDPEngine.gauges sends them (only the keys DPMetrics reads)."""
    return {"running": 1, "waiting": 0, "kv_usage": 0.1 * rank, "kv_blocks": kv_blocks, "prefill_tokens": 2,
            "kv_tokens": 10 * (rank + 1), "prompt_tokens": 5, "cached_tokens": 1, "generation_tokens": 3 + rank,
            "attn_tokens": 7 * (rank + 1), "prefix_placed": 0, "session_placed": 0, "expert_rows": expert_rows}


def rows(layers: int, slots: int, value) -> list:
    return [[value(layer, s) for s in range(slots)] for layer in range(layers)]


def value(reg, name, **labels):
    return reg.get_sample_value(name, {"model_name": "m", **labels})


def test_a_lost_ranks_series_go_and_the_balance_is_over_the_survivors():
    reg = CollectorRegistry()
    m = DPMetrics(reg, "m", 3)
    # 2 MoE layers, 18 slots (6 a rank): every rank routes one row to each slot
    m.update([gauges(r, rows(2, 18, lambda layer, s: 1), kv_blocks=4 + r) for r in range(3)])
    assert value(reg, "inferhal_dp_kv_blocks_in_use", dp_rank="1") == 5
    assert value(reg, "inferhal_dp_expert_load", dp_rank="1", layer="0") == 18  # 3 ranks x its 6 slots
    assert value(reg, "inferhal_dp_balance", figure="expert_load") == 1.0

    # rank 1 lost: the survivors hold 12 slots (6 each); rank 0's slots take 3 rows a slot, rank 2's 1
    survivors = rows(2, 12, lambda layer, s: 3 if s < 6 else 1)
    m.update([gauges(0, survivors, kv_blocks=0), {}, gauges(2, survivors, kv_blocks=0)], lost=[1])
    text = generate_latest(reg).decode()
    assert 'dp_rank="1"' not in text  # no gauge, counter or expert load of the lost rank left at its last value
    assert value(reg, "inferhal_dp_kv_blocks_in_use", dp_rank="0") == 0
    assert value(reg, "inferhal_dp_kv_blocks_in_use", dp_rank="2") == 0  # the survivors under their own labels
    assert value(reg, "inferhal_dp_expert_load", dp_rank="0", layer="1") == 2 * 6 * 3
    assert value(reg, "inferhal_dp_expert_load", dp_rank="2", layer="1") == 2 * 6 * 1
    # max / mean over the two survivors: 72 / ((72 + 24) / 2) = 1.5 (over three ranks with a stale one it was 1.0)
    assert value(reg, "inferhal_dp_balance", figure="expert_load") == pytest.approx(1.5)
    # attention tokens 7 and 21 -> 21 / 14; load tokens 2 + 10 and 2 + 30 -> 32 / 22
    assert value(reg, "inferhal_dp_balance", figure="attention_tokens") == pytest.approx(1.5)
    assert value(reg, "inferhal_dp_balance", figure="load_tokens") == pytest.approx(32 / 22)

    # the whole group restarts: rank 1's series come back, its counters from 0
    m.restarted()
    m.update([{}, {}, {}])
    assert value(reg, "inferhal_dp_kv_blocks_in_use", dp_rank="1") == 0
    assert value(reg, "inferhal_dp_generation_tokens_total", dp_rank="1") == 0
    m.update([gauges(r, rows(2, 18, lambda layer, s: 1)) for r in range(3)])
    assert value(reg, "inferhal_dp_generation_tokens_total", dp_rank="1") == 4
    assert value(reg, "inferhal_dp_balance", figure="expert_load") == 1.0
