"""The cpu_amx backend: selection, its op table, and ``linear`` against the reference.

Selection tests need AMX and a C compiler (skipped with the reason elsewhere); the conformance kit runs
every ``linear`` case against the reference with ``--inferhal-backend=cpu_amx``, and the Gemma 3 bf16
test (tests/models/gemma3/test_bf16.py) runs the real model on it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inferhal.backends.cpu_amx import ops as amx_ops
from inferhal.core.config.schema import BackendConfig
from inferhal.core.errors import UserError
from inferhal.core.registry import BackendRegistry
from inferhal.kernels.cpu import amx, lib

ST = lib.status()
needs_amx = pytest.mark.skipif(not ST.available, reason=f"cpu_amx unavailable here: {ST.reason}")


@pytest.fixture(scope="module")
def reg():
    return BackendRegistry.discover()


def test_probe_gives_the_kernels_status(reg):
    probe = reg.probe("cpu_amx")
    assert probe.available == ST.available and probe.reason == ST.reason


@needs_amx
def test_linear_is_native_and_everything_else_falls_back_visibly(reg):
    be = reg.select(BackendConfig(name="cpu_amx"))
    prov = be.ops.provenance()
    assert prov["linear"] == "device"
    assert all(prov[op] == "device" for op in amx_ops.OP_IDS)
    assert prov["embed"] == prov["sample"] == "fallback"
    assert be.profile.supports("amx_bf16") and be.profile.exec_level.value == "device"
    strict = reg.select(BackendConfig(name="cpu_amx", strict=True))
    assert strict.ops["linear"] is not None
    with pytest.raises(Exception, match="strict=true forbids the reference fallback"):
        strict.ops["sample"]


@needs_amx
def test_linear_routes_bf16_to_the_kernel_and_the_rest_to_the_reference():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 3, 128, generator=g), torch.randn(96, 128, generator=g) * 0.1
    xb, wb = x.bfloat16(), w.bfloat16()
    amx_ops.PACKS.clear()
    got = amx_ops.linear(xb, wb)
    assert len(amx_ops.PACKS.entries) == 1  # packed once, kept
    assert torch.equal(got, amx.linear(xb, amx.pack(wb), 96))
    torch.testing.assert_close(got.float(), F.linear(xb, wb).float(), rtol=2 ** -7, atol=1e-2)
    assert torch.equal(amx_ops.linear(x, w), F.linear(x, w)) or torch.allclose(amx_ops.linear(x, w), F.linear(x, w),
                                                                                rtol=1e-5, atol=1e-5)
    b = torch.randn(96, generator=g).bfloat16()
    torch.testing.assert_close(amx_ops.linear(xb, wb, b), F.linear(xb, wb, b))  # a bias: the reference product
    odd = torch.randn(8, 40, generator=g).bfloat16()  # K = 40, not whole tiles: the reference product
    torch.testing.assert_close(amx_ops.linear(xb[..., :40], odd), F.linear(xb[..., :40], odd))
    assert len(amx_ops.PACKS.entries) == 1


@needs_amx
def test_lm_head_writes_its_logits_into_the_buffer_in_one_pass_within_rounding_of_the_references(monkeypatch):
    from inferhal.backends.reference import ops as ref

    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(6, 128, generator=g).bfloat16(), (torch.randn(5000, 128, generator=g) * 0.1).bfloat16()
    monkeypatch.setattr(ref, "LM_HEAD_CHUNK", 1024)  # the reference's chunks cross the vocabulary
    want = amx_ops.linear(x, w).float()  # the kernel's bf16-rounded sums, widened (equal by construction)
    buf = torch.full((6, 5000), float("nan"))
    got = amx_ops.lm_head(x, w, buf)
    assert got.data_ptr() == buf.data_ptr() and torch.equal(buf, want)  # bit for bit: the same bf16 rounding
    assert torch.equal(amx_ops.lm_head(x, w), want)
    # the reference's product (oneDNN, chunked over the vocabulary) sums in its own order: within bf16's rounding
    torch.testing.assert_close(got, ref.lm_head(x, w), rtol=2 ** -7, atol=1e-2)
    seen = []
    monkeypatch.setattr(amx, "linear", lambda *a, **k: seen.append(a))  # from here on, only the reference may run
    assert torch.equal(amx_ops.lm_head(x.float(), w.float()), ref.lm_head(x.float(), w.float()))  # fp32
    assert torch.equal(amx_ops.lm_head(x[:, :100], w[:, :100]), ref.lm_head(x[:, :100], w[:, :100]))  # K % 32
    with pytest.raises(ValueError, match=r"needs float32 \(6, 5000\)"):
        amx_ops.lm_head(x, w, torch.empty(6, 4999))
    assert seen == []


@needs_amx
@pytest.mark.parametrize("bad,match", [({"options": {"threads": 4}}, "unknown option"),
                                       ({"batch_invariant": True}, "batch_invariant")])
def test_bad_backend_config_is_a_clear_error(reg, bad, match):
    with pytest.raises(UserError, match=match):
        reg.select(BackendConfig(name="cpu_amx", **bad))


def test_unavailable_backend_says_why(reg, monkeypatch):
    lib.clear()
    try:
        monkeypatch.setattr(lib, "cpu_flags", lambda: frozenset())
        fresh = BackendRegistry.discover()
        with pytest.raises(Exception, match="cpu_amx.*unavailable.*lacks amx_tile"):
            fresh.select(BackendConfig(name="cpu_amx"))
    finally:
        monkeypatch.undo()
        lib.clear()
