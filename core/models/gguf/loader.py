"""``load(model_cfg, backend, family) -> LoadedModel`` for a dense decoder GGUF; a family's loader is this
with its :class:`Family` settings.

The file is ``model_cfg.path`` (a ``.gguf``, or a directory holding one) when set, else the one the family
finds for ``model_cfg.package``. Metadata becomes the family's config (:mod:`.config`); every weight the config
implies is checked against it, then dequantised to ``model_cfg.dtype`` (bit-identical to ``gguf.quants``,
:mod:`.dequant`), fixed up as the family's files need (Gemma's norms held minus one; Llama's q/k rows back in
Hugging Face's order) and streamed into the disk cache, which the model then maps (:mod:`.weight_cache`). A bf16
model of a family that allows it, on a backend whose linear takes integer blocks (profile feature
``int_block_linear``: cpu_avx512), keeps the layers' products as int_block weights instead, the same values
(:func:`.dequant.int_blocks`). The tokenizer is rebuilt from the vocabulary (:mod:`.tokenizer`) in a thread
while the weights decode. Problems with the file raise ``UserError`` naming them.
"""

from __future__ import annotations

import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Mapping, Sequence

import torch

from inferhal.core.config.context import model_len
from inferhal.core.errors import UserError
from inferhal.core.models.base import LoadedModel
from inferhal.core.models.gguf import cache_dir, chat, weight_cache
from inferhal.core.models.gguf.config import DecoderConfig
from inferhal.core.models.gguf.decoder import WEIGHT_NAMES, DecoderForCausalLM, LayerWeights, kv_groups_for
from inferhal.core.models.gguf.dequant import dequantize, int_blocks
from inferhal.core.models.gguf.reader import GGUFError, GGUFFile
from inferhal.core.models.gguf.tokenizer import GGUFTokenizer
from inferhal.core.ops.quant import QuantWeight

if TYPE_CHECKING:
    from inferhal.core.config.schema import ModelConfig
    from inferhal.core.paging.spec import KVGroupSpec
    from inferhal.core.registry import ActiveBackend

log = logging.getLogger("inferhal.models.gguf")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NORMS = ("attn_norm", "attn_q_norm", "attn_k_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm", "output_norm")
#: the layers' products: the weights ``int_blocks`` keeps as integer blocks
PRODUCTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
#: the profile feature of a backend whose linear takes int_block weights
INT_BLOCK_FEATURE = "int_block_linear"


@dataclass(frozen=True)
class Family:
    """What a GGUF decoder family sets beside its config class."""

    name: str  # model.family
    config: type[DecoderConfig]
    package_file: Callable[[str], Path]  # model.package -> the GGUF it ships
    permuted_qk: bool = False  # llama.cpp's converter permuted q/k rows for its interleaved RoPE: undo it
    int_blocks: bool = False  # may keep integer blocks for an int_block_linear backend (needs permuted_qk False)
    cache_variant: str = ""  # names the weight cache entries of its fixed-up weights
    stop_pieces: tuple[str, ...] = ()  # vocabulary pieces that also end a generation
    builtin_chat: Callable[[Sequence[Mapping[str, str]], bool], str] | None = None  # without a chat template
    builtin_chat_label: str = "none"  # info["chat_template"] then
    chat_roles: tuple[str, ...] = chat.ROLES


def resolve_path(model_cfg: "ModelConfig", family: Family) -> Path:
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
        return family.package_file(str(model_cfg.package))
    raise UserError(f"model {model_cfg.name!r}: set model.path to a .gguf file or model.package to a weights package")


def config_of(f: GGUFFile, family: Family) -> DecoderConfig:
    return family.config.from_gguf(f.metadata, where=str(f.path), has_output="output.weight" in f.tensors)


def tokenizer_of(f: GGUFFile, family: Family) -> GGUFTokenizer:
    """The file's tokenizer with the family's stop pieces and chat settings (no weights read)."""
    return GGUFTokenizer.from_gguf(f, family.stop_pieces, builtin_chat=family.builtin_chat,
                                   chat_roles=family.chat_roles)


def kv_groups_from_config(model_cfg: "ModelConfig", family: Family) -> "list[KVGroupSpec]":
    """The KV groups ``inferhal plan kv`` sizes, from ``model.arch`` or the file's metadata alone (no weights)."""
    if model_cfg.arch:
        cfg = family.config.from_mapping(dict(model_cfg.arch))
    else:
        cfg = config_of(GGUFFile(resolve_path(model_cfg, family)), family)
    return kv_groups_for(cfg, DTYPES.get(str(model_cfg.dtype), DTYPES["float32"]))


def expected_shapes(cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name → the shape (torch order) the config implies."""
    hd, hid, ffn = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    per_layer = {"attn_norm": (hid,), "attn_q": (cfg.num_heads * hd, hid), "attn_k": (cfg.num_kv_heads * hd, hid),
                 "attn_v": (cfg.num_kv_heads * hd, hid)}
    if cfg.qk_norm:
        per_layer.update(attn_q_norm=(hd,), attn_k_norm=(hd,))
    per_layer["attn_output"] = (hid, cfg.num_heads * hd)
    if cfg.sandwich_norms:
        per_layer["post_attention_norm"] = (hid,)
    per_layer.update(ffn_norm=(hid,), ffn_gate=(ffn, hid), ffn_up=(ffn, hid), ffn_down=(hid, ffn))
    if cfg.sandwich_norms:
        per_layer["post_ffw_norm"] = (hid,)
    out = {f"blk.{i}.{n}.weight": s for i in range(cfg.num_layers) for n, s in per_layer.items()}
    out["token_embd.weight"] = (cfg.vocab_size, hid)
    out["output_norm.weight"] = (hid,)
    if not cfg.tie_embeddings:
        out["output.weight"] = (cfg.vocab_size, hid)
    return out


def check_tensors(f: GGUFFile, cfg: DecoderConfig) -> None:
    """Every weight the config implies is in the file with its shape, or a GGUFError naming the first that is not."""
    for name, shape in expected_shapes(cfg).items():
        if name not in f.tensors:
            raise GGUFError(f"{f.path}: tensor {name!r} is missing")
        if tuple(f.tensors[name].shape) != tuple(shape):
            raise GGUFError(f"{f.path}: tensor {name!r} has shape {list(f.tensors[name].shape)}, the config implies "
                            f"{list(shape)}")
    if "output.weight" in f.tensors and cfg.tie_embeddings:
        log.warning("%s has an untied output.weight; %s ties the LM head to the embedding, ignoring it", f.path,
                    cfg.LABEL)


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's q/k row permutation undone (``[n_head * D, hidden]``): each head's rows go from
    interleaved pairs back to two halves, as transformers' GGUF loader does."""
    d = w.shape[0] // n_head // 2
    return w.reshape(n_head, d, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def read_tensors(f: GGUFFile, cfg: DecoderConfig, dtype: torch.dtype, family: Family,
                 keep_ints: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
    """Every weight the model needs (checked by :func:`check_tensors`), decoded one at a time on the CPU to
    ``dtype``: norms minus one for a ``norm_unit_offset`` config (llama.cpp stores Gemma's ``1 + w``), q/k
    rows un-permuted for a ``permuted_qk`` family. ``keep_ints``: the layers' products whose GGUF blocks are
    integers come back as int_block weights (:func:`~.dequant.int_blocks`: the same values, checked bit for bit)."""
    for name in expected_shapes(cfg):
        w = dequantize(f, name)  # fp32, bit-identical to gguf.quants
        kind = name.split(".")[-2]
        if family.permuted_qk and kind in ("attn_q", "attn_k"):
            w = unpermute(w, cfg.num_heads if kind == "attn_q" else cfg.num_kv_heads)
        q = int_blocks(f, name, w) if keep_ints and kind in PRODUCTS else None
        f.release(name)  # the file's pages of it: a cold load holds no more than a warm one, which never reads them
        if q is not None:
            yield name, q
            continue
        if cfg.norm_unit_offset and kind in NORMS:
            w = w - 1.0
        yield name, (w if w.dtype == dtype else w.to(dtype))


def build_model(tensors: Mapping[str, torch.Tensor | QuantWeight], cfg: DecoderConfig, ops, device,
                max_model_len: int) -> DecoderForCausalLM:
    expected = expected_shapes(cfg)
    for name, shape in expected.items():
        if name not in tensors or tuple(tensors[name].shape) != tuple(shape):
            raise UserError(f"weights: tensor {name!r} is missing or misshapen (want {list(shape)})")
    dev = torch.device(device)
    t = {k: (v if isinstance(v, QuantWeight) or v.device == dev else v.to(dev)) for k, v in tensors.items()}
    names = [n for n in WEIGHT_NAMES if f"blk.0.{n}.weight" in expected]
    layers = [LayerWeights(**{WEIGHT_NAMES[n]: t[f"blk.{i}.{n}.weight"] for n in names}) for i in range(cfg.num_layers)]
    return DecoderForCausalLM(cfg, ops, t["token_embd.weight"], layers, t["output_norm.weight"], max_model_len,
                              None if cfg.tie_embeddings else t["output.weight"])


def load(model_cfg: "ModelConfig", backend: "ActiveBackend", family: Family) -> LoadedModel:
    t0 = time.perf_counter()
    if model_cfg.format not in ("gguf", "auto"):
        raise UserError(f"model {model_cfg.name!r}: the {family.name} loader reads format=gguf, got {model_cfg.format!r}")
    if model_cfg.arch:  # read by `inferhal plan` only, to size a model that has no file
        raise UserError(f"model.arch={dict(model_cfg.arch)}: the {family.name} loader reads its architecture from "
                        f"the GGUF; leave arch empty (inferhal plan reads it to size a model without a file)")
    dtype_name = str(model_cfg.dtype)
    if dtype_name not in DTYPES:
        raise UserError(f"model.dtype {dtype_name!r} is not supported by {family.name}; choose one of {', '.join(DTYPES)}")
    path = resolve_path(model_cfg, family)
    f = GGUFFile(path)
    cfg = config_of(f, family)
    check_tensors(f, cfg)
    t_parse = time.perf_counter()
    max_len = model_len(model_cfg, cfg.max_position_embeddings)  # past context_length with model.allow_long_context
    dtype = DTYPES[dtype_name]
    # a bf16 model on a backend whose linear takes integer blocks keeps them: the same products, bit for bit,
    # from half the bytes at decode sizes (cpu_avx512: kernels/cpu/int_block.py)
    keep_ints = family.int_blocks and dtype == torch.bfloat16 and backend.profile.supports(INT_BLOCK_FEATURE)
    with ThreadPoolExecutor(1) as pool:  # the tokenizer builds (Rust, mostly GIL-free) while weights decode
        tok_future = pool.submit(tokenizer_of, f, family)

        def decode():  # a cache miss: the long part of a first load, said as it starts (also in a log)
            print(f"[load] {model_cfg.name}: decoding {path.name} to {dtype_name} (first load of this file and dtype; "
                  f"then cached under {cache_dir() / 'weights'})", file=sys.stderr, flush=True)
            return read_tensors(f, cfg, dtype, family, keep_ints)

        tensors, hit = weight_cache.cached(cache_dir(), path, dtype, decode,
                                           variant="int_blocks" if keep_ints else family.cache_variant)
        model = build_model(tensors, cfg, backend.ops, backend.profile.torch_device, max_len)
        t_weights = time.perf_counter()
        tok = tok_future.result()
    if model_cfg.chat_template:
        tok.chat_template = str(model_cfg.chat_template)
    t_end = time.perf_counter()
    info = {
        "path": str(path), "config": cfg, "tensor_types": sorted({t.type_name for t in f.tensors.values()}),
        "load_seconds": {"parse": t_parse - t0, "weights": t_weights - t_parse,
                         "tokenizer_wait": t_end - t_weights, "total": t_end - t0},
        "weight_cache": "hit" if hit else ("stored" if weight_cache.enabled(dtype) else "off"),
        "int_block_weights": sum(isinstance(v, QuantWeight) for v in tensors.values()),
        "chat_template": "model.chat_template" if model_cfg.chat_template else
        ("gguf" if tok.chat_template else family.builtin_chat_label),
    }
    log.info("loaded %s from %s in %.2f s", model_cfg.name, path, t_end - t0)
    if t_end - t0 > 5.0:
        print(f"[load] {model_cfg.name}: loaded in {t_end - t0:.1f} s (weights {t_weights - t_parse:.1f} s, "
              f"tokenizer wait {t_end - t_weights:.1f} s)", file=sys.stderr, flush=True)
    return LoadedModel(model=model, tokenizer=tok, name=str(model_cfg.name), family=family.name, info=info,
                       max_context=cfg.max_position_embeddings)
