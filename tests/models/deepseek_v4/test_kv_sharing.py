"""Cross-layer KV sharing (``kv_sources``, V4.1-Flash's "CSA2"): a compressed layer reads an earlier source
layer's compressed KV and indexer keys and writes none; only source layers are paged. Checked against a plain
computation: the unshared model whose layer reads the source's caches (aliased) and skips its own compressor."""

from __future__ import annotations

import pytest
import torch

from inferhal.core.config.schema import ModelConfig
from inferhal.core.errors import UserError
from inferhal.core.models.deepseek_v4 import attention as attn_mod
from inferhal.core.models.deepseek_v4.config import parse_config
from inferhal.core.models.deepseek_v4.kv import kv_groups
from inferhal.core.models.deepseek_v4.loader import load
from inferhal.core.models.deepseek_v4.make_checkpoint import _arch_of

ARCH = _arch_of("tiny")  # layers: sliding, CSA, HCA, CSA
SHARED = {**ARCH, "kv_sources": [-1, -1, -1, 1]}  # layer 3 (CSA) reads layer 1's compressed KV
IDS = [5, 17, 3, 99, 42, 7, 150, 61, 8, 13, 77, 30, 2, 190, 64, 11, 9, 140, 33, 21]


def _model(backend, arch):
    return load(ModelConfig(name="t", family="deepseek_v4", format="random", arch=arch, seed=5), backend).model


class AliasKV:
    """The unshared model's cache with layer 3's compressed groups replaced by layer 1's."""

    def __init__(self, kv) -> None:
        self.kv = kv

    def layer_cache(self, group, layer):
        if group in ("csa", "csa_index") and layer == 3:
            layer = 1
        return self.kv.layer_cache(group, layer)


def _run(model, drv, kv=None):
    """Prefill 12 tokens, then decode the rest one at a time: every step's last logits."""
    kv = kv or drv.kv
    outs = []
    b = drv.batch({0: IDS[:12]})
    outs.append(model.forward(b, kv))
    drv.computed[0] = 12
    for t in IDS[12:]:
        outs.append(model.forward(drv.batch({0: [t]}), kv))
        drv.computed[0] += 1
    return torch.cat(outs)


def test_shared_model_equals_the_unshared_model_reading_the_source(reference_backend, v4, monkeypatch):
    shared = _model(reference_backend, SHARED)
    got = _run(shared, v4.PagedDriver(shared))
    plain_model = _model(reference_backend, ARCH)  # the same weights (same seed), no sharing
    plain_alone = _run(plain_model, v4.PagedDriver(plain_model))
    real = attn_mod.compress
    monkeypatch.setattr(attn_mod, "compress",
                        lambda m, prefix, layer, *a, **k: None if layer == 3 else real(m, prefix, layer, *a, **k))
    drv = v4.PagedDriver(plain_model)
    want = _run(plain_model, drv, AliasKV(drv.kv))
    assert torch.equal(got, want)
    assert (got - plain_alone).abs().max() > 1e-3  # sharing changes the model: the check above means something


def test_only_source_layers_are_paged(reference_backend):
    plain = {s.name: s for s in kv_groups(parse_config(ARCH))}
    shared = {s.name: s for s in kv_groups(parse_config(SHARED))}
    assert plain["csa"].layers == (1, 3) and shared["csa"].layers == (1,)
    for g in ("csa_index", "csa_state", "csa_index_state"):
        assert shared[g].layers == (1,)
    assert shared["swa"].layers == plain["swa"].layers and shared["hca"].layers == plain["hca"].layers
    from inferhal.core.engine.llm import LLM

    llm = LLM("deepseek_v4_tiny", backend="reference", overrides=["+model.arch.kv_sources=[-1,-1,-1,1]"])
    with pytest.raises(KeyError, match="no KV cache for layer 3 in group 'csa'"):
        llm.engine.kv_storage.layer_cache("csa", 3)
    outs = llm.generate([IDS[:9], IDS[4:10]], __import__("inferhal").SamplingParams(max_tokens=6, temperature=0.0))
    assert all(len(o.token_ids) == 6 for o in outs)


@pytest.mark.parametrize("sources,match", [
    ([-1, 3, -1, -1], r"kv_sources\[1\].*layer 1 would read layer 3, a later layer"),
    ([-1, -1, -1, 2], r"kv_sources\[3\].*layer 3 is compressed_sparse_attention but layer 2 is heavily"),
    ([1, -1, -1, -1], r"kv_sources\[0\].*layer 0 is sliding_attention"),
    ([-1, -1, -1], r"kv_sources.*needs num_hidden_layers=4 entries"),
    ([-1, -1, -1, 9], r"kv_sources\[3\].*must be -1 or a layer index"),
])
def test_bad_sharing_maps_are_refused_with_the_layer_named(sources, match):
    with pytest.raises(UserError, match=match):
        parse_config({**ARCH, "kv_sources": sources})


def test_a_source_must_keep_its_own_kv():
    arch = {**ARCH, "num_hidden_layers": 6, "mlp_layer_types": ["moe"] * 6,
            "layer_types": ["sliding_attention"] + ["compressed_sparse_attention"] * 5}
    assert parse_config({**arch, "kv_sources": [-1, -1, 1, 1, -1, 4]}).kv_sources == (0, 1, 1, 1, 4, 4)
    with pytest.raises(UserError, match=r"kv_sources\[4\].*layer 3 is not a source: it reads layer 1"):
        parse_config({**arch, "kv_sources": [-1, -1, 1, 1, 3, -1]})
