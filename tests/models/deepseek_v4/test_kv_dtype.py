"""``cache.kv_dtype=fp8|fp4`` on DeepSeek-V4 (reference backend, fp32 compute): the window, compressed and
indexer-key groups hold records (core/paging/formats.py), the model reads them back, and its logits stay within
a stated distance of the model-dtype cache.

Tolerances (teacher-forced over 2 x 80 tokens of the tiny random config, ``inferhal bench kv_fidelity`` has the
full table): the codec's own error is ~2.5 % (FP8) and ~10 % (FP4) of a record's L2 norm
(tests/backends/reference/test_kv_records.py); this random model amplifies KV noise ~2.3x into its logits
(1 % Gaussian noise on the KV gave 2.3 %), and a flipped indexer top-k choice adds more. Measured: FP8 rel. L2
0.11 and 91 % top-1 agreement, FP4 0.21 and 73 %. Enforced with headroom: FP8 <= 0.16 and >= 85 %, FP4 <= 0.32
and >= 62 %, FP8 better than FP4."""

from __future__ import annotations

import pytest
import torch

from inferhal import LLM, SamplingParams
from inferhal.core.bench.kv_fidelity import _teacher_forced
from inferhal.core.errors import UserError
from inferhal.core.paging import formats

G = torch.Generator().manual_seed(11)
PROMPTS = [torch.randint(1, 192, (80,), generator=G).tolist() for _ in range(2)]
LIMITS = {"fp8": (0.16, 0.85), "fp4": (0.32, 0.62)}


@pytest.fixture(scope="module")
def engines():
    return {kd: LLM("deepseek_v4_tiny", "reference", kv_dtype=kd).engine for kd in ("auto", "fp8", "fp4")}


def test_the_quantised_groups_hold_records_and_the_state_stays_in_the_model_dtype(engines):
    specs = {s.name: s for s in engines["fp8"].specs}
    main = formats.record("fp8", 32, 8, role="main")
    assert specs["swa"].dtype == specs["csa"].dtype == specs["hca"].dtype == torch.uint8
    assert specs["csa"].slot_shape == (main.nbytes,) and "fp8_ds_mla" in specs["csa"].record
    assert specs["csa_index"].slot_shape == (formats.record("fp8", 16, role="index").nbytes,)
    assert specs["csa_state"].dtype == torch.float32
    fp4 = {s.name: s for s in engines["fp4"].specs}
    assert "nvfp4" in fp4["csa"].record and "mxfp4" in fp4["csa_index"].record
    assert engines["fp8"].kv_storage.layer_cache("csa", 1).dtype == torch.uint8


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp4"])
def test_logits_stay_within_the_stated_tolerance(engines, kv_dtype):
    err, agree = [], []
    for ids in PROMPTS:
        ref = _teacher_forced(engines["auto"].model, engines["auto"].backend, ids)
        got = _teacher_forced(engines[kv_dtype].model, engines[kv_dtype].backend, ids)
        assert torch.isfinite(got).all()
        err.append(float((got - ref).norm() / ref.norm()))
        agree.append(float((got.argmax(-1) == ref.argmax(-1)).float().mean()))
    rel, top1 = sum(err) / len(err), sum(agree) / len(agree)
    assert 0 < rel <= LIMITS[kv_dtype][0] and top1 >= LIMITS[kv_dtype][1], (kv_dtype, rel, top1)


def test_fp8_is_closer_than_fp4(engines):
    ids = PROMPTS[0]
    ref = _teacher_forced(engines["auto"].model, engines["auto"].backend, ids)
    e = {kd: float((_teacher_forced(engines[kd].model, engines[kd].backend, ids) - ref).norm()) for kd in ("fp8", "fp4")}
    assert e["fp8"] < e["fp4"]


def test_records_are_deterministic_so_prefix_hits_and_preemption_equal_a_cold_run():
    sp = SamplingParams(temperature=0.0, max_tokens=12)
    prompts = [PROMPTS[0][:40], PROMPTS[0][:40] + [5, 6, 7, 8, 9], PROMPTS[1][:33]]
    cold = [LLM("deepseek_v4_tiny", "reference", kv_dtype="fp8", enable_prefix_caching=False).generate([p], sp)[0]
            for p in prompts]
    warm = LLM("deepseek_v4_tiny", "reference", kv_dtype="fp8")
    warm.generate([prompts[0]], sp)
    hot = warm.generate(prompts, sp)  # prompt 0 and 1 hit the cached prefix
    assert hot[1].num_cached_tokens > 0
    small = LLM("deepseek_v4_tiny", "reference", kv_dtype="fp8", overrides=["cache.num_blocks=9"])
    tight = small.generate(prompts, sp)
    assert small.engine.scheduler.num_preemptions > 0  # few blocks: a request was preempted and recomputed
    for c, h, t in zip(cold, hot, tight):
        assert list(c.outputs[0].token_ids) == list(h.outputs[0].token_ids) == list(t.outputs[0].token_ids)


class _Profile:
    def __init__(self, *features):
        self.features = set(features)

    def supports(self, f):
        return f in self.features


def test_a_kv_dtype_the_backend_cannot_read_is_refused_with_the_formats_it_reads(engines):
    model = engines["auto"].model
    with pytest.raises(UserError, match=r"cache.kv_dtype=fp4 is refused: backend 'cuda_sm100' reads KV caches in "
                                        r"auto, fp8 only"):
        formats.apply_kv_dtype(model, "cuda_sm100", _Profile("kv_dtype:fp8"), "fp4")
    assert model.kv_dtype == "auto"  # nothing changed
    with pytest.raises(UserError, match=r"Plain stores its KV in the model's dtype only .*deepseek_v4 family"):
        formats.apply_kv_dtype(type("Plain", (), {})(), "reference", _Profile("kv_dtype:fp8"), "fp8")


def test_gemma_refuses_kv_records_before_loading_naming_the_model(monkeypatch, capsys):
    from inferhal.core.cli.main import main
    from inferhal.core.models import registry

    monkeypatch.setattr(registry, "load_model", lambda *a: pytest.fail("loaded a model for a refused kv_dtype"))
    assert main(["generate", "model=gemma3_270m", "cache.kv_dtype=fp8", "sampling.max_tokens=1"]) == 2
    assert "model 'gemma3_270m' (family 'gemma3') stores its KV as auto only" in capsys.readouterr().err
