"""The official ``openai`` client against ``inferhal serve`` (SmolLM2-135M-Instruct, loopback): sync, async
and streaming, chat and completions, n=2, stop, seed reproducibility and logprobs. Greedy completions equal
the offline ``LLM.generate`` of the same request; streamed deltas joined equal the non-stream text and
``finish_reason`` comes only in each choice's last chunk."""

from __future__ import annotations

import asyncio
import re

import pytest

from server_fixtures import API_KEY, MODEL, OFFLINE_MAX_TOKENS, OFFLINE_PROMPTS

openai = pytest.importorskip("openai")

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def test_completion_equals_offline_generate(client, offline):
    for prompt in OFFLINE_PROMPTS:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=OFFLINE_MAX_TOKENS, temperature=0)
        want = offline[prompt]
        assert r.choices[0].text == llm_text(want) and r.choices[0].finish_reason == want.finish_reason
        assert r.usage.prompt_tokens == len(want.prompt_token_ids)
        assert r.usage.completion_tokens == len(want.token_ids)


def test_generate_on_the_served_llm_is_refused_not_mixed_into_the_servers_batches(server, llm):
    from inferhal.core.errors import UserError

    with pytest.raises(UserError, match="this LLM's engine is being served"):
        llm.generate(["The capital of France is"])
    with pytest.raises(UserError, match="being served"):
        llm.stream(["The capital of France is"])


def llm_text(out) -> str:
    return out.text  # no special tokens in these outputs (length-limited, no EOS)


def test_chat_answers_sensibly_with_usage(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    c = r.choices[0]
    assert "Paris" in c.message.content and c.message.role == "assistant"
    assert c.finish_reason == "stop" and "<|im_end|>" not in c.message.content
    assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_stream_joins_to_the_non_stream_text(client, chat):
    kw = dict(model=MODEL, max_tokens=16, temperature=0)
    if chat:
        full = client.chat.completions.create(messages=CHAT, **kw).choices[0]
        chunks = list(client.chat.completions.create(messages=CHAT, stream=True,
                                                     stream_options={"include_usage": True}, **kw))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        want = full.message.content
    else:
        full = client.completions.create(prompt="Once upon a time", **kw).choices[0]
        chunks = list(client.completions.create(prompt="Once upon a time", stream=True,
                                                stream_options={"include_usage": True}, **kw))
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        want = full.text
    assert text == want
    with_choices = [ch for ch in chunks if ch.choices]
    reasons = [ch.choices[0].finish_reason for ch in with_choices]
    assert reasons[-1] == full.finish_reason and all(r is None for r in reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0  # include_usage: a last chunk


def test_async_client_concurrent_requests(server):
    async def main():
        aclient = openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        prompts = ["The capital of France is", "The capital of Italy is", "The capital of Spain is",
                   "The capital of Japan is"]
        single = await aclient.completions.create(model=MODEL, prompt=prompts[0], max_tokens=8, temperature=0)
        outs = await asyncio.gather(*(aclient.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0)
                                      for p in prompts))
        stream = await aclient.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0,
                                                       stream=True)
        parts = [ch.choices[0].delta.content or "" async for ch in stream if ch.choices]
        await aclient.close()
        return single, outs, parts

    single, outs, parts = asyncio.run(main())
    assert outs[0].choices[0].text == single.choices[0].text  # batched with others: the same greedy text
    assert all(o.choices[0].text for o in outs) and "".join(parts)


def test_n2_and_seed_reproducibility(client):
    kw = dict(model=MODEL, prompt="My favourite animal is", max_tokens=10, temperature=1.0, n=2)
    a = client.completions.create(seed=1234, **kw)
    b = client.completions.create(seed=1234, **kw)
    c = client.completions.create(seed=99, **kw)
    assert [ch.index for ch in a.choices] == [0, 1]
    ta, tb, tc = ([ch.text for ch in r.choices] for r in (a, b, c))
    assert ta == tb  # the same seed: the same two samples
    assert ta != tc  # another seed: other samples
    assert a.usage.completion_tokens == 20  # both choices counted (no EOS within 10 tokens here)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=1.0, n=2, seed=7)
    assert len(chat.choices) == 2


def test_stop_strings(client):
    r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=20, temperature=0, stop=[" 8"])
    c = r.choices[0]
    assert c.finish_reason == "stop" and " 8" not in c.text and c.text.startswith(" 6, 7,")
    chunks = list(client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=20, temperature=0,
                                            stop=[" 8"], stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == c.text


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and "".join(lp.tokens) == r.choices[0].text
    assert all(len(t) == 3 for t in lp.top_logprobs) and all(x <= 0 for x in lp.token_logprobs)
    # greedy: the chosen token is the most likely one
    assert all(abs(max(t.values()) - x) < 1e-5 for t, x in zip(lp.top_logprobs, lp.token_logprobs))
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(e.top_logprobs) == 2 for e in content)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, logprobs=True, top_logprobs=21)
    assert err.value.body["param"] == "top_logprobs"


def test_models_and_bad_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4", messages=CHAT, max_tokens=2)
    assert err.value.body["code"] == "model_not_found"


def test_structured_outputs_through_response_format(client):
    """response_format json_schema / json_object and vLLM's structured_outputs (extra_body) constrain the answer;
    an invalid schema or regex is a 400 naming the field, and the server keeps serving."""
    import json

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                               "country": {"type": "string", "maxLength": 16}},
              "required": ["city", "country"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a capital city and its country as JSON."}],
        max_tokens=48, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema}})
    got = json.loads(r.choices[0].message.content)
    assert set(got) == {"city", "country"} and r.choices[0].finish_reason == "stop"
    obj = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=48, temperature=0,
                                         response_format={"type": "json_object"})
    assert obj.choices[0].finish_reason == "length" or isinstance(json.loads(obj.choices[0].message.content), dict)
    pick = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=4, temperature=0,
                                     extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert pick.choices[0].text in ("yes", "no")
    for bad, param in [({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
                       ({"structured_outputs": {"regex": "([a-"}}, "structured_outputs"),
                       ({"response_format": {"type": "json_schema", "json_schema": {
                           "name": "x", "schema": {"type": "bogus"}}}}, "response_format")]:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body=bad)
        assert err.value.body["param"] == param  # the field the bad constraint came in
        assert not re.search(r"\[\d\d:\d\d:\d\d\]|\.cc:\d+", err.value.body["message"])  # no xgrammar file:line
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text is not None


def test_completions_without_max_tokens_stop_at_sixteen_as_openai_and_vllm_do(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"
