"""Host reads in cuda_sm100's launch code during model steps (#46 item 3), in Triton's interpreter.

A CUDA graph cannot capture a step whose launch code reads a device value on the host (``.item()``,
``int(t)``, ``nonzero``, ``repeat_interleave`` without ``output_size``, ...), and a shape taken from such a
read would be baked into every replay. core's guard (:mod:`inferhal.core.engine.host_sync`) counts the reads
a backend's ops make, or with ``backend_fatal=True`` raises at them. Here:

- a tiny random Gemma 3 and Llama (the GGUF decoder) on cuda_sm100 run every step, prefill and decode,
  under the guard with backend reads fatal: none may read;
- the tiny DeepSeek-V4 runs every step under the counting guard, and its reads must be exactly
  :data:`REMAINING` (each with the reason it stays; none now): a removed read that comes back, or a new one,
  fails with the step's reads by file:line;
- its decode steps without the host's plan (what a captured graph's step sees) run under the guard with
  backend reads fatal: the compressor's rows come from a host-known bound, padded with -1 (none read).

Execution level: interpreter (no GPU); the guard watches the same Python launch code a device runs.
"""

from __future__ import annotations

import re

import pytest

from inferhal.core.config.schema import CacheConfig, SchedulerConfig
from inferhal.core.engine.engine import Engine
from inferhal.core.engine.host_sync import HostSyncGuard
from inferhal.core.engine.llm import LLM
from inferhal.core.models.base import LoadedModel
from inferhal.core.sampling.params import SamplingParams
from tests.backends.cuda_sm100.conftest import PROMPTS, watch
from tests.core.engine.test_host_sync import CONFIGS, _decoder

#: "what at path function" -> (reads per step of the tiny V4 (2 CSA layers), why it stays). Empty: the last
#: one, indexer.scores' ``int(seq_lens.max())`` width, went when its contract took the block table's reach
#: (block_table.shape[1] x BS, a shape) as the width (#46).
REMAINING: dict[str, tuple[int, str]] = {}


def _place(key: str) -> str:
    """``"what at path:line function"`` -> ``"what at path function"`` (lines move with edits; places do not)."""
    return re.sub(r"(\S+):\d+ ", r"\1 ", key)


@pytest.mark.slow
def test_tiny_v4_steps_read_only_the_listed_places(tiny_v4_greedy):
    got, want, guards = tiny_v4_greedy  # the package's plain greedy run, each model call under a counting guard
    assert got == want  # the guard watched the real ops: tokens unchanged
    assert [n for n, _ in guards] == [12, 2, 2, 2, 2, 2]  # a prefill, then five decode steps
    expected = {k: n for k, (n, _) in REMAINING.items()}
    for i, (_, guard) in enumerate(guards):
        places: dict = {}
        for key, n in guard.backend_reads.items():
            places[_place(key)] = places.get(_place(key), 0) + n
        assert places == expected, f"step {i}: the backend's reads by place:\n" + "\n".join(guard.report())


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_gguf_decoder_steps_make_no_host_read_in_the_backend(family, tiny_v4):
    backend = tiny_v4.engine.backend
    model = _decoder(CONFIGS[family], ops=backend.ops)
    eng = Engine(LoadedModel(model, None, f"tiny-{family}", family), backend,
                 SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32), CacheConfig(num_blocks=24))
    guards: list = []
    watch(model, guards, backend_fatal=True)  # a read in the backend's launch code raises HostSyncError
    for p in ([5, 6, 7, 8, 9] * 3, [3, 4, 5]):
        eng.add_request(p, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    assert [n for n, _ in guards] == [18, 2, 2]  # a prefill, then two decode steps
    assert all(not g.backend_reads for _, g in guards)


@pytest.mark.parametrize("exchange,reads", [("padded", False), ("exact", True)])
def test_ep_dispatch_and_combine_read_nothing_under_the_padded_exchange(exchange, reads):
    """The backend's moe.dispatch / moe.combine bound with backend.options.ep_exchange, under the guard with
    backend reads fatal (one rank; tests/kernels/test_moe_ep.py runs 2 gloo ranks): the padded exchange reads
    nothing, the exact one its split sizes (negative control)."""
    import torch

    from inferhal.backends.reference.comm import SingleProcessCommunicator
    from inferhal.core.backend import ParallelLayout
    from inferhal.core.config.schema import BackendConfig
    from inferhal.core.engine.host_sync import HostSyncError
    from inferhal.core.ops.params import EPParams
    from inferhal.core.registry import BackendRegistry

    ops = BackendRegistry.discover().select(BackendConfig(name="cuda_sm100", interpret=True,
                                                          options={"ep_exchange": exchange})).ops
    g = torch.Generator().manual_seed(1)
    x, ids, w = torch.randn(5, 32, generator=g), torch.randint(-1, 16, (5, 6), generator=g), torch.rand(5, 6, generator=g)
    comm, p = SingleProcessCommunicator(ParallelLayout()), EPParams(ep_size=1, num_physical=16)
    try:
        with HostSyncGuard(backend_fatal=True):
            sent = ops["moe.dispatch"](x, ids, comm, p)
            y = ops["moe.combine"](sent.x, w, sent.handle, comm, p)
    except HostSyncError:
        assert reads
        return
    assert not reads
    want = (x[:, None, :] * w[..., None] * (ids >= 0)[..., None]).sum(1)  # an identity expert
    assert torch.allclose(y, want, atol=1e-5)


@pytest.mark.slow
def test_tiny_v4_decode_steps_without_the_plan_read_nothing(tiny_v4):
    """A decode step as a captured graph sees it (``ForwardBatch.seqs`` None: RoPE and HCA widths from the
    model's bound, the compressor's rows from closing_row_bound with -1 rows past the device's count) runs
    under the guard with the backend's reads fatal too: no read in model or launch code, and the tokens are
    the reference's."""
    import dataclasses

    model = tiny_v4.engine.runner.model
    decodes = []

    def strip(fn):
        def run(batch, kv, *a, **k):
            if int(batch.input_ids.shape[0]) != len(PROMPTS):  # the prefill keeps its plan
                return fn(batch, kv, *a, **k)
            decodes.append(1)
            with HostSyncGuard(backend_fatal=True):
                return fn(dataclasses.replace(batch, seqs=None), kv, *a, **k)
        return run

    for name in ("forward", "forward_greedy"):
        setattr(model, name, strip(getattr(model, name)))
    sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    try:
        got = [o.token_ids for o in tiny_v4.generate(PROMPTS, sp)]
    finally:
        for name in ("forward", "forward_greedy"):
            delattr(model, name)
    want = [o.token_ids for o in LLM("deepseek_v4_tiny", backend="reference").generate(PROMPTS, sp)]
    assert got == want and len(decodes) == 4
