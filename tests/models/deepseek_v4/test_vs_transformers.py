"""inferhal's DeepSeek-V4 on the reference backend (fp32) against transformers' eager DeepseekV4ForCausalLM.

Tiny random configs (with/without hash layers, CSA 4 / HCA 16 and other rates, hc_mult 2-4, sigmoid and
sqrtsoftplus scoring (transformers has no softmax scorer; the op tests cover it), YaRN and plain compress RoPE, MTP declared) with randomised sinks,
position biases, correction biases, HC bases/scales, norm gains and tid2eid, saved with save_pretrained.
16+ indexer heads keep top-k ties away (see FACTS.md).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from inferhal.core.config.schema import ModelConfig  # noqa: E402
from inferhal.core.models.deepseek_v4.loader import load  # noqa: E402

PROMPT, DECODE = 64, 32
TOL = 1e-4

BASE = dict(vocab_size=192, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4, head_dim=32,
            q_lora_rank=32, partial_rotary_factor=0.25, o_lora_rank=16, index_n_heads=16, index_head_dim=16,
            max_position_embeddings=512, n_routed_experts=8, num_experts_per_tok=2)
CONFIGS = {
    "csa4_hca16_hash_yarn": dict(
        num_hidden_layers=4, layer_types=["sliding_attention", "compressed_sparse_attention",
                                          "heavily_compressed_attention", "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        hc_mult=2, sliding_window=16, o_groups=2, index_topk=4,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
    "csa8_hca32_nohash_sigmoid": dict(
        num_hidden_layers=3, layer_types=["heavily_compressed_attention", "compressed_sparse_attention",
                                          "heavily_compressed_attention"],
        mlp_layer_types=["moe", "moe", "moe"], scoring_func="sigmoid", routed_scaling_factor=2.0,
        compress_rates={"compressed_sparse_attention": 8, "heavily_compressed_attention": 32},
        hc_mult=3, sliding_window=24, o_groups=1, index_topk=3, swiglu_limit=0.5),
    "mtp_hc4_sinkhorn5": dict(
        num_hidden_layers=2, layer_types=["compressed_sparse_attention", "sliding_attention"],
        mlp_layer_types=["hash_moe", "moe"], num_nextn_predict_layers=1,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        hc_mult=4, hc_sinkhorn_iters=5, sliding_window=8, o_groups=4, index_topk=6, tie_word_embeddings=False),
}


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter random init leaves trivial a non-trivial value."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "tid2eid":
                e = model.config.n_routed_experts
                p.copy_(torch.stack([torch.randperm(e, generator=g)[: p.shape[1]] for _ in range(p.shape[0])]))
            elif leaf in ("sinks", "position_bias", "e_score_correction_bias", "base", "hc_base"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif leaf in ("scale", "hc_scale") or "norm" in name:
                if "inv_freq" not in name:
                    p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.2)
            elif leaf in ("weight", "gate_up_proj", "down_proj", "fn", "hc_fn") and p.dtype.is_floating_point:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request, tmp_path_factory, reference_backend):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    name = request.param
    cfg = DeepseekV4Config(**{**BASE, **CONFIGS[name]})
    torch.manual_seed(0)
    hf = DeepseekV4ForCausalLM(cfg).eval()
    randomise(hf, seed=len(name))
    path = str(tmp_path_factory.mktemp(name))
    hf.save_pretrained(path)
    hf = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # what the file holds
    ours = load(ModelConfig(name=name, family="deepseek_v4", format="hf", path=path, dtype="float32"),
                reference_backend)
    ids = torch.randint(0, cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(7))
    return name, hf, ours.model, ids, path


def test_prompt_logits_match_transformers(case, v4):
    name, hf, model, ids, _ = case
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    got = v4.PagedDriver(model).step({0: ids.tolist()}, all_logits=True)
    err = (got - ref).abs().max().item()
    print(f"{name}: prompt logits max abs err {err:.3g}")
    assert err < TOL


@pytest.mark.slow  # transformers' generate (eager, no static cache) dominates
def test_incremental_decode_matches_full_recompute_and_greedy(case, v4):
    name, hf, model, ids, _ = case
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        gen = hf.generate(ids[None], max_new_tokens=DECODE, do_sample=False, min_new_tokens=DECODE)[0, PROMPT:]
    drv = v4.PagedDriver(model)
    logits = [drv.step({0: ids.tolist()})[0]]
    toks = [int(logits[-1].argmax())]
    for _ in range(DECODE - 1):
        logits.append(drv.step({0: [toks[-1]]})[0])
        toks.append(int(logits[-1].argmax()))
    assert toks == gen.tolist(), f"{name}: greedy tokens differ from transformers generate"
    full = v4.PagedDriver(model).step({0: ids.tolist() + toks[:-1]}, all_logits=True)[PROMPT - 1:]
    err = (torch.stack(logits) - full).abs().max().item()
    print(f"{name}: incremental vs full recompute max abs err {err:.3g}")
    assert err < TOL
    with torch.no_grad():
        ref = hf(torch.tensor([ids.tolist() + toks[:-1]])).logits[0, PROMPT - 1:]
    assert (full - ref).abs().max().item() < TOL


def test_chunked_prefill_and_mixed_batch_match(case, v4):
    """Chunks that cut through compression windows, and two sequences sharing a step."""
    name, hf, model, ids, _ = case
    full = v4.PagedDriver(model).step({0: ids.tolist()}, all_logits=True)
    drv = v4.PagedDriver(model)
    other = ids.flip(0).tolist()
    out = []
    for s in range(0, PROMPT, 13):  # 13 is coprime with every ratio here
        chunk = ids[s:s + 13].tolist()
        res = drv.step({0: chunk, 1: other[s:s + 13]}, all_logits=True)
        out.append(res[: len(chunk)])
    err = (torch.cat(out) - full).abs().max().item()
    print(f"{name}: chunked prefill vs one-shot max abs err {err:.3g}")
    assert err < TOL
    ref1 = v4.PagedDriver(model).step({0: other})[0]  # sequence 1 alone, one shot
    assert (res[-1] - ref1).abs().max().item() < TOL  # its final prompt token came in the last mixed step


@pytest.mark.slow
def test_llm_greedy_matches_transformers_generate(case):
    """Acceptance: LLM(model=<save_pretrained dir>, backend="reference", dtype="float32") greedy == generate."""
    from inferhal.core.engine.llm import LLM
    from inferhal.core.sampling.params import SamplingParams

    name, hf, model, ids, path = case
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        gen = hf.generate(ids[None], max_new_tokens=DECODE, do_sample=False, min_new_tokens=DECODE)[0, PROMPT:]
    block = max([16] + [s.tokens_per_slot for s in model.kv_groups()])
    llm = LLM(model=path, backend="reference", dtype="float32", block_size=block)
    out = llm.generate([ids.tolist()], SamplingParams(max_tokens=DECODE, temperature=0.0, ignore_eos=True))
    assert list(out[0].token_ids) == gen.tolist(), f"{name}: LLM greedy tokens differ from transformers"
