"""No host synchronisation in a step's model code (core/engine/host_sync.py), so decode steps stay capturable
as device graphs between GPU loans.

The engine's steps (prefill, decode, draft verification) run with every model entry point under the
guard: the tiny DeepSeek-V4 with sync and async scheduling, n-gram drafts and MTP drafts (MTP's own
layer too), and a tiny random Gemma 3 and Llama through the GGUF decoder. The guard raises for a read
that core or model code makes and counts the reference backend's own (its ops are not what a device
graph captures; the device run checks a device backend's ops with the device's sync guard). Negative
controls: a planted ``.item()``, ``int()``, ``.tolist()``, ``nonzero`` and boolean mask in a decode step
each fail with the file and line; the same reads inside a backend op are counted, not raised; and without
the host's plan (a captured graph's batch) the model's decode steps read nothing either.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from inferhal import LLM, SamplingParams
from inferhal.core.config.schema import CacheConfig, SchedulerConfig
from inferhal.core.engine.engine import Engine
from inferhal.core.engine.host_sync import HostSyncError, HostSyncGuard
from inferhal.core.engine.llm import compose_config
from inferhal.core.models.base import LoadedModel
from inferhal.core.models.gemma3.config import Gemma3Config
from inferhal.core.models.gguf.decoder import DecoderForCausalLM, LayerWeights
from inferhal.core.models.llama.config import LlamaConfig

ENTRY_POINTS = ("forward", "forward_greedy", "forward_and_hidden", "mtp_hidden")
PROMPTS = [[5, 6, 7, 8, 9] * 3, [3, 4, 5], [11, 12, 13, 14] * 5 + [15]]


def guard_model(model, guard: HostSyncGuard) -> list[str]:
    """Run each of the model's entry points under ``guard`` (instance attributes shadow the methods)."""
    wrapped = []
    for name in ENTRY_POINTS:
        fn = getattr(model, name, None)
        if fn is None:
            continue

        def run(*a, _fn=fn, **k):
            with guard:
                return _fn(*a, **k)

        setattr(model, name, run)
        wrapped.append(name)
    return wrapped


def unguard(model, names) -> None:
    for name in names:
        delattr(model, name)


def generate(llm: LLM, max_tokens: int = 8):
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return [o.token_ids for o in out]


@pytest.fixture(scope="module")
def tiny():
    return LLM.from_config(compose_config("deepseek_v4_tiny", "reference"))


def test_tiny_v4_steps_make_no_host_read_and_keep_their_tokens(tiny):
    want = generate(tiny)
    guard = HostSyncGuard()
    names = guard_model(tiny.engine.runner.model, guard)
    try:
        got = generate(tiny)
    finally:
        unguard(tiny.engine.runner.model, names)
    assert got == want
    # the guard watched: the reference backend's ops read on the host, and were counted, not raised
    assert sum(guard.backend_reads.values()) > 0
    assert all(" at backends/" in k for k in guard.backend_reads)


@pytest.mark.parametrize("overrides", [["scheduler.async_scheduling=true"], ["spec=ngram"],
                                       ["spec=ngram", "scheduler.async_scheduling=true"]],
                         ids=["async", "ngram", "ngram-async"])
def test_tiny_v4_with_drafts_and_async_scheduling(overrides):
    llm = LLM.from_config(compose_config("deepseek_v4_tiny", "reference", overrides))
    guard_model(llm.engine.runner.model, HostSyncGuard())
    prompts = [[1, 2, 3, 4] * 6, [7, 8, 9] * 5]  # repetitive: the n-gram drafter proposes
    out = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert all(len(o.token_ids) == 10 for o in out)


def test_tiny_v4_with_mtp_drafts():
    llm = LLM.from_config(compose_config("deepseek_v4_tiny_mtp", "reference", ["spec=mtp"]))
    model = llm.engine.runner.model
    names = guard_model(model, HostSyncGuard())
    assert "mtp_hidden" in names and "forward_and_hidden" in names
    out = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert all(len(o.token_ids) == 6 for o in out)


def _decoder(cfg, seed: int = 0, ops=None) -> DecoderForCausalLM:
    """A tiny random GGUF-style decoder of ``cfg`` over ``ops`` (the reference backend's by default)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape, s=0.08: torch.randn(*shape, generator=g) * s  # noqa: E731
    hd, hid, i = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    norms = cfg.qk_norm or cfg.sandwich_norms
    layers = [LayerWeights(attn_norm=r(hid, s=0.3), q=r(cfg.num_heads * hd, hid), k=r(cfg.num_kv_heads * hd, hid),
                           v=r(cfg.num_kv_heads * hd, hid), o=r(hid, cfg.num_heads * hd), ffn_norm=r(hid, s=0.3),
                           gate=r(i, hid), up=r(i, hid), down=r(hid, i),
                           q_norm=r(hd, s=0.3) if norms else None, k_norm=r(hd, s=0.3) if norms else None,
                           post_attn_norm=r(hid, s=0.3) if norms else None,
                           post_ffn_norm=r(hid, s=0.3) if norms else None)
              for _ in range(cfg.num_layers)]
    ops = ops if ops is not None else tiny_backend().ops
    return DecoderForCausalLM(cfg, ops, r(cfg.vocab_size, hid), layers, r(hid, s=0.3), 128)


_BACKEND = {}


def tiny_backend():
    if "be" not in _BACKEND:
        _BACKEND["be"] = LLM.from_config(compose_config("deepseek_v4_tiny", "reference")).engine.backend
    return _BACKEND["be"]


CONFIGS = {
    "gemma3": Gemma3Config(vocab_size=300, hidden_size=64, num_layers=4, intermediate_size=96, num_heads=4,
                           num_kv_heads=1, head_dim=32, sliding_window=6, query_pre_attn_scalar=24,
                           max_position_embeddings=128,
                           layer_types=("sliding_attention", "sliding_attention", "full_attention",
                                        "sliding_attention")),
    "llama": LlamaConfig(vocab_size=300, hidden_size=64, num_layers=3, intermediate_size=96, num_heads=4,
                         num_kv_heads=2, max_position_embeddings=128),
}


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_gguf_decoder_steps_make_no_host_read(family):
    model = _decoder(CONFIGS[family])
    eng = Engine(LoadedModel(model, None, f"tiny-{family}", family), tiny_backend(),
                 SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32), CacheConfig(num_blocks=24))

    def run():
        ids = [eng.add_request(p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)) for p in PROMPTS]
        done = {}
        while eng.has_unfinished():
            done.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
        return [done[i] for i in ids]

    want = run()
    guard_model(model, HostSyncGuard())
    assert run() == want


# ------------------------------------------------------------------ negative controls


def test_a_planted_read_in_a_decode_step_fails_with_its_place(tiny):
    """Each way of reading a device value, planted in the model's head (run by every decode step)."""
    model = tiny.engine.runner.model
    real = model.head
    plants = {
        "item": lambda x: x.sum().item(),
        "int": lambda x: int(x[0, 0, 0] > 0),
        "tolist": lambda x: x[:, 0, 0].tolist(),
        "nonzero": lambda x: torch.nonzero(x[:, 0, 0] > 0),
        "mask": lambda x: x[x > 0],
        "repeat_interleave": lambda x: torch.repeat_interleave(torch.ones(2, dtype=torch.long)),
        "cpu": lambda x: x.cpu(),
        "bool": lambda x: bool((x > 0).any()),
        "host data": lambda x: torch.tensor([1, 2, 3]),
    }
    for name, plant in plants.items():
        calls = []

        def head(pre, streams, *a, _plant=plant, _calls=calls, **k):
            _calls.append(1)
            if len(_calls) > 1:  # the first step prefills every prompt; the rest decode
                _plant(streams)
            return real(pre, streams, *a, **k)

        model.head = head
        names = guard_model(model, HostSyncGuard())
        try:
            with pytest.raises(HostSyncError, match=r"at tests/core/engine/test_host_sync.py:\d+ <lambda>") as err:
                generate(tiny, max_tokens=2)
        finally:
            unguard(model, names)
            del model.head
        assert "host synchronisation in a step" in str(err.value) and len(calls) == 2, name
    assert generate(tiny, max_tokens=2)  # the model is left as it was


def test_reads_inside_a_backend_op_are_counted_not_raised():
    guard = HostSyncGuard()
    from inferhal.backends.reference import attention  # noqa: F401 - a backend module's frame

    x = torch.arange(6.0)
    with guard:
        code = compile("y = int(x.max()); z = torch.nonzero(x > 2)", attention.__file__, "exec")
        exec(code, {"x": x, "torch": torch})  # frames named after a file under backends/
    # one read each: int() is counted once (not again as the aten._local_scalar_dense it dispatches)
    where = "backends/reference/attention.py:1 <module>"
    assert guard.backend_reads == {f"__int__() at {where}": 1, f"aten.nonzero at {where}": 1}
    assert guard.report() == [f"   1  __int__() at {where}", f"   1  aten.nonzero at {where}"]
    with pytest.raises(HostSyncError, match="aten.nonzero"):
        with guard:
            torch.nonzero(x > 2)
    with pytest.raises(HostSyncError, match=f"__int__\\(\\) at {where}"):  # backend_fatal: a backend's read raises
        with HostSyncGuard(backend_fatal=True):
            exec(code, {"x": x, "torch": torch})


def test_without_the_hosts_plan_the_model_uses_bounds(tiny):
    """A batch without ``seqs`` (what a captured graph's step sees): RoPE and HCA widths take the model's
    bound, and the compressor's closing rows a host-known bound (closing_row_bound) with -1 rows past the
    device's count: decode steps make no read in model code, and the tokens are unchanged."""
    model = tiny.engine.runner.model
    real = model.forward_greedy, model.forward
    stripped = []

    def strip(fn):
        def run(batch, kv):
            if int(batch.input_ids.shape[0]) == len(PROMPTS):  # decode steps only
                stripped.append(1)
                with HostSyncGuard():  # a read in core or model code raises HostSyncError
                    return fn(dataclasses.replace(batch, seqs=None), kv)
            return fn(batch, kv)
        return run

    want = generate(tiny, max_tokens=6)
    model.forward_greedy, model.forward = strip(real[0]), strip(real[1])
    try:
        got = generate(tiny, max_tokens=6)
    finally:
        del model.forward_greedy, model.forward
    assert got == want
    assert len(stripped) == 5  # every decode step ran without the plan
