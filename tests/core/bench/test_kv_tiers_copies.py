"""The step thread's time in tier saves, synchronous against asynchronous (core/bench/kv_tiers_copies.py) on the
tiny DeepSeek-V4 (seconds): both engines save the same bytes and give the same tokens, the synchronous engine's
saves all run on its step thread, and the report carries a ratio per repeat and its median."""

from __future__ import annotations

import json

import pytest

from inferhal.core.bench import kv_tiers_copies


@pytest.mark.slow
def test_sync_and_async_saves_measured_side_by_side(tmp_path):
    out = tmp_path / "copies.json"
    assert kv_tiers_copies.main(["deepseek_v4_tiny", "2", "64", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["repeats"] == 2 and len(res["runs"]) == 2
    for run in res["runs"]:
        sync, asyn = run["sync"], run["async"]
        assert sync["saved_bytes"] == asyn["saved_bytes"] > 0  # the same blocks went down (the tokens were equal)
        assert sync["save_s"] >= sync["store_s"] > 0  # inline: every save ran on the step thread
        assert asyn["store_s"] > 0 and run["ratio_save_s"] == asyn["save_s"] / sync["save_s"]
    assert res["median_ratio_save_s"] > 0 and set(res["median"]) == {"sync", "async"}
