"""SamplingParams validation: every bad field is named."""

from __future__ import annotations

import pytest

from inferhal.core.errors import UserError
from inferhal.core.sampling.params import SamplingParams, SamplingParamsError


@pytest.mark.parametrize("kwargs,field", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"logprobs": -1}, "logprobs"), ({"stop": [""]}, "stop"), ({"max_tokenz": 3}, "max_tokens"),
    ({"stop": 5}, "stop must be a string or a list of strings, got int"), ({"seed": "a"}, "seed must be an integer"),
    ({"seed": True}, "seed"), ({"temperature": "hot"}, "temperature must be a number"), ({"top_p": None}, "top_p"),
    ({"seed": 2 ** 64}, "seed must be in"), ({"seed": -2 ** 63 - 1}, "seed must be in"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids must be a list of integer token ids"), ({"stop_token_ids": 7}, "stop_token_ids"),
])
def test_bad_fields_are_named(kwargs, field):
    with pytest.raises(SamplingParamsError, match=field) as ei:
        SamplingParams(**kwargs)
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, UserError)


def test_defaults_and_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=(3, "4"))
    assert p.stop == ["###"] and p.stop_token_ids == [3, 4] and not p.greedy
    assert SamplingParams(temperature=0.0).greedy


def test_from_config_node():
    from inferhal.core.config.schema import SamplingConfig

    p = SamplingParams.from_config({k: getattr(SamplingConfig(), k) for k in SamplingConfig.__dataclass_fields__})
    assert p.max_tokens == SamplingConfig().max_tokens and p.greedy


def test_a_tiny_temperature_samples_at_the_lowest_and_64_bit_seeds_reach_the_generator():
    """1e-300 once reached the sampler as is: the logits' quotient overflowed to inf, the softmax gave NaN and
    torch.multinomial raised in the engine loop (found by tests/core/server/test_fuzz.py)."""
    import torch

    from inferhal.core.sampling.params import MIN_TEMPERATURE, SEED_MAX, SEED_MIN

    assert SamplingParams(temperature=1e-300).temperature == MIN_TEMPERATURE == 1e-2
    assert SamplingParams(temperature=0.5).temperature == 0.5 and SamplingParams(temperature=0.0).greedy
    logits = torch.tensor([3.0, 1.0, -2.0])
    probs = torch.softmax(logits / SamplingParams(temperature=1e-300).temperature, -1)
    assert torch.isfinite(probs).all() and probs.argmax() == 0
    for seed in (SEED_MIN, SEED_MAX):
        torch.Generator().manual_seed(SamplingParams(seed=seed).seed)  # every seed it admits, a generator takes
