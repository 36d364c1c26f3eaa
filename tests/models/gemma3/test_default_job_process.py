"""The README's main job as a new user runs it: ``inferhal generate`` in its own process, the default prompt, prints
the text the Python API produces for it. This process drops its own Gemma before the command loads one (one fp32
Gemma at a time: the suite's peak memory)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from inferhal.core.cli.generate import DEFAULT_PROMPT

pytestmark = pytest.mark.slow
SMALL = ["sampling.max_tokens=8", "cache.num_blocks=128", "model.max_model_len=512"]


def test_default_generate_command_prints_text_for_the_default_prompt(gemma):
    from gemma_fixtures import release_gemma
    from inferhal.core.engine.llm import LLM
    from inferhal.core.sampling.params import SamplingParams

    llm = LLM.from_loaded(*gemma, max_model_len=512, num_blocks=128)
    want = llm.generate([llm.tokenizer.encode(DEFAULT_PROMPT)], SamplingParams(max_tokens=8, temperature=0.0))[0].text
    del llm
    release_gemma()  # later modules load it again when they use it
    exe = os.path.join(os.path.dirname(sys.executable), "inferhal")
    run = subprocess.run([exe, "generate", *SMALL], capture_output=True, text=True, timeout=600, cwd="/")
    assert run.returncode == 0, run.stderr
    assert want.strip() and run.stdout.startswith(DEFAULT_PROMPT + want)
