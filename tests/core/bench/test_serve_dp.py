"""``inferhal bench serve parallel=dep2`` (core/bench/serve_dp.py): the skewed multi-turn workload, the metric
scraping, and a small run end to end (tiny V4 served as text: 6 sessions, 2 clients, 6 tokens an answer)
whose four variants complete every request with the colocated engine's text and report per-rank balance."""

from __future__ import annotations

import json

import pytest

from inferhal.core.bench.serve_dp import GROUPS, TURNS, VARIANTS, _per_rank, _total, pct, sessions


def test_the_workload_is_skewed_shares_prefixes_and_is_seeded():
    plan = sessions(12)
    assert plan == sessions(12) and plan != sessions(12, seed=1)
    assert all(len(s) == TURNS for s in plan)
    firsts = [s[0] for s in plan]
    long = [p for i, p in enumerate(firsts) if i % 4 == 0]
    short = [p for i, p in enumerate(firsts) if i % 4 and i % 2]
    assert min(map(len, long)) > 3 * max(map(len, short))  # long and short prompts
    heads = {p.split("\n", 1)[0] for p in firsts if p.startswith("System")}
    assert len(heads) == GROUPS  # three system prompts, each shared by several sessions
    assert sum(p.startswith("System") for p in firsts) > GROUPS


def test_metrics_are_read_per_rank_and_summed():
    text = ('inferhal_dp_attention_tokens_total{model_name="m",dp_rank="0"} 12.0\n'
            'inferhal_dp_attention_tokens_total{model_name="m",dp_rank="1"} 30.0\n'
            'inferhal_prefix_cache_hits_total{model_name="m"} 5.0\n')
    assert _per_rank(text, "inferhal_dp_attention_tokens_total") == {0: 12.0, 1: 30.0}
    assert _total(text, "inferhal_dp_attention_tokens_total") == 42.0
    assert _total(text, "inferhal_prefix_cache_hits_total") == 5.0
    assert pct([1.0, 3.0], 50) == 2.0


@pytest.mark.slow
def test_a_small_run_of_every_variant(tmp_path):
    pytest.importorskip("fastapi")
    from inferhal.core.cli.main import main
    from inferhal.core.models.deepseek_v4.make_checkpoint import main as make

    assert make([str(tmp_path / "m"), "--config", "tiny", "--tokenizer", "chars"]) == 0
    out = tmp_path / "serve_dp.json"
    rc = main(["bench", "serve", "model=deepseek_v4_tiny", "model.format=hf", f"model.path={tmp_path / 'm'}",
               "parallel=dep2", "parallel.master_port=0", "cache.num_blocks=256", "bench.concurrency=[2]",
               "bench.num_prompts=6", "bench.max_tokens=6", "bench.warmup=0", f"output={out}"])
    res = json.loads(out.read_text())
    assert rc == 0, res["failures"]
    assert set(res["variants"]) == {name for name, _ in VARIANTS}
    for name, v in res["variants"].items():
        row = v["rows"][0]
        assert row["completed"] == row["requests"] >= 6 and v["server_exit"] == 0
        if name != "colocated":
            assert len(row["rank_attention_tokens"]) == 2 and row["attention_tokens_balance"] >= 1.0
    assert res["variants"]["dep tokens_cache"]["rows"][0]["prefix_hit_rate"] > 0  # later turns find their history
