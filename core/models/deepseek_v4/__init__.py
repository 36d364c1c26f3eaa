"""DeepSeek-V4 (transformers' ``deepseek_v4``): hybrid CSA/HCA attention with a sliding-window branch and
sinks, mHC residual streams, MoE with a shared expert and hash-routed early layers, MTP draft layers.

Files: ``config`` (config.json validation), ``kv`` (paged KV groups), ``rope`` (rotary tables),
``attention`` / ``model`` (the forward pass on op IDs), ``names`` (official ↔ transformers tensor
names), ``shapes`` (expected tensors), ``quantized`` (FP8/FP4), ``loader``, ``make_checkpoint``
(random checkpoints), ``tokenizer``.
"""

from inferhal.core.models.deepseek_v4.kv import kv_groups, kv_groups_from_config, v4_config

__all__ = ["KV_DTYPES", "kv_groups", "kv_groups_from_config", "routed_experts_from_config"]

#: cache.kv_dtype values this family stores (FP8/FP4 records: core/paging/formats.py); a family without this
#: name stores its KV in the model's dtype only
KV_DTYPES = ("auto", "fp8", "fp4")


def routed_experts_from_config(model_cfg) -> int:
    """Routed experts per MoE layer (``n_routed_experts``), from ``model.arch`` or the checkpoint's config.json."""
    return v4_config(model_cfg).n_experts
