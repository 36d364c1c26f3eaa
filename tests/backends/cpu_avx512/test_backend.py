"""The cpu_avx512 backend: selection, its op table, and its products against the reference.

Selection tests need AVX512-BF16 and a C compiler (skipped with the reason elsewhere); the op functions are
cpu_amx's with the AVX-512 product (tests/backends/cpu_amx/test_backend.py covers their routing), the
conformance kit runs every case of its ops against the reference with ``--inferhal-backend=cpu_avx512``,
and the Gemma 3 bf16 test (tests/models/gemma3/test_bf16.py) runs the real model on it.
"""

from __future__ import annotations

import pytest
import torch

from inferhal.backends.cpu_amx import ops as amx_ops
from inferhal.backends.reference import ops as ref
from inferhal.core.config.schema import BackendConfig
from inferhal.core.errors import UserError
from inferhal.core.registry import BackendRegistry
from inferhal.kernels.cpu import amx, lib
from inferhal.kernels.cpu import head as head_kernel

ST = lib.avx512_status()
needs_avx512 = pytest.mark.skipif(not ST.available, reason=f"cpu_avx512 unavailable here: {ST.reason}")


@pytest.fixture(scope="module")
def reg():
    return BackendRegistry.discover()


def test_probe_gives_the_kernels_status(reg):
    probe = reg.probe("cpu_avx512")
    assert probe.available == ST.available and probe.reason == ST.reason


@needs_avx512
def test_products_run_the_avx512_kernel_and_everything_else_falls_back_visibly(reg, monkeypatch):
    be = reg.select(BackendConfig(name="cpu_avx512"))
    prov = be.ops.provenance()
    assert all(prov[op] == "device" for op in amx_ops.OP_IDS)
    assert prov["embed"] == prov["sample"] == "fallback"
    assert be.profile.supports("avx512_bf16") and not be.profile.supports("amx_bf16")
    assert be.profile.backend == "cpu_avx512" and "AVX512-BF16" in be.profile.device_name
    assert "avx512_linear.c" in be.ops.entry("linear").note
    # the AMX product must never run here, even where the CPU has it
    monkeypatch.setattr(lib, "_amx", lambda: lib.Status(False, "this CPU lacks amx_tile"))
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(7, 128, generator=g).bfloat16(), (torch.randn(96, 128, generator=g) * 0.1).bfloat16()
    got = be.ops["linear"](x, w)
    assert torch.equal(got, amx.linear(x, amx.pack(w), 96, kernel="avx512"))
    torch.testing.assert_close(got, ref.linear(x, w), rtol=2 ** -7, atol=1e-2)
    head = (torch.randn(3000, 128, generator=g) * 0.1).bfloat16()
    buf = torch.full((7, 3000), float("nan"))
    # the kernel's own bf16-rounded sums, widened: equal by construction to its linear's; the reference's
    # oneDNN product sums in another order where oneDNN picks AMX (Intel), so it is compared within bf16's
    # rounding (one bf16 ulp of the largest logit's magnitude), as linear's above
    got = be.ops["lm_head"](x, head, buf)
    assert got.dtype == torch.float32 and torch.equal(got, be.ops["linear"](x, head).float())
    assert torch.equal(buf, got)
    torch.testing.assert_close(got, ref.lm_head(x, head), rtol=2 ** -7, atol=1e-2)


@needs_avx512
@pytest.mark.skipif(not head_kernel.available(), reason="this CPU lacks avx512_vnni (the greedy head's screen)")
def test_greedy_head_is_the_argmax_of_its_own_logits_and_falls_back_per_call(reg, monkeypatch):
    be = reg.select(BackendConfig(name="cpu_avx512"))
    assert "head_argmax.c" in be.ops.entry("lm_head.argmax").note
    greedy = be.ops["lm_head.argmax"]
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(9, 640, generator=g).bfloat16(), (torch.randn(5000, 640, generator=g) * 0.05).bfloat16()

    def full(x):
        return ref.argmax_rows(be.ops["lm_head"](x, w))

    screened = []  # (rows, rows overflowing) of each screen

    def spy(*a):
        tokens, overflow = real(*a)
        screened.append((a[0].shape[0], int(overflow.sum())))
        return tokens, overflow

    real = head_kernel.argmax
    monkeypatch.setattr(head_kernel, "argmax", spy)
    assert torch.equal(greedy(x, w), full(x)) and screened == [(9, 0)]
    # rows whose candidates overflow get the full head, the others keep the screen's tokens
    capacity = head_kernel.CAPACITY
    monkeypatch.setattr(head_kernel, "CAPACITY", 16)
    assert torch.equal(greedy(x, w), full(x)) and len(screened) == 2 and screened[1][1] > 0
    monkeypatch.setattr(head_kernel, "CAPACITY", capacity)
    # a row with a NaN (no bound holds) is handed back alone and gets the argmax of its full logits, as
    # sample's greedy rows would; the other rows keep the screen's tokens
    xn = x.clone()
    xn[2, 7] = float("nan")
    assert torch.equal(greedy(xn, w), full(xn)) and int(greedy(xn, w)[2]) == 0
    assert screened[2:] == [(9, 1), (9, 1)]
    # fp32, or a K the screen does not take: the argmax of lm_head
    assert torch.equal(greedy(x.float(), w.float()), ref.argmax_rows(ref.lm_head(x.float(), w.float())))
    x96, w96 = x[:, :96].contiguous(), w[:, :96].contiguous()
    assert torch.equal(greedy(x96, w96), ref.argmax_rows(be.ops["lm_head"](x96, w96)))
    assert len(screened) == 4


@needs_avx512
@pytest.mark.skipif(not head_kernel.available(), reason="this CPU lacks avx512_vnni (the greedy head's screen)")
def test_greedy_head_packs_the_bf16_head_only_for_the_rows_it_hands_back(reg, monkeypatch):
    be = reg.select(BackendConfig(name="cpu_avx512"))
    greedy = be.ops["lm_head.argmax"]
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(6, 640, generator=g).bfloat16(), (torch.randn(3000, 640, generator=g) * 0.05).bfloat16()
    amx_ops.PACKS.clear()
    tokens = greedy(x, w)
    assert not amx_ops.PACKS.entries  # the screen alone: no packed bf16 copy of the head
    monkeypatch.setattr(head_kernel, "CAPACITY", 16)  # every row hands back: lm_head packs the head for them
    assert torch.equal(greedy(x, w), tokens) and len(amx_ops.PACKS.entries) == 1
    assert torch.equal(tokens, ref.argmax_rows(be.ops["lm_head"](x, w)))
    # a head whose packed copy could not be kept is not screened (its handed-back rows would run another
    # product): every row gets the argmax of lm_head, the reference's here
    amx_ops.PACKS.clear()
    monkeypatch.setattr(amx_ops.PACKS, "max_bytes", 100)
    monkeypatch.setattr(head_kernel, "argmax", lambda *a: pytest.fail("screened a head lm_head cannot pack"))
    assert torch.equal(greedy(x, w), ref.argmax_rows(ref.lm_head(x, w)))
    amx_ops.PACKS.clear()


@needs_avx512
@pytest.mark.parametrize("bad,match", [({"options": {"threads": 4}}, "unknown option.*cpu_avx512"),
                                       ({"batch_invariant": True}, "batch_invariant=true: cpu_avx512")])
def test_bad_backend_config_is_a_clear_error(reg, bad, match):
    with pytest.raises(UserError, match=match):
        reg.select(BackendConfig(name="cpu_avx512", **bad))


def test_unavailable_backend_says_why(monkeypatch):
    lib.clear()
    try:
        monkeypatch.setattr(lib, "cpu_flags", lambda: frozenset({"avx512f", "avx512bw", "avx512vl"}))
        fresh = BackendRegistry.discover()
        with pytest.raises(Exception, match="cpu_avx512.*unavailable.*lacks avx512_bf16"):
            fresh.select(BackendConfig(name="cpu_avx512"))
    finally:
        monkeypatch.undo()
        lib.clear()
