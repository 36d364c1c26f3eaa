"""Golden outputs: each model runs from its own qualify level up; below it, it is listed as skipped."""

from __future__ import annotations

import json
from types import SimpleNamespace

from inferhal.core.qualify import golden


def _active():
    profile = SimpleNamespace(exec_level=SimpleNamespace(value="device"))
    return SimpleNamespace(name="reference", profile=profile, config=SimpleNamespace(interpret=False),
                           ops=SimpleNamespace(fallbacks=lambda: []))


def test_recorded_models_carry_their_level_and_gemma_is_full_only():
    data = json.loads(golden.DATA.read_text())
    assert set(data) == set(golden.MODELS)
    assert data["gemma3_270m"]["level"] == "full" and data["deepseek_v4_tiny"]["level"] == "quick"
    for name, spec in data.items():
        assert spec["prompts"] == golden.MODELS[name]["prompts"]
        assert [len(t) for t in spec["tokens"]] == [spec["max_tokens"]] * len(spec["prompts"])


def test_levels_select_models_and_mismatches_fail(monkeypatch):
    data = json.loads(golden.DATA.read_text())
    calls = []

    def fake(model, spec, backend, interpret):
        calls.append(model)
        toks = [list(t) for t in data[model]["tokens"]]
        if model == "gemma3_270m":
            toks[1][-1] += 1  # one token off
        return toks

    monkeypatch.setattr(golden, "_generate", fake)
    quick = golden.run(SimpleNamespace(qualify=SimpleNamespace(level="quick")), _active())
    assert calls == ["deepseek_v4_tiny"]
    by = {r["name"]: r for r in quick}
    assert by["deepseek_v4_tiny"]["status"] == "pass" and by["gemma3_270m"]["status"] == "skipped"
    assert "qualify=full only" in by["gemma3_270m"]["message"]
    full = {r["name"]: r for r in golden.run(SimpleNamespace(qualify=SimpleNamespace(level="full")), _active())}
    assert full["gemma3_270m"]["status"] == "fail" and full["gemma3_270m"]["matched"] == "23/24"
