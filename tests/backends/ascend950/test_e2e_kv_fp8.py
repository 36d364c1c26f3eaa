"""DeepSeek-V4 with ``cache.kv_dtype=fp8`` end to end on the ascend950 op table over the documented fake NPU,
with the backend's own KV storage and the 950PR's device profile: greedy tokens equal the reference backend's.

- The tiny V4 (head_dim 32, 8 RoPE dims, window 16): its 48-byte FP8 records are not the record the 950's
  operators read (448 + 64 channels), so kv.write and attn.sparse_topk fall back per call, each saying why.
- The same with V4's attention shapes (head_dim 512, 64 RoPE dims, window 128, CSA 4 / HCA 128): the window and
  compressed records go through kv_compress_epilog into 640-byte rows and npu_kv_quant_sparse_attn_sharedkv reads
  them; the indexer's FP8 keys reach npu_lightning_indexer as their e4m3 codes (their write falls back, saying why).
- ``cache.kv_dtype=fp4`` is refused at start-up, naming the field: no Ascend operator reads FP4 records.

Not a hardware result (wired-unrun): the fake computes what each operator's documentation says."""

from __future__ import annotations

import collections
import dataclasses

import pytest

from inferhal.backends.ascend950.device import AscendKVStorage, profile_for
from inferhal.backends.ascend950.ops import provide
from inferhal.backends.reference.ops import OPS as REF
from inferhal.core.engine.llm import LLM
from inferhal.core.errors import UserError
from inferhal.core.ops.table import OpTable
from inferhal.core.profile import ExecLevel
from inferhal.core.registry import ActiveBackend
from inferhal.core.sampling.params import SamplingParams

PROMPTS = [[1, 17, 130, 5, 99, 42, 7], [3, 3, 81, 190, 12]]  # vocab 192
#: V4-Flash's attention shapes on the tiny model (heads, hidden, experts stay tiny)
V4_ATTENTION = ["model.arch.head_dim=512", "model.arch.partial_rotary_factor=0.125", "model.arch.sliding_window=128",
                "model.arch.compress_rates.heavily_compressed_attention=128", "model.arch.index_head_dim=128",
                "cache.block_size=128"]


class FakeNpuBackend(ActiveBackend):
    """ascend950 as the engine sees it on a 950PR, with the fake NPU in place of torch_npu (CPU tensors)."""

    def kv_storage(self, request):
        return AscendKVStorage(request, "cpu", operator_records=self.profile.supports("kv_quant_sparse_attn_sharedkv"))

    def graph_runner(self):
        return None


def npu_backend(reference: LLM, rec):
    native = provide(rec, triton=False)
    wrappers = next(iter(native.values())).fn.__self__
    ref = reference.engine.backend
    fields = {f.name: getattr(ref, f.name) for f in dataclasses.fields(ActiveBackend)}
    fields.update(name="ascend950", ops=OpTable("ascend950", native, REF, ExecLevel.WIRED_UNRUN),
                  profile=dataclasses.replace(profile_for("Ascend950PR_9589"), torch_device="cpu"))
    return FakeNpuBackend(**fields), wrappers


def run(recorder, extra: list[str], prompts, max_tokens=4):
    overrides = ["model.dtype=bfloat16", "cache.kv_dtype=fp8", "cache.num_blocks=24", *extra]  # a small pool
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    ref = LLM("deepseek_v4_tiny", backend="reference", overrides=overrides)
    want = [o.token_ids for o in ref.generate(prompts, sp)]
    backend, wrappers = npu_backend(ref, recorder)
    npu = LLM("deepseek_v4_tiny", active_backend=backend, overrides=overrides)
    got = [o.token_ids for o in npu.generate(prompts, sp)]
    assert got == want, f"greedy tokens differ (fallbacks: {sorted(set(wrappers.events))})"
    fell = collections.defaultdict(set)
    for op, why in wrappers.events:
        fell[op].add(why)
    return collections.Counter(c.op for c in recorder.calls), {op: " | ".join(sorted(w)) for op, w in fell.items()}


def test_tiny_v4_fp8_kv_on_the_fake_npu_equals_reference(recorder):
    called, fell = run(recorder, [], PROMPTS)
    assert "the operator reads 448 e4m3 + 64 bf16 RoPE" in fell["attn.sparse_topk"]
    assert "kv_compress_epilog writes 448 e4m3" in fell["kv.write"]
    assert "indexer.scores" not in fell and called["npu_lightning_indexer"] > 0  # the FP8 keys' codes, scaled after
    assert not called["kv_compress_epilog"] and not called["npu_kv_quant_sparse_attn_sharedkv"]


def test_v4_attention_shapes_fp8_kv_reach_the_quantised_operators(recorder):
    prompts = [[(7 * i + 3) % 191 + 1 for i in range(22)], [(5 * i + 1) % 191 + 1 for i in range(9)]]
    called, fell = run(recorder, V4_ATTENTION, prompts, max_tokens=3)
    assert called["kv_compress_epilog"] > 0 and called["npu_kv_quant_sparse_attn_sharedkv"] > 0
    sparse = [c for c in recorder.calls if c.op == "npu_kv_quant_sparse_attn_sharedkv"]
    # window-only layers and HCA before its first 128-token entry (cmp_ratio 1); CSA with its selected entries
    assert {c.args["cmp_ratio"] for c in sparse} == {1, 4}
    assert all(c.tensor("cmp_sparse_indices").shape[1:] == (1, 512) for c in sparse if c.args["cmp_ratio"] == 4)
    assert "attn.sparse_topk" not in fell, fell
    # the indexer reads its FP8 keys (132-byte fp8_index records) through npu_lightning_indexer
    keys = [c.tensor("key") for c in recorder.calls if c.op == "npu_lightning_indexer"]
    assert keys and all(k.dtype == "bfloat16" and k.shape[1:] == (1, 128) for k in keys)
    # what still falls back, each call saying why: the FP8 key write (kv_compress_epilog writes only the 640-byte
    # main record) and the tiny mHC
    assert set(fell) == {"kv.write", "mhc.pre", "mhc.head"}, fell
    assert fell["kv.write"].startswith("fp8_index records of 128 dims") and " | " not in fell["kv.write"]


def test_fp4_kv_is_refused_at_start_up_naming_the_field(recorder):
    ref = LLM("deepseek_v4_tiny", backend="reference", overrides=["model.dtype=bfloat16"])
    backend, _ = npu_backend(ref, recorder)
    with pytest.raises(UserError, match=r"cache.kv_dtype=fp4 is refused: backend 'ascend950' reads KV caches in "
                                        r"auto, fp8 only"):
        LLM("deepseek_v4_tiny", active_backend=backend, overrides=["model.dtype=bfloat16", "cache.kv_dtype=fp4"])
    assert not recorder.calls
