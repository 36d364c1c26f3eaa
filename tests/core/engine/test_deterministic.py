"""``deterministic=true`` on the reference (tiny DeepSeek-V4, fp32), tested the way SGLang's and vLLM's
determinism suites test it: a "needle" request alone, beside a longer prompt and inside random batches of
1..32 gives bitwise the same tokens and logprobs, across chunked-prefill chunk sizes, prefix-cache hits at
lengths that cross block and chunk boundaries, preemption, and speculative decoding (greedy); seeded sampling
too. The negative control: with the mode off, the same batches change the needle's logprobs (this backend path
is not batch invariant by default). Refusals: a backend whose ops cannot honour the mode, naming them; commands and
layouts that do not run it."""

from __future__ import annotations

import random

import batch_variant
import pytest

from inferhal import LLM, SamplingParams
from inferhal.core.cli.main import main
from inferhal.core.engine.llm import compose_config
from inferhal.core.errors import UserError

BS = 16  # cache.block_size
CHUNK = 32  # scheduler.max_num_batched_tokens of the chunked engines
rng = random.Random(1234)
NEEDLE = [rng.randrange(1, 190) for _ in range(36)] * 2  # repeated: n-gram drafts find matches


def llm(deterministic=True, *overrides):
    return LLM.from_config(compose_config("deepseek_v4_tiny", "reference", overrides=[
        f"deterministic={str(deterministic).lower()}", "cache.num_blocks=512", *overrides]))


def greedy(n=6):
    return SamplingParams(max_tokens=n, temperature=0.0, logprobs=2, ignore_eos=True)


def batch_around(needle, size, seed, prefix=0):
    """``size`` prompts with the needle at a random place; the others random, sharing the needle's first
    ``prefix`` tokens."""
    r = random.Random(seed)
    others = [needle[:prefix] + [r.randrange(1, 190) for _ in range(r.randrange(3, 60))] for _ in range(size - 1)]
    at = r.randrange(size)
    return others[:at] + [needle] + others[at:], at


def same(a, b) -> bool:
    return a.outputs[0].token_ids == b.outputs[0].token_ids and a.outputs[0].logprobs == b.outputs[0].logprobs


@pytest.fixture(scope="module")
def chunked():
    """(engine, the needle alone): chunked prefill at CHUNK tokens, prefix caching on; the default products
    planted with a batch dependence (tests/fixtures/batch_variant.py), which the mode's own products replace."""
    with pytest.MonkeyPatch.context() as mp:
        batch_variant.plant(mp)
        e = llm(True, f"scheduler.max_num_batched_tokens={CHUNK}", "scheduler.max_num_seqs=32")
    return e, e.generate([NEEDLE], greedy())[0]


@pytest.mark.parametrize("size", [1, 3, 8, 17, 32])
def test_the_needle_is_bitwise_the_same_in_any_batch(chunked, size):
    e, alone = chunked
    batch, at = batch_around(NEEDLE, size, seed=size)
    assert same(e.generate(batch, greedy())[at], alone)


def test_a_longer_prompt_beside_the_needle_changes_nothing(chunked):
    """The batches above hold shorter prompts than the needle; beside a longer one the needle's HCA rows are
    padded to the batch's width (its largest position // 16 entries, -1 past the needle's own). Sparse
    attention's fixed key slices make that padding add exact zeros (before them the needle's logprobs
    differed here in the last bits)."""
    e, alone = chunked
    longer = [random.Random(5).randrange(1, 190) for _ in range(120)]
    assert same(e.generate([longer, NEEDLE], greedy())[1], alone)


@pytest.mark.parametrize("prefix", [1, BS - 1, CHUNK + 1, 3 * BS + 5])
def test_prefix_hits_of_any_length_change_nothing(chunked, prefix):
    """The batch's other prompts share the needle's first ``prefix`` tokens, so the needle (run after them,
    and again) is served partly from the prefix cache, the hit ending inside a block or past a chunk."""
    e, alone = chunked
    batch, at = batch_around(NEEDLE, 6, seed=prefix, prefix=prefix)
    e.generate([p for i, p in enumerate(batch) if i != at], greedy(1))  # cache the shared prefixes first
    got = e.generate(batch, greedy())
    assert same(got[at], alone)
    assert got[at].num_cached_tokens >= (prefix // BS) * BS


@pytest.mark.parametrize("over", [["scheduler.max_num_batched_tokens=16"], ["scheduler.max_num_batched_tokens=2048"],
                                  ["cache.enable_prefix_caching=false"],
                                  ["cache.num_blocks=9", "scheduler.max_num_seqs=6",  # preemption of the needle
                                   "scheduler.max_num_batched_tokens=24"],
                                  ["spec=ngram", "spec.disable_by_batch_size=0"],
                                  ["spec=mtp", "spec.num_speculative_tokens=2", "spec.disable_by_batch_size=0"]],
                         ids=["chunk16", "no-chunking", "no-prefix-cache", "preemption", "ngram", "mtp"])
def test_chunk_sizes_preemption_and_drafts_change_nothing(chunked, over):
    _, alone = chunked
    e = llm(True, *over)
    batch, at = batch_around(NEEDLE, 8, seed=7)
    got = e.generate(batch, greedy())
    if "cache.num_blocks=9" in over:
        assert got[at].num_preemptions > 0
    if over[0].startswith("spec="):  # drafts verified on top, greedy: the same tokens and logprobs
        assert e.engine.stats["draft_tokens"] > 0
    assert same(got[at], alone)


def test_seeded_and_unseeded_sampling_reproduce_in_any_batch(chunked):
    e, _ = chunked
    for seed in (3, None):  # unseeded requests all draw from the config's seed in this mode
        sp = SamplingParams(max_tokens=6, temperature=0.9, seed=seed, logprobs=1, ignore_eos=True)
        alone = e.generate([NEEDLE], sp)[0]
        batch, at = batch_around(NEEDLE, 9, seed=11)
        assert same(e.generate(batch, sp)[at], alone)


def test_negative_control_the_mode_off_changes_the_needle(monkeypatch):
    """The same test with deterministic=false must find a difference, or it proves nothing. Whether the host's
    own products depend on the batch is the host's choice (they did on AMD EPYC, through expert order and
    vector-tail rounding), so the difference is planted: the default products sum K in another order when
    they hold more than one row (tests/fixtures/batch_variant.py). The engines above carry the same plant
    and stay bitwise: the mode's products replace it."""
    batch_variant.plant(monkeypatch)
    e = llm(False, "scheduler.max_num_batched_tokens=2048", "cache.enable_prefix_caching=false")
    alone = e.generate([NEEDLE], greedy())[0]
    differ = 0
    for size in (3, 8, 17, 32):
        batch, at = batch_around(NEEDLE, size, seed=size)
        differ += not same(e.generate(batch, greedy())[at], alone)
    assert differ > 0


def test_a_backend_that_cannot_honour_it_is_refused_naming_its_ops(capsys):
    from inferhal.core.registry import BackendRegistry

    reg = BackendRegistry.discover()
    if not reg.probe("cpu_avx512").available:
        pytest.skip("cpu_avx512 is unavailable on this host (its refusal needs its op table)")
    with pytest.raises(UserError, match=r"deterministic=true: backend 'cpu_avx512' cannot honour it: its ops .*linear"):
        llm(True, "backend=cpu_avx512", "model.dtype=bfloat16")


def test_commands_that_do_not_run_it_refuse_it(capsys):
    assert main(["qualify", "deterministic=true"]) == 2
    assert "deterministic=true is refused by `inferhal qualify`" in capsys.readouterr().err
    # every parallel layout runs it (tests/core/parallel: ep2 and dep2 bitwise equal to one process)
    from inferhal.core.cli.main import compose

    assert compose(["model=deepseek_v4_tiny", "parallel=ep2", "deterministic=true"], "generate").deterministic
