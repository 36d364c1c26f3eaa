"""The dequantised-weight cache: exact round trip (fp32, bf16), a changed GGUF misses, a corrupt entry
is rebuilt, and INFERHAL_WEIGHT_CACHE=0 turns it off."""

from __future__ import annotations

import os

import torch

from inferhal.core.models.gemma3 import weight_cache as wc


def _tensors(dtype):
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(3, 5, generator=g).to(dtype), "b.weight": torch.randn(7, generator=g).to(dtype)}


def test_round_trip_is_exact_and_mapped(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    for dtype in (torch.float32, torch.bfloat16):
        calls = []
        want = _tensors(dtype)
        got, hit = wc.cached(tmp_path / "c", gguf, dtype, lambda: calls.append(1) or want)
        assert not hit and calls == [1]
        got, hit = wc.cached(tmp_path / "c", gguf, dtype, lambda: calls.append(1) or want)
        assert hit and calls == [1]
        for k in want:
            assert got[k].dtype == dtype and torch.equal(got[k], want[k])


def test_changed_file_misses_and_corrupt_entry_rebuilds(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    want = _tensors(torch.float32)
    wc.cached(tmp_path / "c", gguf, torch.float32, lambda: want)
    d = wc.entry_dir(tmp_path / "c", gguf, torch.float32)
    (d / "weights.bin").write_bytes(b"short")  # corrupt: size no longer matches the index
    got, hit = wc.cached(tmp_path / "c", gguf, torch.float32, lambda: want)
    assert not hit and torch.equal(got["a"], want["a"])
    assert wc.cached(tmp_path / "c", gguf, torch.float32, lambda: want)[1]  # rebuilt entry now hits
    os.utime(gguf, ns=(1, 1))
    assert wc.entry_dir(tmp_path / "c", gguf, torch.float32) != d


def test_cache_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERHAL_WEIGHT_CACHE", "0")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    _, hit = wc.cached(tmp_path / "c", gguf, torch.float32, lambda: _tensors(torch.float32))
    assert not hit and not (tmp_path / "c").exists()


def test_int_block_weights_round_trip_under_their_own_key(tmp_path):
    from inferhal.core.ops.quant import int_block

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    g = torch.Generator().manual_seed(1)
    data = torch.randint(-16, 16, (4, 64), generator=g, dtype=torch.int8)
    want = {"n.weight": torch.randn(4, generator=g).bfloat16(),
            "p.weight": int_block(data, torch.rand(4, 2, generator=g)),
            "o.weight": int_block(data, torch.rand(4, 4, generator=g), torch.rand(4, 4, generator=g))}
    wc.cached(tmp_path / "c", gguf, torch.bfloat16, lambda: want, variant="int_blocks")
    got, hit = wc.cached(tmp_path / "c", gguf, torch.bfloat16, lambda: {}, variant="int_blocks")
    assert hit and set(got) == set(want) and torch.equal(got["n.weight"], want["n.weight"])
    for name in ("p.weight", "o.weight"):
        a, b = got[name], want[name]
        assert a.format == "int_block" and a.block == b.block and torch.equal(a.data, b.data)
        assert torch.equal(a.scale, b.scale) and (a.offset is None) == (b.offset is None)
    assert torch.equal(got["o.weight"].offset, want["o.weight"].offset)
    # the dense entry of the same file and dtype is another one
    assert wc.entry_dir(tmp_path / "c", gguf, torch.bfloat16) != wc.entry_dir(tmp_path / "c", gguf, torch.bfloat16,
                                                                                "int_blocks")
    assert not wc.cached(tmp_path / "c", gguf, torch.bfloat16, lambda: {"x": torch.ones(1)})[1]
