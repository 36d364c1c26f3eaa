"""Kernel tests run in Triton's interpreter: the mode is fixed here, at collection, before any test
module imports a kernel (``@triton.jit`` reads TRITON_INTERPRET when a kernel is defined).

The tiny DeepSeek-V4 on cuda_sm100 (strict, interpreter) is built once for the package, and its plain greedy
run (a prefill and five decode steps, each model call under a counting host-read guard) is made once:
test_e2e_tiny_v4.py checks its tokens against the reference backend's, test_host_reads.py the reads of each of
its steps. In the interpreter a step costs seconds (a prefill ~3.6 s, a decode ~1.7 s here), so the two checks
of one run save a second run (tests/conftest.py keeps both modules on one worker)."""

import pytest

from inferhal.kernels.runtime import use_interpreter

use_interpreter(True)

PROMPTS = [[1, 17, 130, 5, 99, 42, 7], [3, 3, 81, 190, 12]]  # vocab 192
ENTRY_POINTS = ("forward", "forward_greedy", "forward_and_hidden")


def watch(model, guards: list, backend_fatal: bool = False) -> list:
    """Run each model call under a fresh guard, kept in ``guards`` as (tokens in the batch, guard); returns the
    names wrapped (``delattr`` them to unwrap)."""
    from inferhal.core.engine.host_sync import HostSyncGuard

    names = [name for name in ENTRY_POINTS if getattr(model, name, None) is not None]
    for name in names:
        fn = getattr(model, name)

        def run(batch, *a, _fn=fn, **k):
            guard = HostSyncGuard(backend_fatal=backend_fatal)
            with guard:
                out = _fn(batch, *a, **k)
            guards.append((int(batch.input_ids.shape[0]), guard))
            return out

        setattr(model, name, run)
    return names


@pytest.fixture(scope="package")
def tiny_v4():
    from inferhal.core.engine.llm import LLM

    return LLM("deepseek_v4_tiny", backend="cuda_sm100", overrides=["backend.interpret=true", "backend.strict=true"])


@pytest.fixture(scope="package")
def tiny_v4_greedy(tiny_v4):
    """The kernels' greedy run of :data:`PROMPTS` (6 tokens each, ignore_eos) under :func:`watch`, and the
    reference backend's: ``(tokens, reference tokens, guards)``."""
    from inferhal.core.engine.llm import LLM
    from inferhal.core.sampling.params import SamplingParams

    model = tiny_v4.engine.runner.model
    guards: list = []
    names = watch(model, guards)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    try:
        got = [o.token_ids for o in tiny_v4.generate(PROMPTS, sp)]
    finally:
        for name in names:
            delattr(model, name)
    want = [o.token_ids for o in LLM("deepseek_v4_tiny", backend="reference").generate(PROMPTS, sp)]
    return got, want, guards
