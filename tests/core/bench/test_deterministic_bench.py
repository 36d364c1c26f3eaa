"""``inferhal bench deterministic`` runs (a tiny model, small sizes) and reports both modes and the check."""

from __future__ import annotations

import json

from inferhal.core.cli.main import main


def test_bench_deterministic_small_run(tmp_path, capsys):
    rc = main(["bench", "deterministic", "model=deepseek_v4_tiny", "bench.concurrency=[1,5]", "bench.max_tokens=4",
               "bench.repeats=1", "bench.warmup=0", f"bench.output_dir={tmp_path}"])
    assert rc == 0
    data = json.loads((tmp_path / "deterministic_deepseek_v4_tiny_reference_float32.json").read_text())
    assert [r["concurrency"] for r in data["rows"]] == [1, 5]
    assert all(r["on_bitwise_equal_alone"] and r["on_tok_s"] > 0 and r["off_tok_s"] > 0 for r in data["rows"])
    assert "cost (off/on)" in capsys.readouterr().out
