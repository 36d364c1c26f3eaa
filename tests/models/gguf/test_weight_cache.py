"""The dequantised-weight cache: exact round trip (fp32, bf16), a changed GGUF misses, a corrupt entry
is rebuilt, and INFERHAL_WEIGHT_CACHE=0 turns it off. A miss takes the weights one at a time, each let go
before the next is decoded, and returns the mapped entry; an entry that cannot be written leaves the weights
in memory."""

from __future__ import annotations

import os
import weakref

import torch

from inferhal.core.models.gguf import weight_cache as wc


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


def test_weights_written_back_to_back_join_as_a_view_of_the_mapping(tmp_path):
    """A layer's q, k, v (and gate, up) are decoded one after another, so the entry holds them back to back;
    mapped as one storage, cat_rows joins them without a copy (a model's fused product reads the file's pages,
    which a backend's packed copy gives back). Parts apart in the file, or not mapped, are copied."""
    from inferhal.core.ops import mapped
    from inferhal.core.ops.quant import cat_rows

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    g = torch.Generator().manual_seed(1)
    want = {n: torch.randn(r, 16, generator=g) for n, r in (("q", 8), ("k", 4), ("v", 4), ("o", 16), ("gate", 8))}
    got, _ = wc.cached(tmp_path / "c", gguf, torch.float32, lambda: iter(want.items()))
    qkv = cat_rows((got["q"], got["k"], got["v"]))
    assert qkv.data_ptr() == got["q"].data_ptr() and mapped.is_mapped(qkv)  # a view, no copy
    assert torch.equal(qkv, torch.cat((want["q"], want["k"], want["v"])))
    apart = cat_rows((got["q"], got["gate"]))  # o lies between them
    assert apart.data_ptr() != got["q"].data_ptr() and torch.equal(apart, torch.cat((want["q"], want["gate"])))
    mem = torch.randn(16, 16)
    anon = cat_rows((mem[:8], mem[8:]))  # back to back, but anonymous memory: a copy, as before
    assert anon.data_ptr() != mem.data_ptr() and torch.equal(anon, mem)


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


def test_a_miss_holds_one_decoded_weight_at_a_time_and_returns_the_mapped_entry(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    decoded, want = [], {}  # weak references to every tensor the build made; their values

    def build():
        for i in range(4):
            held = [j for j, r in enumerate(decoded) if r() is not None]
            assert not held, f"decoding weight {i} while weight(s) {held} are still held"
            t = torch.full((64, 16), float(i)).to(torch.bfloat16)
            want[f"w{i}"] = t.clone()
            decoded.append(weakref.ref(t))
            yield f"w{i}", t
            del t

    got, hit = wc.cached(tmp_path / "c", gguf, torch.bfloat16, build)
    assert not hit and len(decoded) == 4 and all(r() is None for r in decoded)  # what comes back is the file's
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_an_entry_that_cannot_be_written_leaves_the_weights_in_memory(tmp_path, caplog):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    (tmp_path / "c").write_text("a file where the cache directory should be")
    want = _tensors(torch.float32)
    got, hit = wc.cached(tmp_path / "c", gguf, torch.float32, lambda: iter(want.items()))
    assert not hit and "could not write the weight cache" in caplog.text
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
