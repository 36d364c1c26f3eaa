"""``model.max_model_len`` past the context the model was trained for is refused, at compose where the config
declares the context and at load where only the checkpoint does, unless ``model.allow_long_context=true``,
with which the engine serves the longer positions (core/config/context.py)."""

from __future__ import annotations

import pytest

from inferhal.core.cli.main import compose, main
from inferhal.core.config.errors import ConfigError

PAST = r"model.max_model_len=(\d+) is beyond the context model '.*' was trained for: (\d+) tokens"


def test_the_config_declared_context_is_checked_at_compose_before_loading(monkeypatch):
    from inferhal import LLM
    from inferhal.core.models import registry

    monkeypatch.setattr(registry, "load_model", lambda *a: pytest.fail("loaded a model for a refused config"))
    with pytest.raises(ConfigError, match=PAST + r" \(model.arch.max_position_embeddings\).*model.allow_long_context=true"):
        LLM("deepseek_v4_tiny", max_model_len=100000)
    with pytest.raises(ConfigError, match=r"model.max_model_len=513 is beyond .* 512 tokens"):
        compose(["model=deepseek_v4_tiny", "model.max_model_len=513"], "plan kv")
    assert compose(["model=deepseek_v4_tiny", "model.max_model_len=512"], "plan kv").model.max_model_len == 512
    cfg = compose(["model=deepseek_v4_tiny", "model.max_model_len=1024", "model.allow_long_context=true"], "plan kv")
    assert cfg.model.allow_long_context


def test_the_cli_refuses_it_with_exit_status_2(capsys):
    assert main(["generate", "model=deepseek_v4_tiny", "model.max_model_len=100000", "prompt_ids=[1]"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("inferhal: model.max_model_len=100000 is beyond the context model 'deepseek_v4_tiny' "
                          "was trained for: 512 tokens") and "Traceback" not in err


def test_with_allow_long_context_the_engine_serves_past_the_trained_context():
    from inferhal import LLM, SamplingParams

    llm = LLM("deepseek_v4_tiny", max_model_len=1024, allow_long_context=True, num_blocks=64)
    assert llm.engine.loaded.max_context == 512 and llm.engine.max_model_len == 1024
    out = llm.generate([[5] * 520], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 2  # positions 520 and 521: past the 512 the model declares


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny DeepSeek-V4 HF directory whose config.json declares a 512-token context."""
    from inferhal.core.models.deepseek_v4.make_checkpoint import _arch_of, write_checkpoint

    arch = _arch_of("tiny")
    assert arch["max_position_embeddings"] == 512
    return write_checkpoint(str(tmp_path_factory.mktemp("ctx")), arch, seed=1)


def test_a_checkpoint_declared_context_is_checked_at_load(checkpoint):
    from inferhal import LLM

    with pytest.raises(ConfigError, match=PAST.replace("(\\d+)", "1024", 1).replace("(\\d+)", "512")
                       + r" \(its config's max_position_embeddings\)"):
        LLM(checkpoint, max_model_len=1024)
    assert LLM(checkpoint, max_model_len=1024, allow_long_context=True).engine.max_model_len == 1024
    # no length given: the family config's (65536) within the checkpoint's own context
    assert LLM(checkpoint).engine.max_model_len == 512


@pytest.fixture(scope="module")
def gemma_long():
    """Gemma 3 270M loaded once for 40000 positions, past the 32768 its GGUF declares (context_length)."""
    from inferhal.core.config.schema import BackendConfig, ModelConfig
    from inferhal.core.engine.llm import _to
    from inferhal.core.models.registry import load_model
    from inferhal.core.registry import BackendRegistry

    backend = BackendRegistry.discover().select(BackendConfig())
    cfg = compose(["model.max_model_len=40000", "model.allow_long_context=true"], "LLM")
    return load_model(_to(ModelConfig, cfg.model), backend), backend


def test_gemma_past_its_gguf_context_is_refused_at_load(gemma_long, monkeypatch):
    from inferhal import LLM
    from inferhal.core.models import registry

    loaded, _ = gemma_long
    assert loaded.max_context == 32768 and loaded.model.max_model_len == 40000  # the loader honours the switch
    monkeypatch.setattr(registry, "load_model", lambda *a: loaded)  # the GGUF declares its context: known at load
    with pytest.raises(ConfigError, match=r"model.max_model_len=100000000 is beyond the context model 'gemma3_270m' "
                                          r"was trained for: 32768 tokens \(its GGUF's context_length\)"):
        LLM("gemma3_270m", max_model_len=100000000)
    with pytest.raises(ConfigError, match=r"model.max_model_len=40000 is beyond"):
        LLM.from_loaded(*gemma_long, max_model_len=40000)


def test_gemma_runs_past_its_gguf_context_when_allowed(gemma_long):
    from inferhal import LLM

    llm = LLM.from_loaded(*gemma_long, max_model_len=40000, allow_long_context=True)
    assert llm.engine.max_model_len == 40000
    assert LLM.from_loaded(*gemma_long, max_model_len=32768).engine.max_model_len == 32768
