"""``inferhal bench ops``: the per-op timer (own time, nesting, sync) and the whole run on a tiny model (no
speed is asserted)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from inferhal.core.bench import ops as bench_ops
from inferhal.core.ops.table import OpTable
from inferhal.core.profile import ExecLevel


def test_timer_counts_calls_and_own_time_with_nested_ops_excluded():
    table = OpTable("fake", {}, {"linear": lambda x, w: time.sleep(0.02) or x,
                                 "norm.rms": lambda x, w, p: time.sleep(0.01) or table["linear"](x, w)},
                    ExecLevel.FALLBACK)
    synced = []
    timer = bench_ops.OpTimer(sync=lambda: synced.append(1))
    with table.intercept(timer):
        table["norm.rms"](1, 2, None)
        table["linear"](1, 2)
    assert timer.calls == {"norm.rms": 1, "linear": 2}
    assert 0.04 <= timer.seconds["linear"] < 0.2  # both linear calls, the nested one included
    assert 0.01 <= timer.seconds["norm.rms"] < 0.018  # without the nested linear's 20 ms
    assert len(synced) == 2 * 3  # before and after every call
    timer.reset()
    assert timer.calls == {} and timer.seconds == {}


def test_a_failing_op_still_counts_and_leaves_the_timer_balanced():
    def bad(x, w):
        raise ValueError("bad op")

    table = OpTable("fake", {}, {"linear": bad, "embed": lambda *a: 0}, ExecLevel.FALLBACK)
    timer = bench_ops.OpTimer()
    with table.intercept(timer):
        with pytest.raises(ValueError, match="bad op"):
            table["linear"](1, 2)
        table["embed"](1, 2, 1.0)
    assert timer.calls == {"linear": 1, "embed": 1} and timer._child == [timer._child[0]]


def test_products_are_also_split_by_weight_shape_with_their_rate():
    table = OpTable("fake", {}, {"linear": lambda x, w: time.sleep(0.01) or x,
                                 "norm.rms": lambda x, w, p: x}, ExecLevel.FALLBACK)
    timer = bench_ops.OpTimer()
    x3, x5, w = torch.zeros(3, 64), torch.zeros(5, 1, 64), torch.zeros(96, 64)
    with table.intercept(timer):
        table["linear"](x3, w)
        table["linear"](x5, w)
        table["linear"](x3, torch.zeros(8, 64))
        table["norm.rms"](x3, w, None)  # not a product: no parts
    assert set(timer.parts) == {("linear", "96x64"), ("linear", "8x64")}
    calls, seconds, flops = timer.parts[("linear", "96x64")]
    assert calls == 2 and flops == 2 * (3 + 5) * 96 * 64 and seconds >= 0.02
    assert bench_ops.product_shape((x3,)) is None and bench_ops.product_shape((x3, torch.zeros(4))) is None
    rep = {"wall": 1.0, "steps": 2, "calls": dict(timer.calls), "seconds": dict(timer.seconds),
           "parts": {k: list(v) for k, v in timer.parts.items()}}
    row = bench_ops.level_row(1, 1, 2, [1.0], [rep], {})
    lin = next(o for o in row["ops"] if o["op"] == "linear")
    assert [q["shape"] for q in lin["parts"]] == ["96x64", "8x64"]  # the larger time first
    q = lin["parts"][0]
    assert q["calls_per_step"] == 1.0 and q["gflops"] == pytest.approx(flops / seconds / 1e9)
    assert "parts" not in next(o for o in row["ops"] if o["op"] == "norm.rms")


def test_device_sync_only_off_the_cpu():
    assert bench_ops.device_sync(torch.device("cpu")) is None
    assert bench_ops.device_sync(torch.device("meta")) is None  # torch has no torch.meta.synchronize


def test_level_row_takes_the_median_profiled_repeat_and_puts_the_rest_outside_ops():
    reps = [{"wall": w, "steps": 10, "calls": {"linear": 20, "sample": 10},
             "seconds": {"linear": w / 2, "sample": w / 4}} for w in (1.0, 3.0, 2.0)]
    row = bench_ops.level_row(4, 8, 64, [0.9, 2.5, 1.9], reps, {"linear": "device", "sample": "fallback"})
    assert row["profiled_wall_s"] == 2.0 and row["steps"] == 10 and row["step_ms"] == pytest.approx(200)
    assert [o["op"] for o in row["ops"]] == ["linear", "sample"]
    lin, samp = row["ops"]
    assert lin == {"op": "linear", "level": "device", "calls_per_step": 2.0, "ms_per_step": pytest.approx(100),
                   "share": pytest.approx(0.5)}
    assert samp["level"] == "fallback" and samp["share"] == pytest.approx(0.25)
    assert row["outside_ms_per_step"] == pytest.approx(50) and row["outside_share"] == pytest.approx(0.25)
    assert row["overhead"] == pytest.approx(statistics_median([1 / 0.9, 3 / 2.5, 2 / 1.9]))
    assert row["tok_s_plain"] == pytest.approx(64 / 1.9)


def statistics_median(xs):
    return sorted(xs)[len(xs) // 2]


def test_bench_ops_runs_the_engine_and_writes_a_table_json_and_plot(tmp_path, capsys):
    from inferhal.core.engine.llm import compose_config

    out = tmp_path / "ops.json"
    cfg = compose_config("deepseek_v4_tiny", "reference", command="bench ops", overrides=[
        "cache.num_blocks=64", "bench.concurrency=[1,3]", "bench.num_prompts=4", "bench.max_tokens=3",
        "bench.repeats=2", f"+output={out}"])
    assert bench_ops.run(cfg) == 0
    assert cfg.cache.enable_prefix_caching is False  # the runs repeat their prompts: each prefills them all
    result = json.loads(out.read_text())
    assert (tmp_path / "ops.png").stat().st_size > 0
    assert result["backend"] == "reference" and result["synchronised_per_op"] is False
    assert [r["concurrency"] for r in result["levels"]] == [1, 3]
    for r in result["levels"]:
        assert r["requests"] == max(r["concurrency"], min(4, 4 * r["concurrency"]))
        assert r["tokens"] == 3 * r["requests"] and r["steps"] >= 3
        ops = {o["op"]: o for o in r["ops"]}
        assert {"embed", "linear", "norm.rms", "lm_head.argmax"} <= set(ops)  # greedy steps skip the logits
        assert "lm_head" not in ops and "sample" not in ops
        shapes = {q["shape"] for q in ops["linear"]["parts"]}
        assert shapes and all(q["gflops"] > 0 for q in ops["linear"]["parts"])
        assert sum(q["calls_per_step"] for q in ops["linear"]["parts"]) == pytest.approx(
            ops["linear"]["calls_per_step"])
        assert all(o["level"] == "device" and o["ms_per_step"] > 0 for o in ops.values())  # reference: the CPU
        assert r["ops_ms_per_step"] + r["outside_ms_per_step"] == pytest.approx(r["step_ms"])
        assert 0 < r["outside_share"] < 1 and r["overhead"] > 0
        assert len(r["profiled_walls_s"]) == len(r["plain_walls_s"]) == 2
    printed = capsys.readouterr().out
    assert "(outside ops)" in printed and "c=3:" in printed
