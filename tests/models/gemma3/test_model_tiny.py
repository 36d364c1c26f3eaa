"""The Gemma 3 model against transformers' Gemma3ForCausalLM on tiny random configs (no checkpoint):
sliding/global interleave with a window smaller than the prompt, GQA, QK-norm, (1+w) norms with random
weights, scaled tied embeddings, per-layer-type RoPE (with linear scaling), final-logit soft-capping.

Attention-logit soft-capping is not compared: transformers 5.24's Gemma 3 attention never passes
``attn_logit_softcapping`` to its attention function (Gemma 3 checkpoints leave it unset); ours honours
it through ``attn.paged``'s ``softcap``, which the reference op tests cover."""

from __future__ import annotations

import pytest
import torch

from harness import ContiguousKV, greedy, step
from inferhal.core.config.schema import BackendConfig
from inferhal.core.models.gemma3.config import Gemma3Config
from inferhal.core.models.gguf.decoder import DecoderForCausalLM, LayerWeights
from inferhal.core.registry import BackendRegistry

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ops():
    return BackendRegistry.discover().select(BackendConfig(name="reference")).ops


def _pair(ops, softcap: float, scaling: float, seed: int = 0):
    from transformers import Gemma3ForCausalLM as HF
    from transformers import Gemma3TextConfig

    torch.manual_seed(seed)
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": ({"rope_type": "linear", "factor": scaling, "rope_theta": 1_000_000.0} if scaling != 1.0
                               else {"rope_type": "default", "rope_theta": 1_000_000.0})}
    hc = Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=7,
                          num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=6,
                          max_position_embeddings=128, query_pre_attn_scalar=24, rope_parameters=rope,
                          final_logit_softcapping=softcap or None,
                          attn_implementation="eager")
    hf = HF(hc).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" in name else 0.08))
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    layers = []
    for i in range(hc.num_hidden_layers):
        g = lambda n: sd[f"model.layers.{i}.{n}.weight"]  # noqa: E731
        layers.append(LayerWeights(
            attn_norm=g("input_layernorm"), q=g("self_attn.q_proj"), k=g("self_attn.k_proj"), v=g("self_attn.v_proj"),
            q_norm=g("self_attn.q_norm"), k_norm=g("self_attn.k_norm"), o=g("self_attn.o_proj"),
            post_attn_norm=g("post_attention_layernorm"), ffn_norm=g("pre_feedforward_layernorm"),
            gate=g("mlp.gate_proj"), up=g("mlp.up_proj"), down=g("mlp.down_proj"),
            post_ffn_norm=g("post_feedforward_layernorm")))
    cfg = Gemma3Config(vocab_size=300, hidden_size=64, num_layers=7, intermediate_size=96, num_heads=4, num_kv_heads=1,
                       head_dim=32, sliding_window=6, query_pre_attn_scalar=24, rope_global_scaling=scaling,
                       final_softcap=softcap, max_position_embeddings=128,
                       layer_types=tuple(hc.layer_types))
    ours = DecoderForCausalLM(cfg, ops, sd["model.embed_tokens.weight"], layers, sd["model.norm.weight"], 128)
    return hf, ours


@pytest.mark.parametrize("softcap,scaling", [(0.0, 1.0), (15.0, 1.0), (0.0, 4.0)])
def test_prefill_and_decode_logits_match_transformers(ops, softcap, scaling):
    hf, ours = _pair(ops, softcap, scaling)
    assert ours.cfg.layer_types[5] == "full_attention" and ours.cfg.layer_types[6] == "sliding_attention"
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (17, 5, 11)]  # longer than the window 6
    toks, logits = greedy(ours, prompts, max_new=6, block_size=4)
    for b, p in enumerate(prompts):
        seq = torch.tensor([p + toks[b]])
        with torch.no_grad():
            ref = hf(seq).logits[0].float()  # [L, V]: full recompute, no cache
        for s in range(6):
            want = ref[len(p) - 1 + s]
            torch.testing.assert_close(logits[s][b], want, rtol=0, atol=2e-5)
        assert toks[b] == ref[len(p) - 1 : len(p) + 5].argmax(-1).tolist()


def test_chunked_prefill_equals_one_shot_prefill(ops):
    _, ours = _pair(ops, 0.0, 1.0, seed=3)
    prompt = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    kv = ContiguousKV(ours, 1, 32, block_size=4)
    one = step(ours, kv, [prompt], [0])
    kv2 = ContiguousKV(ours, 1, 32, block_size=4)
    step(ours, kv2, [prompt[:7]], [0])
    step(ours, kv2, [prompt[7:13]], [7])
    chunked = step(ours, kv2, [prompt[13:]], [13])
    torch.testing.assert_close(chunked, one, rtol=0, atol=2e-5)


def test_kv_groups_split_sliding_and_global_layers(ops):
    _, ours = _pair(ops, 0.0, 1.0)
    groups = {g.name: g for g in ours.kv_groups()}
    assert groups["sliding"].kind == "sliding" and groups["sliding"].window == 6
    assert groups["sliding"].layers == (0, 1, 2, 3, 4, 6) and groups["full"].layers == (5,)
    assert groups["full"].slot_shape == (2, 1, 32)


def test_token_product_flops_are_two_per_weight_of_every_product_and_the_head(ops):
    hf, ours = _pair(ops, 0.0, 1.0)
    matrices = sum(p.numel() for p in hf.parameters() if p.dim() == 2)  # every Linear and the tied table once
    assert ours.token_product_flops() == 2 * matrices == 2 * (7 * (192 * 64 + 64 * 128 + 192 * 64 + 64 * 96)
                                                              + 300 * 64)
    assert ours.token_product_flops(head=False) == 2 * matrices - 2 * 300 * 64  # greedy steps: the head left out


def test_step_weight_bytes_counts_every_weight_once_and_the_tied_table_as_the_head(ops):
    hf, ours = _pair(ops, 0.0, 1.0)
    want = sum(p.numel() * p.element_size() for p in hf.parameters())  # the tied table once
    assert ours.step_weight_bytes() == want == (7 * (4 * 64 + 2 * 32 + 192 * 64 + 64 * 128 + 192 * 64 + 64 * 96)
                                                + 64 + 300 * 64) * 4
    assert ours.step_weight_bytes(head=False) == want - 300 * 64 * 4
    from inferhal.core.ops.quantize import quantize_fp8_block

    ours.layers[0].o = qo = quantize_fp8_block(ours.layers[0].o, (32, 32))  # a weight kept quantised: its own bytes
    assert ours.step_weight_bytes() == want - 64 * 128 * 4 + qo.nbytes() and qo.nbytes() == 64 * 128 + 2 * 4 * 4


@pytest.mark.parametrize("softcap", [0.0, 15.0])
def test_forward_greedy_takes_the_argmax_of_forwards_logits(ops, softcap):
    """Without soft-capping through ``lm_head.argmax``; with it, through ``sample``'s greedy rows over the
    capped logits (tanh can tie logits the head keeps apart)."""
    from inferhal.backends.reference.ops import argmax_rows

    _, ours = _pair(ops, softcap, 1.0, seed=4)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (9, 3, 14)]
    kv = ContiguousKV(ours, 3, 32, block_size=4)
    ids, done = prompts, [0, 0, 0]
    for _ in range(4):
        want = argmax_rows(step(ours, kv, ids, done))
        assert torch.equal(step(ours, kv, ids, done, greedy=True), want)
        done = [d + len(i) for d, i in zip(done, ids)]
        ids = [[t] for t in want.tolist()]


def test_the_runner_takes_greedy_steps_from_forward_greedy_and_the_rest_from_logits(ops):
    """Every row greedy without logprobs: ``forward_greedy``, no logits; a row with logprobs or a
    temperature: ``forward`` and ``sample``. The tokens are the same either way."""
    from inferhal import LLM, SamplingParams
    from inferhal.core.models.base import LoadedModel

    _, ours = _pair(ops, 0.0, 1.0, seed=6)
    calls = {"forward": 0, "forward_greedy": 0}
    for name in calls:
        real = getattr(ours, name)

        def counted(*a, _real=real, _name=name):
            calls[_name] += 1
            return _real(*a)

        setattr(ours, name, counted)
    be = BackendRegistry.discover().select(BackendConfig(name="reference"))
    llm = LLM.from_loaded(LoadedModel(ours, None, "tiny", "gemma3"), be, max_model_len=64)
    prompts = [[5, 17, 42, 9], [3, 250, 7], [11] * 12]
    greedy_out = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert calls["forward"] == 0 and calls["forward_greedy"] > 0
    calls["forward_greedy"] = 0
    logged = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0, logprobs=2, ignore_eos=True))
    assert calls["forward"] > 0 and calls["forward_greedy"] == 0
    assert [o.outputs[0].token_ids for o in greedy_out] == [o.outputs[0].token_ids for o in logged]
    calls["forward"] = 0
    llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0.8, seed=1, ignore_eos=True))
    assert calls["forward"] > 0 and calls["forward_greedy"] == 0
