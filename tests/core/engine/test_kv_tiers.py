"""The tiers behind the prefix cache in a running engine (the tiny DeepSeek-V4: a window group beside CSA/HCA
groups, each with its own pool): a session's next turn after its blocks left the pool restores them instead of
recomputing, with the outputs of the run whose pool kept them (bit for bit) and of the run that recomputed
(same tokens); a restarted engine finds its prefixes in the disk tier; a damaged file is recomputed."""

from __future__ import annotations

import random
import threading
import time

import pytest

from inferhal.core.engine.llm import LLM
from inferhal.core.errors import UserError
from inferhal.core.sampling.params import SamplingParams

BASE = ["model.max_model_len=1280", "model.arch.max_position_embeddings=2048", "cache.block_size=16"]
SMALL = ["cache.num_blocks=40"]  # 640 tokens a group: two 300-token requests evict a third's blocks
TIER = ["cache.host_tier_bytes=50000000"]
SP = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)


def _p(n: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(3, 190) for _ in range(n)]


def _session(llm, turn1: list[int]) -> tuple:
    """Turn 1, three other sessions (the pool evicts turn 1's blocks), then turn 2 on turn 1's whole history."""
    first = llm.generate([turn1], SP)[0]
    for k in range(3):
        llm.generate([_p(300, 50 + k)], SP)
    second = llm.generate([turn1 + first.token_ids + _p(20, 9)], SP)[0]
    llm.engine.kv_manager.check()
    return first, second


@pytest.fixture(scope="module")
def kept():
    """The reference: a pool big enough to keep turn 1 (a plain prefix hit)."""
    return _session(LLM("deepseek_v4_tiny", backend="reference", overrides=BASE + ["cache.num_blocks=400"]),
                    _p(300, 1))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_next_turn_restores_with_the_outputs_of_a_kept_prefix(kept, mode):
    ov = BASE + SMALL + TIER + (["scheduler.async_scheduling=true"] if mode == "async" else [])
    llm = LLM("deepseek_v4_tiny", backend="reference", overrides=ov)
    first, second = _session(llm, _p(300, 1))
    st = llm.engine.kv_offload.stats()
    assert llm.engine.kv_manager.num_evictions() > 0 and st["tiers"]["host"]["restored"] > 0
    assert second.num_cached_tokens == kept[1].num_cached_tokens == 304  # 19 whole blocks of the 306-token history
    # the restored bytes are the bytes the pool held: bit for bit the kept run's logprobs
    assert (first.token_ids, second.token_ids) == (kept[0].token_ids, kept[1].token_ids)
    assert second.logprobs == kept[1].logprobs


class _SlowGather:
    """The engine's copier with every gather started late on purpose (a test hook): a block handed out again before
    its save read it would reach the tier with its new owner's bytes, and the restored turn's logprobs would differ.
    The first gather also waits (10 s at most) until an allocation asks the pending saves for room, so the pool
    surely waits for a pinned block: with only the fixed delay, on a loaded host the steps were slower than the
    saves and nothing waited (1 of the suite's runs here)."""

    def __init__(self, copier, delay, pending):
        self.copier, self.delay = copier, delay
        self.asked = threading.Event()
        make_room = pending.make_room

        def asked_then_make_room(*a, **k):
            self.asked.set()
            return make_room(*a, **k)

        pending.make_room = asked_then_make_room

    def gather(self, *a):
        self.asked.wait(10)
        time.sleep(self.delay)
        return self.copier.gather(*a)

    def scatter(self, *a):
        return self.copier.scatter(*a)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_slow_saves_still_restore_the_bytes_the_pool_held(kept, mode):
    ov = BASE + SMALL + TIER + (["scheduler.async_scheduling=true"] if mode == "async" else [])
    llm = LLM("deepseek_v4_tiny", backend="reference", overrides=ov)
    tiers = llm.engine.kv_offload
    tiers.copier = _SlowGather(tiers.copier, 0.05, tiers.pending)
    first, second = _session(llm, _p(300, 1))
    st = tiers.stats()
    assert (first.token_ids, second.token_ids) == (kept[0].token_ids, kept[1].token_ids)
    assert second.logprobs == kept[1].logprobs
    assert st["tiers"]["host"]["restored"] > 0 and st["store_waits"] > 0  # the pool waited for pinned blocks
    tiers.close()
    assert st["store_s"] > st["save_s"]  # the saves' time was mostly the worker's


def test_without_tiers_the_turn_recomputes_the_same_tokens(kept):
    llm = LLM("deepseek_v4_tiny", backend="reference", overrides=BASE + SMALL)
    _, second = _session(llm, _p(300, 1))
    assert second.num_cached_tokens == 0 and second.token_ids == kept[1].token_ids


def test_deterministic_mode_restores_bit_for_bit():
    """deterministic=true: restored from the tier or kept in the pool, bit for bit; recomputed, the same tokens.
    (Recomputed is not bit for bit even between a pool hit and a cold run here: a prefix hit's shorter prefill
    moves the logprobs of the third decode by about 1e-7, with or without tiers.)"""
    runs = {}
    for name, extra in (("kept", ["cache.num_blocks=400"]), ("tier", SMALL + TIER), ("none", SMALL)):
        llm = LLM("deepseek_v4_tiny", backend="reference", overrides=BASE + extra + ["deterministic=true"])
        a = _p(288, 3)
        llm.generate([a + [5]], SP)
        for k in range(3):
            llm.generate([_p(300, 60 + k)], SP)
        runs[name] = llm.generate([a + _p(30, 4)], SP)[0]
    assert [runs[k].num_cached_tokens for k in ("kept", "tier", "none")] == [288, 288, 0]
    assert runs["tier"].token_ids == runs["kept"].token_ids == runs["none"].token_ids
    assert runs["tier"].logprobs == runs["kept"].logprobs


def test_a_restart_finds_the_disk_tier_and_a_damaged_file_is_recomputed(kept, tmp_path):
    ov = BASE + SMALL + [f"cache.disk_tier_dir={tmp_path}"]
    turn1 = _p(300, 1)
    llm = LLM("deepseek_v4_tiny", backend="reference", overrides=ov)
    first = llm.generate([turn1], SP)[0]
    llm.engine.kv_offload.close()  # the server stops (its queued writes reach the disk)
    history = turn1 + first.token_ids + _p(20, 9)
    again = LLM("deepseek_v4_tiny", backend="reference", overrides=ov)  # a new process, an empty pool
    second = again.generate([history], SP)[0]
    assert second.num_cached_tokens == 304 and again.engine.kv_offload.stats()["tiers"]["disk"]["restored"] > 0
    assert second.token_ids == kept[1].token_ids and second.logprobs == kept[1].logprobs
    again.engine.kv_offload.close()
    files = sorted(tmp_path.rglob("*.kvb"), key=lambda p: p.name)
    for f in files:  # every CSA block truncated by a byte
        if f.parent.name == "csa":
            f.write_bytes(f.read_bytes()[:-1])
    third_llm = LLM("deepseek_v4_tiny", backend="reference", overrides=ov)
    third = third_llm.generate([history], SP)[0]
    assert third.num_cached_tokens < 304 and third.token_ids == kept[1].token_ids
    assert third_llm.engine.kv_offload.stats()["tiers"]["disk"]["failures"] > 0
    third_llm.engine.kv_offload.close()


def test_tiers_are_refused_without_prefix_caching_and_on_an_unwritable_folder(tmp_path):
    with pytest.raises(UserError, match="cache.enable_prefix_caching=true"):
        LLM("deepseek_v4_tiny", backend="reference",
            overrides=BASE + TIER + ["cache.enable_prefix_caching=false"])
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match="cache.disk_tier_dir"):
        LLM("deepseek_v4_tiny", backend="reference", overrides=BASE + [f"cache.disk_tier_dir={tmp_path}/f/t"])
    with pytest.raises(UserError, match="cache.host_tier_bytes must be >= 0"):
        LLM("deepseek_v4_tiny", backend="reference", overrides=BASE + ["cache.host_tier_bytes=-1"])


def test_retained_windows_serve_a_turn_that_ran_past_its_last_block():
    """cache.retain_windows with a realistic answer: turn 1 (304 prompt tokens, 16 generated) computes 319 tokens,
    15 past its last full block boundary C = 304, where the window groups (8 and 16 tokens, blocks of 16) no longer
    read the block before C. Retention still serves the next turn up to C after other requests cycled the small window
    pools; without it the turn gets the bounded replay's hit, C minus the replay span. Same tokens either way."""
    from inferhal.core.paging.replay import replay_span

    ov = BASE + ["scheduler.max_num_seqs=2", "scheduler.max_num_batched_tokens=64", "cache.kv_cache_bytes=1200000"]
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    turn1, out = _p(304, 1), {}
    for retain in (0, 2):  # a byte budget: the window pools hold two running requests' windows (+ the kept ones)
        llm = LLM("deepseek_v4_tiny", backend="reference", overrides=ov + [f"cache.retain_windows={retain}"])
        first = llm.generate([turn1], sp)[0]
        for k in range(3):
            llm.generate([_p(128, 50 + k)], sp)
        second = llm.generate([turn1 + first.token_ids + _p(32, 9)], sp)[0]
        llm.engine.kv_manager.check()
        out[retain] = (first.token_ids, second.token_ids, second.num_cached_tokens)
        span = replay_span(llm.engine.kv_manager.specs)
    assert out[2][2] == 304 and out[0][2] == 304 - span == 186
    assert out[2][:2] == out[0][:2]
