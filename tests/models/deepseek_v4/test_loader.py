"""Loader: random format, the checkpoint generator, FP8/FP4 quantised checkpoints, official DeepSeek
names, and clear errors for missing / extra / mis-shaped tensors and unsupported config values."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from inferhal.core.config.schema import ModelConfig
from inferhal.core.errors import UserError
from inferhal.core.models.deepseek_v4.config import parse_config
from inferhal.core.models.deepseek_v4.loader import load
from inferhal.core.models.deepseek_v4.make_checkpoint import _arch_of, write_checkpoint
from inferhal.core.ops.quant import QuantWeight

ARCH = _arch_of("tiny")


def _load(path, backend, **kw):
    return load(ModelConfig(name="t", family="deepseek_v4", format="hf", path=path, dtype="float32", **kw), backend)


def _logits(model, v4, ids):
    return v4.PagedDriver(model).step({0: ids}, all_logits=True)


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("plain")), ARCH, seed=3)


IDS = list(range(5, 45))


def test_random_format_equals_written_checkpoint(plain_dir, reference_backend, v4):
    rnd = load(ModelConfig(name="r", family="deepseek_v4", format="random", arch=ARCH, seed=3), reference_backend)
    hf = _load(plain_dir, reference_backend)
    assert rnd.tokenizer is None and hf.model.num_mtp_layers == 1
    assert (_logits(rnd.model, v4, IDS) - _logits(hf.model, v4, IDS)).abs().max().item() < 1e-5


def test_generator_cli_writes_a_loadable_checkpoint(tmp_path, reference_backend):
    out = tmp_path / "ck"
    r = subprocess.run([sys.executable, "-m", "inferhal.core.models.deepseek_v4.make_checkpoint", str(out),
                        "--config", "tiny_nohash", "--seed", "1"], cwd=str(tmp_path), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lm = _load(str(out), reference_backend)
    assert lm.model.cfg.num_layers == 3 and lm.model.num_mtp_layers == 0


def test_quantised_checkpoint_stays_quantised_and_matches_dequantised(tmp_path, reference_backend, v4):
    q = write_checkpoint(str(tmp_path / "q"), ARCH, seed=3, quantize=True)
    lm = _load(q, reference_backend)
    w = lm.model.weights
    gu = w["layers.1.mlp.experts.gate_up_proj"]
    assert isinstance(gu, QuantWeight) and gu.format == "fp4_group" and gu.scale.dtype == torch.float8_e8m0fnu
    assert isinstance(w["layers.1.self_attn.q_b_proj.weight"], QuantWeight)
    assert w["layers.1.self_attn.q_b_proj.weight"].format == "fp8_block"
    assert lm.info["quantized"] == ["fp4_group", "fp8_block"]
    # the same file, dequantised to dense fp32 by hand and saved without scales, gives the same logits
    from inferhal.core.ops.quantize import dequantize

    raw = load_file(os.path.join(q, "model.safetensors"))
    dense = {}
    for k, t in raw.items():
        if k.endswith("_scale_inv"):
            continue
        s = raw.get(k + "_scale_inv")
        if s is None:
            dense[k] = t
            continue
        shape = (*t.shape[:-1], t.shape[-1] * 2) if t.dtype == torch.uint8 else tuple(t.shape)
        from inferhal.core.models.deepseek_v4.quantized import make_quant

        dense[k] = dequantize(make_quant(k, t, s, shape)).contiguous()
    d = tmp_path / "d"
    d.mkdir()
    save_file(dense, str(d / "model.safetensors"))
    cfg = json.load(open(os.path.join(q, "config.json")))
    cfg.pop("quantization_config")
    json.dump(cfg, open(d / "config.json", "w"))
    ref = _logits(_load(str(d), reference_backend).model, v4, IDS)
    got = _logits(lm.model, v4, IDS)
    assert (got - ref).abs().max().item() < 1e-4
    # and quantisation really happened: the dense original differs
    orig = _logits(load(ModelConfig(name="r", family="deepseek_v4", format="random", arch=ARCH, seed=3),
                        reference_backend).model, v4, IDS)
    assert (orig - got).abs().max().item() > 1e-4


def _official(name: str) -> str:
    """transformers' canonical name → DeepSeek's official name (the inverse of names.py, for this test)."""
    rules = [(".self_attn.compressor.indexer.scorer.weights_proj.", ".attn.indexer.weights_proj."),
             (".self_attn.compressor.indexer.q_b_proj.", ".attn.indexer.wq_b."),
             (".self_attn.compressor.indexer.", ".attn.indexer.compressor."),
             (".self_attn.", ".attn."), (".mlp.", ".ffn."), (".input_layernorm.", ".attn_norm."),
             (".post_attention_layernorm.", ".ffn_norm."), (".attn_hc.", ".hc_attn_"), (".ffn_hc.", ".hc_ffn_"),
             (".sinks", ".attn_sink"), ("compressor.kv_norm.", "compressor.norm."), (".position_bias", ".ape"),
             (".q_a_proj.", ".wq_a."), (".q_b_proj.", ".wq_b."), (".kv_proj.", ".wkv."), (".gate_proj.", ".wgate."),
             (".o_a_proj.", ".wo_a."), (".o_b_proj.", ".wo_b."), (".q_a_norm.", ".q_norm."),
             (".gate.e_score_correction_bias", ".gate.bias"), ("shared_experts.wgate.", "shared_experts.w1."),
             ("shared_experts.down_proj.", "shared_experts.w2."), ("shared_experts.up_proj.", "shared_experts.w3."),
             ("hc_attn_fn", "hc_attn_fn"), ("_scale_inv", "")]
    top = {"embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight", "hc_head.hc_fn": "hc_head_fn",
           "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}
    if name in top:
        return top[name]
    if name.startswith("mtp.0.") and name[6:] in top:
        return "mtp.0." + top[name[6:]]
    for a, b in rules:
        name = name.replace(a, b)
    return name.replace(".weight_scale", ".scale")


def test_official_deepseek_names_load_identically(plain_dir, reference_backend, v4, tmp_path):
    from inferhal.core.models.deepseek_v4.names import canonical

    raw = load_file(os.path.join(plain_dir, "model.safetensors"))
    off = {}
    for k, t in raw.items():
        c = canonical(k)
        if c.endswith("experts.gate_up_proj"):
            stem = _official(c[: -len(".gate_up_proj")])
            for e in range(t.shape[0]):
                w1, w3 = t[e].chunk(2)
                off[f"{stem}.{e}.w1.weight"], off[f"{stem}.{e}.w3.weight"] = w1.contiguous(), w3.contiguous()
        elif c.endswith("experts.down_proj"):
            stem = _official(c[: -len(".down_proj")])
            for e in range(t.shape[0]):
                off[f"{stem}.{e}.w2.weight"] = t[e].contiguous()
        else:
            off[_official(c)] = t
    assert "layers.1.attn.indexer.compressor.wkv.weight" in off and "layers.0.ffn.experts.3.w1.weight" in off
    assert all(canonical(k) for k in off)
    d = tmp_path / "official"
    d.mkdir()
    half = sorted(off)
    save_file({k: off[k] for k in half[: len(half) // 2]}, str(d / "a.safetensors"))
    save_file({k: off[k] for k in half[len(half) // 2:]}, str(d / "b.safetensors"))
    json.dump({"weight_map": {k: ("a" if i < len(half) // 2 else "b") + ".safetensors" for i, k in enumerate(half)}},
              open(d / "model.safetensors.index.json", "w"))
    json.dump(json.load(open(os.path.join(plain_dir, "config.json"))), open(d / "config.json", "w"))
    a = _logits(_load(str(d), reference_backend).model, v4, IDS)
    assert (a - _logits(_load(plain_dir, reference_backend).model, v4, IDS)).abs().max().item() < 1e-5


def _rewrite(src, dst, edit):
    t = load_file(os.path.join(src, "model.safetensors"))
    edit(t)
    os.makedirs(dst, exist_ok=True)
    save_file(t, os.path.join(dst, "model.safetensors"))
    json.dump(json.load(open(os.path.join(src, "config.json"))), open(os.path.join(dst, "config.json"), "w"))
    return dst


def test_missing_extra_misshaped_tensors_are_named(plain_dir, reference_backend, tmp_path):
    key = "model.layers.1.self_attn.compressor.indexer.q_b_proj.weight"
    d = _rewrite(plain_dir, str(tmp_path / "m"), lambda t: t.pop(key))
    with pytest.raises(UserError, match="missing tensor 'layers.1.self_attn.compressor.indexer.q_b_proj.weight'"):
        _load(d, reference_backend)
    d = _rewrite(plain_dir, str(tmp_path / "x"), lambda t: t.__setitem__("model.layers.0.bogus.weight", torch.zeros(2)))
    with pytest.raises(UserError, match="unexpected checkpoint tensor 'layers.0.bogus.weight'"):
        _load(d, reference_backend)
    d = _rewrite(plain_dir, str(tmp_path / "s"), lambda t: t.__setitem__(key, torch.zeros(3, 3)))
    with pytest.raises(UserError, match=r"'layers.1.self_attn.compressor.indexer.q_b_proj.weight' has shape \(3, 3\)"):
        _load(d, reference_backend)
    d = _rewrite(plain_dir, str(tmp_path / "p"), lambda t: t.pop("mtp.0.e_proj.weight"))
    with pytest.raises(UserError, match="missing tensor 'mtp.0.e_proj.weight' .*all-or-none"):
        _load(d, reference_backend)
    d = _rewrite(plain_dir, str(tmp_path / "n"), lambda t: [t.pop(k) for k in list(t) if k.startswith("mtp.")])
    assert _load(d, reference_backend).model.num_mtp_layers == 0  # transformers' save_pretrained drops mtp.*


def test_a_malformed_checkpoint_file_is_named_not_a_traceback(plain_dir, reference_backend, tmp_path):
    import shutil

    d = tmp_path / "cut"
    shutil.copytree(plain_dir, d)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match=r"model.safetensors is not a readable safetensors file: .*"):
        _load(str(d), reference_backend)
    (d / "model.safetensors.index.json").write_text("{nope")
    with pytest.raises(UserError, match=r"model.safetensors.index.json is not a safetensors index"):
        _load(str(d), reference_backend)
    (d / "config.json").write_text("[1, 2")
    with pytest.raises(UserError, match=r"config.json is not JSON"):
        _load(str(d), reference_backend)
    (d / "config.json").write_text("[1, 2]")
    with pytest.raises(UserError, match=r"config.json holds a list, not a JSON object"):
        _load(str(d), reference_backend)


@pytest.mark.parametrize("field,value,match", [
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("scoring_func", "relu", "scoring_func='relu'"),
    ("layer_types", ["sliding_attention"] * 3 + ["full_attention"], "layer_types='full_attention'"),
    ("rope_parameters", {"rope_type": "longrope"}, "rope_type='longrope'"),
    ("n_shared_experts", 2, "n_shared_experts=2"),
    ("brand_new_field", 1, "unknown field 'brand_new_field'"),
    ("o_groups", 3, "o_groups=3"),
    ("compress_ratios", [0, 4, 128, 4, 4], "compress_ratios"),
])
def test_unsupported_config_values_are_named(field, value, match):
    arch = {**ARCH, field: value}
    if field == "compress_ratios":
        arch.pop("layer_types")
    with pytest.raises(UserError, match=match):
        parse_config(arch)


def test_legacy_config_fields_fold_in():
    arch = {k: v for k, v in ARCH.items() if k not in ("layer_types", "mlp_layer_types", "compress_rates")}
    cfg = parse_config({**arch, "compress_ratios": [0, 4, 128, 4, 0], "num_hash_layers": 1, "compress_rate_hca": 16})
    assert cfg.layer_types == ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                               "compressed_sparse_attention")
    assert cfg.mlp_layer_types == ("hash_moe", "moe", "moe", "moe") and cfg.compress_rates["heavily_compressed_attention"] == 16


def test_flash_config_plans_kv_without_weights():
    from omegaconf import OmegaConf

    from inferhal.core.models.deepseek_v4 import kv_groups_from_config

    path = os.path.join(os.path.dirname(__file__), "..", "..", "..", "conf", "model", "deepseek_v4_flash.yaml")
    mc = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(path)))
    groups = {g.name: g for g in kv_groups_from_config(mc)}
    assert len(groups["swa"].layers) == 43 + 1 and groups["swa"].window == 128
    assert groups["csa"].tokens_per_slot == 4 and len(groups["csa"].layers) == 21
    assert groups["hca"].tokens_per_slot == 128 and len(groups["hca"].layers) == 20
    assert groups["csa_index"].slot_shape == (128,) and groups["swa"].dtype == torch.bfloat16
    cfg = parse_config(mc.arch)
    assert (cfg.hidden_size, cfg.n_experts, cfg.top_k, cfg.hc_mult, cfg.rope_dim) == (4096, 256, 6, 4, 64)
