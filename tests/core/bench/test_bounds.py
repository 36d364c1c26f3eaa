"""The decode-step bounds the e2e benchmark holds its rows to (core/bench/bounds.py)."""

from __future__ import annotations

import pytest

from inferhal.core.bench.bounds import add_compute_bounds, add_weight_bounds, bound_lines
from inferhal.core.bench.e2e import summarize


def test_weight_bounds_are_c_tokens_per_time_to_stream_the_weights_once():
    rows = [{**summarize("inferhal", 32, 1.0, [(0.0, 0.0, 300)]), "read_gbs": 12.0},
            {**summarize("inferhal", 8, 1.0, [(0.0, 0.0, 80)]), "read_gbs": None},
            {**summarize("transformers", 32, 1.0, [(0.0, 0.0, 60)]), "read_gbs": 12.0}]
    add_weight_bounds(rows, {"inferhal": 600_000_000})
    assert rows[0]["bound_tok_s"] == pytest.approx(640.0)  # a step >= 600 MB / 12 GB/s = 50 ms, 32 tokens each
    assert "bound_tok_s" not in rows[1] and rows[1]["weight_bytes_per_step"] == 600_000_000  # no bandwidth
    assert "weight_bytes_per_step" not in rows[2]  # a peer's bytes are not known
    (line,) = bound_lines(rows)
    assert "600 MB" in line and ">= 50 ms" in line and "<= 640 tok/s" in line and "(47% of that bound)" in line
    rows[0].update(tok_s=700.0, read_gbs_start=9.0, read_gbs_end=12.0)  # faster than the readings allow
    (line,) = bound_lines(rows)
    assert "above it" in line and "9.0 before, 12.0 after" in line and "% of that bound" not in line


def test_compute_bounds_are_the_product_rate_over_each_tokens_product_flops():
    rows = [{**summarize("inferhal", 32, 1.0, [(0.0, 0.0, 400)]), "product_gflops": 400.0},
            {**summarize("inferhal", 1, 1.0, [(0.0, 0.0, 20)]), "product_gflops": 400.0},
            {**summarize("transformers", 32, 1.0, [(0.0, 0.0, 100)]), "product_gflops": 400.0}]
    add_compute_bounds(rows, {"inferhal": 500_000_000})
    assert rows[0]["compute_bound_tok_s"] == rows[1]["compute_bound_tok_s"] == pytest.approx(800.0)  # any c
    assert "compute_bound_tok_s" not in rows[2]
    first, second = bound_lines(rows)
    assert "500 MFLOP a token" in first and "400 GFLOP/s" in first and ">= 40 ms a step" in first
    assert "<= 800 tok/s" in first and "(50% of that bound)" in first and ">= 1 ms a step" in second
    rows[0]["tok_s"] = 900.0
    assert "above it" in bound_lines(rows)[0] and "% of that bound" not in bound_lines(rows)[0]


def test_bounds_that_leave_the_head_out_say_so():
    row = {**summarize("inferhal", 1, 1.0, [(0.0, 0.0, 20)]), "read_gbs": 10.0, "product_gflops": 100.0,
           "bounds_without_head": True}
    add_weight_bounds([row], {"inferhal": 200_000_000})
    add_compute_bounds([row], {"inferhal": 400_000_000})
    compute, weights = bound_lines([row])
    assert "products other than the LM head cost 400 MFLOP" in compute
    assert "200 MB of weights other than the LM head" in weights
    del row["bounds_without_head"]
    assert "LM head" not in " ".join(bound_lines([row]))
