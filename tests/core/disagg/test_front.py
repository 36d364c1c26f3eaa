"""The router's weightless front (core/disagg/front.py) refuses a request as an engine would: the scheduler's
own prompt checks, and the smallest KV pool among the instances."""

from __future__ import annotations

import pytest

from inferhal.core.disagg.front import Front
from inferhal.core.sampling.params import SamplingParams
from inferhal.core.scheduler.scheduler import RequestError

LIMITS = {"max_model_len": 64, "vocab_size": 100, "eos_token_ids": [1], "chunked_prefill": False,
          "max_num_batched_tokens": 32, "capacity_tokens": 60}


@pytest.mark.parametrize("prompt, max_tokens, words", [
    ([], 4, "the prompt is empty"),
    ([5] * 64, 4, "does not fit max_model_len=64"),
    ([5] * 33, 4, "exceeds scheduler.max_num_batched_tokens=32 and chunked_prefill is off"),
    ([5] * 20, 41, "61 tokens do not fit the KV pool of every instance .at most 50."),
    ([5, 100], 4, r"token id 100 is outside the vocabulary \[0, 100\)"),
])
def test_the_front_refuses_what_an_instance_would(prompt, max_tokens, words):
    front = Front(None, LIMITS)
    front.tighten(dict(LIMITS, capacity_tokens=50))  # the smaller pool of a second instance
    with pytest.raises(RequestError, match=words):
        front.make_request(prompt, SamplingParams(max_tokens=max_tokens))
    req = front.make_request([5] * 20, SamplingParams(max_tokens=30), request_id="ok")
    assert req.request_id == "ok" and req.prompt_token_ids == [5] * 20 and req.eos_token_ids == (1,)
