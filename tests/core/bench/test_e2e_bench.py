"""The e2e benchmark's bookkeeping: per-request percentiles and the speed ratios it reports."""

from __future__ import annotations

import itertools

import pytest

from inferhal.core.bench.bounds import add_compute_bounds, add_weight_bounds
from inferhal.core.bench.e2e import _pct, _plot, inferhal_variants, measure, speed_ratios, summarize


def test_summary_counts_tokens_over_wall_time_and_takes_percentiles_per_request():
    per = [(0.1, 0.02, 16), (0.3, 0.04, 16), (0.2, 0.0, 1)]  # a 1-token request has no TPOT
    r = summarize("inferhal", 8, 2.0, per)
    assert r["output_tokens"] == 33 and r["tok_s"] == pytest.approx(16.5)
    assert r["ttft_p50_ms"] == pytest.approx(200.0) and r["tpot_p50_ms"] == pytest.approx(30.0)
    assert _pct([1.0, 2.0, 3.0, 4.0], 0.95) == pytest.approx(3.85)


def test_every_inferhal_engine_is_compared_with_every_peer_row_at_its_own_concurrency():
    rows = [summarize(e, c, 1.0, [(0.0, 0.0, n)]) for e, c, n in (
        ("inferhal", 8, 40), ("inferhal-bf16", 8, 80), ("transformers", 8, 20), ("transformers-bf16", 8, 40),
        ("llama_cpp", 8, 10), ("transformers", 32, 5))]
    r = speed_ratios(rows, ["inferhal", "inferhal-bf16"])
    assert r["vs_transformers@8"] == 2.0 and r["inferhal-bf16_vs_transformers-bf16@8"] == 2.0
    assert r["inferhal-bf16_vs_transformers@8"] == 4.0 and r["vs_llama_cpp@8"] == 4.0
    assert not any(k.endswith("@32") for k in r)  # no inferhal row at 32: nothing to compare


def test_bf16_runs_beside_fp32_only():
    assert inferhal_variants("float32") == [("inferhal", "float32"), ("inferhal-bf16", "bfloat16")]
    assert inferhal_variants("bfloat16") == [("inferhal", "bfloat16")]


def test_paired_repeats_give_the_median_of_their_ratios():
    ours = {**summarize("inferhal", 8, 1.0, [(0.0, 0.0, 30)]), "tok_s_repeats": [30.0, 10.0, 40.0]}
    peer = {**summarize("transformers", 8, 1.0, [(0.0, 0.0, 10)]), "tok_s_repeats": [10.0, 5.0, 40.0]}
    assert speed_ratios([ours, peer], ["inferhal"]) == {"vs_transformers@8": 2.0}  # ratios 3, 2, 1


def test_measure_interleaves_engines_and_keeps_the_median_repeat():
    calls = []

    def engine(name, speeds):
        it = iter(speeds)

        def run(prompts, c, max_tokens):
            calls.append((name, c, len(prompts)))
            return 1.0, [(0.01, 0.001, next(it))] * len(prompts)
        return run

    runners = {"inferhal": engine("inferhal", [4, 6, 5]), "transformers": engine("transformers", [2, 3, 1])}
    clock = itertools.count()  # each reading: 100 more ticks, 50 of them stolen
    rows = measure(runners, [[1]] * 8, [2], num_prompts=8, max_tokens=4, repeats=3, log=lambda _: None,
                   cpu_times=lambda: (lambda k: (50 * k, 100 * k))(next(clock)),
                   bandwidth=iter([10e9, 12e9]).__next__,  # before and after the level
                   product_rates={"inferhal": iter([300e9, 250e9]).__next__})
    assert [c[0] for c in calls] == ["inferhal", "transformers", "transformers", "inferhal", "inferhal", "transformers"]
    assert all(n == 8 for _, _, n in calls)  # min(num_prompts, 4c) requests at c=2
    by = {r["engine"]: r for r in rows}
    assert by["inferhal"]["tok_s_repeats"] == [32.0, 48.0, 40.0] and by["inferhal"]["tok_s"] == 40.0
    assert by["transformers"]["tok_s"] == 16.0
    assert speed_ratios(rows, ["inferhal"])["vs_transformers@2"] == 2.0  # 32/16, 48/24, 40/8 -> median 2
    assert by["inferhal"]["steal_repeats"] == [0.5] * 3 and by["inferhal"]["steal"] == 0.5
    ours = by["inferhal"]
    assert (ours["read_gbs_start"], ours["read_gbs_end"], ours["read_gbs"]) == (10, 12, 12)
    assert by["transformers"]["read_gbs"] == 12.0  # the best reading of the level, on every row of it
    assert (ours["product_gflops_start"], ours["product_gflops_end"], ours["product_gflops"]) == (300, 250, 300)
    assert "product_gflops" not in by["transformers"]  # an engine's own products: only where it gave a rate


@pytest.mark.parametrize("levels", [[32], [1, 8, 32]])
def test_the_plot_draws_one_level_as_bars_and_several_as_lines(tmp_path, levels):
    rows = [{**summarize(e, c, 1.0, [(0.1, 0.01, 4 * c)]), "read_gbs": 10.0, "product_gflops": 100.0}
            for c in levels for e in ("inferhal", "transformers")]
    add_weight_bounds(rows, {"inferhal": 10**9})
    add_compute_bounds(rows, {"inferhal": 10**9})
    path = tmp_path / "e2e.png"
    _plot(rows, str(path), "toy")
    assert path.stat().st_size > 10_000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_inferhal_runs_without_prefix_caching(monkeypatch):
    """The repeats send the same prompts: a cached block would spare inferhal prefill the peers redo."""
    from inferhal.core.bench import e2e
    from inferhal.core.cli.main import compose
    from inferhal.core.engine.llm import LLM

    seen = []

    class Stop(Exception):
        pass

    def load(cfg):
        seen.append(bool(cfg.cache.enable_prefix_caching))
        raise Stop

    monkeypatch.setattr(LLM, "from_config", staticmethod(load))
    cfg = compose(["model=deepseek_v4_tiny", "bench.peers=[transformers]"], "bench e2e")
    assert cfg.cache.enable_prefix_caching  # on by default
    with pytest.raises(Stop):
        e2e.run(cfg)
    assert seen == [False]
