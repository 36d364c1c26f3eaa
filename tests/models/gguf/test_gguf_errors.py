"""The GGUF reader and loader on small synthetic files: what they read, and a clear UserError naming
the problem for a wrong magic, truncated metadata or tensor data, a foreign architecture, a missing or
misshapen tensor and a bad path."""

from __future__ import annotations

import numpy as np
import pytest

from inferhal.core.config.schema import BackendConfig, ModelConfig
from inferhal.core.errors import UserError
from inferhal.core.models.gguf.reader import GGUFFile
from inferhal.core.models.gemma3.loader import load
from inferhal.core.registry import BackendRegistry

gguf = pytest.importorskip("gguf")


def _write(path, arch="gemma3", tensors=None, meta=True):
    w = gguf.GGUFWriter(str(path), arch=arch)
    if meta:
        w.add_uint32(f"{arch}.embedding_length", 8)
        w.add_uint32(f"{arch}.block_count", 1)
        w.add_uint32(f"{arch}.feed_forward_length", 16)
        w.add_uint32(f"{arch}.attention.head_count", 2)
        w.add_uint32(f"{arch}.attention.head_count_kv", 1)
        w.add_uint32(f"{arch}.attention.key_length", 4)
        w.add_uint32(f"{arch}.attention.value_length", 4)
        w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
        w.add_uint32(f"{arch}.attention.sliding_window", 4)
        w.add_tokenizer_model("llama")
        w.add_token_list(["<pad>", "<eos>", "<bos>", "<unk>", "a", "b", "ab", "\u2581"])
        w.add_token_types([3, 3, 3, 3, 1, 1, 1, 1])
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
    for name, arr in (tensors or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _load(path):
    be = BackendRegistry.discover().select(BackendConfig(name="reference"))
    return load(ModelConfig(name="t", family="gemma3", format="gguf", path=str(path)), be)


def test_reader_reads_metadata_and_tensor_bytes(tmp_path):
    arr = np.arange(24, dtype=np.float32).reshape(3, 8)
    f = GGUFFile(_write(tmp_path / "m.gguf", tensors={"token_embd.weight": arr}))
    assert f.metadata["general.architecture"] == "gemma3" and f.metadata["gemma3.block_count"] == 1
    assert f.metadata["tokenizer.ggml.tokens"][6] == "ab"
    assert list(f.metadata["tokenizer.ggml.token_type"]) == [3, 3, 3, 3, 1, 1, 1, 1]
    info = f.tensors["token_embd.weight"]
    assert info.shape == (3, 8) and info.type_name == "F32"
    assert np.array_equal(f.raw("token_embd.weight").view(np.float32).reshape(3, 8), arr)


def test_wrong_magic_is_named(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"GGUX" + bytes(100))
    with pytest.raises(UserError, match="not a GGUF file: magic b'GGUX'"):
        _load(p)
    (tmp_path / "tiny.gguf").write_bytes(b"GG")
    with pytest.raises(UserError, match="not a GGUF file: only 2 bytes"):
        GGUFFile(tmp_path / "tiny.gguf")


def test_truncated_metadata_and_truncated_tensor_data_are_named(tmp_path):
    full = _write(tmp_path / "m.gguf", tensors={"token_embd.weight": np.ones((64, 8), np.float32)}).read_bytes()
    cut_meta = tmp_path / "meta.gguf"
    cut_meta.write_bytes(full[:200])
    with pytest.raises(UserError, match="truncated"):
        GGUFFile(cut_meta)
    cut_data = tmp_path / "data.gguf"
    cut_data.write_bytes(full[:-100])
    with pytest.raises(UserError, match="truncated: tensor 'token_embd.weight' needs bytes"):
        GGUFFile(cut_data)


def test_foreign_architecture_is_refused(tmp_path):
    p = _write(tmp_path / "llama.gguf", arch="llama")
    with pytest.raises(UserError, match="general.architecture is 'llama'.*only 'gemma3'"):
        _load(p)


def test_missing_metadata_and_missing_or_misshapen_tensors_are_named(tmp_path):
    with pytest.raises(UserError, match="'gemma3.embedding_length' is missing"):
        _load(_write(tmp_path / "nometa.gguf", meta=False))
    with pytest.raises(UserError, match="tensor 'blk.0.attn_norm.weight' is missing"):
        _load(_write(tmp_path / "empty.gguf"))
    bad = {"blk.0.attn_norm.weight": np.ones(7, np.float32)}
    with pytest.raises(UserError, match=r"'blk.0.attn_norm.weight' has shape \[7\], the config implies \[8\]"):
        _load(_write(tmp_path / "shape.gguf", tensors=bad))


def test_bad_paths_are_named(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        _load(tmp_path / "nope.gguf")
    with pytest.raises(UserError, match="0 .gguf files"):
        _load(tmp_path)


def test_an_arch_mapping_is_refused_by_the_loader_not_ignored(tmp_path):
    be = BackendRegistry.discover().select(BackendConfig(name="reference"))
    cfg = ModelConfig(name="t", family="gemma3", format="gguf", path=str(tmp_path / "x.gguf"), arch={"num_hidden_layers": 2})
    with pytest.raises(UserError, match="model.arch=.*the gemma3 loader reads its architecture from the GGUF"):
        load(cfg, be)

