"""The constraint behind ``tool_choice=required`` and a named function accepts exactly well-formed calls in
the model's format whose arguments validate against the function's schema, and our own renderer of each
format writes calls it accepts (so the DSML renderer, the parser and xgrammar's DeepSeek-V4 tag agree)."""

from __future__ import annotations

import pytest

from inferhal.core.server.tools import constrain, dsml, hermes
from inferhal.core.server.tools.spec import ToolSpec

xgr_testing = pytest.importorskip("xgrammar.testing")

WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"], "additionalProperties": False}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                                           "required": ["zone"]}}


def accepts(spec: ToolSpec, fmt, text: str, thinking: bool = False) -> bool:
    return xgr_testing._is_grammar_accept_string(constrain.constraint(spec, fmt, thinking).grammar, text)


@pytest.mark.parametrize("fmt", [hermes, dsml], ids=["hermes", "dsml"])
def test_required_accepts_calls_of_any_function_and_nothing_else(fmt):
    spec = ToolSpec((WEATHER, TIME), "required", parallel=True)
    one = fmt.render_calls([("get_weather", {"city": "Paris", "days": 3})])
    two = fmt.render_calls([("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})])
    assert accepts(spec, fmt, one) and accepts(spec, fmt, two)
    assert not accepts(spec, fmt, "Sure! " + one)  # nothing before the calls
    assert not accepts(spec, fmt, "")  # at least one call
    assert not accepts(spec, fmt, fmt.render_calls([("get_weather", {"days": 3})]))  # a required field missing
    assert not accepts(spec, fmt, fmt.render_calls([("get_weather", {"city": "Paris", "days": "3"})]))  # wrong type
    assert not accepts(spec, fmt, fmt.render_calls([("get_news", {"city": "Paris"})]))  # not a function offered
    single = ToolSpec((WEATHER, TIME), "required", parallel=False)
    assert accepts(single, fmt, one) and not accepts(single, fmt, two)


@pytest.mark.parametrize("fmt", [hermes, dsml], ids=["hermes", "dsml"])
def test_a_named_function_accepts_one_call_of_it(fmt):
    spec = ToolSpec((WEATHER, TIME), "get_time")
    assert accepts(spec, fmt, fmt.render_calls([("get_time", {"zone": "UTC"})]))
    assert not accepts(spec, fmt, fmt.render_calls([("get_weather", {"city": "Paris"})]))
    assert not accepts(spec, fmt, fmt.render_calls([("get_time", {"zone": "UTC"}), ("get_time", {"zone": "CET"})]))


@pytest.mark.parametrize("fmt", [hermes, dsml], ids=["hermes", "dsml"])
def test_thinking_lets_reasoning_run_to_its_end_first(fmt):
    spec = ToolSpec((WEATHER,), "required")
    call = fmt.render_calls([("get_weather", {"city": "Paris"})])
    assert accepts(spec, fmt, "The user wants Paris.</think>" + call, thinking=True)
    assert not accepts(spec, fmt, call, thinking=True)  # the reasoning must end first


def test_auto_and_none_are_not_constrained():
    assert constrain.constraint(ToolSpec((WEATHER,), "auto"), hermes, False) is None
    assert constrain.constraint(ToolSpec((WEATHER,), "none"), dsml, False) is None
