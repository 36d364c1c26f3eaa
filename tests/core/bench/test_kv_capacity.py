"""bench kv_capacity: planning arithmetic only; the one-pool-per-group plan holds what the padded shared pool could not."""

import json

from inferhal.core.bench import kv_capacity
from inferhal.core.cli.main import compose


def test_kv_capacity_table_json_and_numbers(tmp_path, capsys):
    cfg = compose([f"bench.output_dir={tmp_path}", "cache.kv_cache_bytes=8589934592"], "bench kv_capacity")
    assert kv_capacity.run(cfg) == 0
    rows = json.loads((tmp_path / "kv_capacity.json").read_text())["rows"]
    at = {(r["model"], r["kv_dtype"], r["context"]): r for r in rows}
    flash32 = at[("deepseek_v4_flash", "auto", 32768)]
    assert flash32["requests_shared_pool"] == 0 and flash32["requests"] >= 20  # 16.7 GiB a request before
    assert at[("deepseek_v4_flash", "fp8", 32768)]["requests"] > flash32["requests"]
    assert at[("deepseek_v4_1_flash", "fp4", 32768)]["global_bytes_per_token"] == 890.0
    assert "32K" in capsys.readouterr().out
