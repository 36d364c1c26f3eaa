"""``inferhal bench greedy_head``: the timing loop, the mismatch check and the report, on a tiny head (no
speed is asserted); capture on a tiny Gemma 3 through the engine."""

from __future__ import annotations

import pytest
import torch

from inferhal.backends.reference import ops as ref
from inferhal.core.bench import greedy_head


def _pair(v=500, k=64):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(v, k, generator=g).bfloat16()
    hidden = torch.randn(20, k, generator=g).bfloat16()
    return w, hidden


def test_measure_times_both_paths_and_counts_mismatched_windows():
    w, hidden = _pair()
    logits = lambda x: ref.argmax_rows(ref.lm_head(x, w))  # noqa: E731
    rows = greedy_head.measure(logits, lambda x: ref.lm_head_argmax(x, w), hidden, [1, 3, 32], repeats=4)
    assert [r["rows"] for r in rows] == [1, 3, 32]
    for r in rows:
        assert r["mismatches"] == 0 and len(r["logits_repeat_ms"]) == len(r["greedy_repeat_ms"]) == 4
        assert r["logits_ms"] > 0 and r["greedy_ms"] > 0 and r["ratio"] > 0
    off_by_one = greedy_head.measure(logits, lambda x: ref.lm_head_argmax(x, w) + 1, hidden, [2], repeats=3)
    assert off_by_one[0]["mismatches"] == 3


def test_capture_keeps_the_rows_that_reach_the_greedy_head_and_restores_the_op():
    from inferhal import LLM
    from inferhal.core.config.schema import BackendConfig
    from inferhal.core.models.base import LoadedModel
    from inferhal.core.models.gemma3.config import Gemma3Config
    from inferhal.core.models.gguf.decoder import DecoderForCausalLM as Gemma3ForCausalLM, LayerWeights
    from inferhal.core.registry import BackendRegistry

    be = BackendRegistry.discover().select(BackendConfig(name="reference"))
    torch.manual_seed(0)
    d, i, h, hd, v = 32, 48, 2, 16, 300
    r = lambda *s: torch.randn(*s) * 0.1  # noqa: E731
    layers = [LayerWeights(attn_norm=r(d), q=r(h * hd, d), k=r(hd, d), v=r(hd, d), q_norm=r(hd), k_norm=r(hd),
                           o=r(d, h * hd), post_attn_norm=r(d), ffn_norm=r(d), gate=r(i, d), up=r(i, d),
                           down=r(d, i), post_ffn_norm=r(d)) for _ in range(2)]
    cfg = Gemma3Config(vocab_size=v, hidden_size=d, num_layers=2, intermediate_size=i, num_heads=h, num_kv_heads=1,
                       head_dim=hd, sliding_window=4, query_pre_attn_scalar=hd, max_position_embeddings=64,
                       layer_types=("sliding_attention", "full_attention"))
    model = Gemma3ForCausalLM(cfg, be.ops, r(v, d), layers, r(d), 64)

    class Tok:  # token ids from text: one id per character
        bos_token_id, eos_token_ids = 2, (1,)

        def encode(self, text, add_bos=True):
            return [2] + [3 + ord(c) % 200 for c in text]

        def decode(self, ids):
            return ""

        def apply_chat_template(self, messages, add_generation_prompt=True):
            return ""

    llm = LLM.from_loaded(LoadedModel(model, Tok(), "tiny", "gemma3"), be, max_model_len=64)
    entry = be.ops.entry("lm_head.argmax")
    hidden = greedy_head.capture(llm, ["ab", "cde", "f"], max_tokens=4)
    assert hidden.shape == (3 * 4, d)  # one row per prompt and step, prefill's last token included
    assert be.ops.entry("lm_head.argmax") is entry


def test_capture_without_a_greedy_step_is_a_clear_error():
    from inferhal.core.ops.table import OpTable
    from inferhal.core.profile import ExecLevel

    ops = OpTable("fake", {}, {"lm_head.argmax": lambda *a: None}, ExecLevel.FALLBACK)

    class Fake:  # an engine whose steps never reach lm_head.argmax (a model without forward_greedy)
        class engine:
            class loaded:
                class model:
                    ops = None

        def generate(self, *a):
            return []

    Fake.engine.loaded.model.ops = ops
    with pytest.raises(RuntimeError, match="no step reached lm_head.argmax"):
        greedy_head.capture(Fake(), ["x"], 2)
