"""Random-weight DeepSeek-V4 checkpoints: in memory (``format: random``) or as an HF directory.

    python -m inferhal.core.models.deepseek_v4.make_checkpoint OUT_DIR --config tiny [--seed 0] [--quantize]
        [--tokenizer chars]

``--config NAME`` reads ``conf/model/deepseek_v4_NAME.yaml``'s ``arch`` (or pass a YAML/JSON path).
Weights are non-trivial on purpose: random sinks, position biases, correction biases, HC bases/scales,
norm gains and a random ``tid2eid`` (distinct experts per token), so tests exercise every parameter.
``--quantize`` stores dense projections as FP8 e4m3 with 128x128 fp32 block scales and routed experts
as FP4 e2m1 with ue8m0 group-of-32 scales, in transformers' tensor names.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Mapping

import torch

from inferhal.core.models.deepseek_v4.config import V4Config, parse_config
from inferhal.core.models.deepseek_v4.shapes import expected

_STD = 0.08
#: the chat template of :func:`write_char_tokenizer`: ``role: content`` lines, then ``assistant:``
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def _is_norm(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and "norm" in parts[-2] and parts[-1] == "weight"


def random_tensors(cfg: V4Config, seed: int = 0, with_mtp: bool = True) -> dict[str, torch.Tensor]:
    """Canonical name → fp32 (tid2eid: int64) tensor for every tensor of :func:`shapes.expected`."""
    g = torch.Generator().manual_seed(seed)

    def rn(*shape: int, std: float = _STD) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    out: dict[str, torch.Tensor] = {}
    for name, shape in expected(cfg, with_mtp).items():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("tid2eid"):
            out[name] = torch.stack([torch.randperm(cfg.n_experts, generator=g)[: cfg.top_k] for _ in range(shape[0])])
        elif _is_norm(name):
            out[name] = 1.0 + rn(*shape, std=0.1)
        elif leaf in ("sinks", "position_bias", "e_score_correction_bias", "base", "hc_base"):
            out[name] = rn(*shape, std=0.5)
        elif leaf in ("scale", "hc_scale"):
            out[name] = 1.0 + rn(*shape, std=0.2)
        elif name.endswith("embed_tokens.weight"):
            out[name] = rn(*shape, std=1.0)
        else:
            fan_in = shape[-1]
            out[name] = rn(*shape, std=min(_STD * 4, fan_in ** -0.5))
    return out


def _fp8(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    pn, pk = -n % block, -k % block
    x = torch.nn.functional.pad(w.float(), (0, pk, 0, pn)).reshape((n + pn) // block, block, (k + pk) // block, block)
    s = (x.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
    q = (x / s[:, None, :, None]).clamp(-448, 448).reshape(n + pn, k + pk)[:n, :k].to(torch.float8_e4m3fn)
    return q.contiguous(), s


def _fp4(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    *lead, n, k = w.shape
    x = w.float().reshape(*lead, n, k // group, group)
    amax = x.abs().amax(dim=-1).clamp(min=1e-12)
    s = torch.exp2(torch.ceil(torch.log2(amax / 6.0)))  # power-of-two (ue8m0) scales
    y = (x / s[..., None]).reshape(*lead, n, k)
    mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    codes = (y.abs()[..., None] - mags).abs().argmin(dim=-1) | ((y < 0).long() << 3)
    codes = codes.reshape(*lead, n, k // 2, 2).to(torch.uint8)
    return (codes[..., 0] | (codes[..., 1] << 4)).contiguous(), s.to(torch.float8_e8m0fnu)


def _quantisable_dense(name: str) -> bool:
    skip = ("compressor.", "mlp.gate.", "embed_tokens", "lm_head", "hc_head", "attn_hc", "ffn_hc")
    return name.endswith(".weight") and not _is_norm(name) and not any(s in name for s in skip)


def write_checkpoint(out_dir: str, arch: Mapping[str, Any], seed: int = 0, quantize: bool = False,
                     with_mtp: bool = True) -> str:
    """Write ``config.json`` + ``model.safetensors`` (transformers' names under ``model.``); returns out_dir."""
    from safetensors.torch import save_file

    cfg = parse_config(dict(arch))
    tensors = random_tensors(cfg, seed, with_mtp)
    os.makedirs(out_dir, exist_ok=True)
    flat: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        key = name if name.startswith(("lm_head", "mtp.")) else "model." + name
        if quantize and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            q, s = _fp4(t)
            flat[key], flat[key + "_scale_inv"] = q, s
        elif quantize and t.dim() == 2 and _quantisable_dense(name):
            q, s = _fp8(t)
            flat[key], flat[key[: -len(".weight")] + ".weight_scale_inv"] = q, s
        else:
            flat[key] = t.contiguous()
    save_file(flat, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config = {"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"], **dict(arch)}
    if quantize:
        config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128],
                                         "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return out_dir


def write_char_tokenizer(out_dir: str, vocab_size: int, chat_template: str = CHAT_TEMPLATE) -> str:
    """A character-level ``tokenizer.json`` (``tokenizers``: a BPE with no merges over the printable ASCII
    characters; ``<s>`` = 0 and ``</s>`` = 1, the random configs' bos/eos; the other ids up to ``vocab_size``
    as ``<tNNN>`` pieces) and a ``tokenizer_config.json`` with a plain chat template, so a random checkpoint
    can be served as text (``inferhal serve``, ``bench serve``); returns ``out_dir``."""
    import string

    from tokenizers import Tokenizer, decoders, models

    vocab = {"<s>": 0, "</s>": 1}
    for c in string.printable:
        if c not in "\x0b\x0c\r":
            vocab[c] = len(vocab)
    if len(vocab) > vocab_size:
        raise SystemExit(f"a character-level tokenizer needs a vocabulary of >= {len(vocab)} ids, not {vocab_size}")
    while len(vocab) < vocab_size:
        vocab[f"<t{len(vocab)}>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.Fuse()
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "chat_template": chat_template}, f)
    return out_dir


def _arch_of(config: str) -> dict[str, Any]:
    from omegaconf import OmegaConf

    path = config
    if not os.path.isfile(path):
        conf_dir = os.path.join(os.path.dirname(__file__), "..", "..", "..", "conf", "model")
        path = os.path.join(conf_dir, f"deepseek_v4_{config}.yaml")
    if not os.path.isfile(path):
        raise SystemExit(f"no model config {config!r} (looked for {path})")
    if path.endswith(".json"):
        with open(path) as f:
            return json.load(f)
    node = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    return dict(node.get("arch", node))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--config", default="tiny", help="tiny variant name, or a YAML/JSON file with an arch dict")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quantize", action="store_true")
    ap.add_argument("--no-mtp", action="store_true")
    ap.add_argument("--tokenizer", choices=["none", "chars"], default="none",
                    help="chars: add a character-level tokenizer and chat template (a servable text model)")
    a = ap.parse_args(argv)
    arch = _arch_of(a.config)
    write_checkpoint(a.out_dir, arch, a.seed, a.quantize, not a.no_mtp)
    if a.tokenizer == "chars":
        write_char_tokenizer(a.out_dir, int(arch["vocab_size"]))
    print(f"wrote {a.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
