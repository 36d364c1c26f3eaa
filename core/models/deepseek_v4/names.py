"""Tensor names: the ONE place where DeepSeek's official checkpoint names meet transformers' names.

Canonical names are transformers' ``DeepseekV4ForCausalLM`` parameter names without the ``model.``
prefix (``layers.3.self_attn.compressor.indexer.q_b_proj.weight``, ``lm_head.weight``), plus, for
quantised checkpoints, ``<weight>_scale_inv`` siblings (DeepSeek's ``.scale``) and per-expert
``layers.i.mlp.experts.E.w1|w2|w3.weight`` that the loader stacks into ``gate_up_proj`` / ``down_proj``.
MTP layers (``mtp.K.``) use the layer names plus their own ``e_proj``, ``h_proj``, ``enorm``, ``hnorm``,
``norm`` and ``hc_head``. :func:`canonical` accepts official names, transformers' ``save_pretrained``
names (official names under ``model.``) and canonical names alike.
"""

from __future__ import annotations

import re

# applied in order to "." + the part after "layers.N." / "mtp.K."
_LAYER_RULES = [
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^\.attn_norm\.", ".input_layernorm."),
    (r"^\.ffn_norm\.", ".post_attention_layernorm."),
    (r"^\.hc_attn_(fn|base|scale)$", r".attn_hc.\1"),
    (r"^\.hc_ffn_(fn|base|scale)$", r".ffn_hc.\1"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."),
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]
_TOP = {"embed.weight": "embed_tokens.weight", "head.weight": "lm_head.weight", "head.scale": "lm_head.weight_scale_inv",
        "hc_head_fn": "hc_head.hc_fn", "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale"}
_MTP_OWN = {"e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight", "e_proj.scale",
            "h_proj.scale", "hc_head_fn", "hc_head_base", "hc_head_scale", "hc_head.hc_fn", "hc_head.hc_base",
            "hc_head.hc_scale", "e_proj.weight_scale_inv", "h_proj.weight_scale_inv"}
_KEEP_SCALE = {".attn_hc.scale", ".ffn_hc.scale", ".hc_attn_scale", ".hc_ffn_scale"}
_PREFIX = re.compile(r"^((?:layers|mtp)\.\d+\.)(.*)$")


def _scale(rest: str) -> str:
    # DeepSeek's ".scale" beside a quantised ".weight" is transformers' ".weight_scale_inv"
    if rest.endswith(".scale") and rest not in _KEEP_SCALE:
        return rest[: -len(".scale")] + ".weight_scale_inv"
    return rest


def canonical(key: str) -> str:
    """Checkpoint tensor name → canonical name (see the module docstring)."""
    if key.startswith("model."):
        key = key[len("model."):]
    m = _PREFIX.match(key)
    if not m:
        return _TOP.get(key, key)
    prefix, rest = m.groups()
    if prefix.startswith("mtp.") and rest in _MTP_OWN:
        rest = {"hc_head_fn": "hc_head.hc_fn", "hc_head_base": "hc_head.hc_base",
                "hc_head_scale": "hc_head.hc_scale"}.get(rest, rest)
        return prefix + _scale("." + rest)[1:]
    rest = _scale("." + rest)
    for pat, rep in _LAYER_RULES:
        rest = re.sub(pat, rep, rest)
    return prefix + rest[1:]


_EXPERT = re.compile(r"^((?:layers|mtp)\.\d+\.mlp\.experts)\.(\d+)\.(w1|w2|w3)\.(weight|weight_scale_inv)$")


def split_expert(name: str) -> tuple[str, int, str, str] | None:
    """``layers.i.mlp.experts.E.w1.weight`` → (``layers.i.mlp.experts``, E, ``w1``, ``weight``), else None."""
    m = _EXPERT.match(name)
    return None if m is None else (m.group(1), int(m.group(2)), m.group(3), m.group(4))
