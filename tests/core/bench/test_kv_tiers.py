"""``inferhal bench kv_tiers`` end to end on the tiny DeepSeek-V4 (seconds): multi-turn sessions on a pool too small
to keep them, with and without tiers; the report's shape, the tiers' hits and restore times, equal outputs; the
output check and the refusals."""

from __future__ import annotations

import json

import pytest
import torch

from inferhal.core.bench import kv_tiers
from inferhal.core.cli.main import compose
from inferhal.core.config.errors import ConfigError
from inferhal.core.errors import UserError

VARIANTS = ["none", "host", "disk", "kept"]
SHORT = ["model=deepseek_v4_tiny", "bench.max_tokens=4", "bench.repeats=1", "bench.warmup=0",
         "bench.kv_tiers.sessions=3", "bench.kv_tiers.turns=2", "bench.kv_tiers.system_tokens=16",
         "bench.kv_tiers.first_tokens=64", "bench.kv_tiers.turn_tokens=16", "bench.kv_tiers.pool_sessions=1.2",
         f"bench.kv_tiers.variants=[{','.join(VARIANTS)}]"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("kv_tiers")
    cfg = compose([*SHORT, f"output={out / 'kv_tiers.json'}", f"cache.disk_tier_dir={out / 'tiers'}"],
                  "bench kv_tiers")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model's ops are small: on a busy 2-core host two threads wait on each other
    try:
        rc = kv_tiers.run(cfg)
    finally:
        torch.set_num_threads(threads)
    return rc, json.loads((out / "kv_tiers.json").read_text()), out


def test_the_report_has_every_variant_and_turn_and_its_stamp(report):
    rc, res, out = report
    assert rc == 0 and (out / "kv_tiers.png").stat().st_size > 0
    assert [r["variant"] for r in res["variants"]] == VARIANTS
    assert len(res["turns"]) == len(VARIANTS) * 3 * 2 and res["stamp"]["commit"]
    assert res["pool_blocks"] == 9 and res["kept_blocks"] > 3 * res["pool_blocks"]  # ceil(1.2 x 7 blocks)
    assert res["pools"]["none"] == {g: 9 for g, _ in res["groups"]} and res["pools"]["kept"]["csa"] == res["kept_blocks"]
    for r in res["variants"]:
        assert r["ttft_return_p50_ms"] > 0 and r["ttft_return_p90_ms"] >= r["ttft_return_p50_ms"]
        assert r["ttft_cpu_return_p50_ms"] > 0 and r["ttft_cpu_first_p50_ms"] > 0
        assert len(r["repeats"]) == 1
    assert not list((out / "tiers").iterdir())  # the disk variant's folder is gone


def test_tiers_restore_what_the_small_pool_lost_with_equal_outputs(report):
    _, res, _ = report
    rows = {r["variant"]: r for r in res["variants"]}
    assert rows["none"]["tier_rate_return"] == 0 and rows["none"]["restore_us_per_token"] is None
    for v in ("host", "disk"):
        assert rows[v]["tier_rate_return"] > 0.5 and rows[v]["restore_us_per_token"] > 0
        assert rows[v]["hit_rate_return"] > rows["none"]["hit_rate_return"] + 0.5
        assert rows[v]["restore_vs_recompute"] > 0
    assert rows["kept"]["hit_rate_return"] >= rows["host"]["hit_rate_return"] and rows["kept"]["tier_rate_return"] == 0
    for v, c in res["checks"].items():
        assert c["turns"] == 6 and c["tokens_differ"] == [], v
    # restored bytes are the bytes the pool held: the host tier's turns are bit for bit the kept pool's
    assert res["checks"]["host"]["logprobs_equal_kept"] == 6
    ret = [t for t in res["turns"] if t["variant"] == "host" and t["turn"] > 1]
    assert all(t["tier_tokens"] <= t["cached_tokens"] <= t["prompt_tokens"] for t in ret)


def test_compare_names_the_turns_whose_tokens_differ():
    rec = {"repeat": 0, "session": 1, "turn": 2, "logprobs": [{5: -0.5}]}
    records = [dict(rec, variant="none", tokens=[5, 6]), dict(rec, variant="host", tokens=[5, 7]),
               dict(rec, variant="kept", tokens=[5, 6])]
    got = kv_tiers.compare(records)
    assert got["host"]["tokens_differ"] == [[0, 1, 2]] and got["kept"]["tokens_differ"] == []
    assert got["host"]["logprobs_equal_kept"] == 1


@pytest.mark.parametrize("override, message", [
    ("bench.kv_tiers.turns=1", "bench.kv_tiers.turns must be >= 2"),
    ("bench.kv_tiers.variants=[none,cold]", "bench.kv_tiers.variants"),
    ("bench.kv_tiers.pool_sessions=0.5", "bench.kv_tiers.pool_sessions must be >= 1"),
    ("cache.kv_events_endpoint=tcp://*:5557", "cache.kv_events_endpoint is refused"),
    ("cache.enable_prefix_caching=false", "cache.enable_prefix_caching=false is refused"),
])
def test_bad_settings_are_refused_naming_the_field(override, message):
    with pytest.raises(UserError, match=message.replace(".", r"\.").replace("[", r"\[")):
        kv_tiers.plan_of(compose([*SHORT, override], "bench kv_tiers"))


@pytest.mark.parametrize("override", ["bench.concurrency=[2]", "cache.memory_fraction=0.2"])
def test_fields_it_does_not_read_or_sets_itself_are_refused(override):
    with pytest.raises(ConfigError, match=override.split("=")[0].replace(".", r"\.")):
        compose([override], "bench kv_tiers")


def test_the_pool_comes_from_num_blocks_else_the_byte_budget_else_pool_sessions():
    plan = kv_tiers.plan_of(compose(SHORT, "bench kv_tiers"))  # longest turn 104 tokens: 7 blocks of 16
    assert plan.longest == 104 and kv_tiers.pool_blocks(plan, 16, 0, 0)[0] == 9
    assert kv_tiers.pool_blocks(plan, 16, 7, 10 ** 6)[0] == 7 and kv_tiers.pool_blocks(plan, 16, 0, 10 ** 6)[0] == 0
    over = kv_tiers.cache_for("host_retain", compose(SHORT, "bench kv_tiers").cache, plan, 12, 80, "")
    assert over == {"num_blocks": 12, "host_tier_bytes": 4 << 30, "disk_tier_dir": "", "disk_tier_bytes": 0,
                    "retain_windows": 3}
