"""A bf16 Gemma 3 on cpu_avx512 keeps its layers' GGUF integer blocks (int_block weights, read in registers
at 1-8 rows, through their bf16 copy past that): its logits must equal, bit for bit, those of the same
backend over the dense bf16 weights, at every batch size. Skips with the reason where cpu_avx512 cannot run."""

from __future__ import annotations

import pytest
import torch

from harness import greedy
from prompts import PROMPTS

pytestmark = pytest.mark.slow


def _load(gemma_path, keep_ints: bool, monkeypatch):
    from inferhal.core.config.schema import BackendConfig, ModelConfig
    from inferhal.core.models.gemma3 import loader
    from inferhal.core.models.gguf import loader as gguf_loader
    from inferhal.core.registry import BackendRegistry

    reg = BackendRegistry.discover()
    probe = reg.probe("cpu_avx512")
    if not probe.available:
        pytest.skip(f"backend cpu_avx512 unavailable here: {probe.reason}")
    if not keep_ints:
        monkeypatch.setattr(gguf_loader, "INT_BLOCK_FEATURE", "no such feature")
    be = reg.select(BackendConfig(name="cpu_avx512"))
    mc = ModelConfig(name="gemma3_270m", family="gemma3", format="gguf", path=gemma_path, max_model_len=2048,
                     dtype="bfloat16")
    return loader.load(mc, be)


def test_integer_blocks_give_the_dense_logits_bit_for_bit(gemma_path, monkeypatch):
    import gc

    from gemma_fixtures import release_gemma

    release_gemma()  # the directory's shared fp32 Gemma: one Gemma copy at a time in this process

    batches = (1, 3, 9)  # decode steps of 1, 3 (in registers) and 9 rows (bf16 copy)
    dense = _load(gemma_path, False, monkeypatch)  # one model alive at a time: the suite's memory stays bounded
    ids = [dense.tokenizer.encode(p) for p in PROMPTS]
    dense_bytes = dense.model.step_weight_bytes(head=False)
    assert dense.info["int_block_weights"] == 0
    want = [greedy(dense.model, ids[:n], 4) for n in batches]
    del dense
    gc.collect()
    monkeypatch.undo()
    ints = _load(gemma_path, True, monkeypatch)
    assert ints.info["int_block_weights"] == 18 * 7
    assert ints.model.step_weight_bytes(head=False) < 0.6 * dense_bytes
    for n, (t_d, l_d) in zip(batches, want):
        t_i, l_i = greedy(ints.model, ids[:n], 4)
        assert t_i == t_d
        for a, b in zip(l_i, l_d):
            assert torch.equal(a, b)
