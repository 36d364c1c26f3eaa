"""GGUF metadata → Gemma3Config, and the KV groups ``inferhal plan kv`` gets without loading weights."""

from __future__ import annotations

import pytest

from inferhal.core.config.schema import ModelConfig
from inferhal.core.errors import UserError
from inferhal.core.models.gemma3 import kv_groups_from_config
from inferhal.core.models.gemma3.config import FULL, SLIDING, Gemma3Config, from_gguf_metadata
from inferhal.core.models.gguf.reader import GGUFFile


def test_the_270m_metadata_becomes_its_config(gemma_path):
    cfg = from_gguf_metadata(GGUFFile(gemma_path).metadata)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (18, 640, 4, 1, 256)
    assert cfg.sliding_window == 512 and cfg.rope_global_base == 1e6 and cfg.rope_local_base == 1e4
    assert cfg.vocab_size == 262144 and cfg.attn_scale == 256 ** -0.5 and cfg.final_softcap == 0
    assert cfg.layers_of(FULL) == (5, 11, 17) and len(cfg.layers_of(SLIDING)) == 15


def test_kv_groups_from_the_file_and_from_arch(gemma_path):
    groups = {g.name: g for g in kv_groups_from_config(ModelConfig(name="g", family="gemma3", path=gemma_path))}
    assert groups["sliding"].kind == "sliding" and groups["sliding"].window == 512
    assert groups["full"].layers == (5, 11, 17) and groups["full"].slot_shape == (2, 1, 256)
    arch = dict(vocab_size=10, hidden_size=8, num_layers=2, intermediate_size=16, num_heads=2, num_kv_heads=1,
                head_dim=4, layer_types=[SLIDING, FULL], sliding_window=4)
    g2 = kv_groups_from_config(ModelConfig(name="t", family="gemma3", arch=arch))
    assert [(g.name, g.layers) for g in g2] == [("sliding", (0,)), ("full", (1,))]


@pytest.mark.parametrize("bad,match", [
    (dict(num_heads=3, num_kv_heads=2), "not a multiple of num_kv_heads"), (dict(layer_types=["local"] * 2), "unknown layer type"),
    (dict(bogus=1), "unknown field"), (dict(hidden_size=0), "hidden_size must be > 0")])
def test_bad_configs_are_named(bad, match):
    base = dict(vocab_size=10, hidden_size=8, num_layers=2, intermediate_size=16, num_heads=2, num_kv_heads=1, head_dim=4)
    with pytest.raises(UserError, match=match):
        Gemma3Config.from_mapping({**base, **bad})


def test_unsupported_rope_scaling_is_named():
    md = {"general.architecture": "gemma3", "gemma3.embedding_length": 8, "gemma3.block_count": 1,
          "gemma3.feed_forward_length": 8, "gemma3.attention.head_count": 2, "gemma3.vocab_size": 4,
          "gemma3.rope.scaling.type": "yarn"}
    with pytest.raises(UserError, match="rope scaling type 'yarn' is not supported"):
        from_gguf_metadata(md)
    md["gemma3.rope.scaling.type"], md["gemma3.rope.scaling.factor"] = "linear", 8.0
    assert from_gguf_metadata(md).rope_global_scaling == 8.0
