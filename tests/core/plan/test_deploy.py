"""Memory, fit, MTP, throughput and cost of a planned deployment; clear errors for bad inputs."""

from __future__ import annotations

import copy
import functools
from dataclasses import replace

import yaml
from omegaconf import OmegaConf

import pytest

from inferhal.core.cli.main import compose
from inferhal.core.errors import UserError
from inferhal.core.plan import deploy, hardware
from inferhal.core.plan.inventory import inventory
from inferhal.core.plan.kv import kv_groups_for

BASE = ["model=deepseek_v4_flash", "parallel=dep8", "cache.kv_dtype=fp8", "plan.device=B200",
        "plan.traffic.prompt_tokens=[8192]", "plan.traffic.output_tokens=[1024]"]


@functools.lru_cache(maxsize=None)
def _base():
    return compose(BASE, "plan")


def planned(*extra: str, prof=None):
    """The plan of BASE with ``extra`` overrides: field values set on one composed config (composing
    costs ~0.2 s each); a group choice (``model=...``) composes anew."""
    if any("." not in o.split("=")[0] for o in extra):
        cfg = compose([*BASE, *extra], "plan")
    else:
        cfg = copy.deepcopy(_base())
        for o in extra:
            key, value = o.split("=", 1)
            OmegaConf.update(cfg, key, yaml.safe_load(value), merge=False)
    inv = inventory(cfg.model, kv_groups_for(cfg.model, str(cfg.cache.kv_dtype)))
    return deploy.plan(cfg, prof or hardware.resolve(str(cfg.plan.device)), inv), cfg, inv


def test_memory_fit_and_the_pareto_front():
    plan, cfg, inv = planned("plan.traffic.batch_sizes=[1,16,256,100000]")
    mem = plan["memory"]
    assert mem["weights"]["experts"] == pytest.approx(147_169_738_752 / 8)  # FP4 experts split over EP8
    assert mem["kv_free_bytes"] == pytest.approx(mem["usable_bytes"] - mem["weights_bytes"] - mem["activations_bytes"])
    per_request = inv.kv_stored(8192 + 1024)
    assert plan["max_batch"] == int(mem["kv_free_bytes"] // per_request)
    fits = {r["batch"]: r["fits"] for r in plan["rows"]}
    assert fits == {1: True, 16: True, 256: True, 100000: False}
    assert plan["max_context"]["1"] == 65536  # the model's max_model_len bounds it, not memory
    assert 0 < plan["max_context"]["100000"] < 9216
    tok = [r["tok_s_device"] for r in plan["rows"][:3]]
    user = [r["tok_s_user"] for r in plan["rows"][:3]]
    assert tok == sorted(tok) and user == sorted(user, reverse=True)  # batching trades per-user for per-device
    assert plan["pareto"] == [1, 16, 256]


def test_mtp_drafts_emit_more_tokens_per_step():
    assert deploy.tokens_per_cycle(0, 0.75) == 1.0
    assert deploy.tokens_per_cycle(3, 0.75) == pytest.approx(1 + 0.75 + 0.75**2 + 0.75**3)
    assert deploy.tokens_per_cycle(2, 1.0) == 3.0
    base, _, _ = planned("plan.traffic.batch_sizes=[1]")
    mtp, _, _ = planned("plan.traffic.batch_sizes=[1]", "plan.draft_tokens=3")
    assert mtp["rows"][0]["tokens_per_step"] == pytest.approx(2.734375)
    assert mtp["rows"][0]["draft_ms"] > 0 and "mtp" in mtp["memory"]["weights"]
    assert mtp["rows"][0]["tok_s_user"] > base["rows"][0]["tok_s_user"]


def test_cost_and_revenue_follow_the_prices():
    plan, _, _ = planned("plan.traffic.batch_sizes=[64]", "plan.gpu_hour_usd=3.6", "plan.price_output_usd=1.0",
                         "plan.price_input_usd=0.5", "plan.price_cached_input_usd=0.1", "plan.traffic.prefix_hit_rate=0.5")
    r = plan["rows"][0]
    assert r["usd_per_mtok"] == pytest.approx(3.6 / 3600 / r["tok_s_device"] * 1e6)
    want = 3600 * (r["tok_s_device"] * 1.0 + r["in_tok_s_device"] * (0.5 * 0.5 + 0.5 * 0.1)) / 1e6
    assert r["revenue_per_device_hour"] == pytest.approx(want)
    assert "usd_per_mtok" not in planned("plan.traffic.batch_sizes=[64]")[0]["rows"][0]


def test_disaggregated_prefill_counts_its_devices():
    colo, _, _ = planned("plan.traffic.batch_sizes=[64]")
    pd, _, _ = planned("plan.traffic.batch_sizes=[64]", "plan.prefill_gpus=2")
    assert pd["layout"]["prefill_devices"] == 2
    assert pd["rows"][0]["limited_by"] in ("prefill", "decode")
    assert pd["rows"][0]["tok_s_user"] > colo["rows"][0]["tok_s_user"]  # no prefill interrupts decoding


def test_arrival_rate_picks_the_smallest_batch_that_serves_it():
    plan, _, _ = planned("plan.traffic.batch_sizes=[1,8,64,256]", "plan.traffic.arrival_rate=20")
    need = 20 * 1024 / 8
    a = plan["arrival"]
    assert a["output_tok_s_device_needed"] == pytest.approx(need)
    rows = {r["batch"]: r for r in plan["rows"]}
    assert rows[a["batch"]]["tok_s_device"] >= need
    assert all(rows[b]["tok_s_device"] < need for b in rows if b < a["batch"])


@pytest.mark.parametrize("override, message", [
    ("plan.experts_format=int3", "plan.experts_format='int3'"),
    ("plan.activation_format=fp6", "plan.activation_format='fp6'"),
    ("plan.traffic.prefix_hit_rate=1.0", "prefix_hit_rate"),
    ("plan.acceptance=1.5", "plan.acceptance"),
    ("plan.traffic.prompt_tokens=[70000]", "max_model_len"),
    ("plan.traffic.batch_sizes=[0]", "batch_sizes"),
    ("parallel.ep=4", "ep = dp\\*tp"),
])
def test_bad_inputs_are_user_errors(override, message):
    with pytest.raises(UserError, match=message):
        planned(override)


def test_unknown_device_names_the_known_ones():
    with pytest.raises(UserError, match="known: .*B200.*H200.*host"):
        hardware.resolve("Z9000")


def test_a_model_that_does_not_fit_is_refused():
    small = replace(hardware.resolve("B200"), memory_bytes=20 * 10**9)
    with pytest.raises(UserError, match="does not fit"):
        planned(prof=small)


def test_a_dtype_the_device_does_not_declare_is_refused_naming_the_devices_that_do():
    with pytest.raises(UserError, match=r"declares no peak FLOP/s for bfloat16 .*plan.device=B200\|B300\|GB300\|H200 "
                                        r"\(`inferhal plan devices`"):
        planned("plan.device=950DT", "plan.activation_format=bfloat16")


def test_a_prefill_pool_too_small_for_the_weights_is_refused():
    with pytest.raises(UserError, match="plan.prefill_gpus=1: 1 device"):
        planned("model=deepseek_v4_1_flash", "cache.kv_dtype=fp4", "plan.prefill_gpus=1")


def test_fp4_experts_on_a_device_without_fp4_gemm_run_at_its_bf16_peak():
    h200, _, _ = planned("plan.device=H200", "plan.traffic.batch_sizes=[1024]")
    assert any("lacks fp4_grouped_gemm" in n for n in h200["notes"])
    b200, _, _ = planned("plan.traffic.batch_sizes=[1024]")
    assert not any("fp4_grouped_gemm" in n for n in b200["notes"])
