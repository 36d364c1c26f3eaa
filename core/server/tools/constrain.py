"""``tool_choice=required`` and a named function, enforced: the request's output is constrained by an
xgrammar structural tag for the model's call format (xgrammar's builtin ``qwen_3`` tag for Hermes calls,
``deepseek_v4`` for DSML; xgrammar/builtin_structural_tag.py), so it is always well-formed calls whose
arguments validate against each function's JSON schema. The tag is lowered to xgrammar's EBNF and goes
through the structured-output path every constraint takes (:mod:`inferhal.core.structured`).

``required`` allows one or more calls (one when ``parallel_tool_calls`` is false) and nothing else (for
Hermes calls a tag of our own: xgrammar's ``qwen_3`` one lets free text follow the first call, which a
greedy model fills up to ``max_tokens``); a named function allows exactly one call of it. When the request
starts in reasoning (thinking on), the tag lets the reasoning run to ``</think>`` first.
"""

from __future__ import annotations

from types import ModuleType

from inferhal.core.server.tools import hermes
from inferhal.core.server.tools.reasoning import CLOSE, OPEN
from inferhal.core.server.tools.spec import CHOICES, ToolSpec

#: whitespace runs allowed inside the arguments' JSON (a greedy model may otherwise emit them without end)
MAX_WHITESPACE = 2


def constraint(spec: ToolSpec, fmt: ModuleType, thinking: bool):
    """The StructuredOutputs that forces ``spec``'s calls (None when the choice is ``auto`` or ``none``)."""
    if not spec.forced:
        return None
    import xgrammar as xgr

    from inferhal.core.structured.params import StructuredOutputs

    if fmt is hermes and spec.choice == "required":
        return StructuredOutputs(grammar=str(xgr.Grammar.from_structural_tag(_hermes_calls(spec, thinking))))
    tools = [{"type": "function", "function": f} for f in spec.functions]
    choice = spec.choice if spec.choice in CHOICES else {"type": "function", "function": {"name": spec.choice}}
    tag = xgr.get_model_structural_tag(fmt.XGRAMMAR_MODEL, tools=tools, tool_choice=choice,
                                       reasoning="enabled" if thinking else "disabled",
                                       parallel_tool_calls=spec.parallel, max_whitespace_cnt=MAX_WHITESPACE)
    return StructuredOutputs(grammar=str(xgr.Grammar.from_structural_tag(tag)))


def _hermes_calls(spec: ToolSpec, thinking: bool):
    """One or more Hermes calls separated by newlines (reasoning up to ``</think>`` first when thinking)."""
    from xgrammar import structural_tag as st

    tags = [st.TagFormat(begin=f'{hermes.START}\n{{"name": "{f["name"]}", "arguments": ',
                         content=st.JSONSchemaFormat(json_schema=True if f.get("strict") is False else
                                                     f.get("parameters", True), max_whitespace_cnt=MAX_WHITESPACE),
                         end=f"}}\n{hermes.END}") for f in spec.functions]
    calls = st.TagsWithSeparatorFormat(tags=tags, separator="\n", at_least_one=True, stop_after_first=not spec.parallel)
    if thinking:
        think = st.TagFormat(begin="", content=st.AnyTextFormat(excludes=[OPEN, CLOSE]), end=CLOSE)
        return st.StructuralTag(format=st.SequenceFormat(elements=[think, calls]))
    return st.StructuralTag(format=calls)
