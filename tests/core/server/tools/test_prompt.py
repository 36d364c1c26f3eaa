"""A chat request's prompt with tools: a template without tools support (SmolLM2's ChatML) gets the tools in
the system message and calls/results written in the family's format; a template that renders tools gets them
and the tool messages as they are; ``chat_template_kwargs`` reach the template, and a model without a Jinja
template refuses them."""

from __future__ import annotations

import json

import pytest

from inferhal.core.server.chat_messages import openai_messages
from inferhal.core.server.errors import APIError
from inferhal.core.server.tools import dsml, hermes, prompt
from inferhal.core.server.tools.spec import ToolSpec

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
NATIVE = ("{% if tools %}TOOLS={{ tools | map(attribute='function') | map(attribute='name') | join(',') }}\n{% endif %}"
          "{% for m in messages %}{{ m.role }}:{{ m.content }}"
          "{% for c in m.tool_calls or [] %}[{{ c.function.name }} city={{ c.function.arguments.city }}]{% endfor %}"
          "{% if m.tool_call_id %}[answers {{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
          "{% if thinking %}<think>{% endif %}")
WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
SPEC = ToolSpec((WEATHER,), "auto")
HISTORY = openai_messages([
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "21C"},
    {"role": "tool", "tool_call_id": "c2", "content": "25C"}])


class Tok:
    bos_token, eos_token = "<s>", "</s>"
    chat_roles = ("system", "user", "assistant")

    def __init__(self, template):
        self.chat_template = template

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return "|".join(f"{m['role']}={m['content']}" for m in messages)


def test_a_template_without_tools_gets_the_hermes_rendering():
    text = prompt.render(Tok(CHATML), HISTORY, hermes, SPEC, {})
    sys_turn, user, assistant, results = text.split("<|im_end|>\n")[:4]
    assert sys_turn.startswith("<|im_start|>system\n# Tools") and json.dumps(
        {"type": "function", "function": WEATHER}) in sys_turn
    assert assistant == ("<|im_start|>assistant\n" + hermes.render_calls(
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]))
    assert results == "<|im_start|>user\n<tool_response>\n21C\n</tool_response>\n<tool_response>\n25C\n</tool_response>"
    assert text.endswith("<|im_start|>assistant\n")


def test_dsml_folding_and_an_existing_system_message():
    msgs = [{"role": "system", "content": "Be brief."}] + HISTORY
    folded = prompt.fold(msgs, dsml, [WEATHER])
    assert folded[0]["content"].startswith("Be brief.\n\n## Tools") and "<｜DSML｜tool_calls>" in folded[0]["content"]
    assert folded[2]["content"] == dsml.render_calls([("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})])
    assert folded[3] == {"role": "user", "content": "<tool_result>21C</tool_result>\n<tool_result>25C</tool_result>"}
    assert [m["role"] for m in folded] == ["system", "user", "assistant", "user"]


def test_tool_choice_none_leaves_the_tools_out_but_keeps_the_history():
    text = prompt.render(Tok(CHATML), HISTORY, hermes, ToolSpec((WEATHER,), "none"), {})
    assert "# Tools" not in text and "<tool_response>\n21C" in text


def test_a_template_that_renders_tools_gets_them_as_they_are():
    text = prompt.render(Tok(NATIVE), HISTORY, hermes, SPEC, {"thinking": True})
    assert text == ("TOOLS=get_weather\nuser:Weather in Paris and Rome?assistant:[get_weather city=Paris]"
                    "[get_weather city=Rome]tool:21C[answers c1]tool:25C[answers c2]<think>")  # (trim_blocks)


def test_kwargs_need_a_jinja_template():
    assert prompt.render(Tok(None), HISTORY[:1], hermes, None, {}) == "user=Weather in Paris and Rome?"
    with pytest.raises(APIError) as err:
        prompt.render(Tok(None), HISTORY[:1], hermes, None, {"thinking": True})
    assert err.value.param == "chat_template_kwargs"


def test_a_template_error_is_a_400_naming_messages():
    with pytest.raises(APIError) as err:
        prompt.render(Tok("{{ raise_exception('no tools here') }}"), HISTORY[:1], hermes, None, {})
    assert err.value.status == 400 and err.value.param == "messages" and "no tools here" in err.value.message
