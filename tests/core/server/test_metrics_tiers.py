"""The KV tiers' series in /metrics (core/server/metrics.py): gauges follow what each tier holds, counters
grow by what was restored, failed and saved since the last turn of the engine loop."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from inferhal.core.server.metrics import ServerMetrics


def _engine(stats):
    kv = SimpleNamespace(usage=lambda: 0.0)
    sched = SimpleNamespace(running=[], waiting=[], num_preemptions=0, num_draft_tokens=0, num_accepted_tokens=0)
    return SimpleNamespace(scheduler=sched, kv_manager=kv, kv_offload=SimpleNamespace(stats=lambda: stats))


def _samples(m: ServerMetrics) -> dict:
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            if s.name.startswith("inferhal_kv_tier"):
                out[(s.name, s.labels.get("tier"))] = s.value
    return out


def _stats(blocks, restored, failures, saved, restore_s=0.0, pending=0, wait_s=0.0):
    tier = {"blocks": blocks, "bytes": 100 * blocks, "restored": restored, "restored_bytes": 10 * restored,
            "evictions": 0, "failures": failures}
    return {"tiers": {"host": tier, "disk": dict(tier, failures=0)}, "saved": 0, "saved_bytes": saved,
            "save_s": restore_s / 2, "load_s": 0.0, "restore_s": restore_s, "pending_stores": pending,
            "store_wait_s": wait_s}


def test_tier_series_follow_the_engine():
    m = ServerMetrics("tiny")
    m.engine_state(_engine(_stats(5, 2, 1, 1000, 0.25)))
    m.engine_state(_engine(_stats(7, 6, 1, 1500, 0.75)))
    got = _samples(m)
    assert got[("inferhal_kv_tier_blocks", "host")] == 7 and got[("inferhal_kv_tier_bytes", "disk")] == 700
    assert got[("inferhal_kv_tier_hits_total", "host")] == 6 and got[("inferhal_kv_tier_hit_bytes_total", "disk")] == 60
    assert got[("inferhal_kv_tier_failures_total", "host")] == 1 and got[("inferhal_kv_tier_failures_total", "disk")] == 0
    assert got[("inferhal_kv_tier_saved_bytes_total", None)] == 1500
    assert got[("inferhal_kv_tier_restore_seconds_total", None)] == 0.75
    assert got[("inferhal_kv_tier_save_seconds_total", None)] == 0.375


def test_no_tiers_no_series_per_tier():
    m = ServerMetrics("tiny")
    eng = _engine(None)
    eng.kv_offload = None
    m.engine_state(eng)
    got = _samples(m)
    assert not [k for k in got if k[1]] and got[("inferhal_kv_tier_saved_bytes_total", None)] == 0


def test_pending_stores_and_the_time_waited_for_them():
    m = ServerMetrics("tiny")
    m.engine_state(_engine(_stats(5, 2, 1, 1000, pending=9, wait_s=0.5)))
    got = _samples(m)
    assert got[("inferhal_kv_tier_pending_stores", None)] == 9
    assert got[("inferhal_kv_tier_store_wait_seconds_total", None)] == 0.5
    m.engine_state(_engine(_stats(5, 2, 1, 1000, pending=0, wait_s=1.25)))
    got = _samples(m)
    assert got[("inferhal_kv_tier_pending_stores", None)] == 0  # a gauge: what is pending now
    assert got[("inferhal_kv_tier_store_wait_seconds_total", None)] == 1.25  # a counter: the running total
