"""Each model family's tool-call format and reasoning markers, as data: DeepSeek-V4 writes DSML calls and
thinks in ``<think>``; the GGUF families (Llama/SmolLM2, Gemma 3) write Hermes calls and have no reasoning
markers of their own (``server.reasoning_parser=think`` turns the splitter on for any model)."""

from __future__ import annotations

from types import ModuleType
from typing import Optional

from inferhal.core.server.tools import dsml, hermes

FORMATS: dict[str, ModuleType] = {hermes.NAME: hermes, dsml.NAME: dsml}
#: family → its call format (any family not named: Hermes)
CALL_FORMAT = {"deepseek_v4": dsml.NAME}
#: family → its reasoning parser (any family not named: none)
REASONING = {"deepseek_v4": "think"}
REASONING_PARSERS = ("think", "none")


def call_format(family: Optional[str]) -> ModuleType:
    return FORMATS[CALL_FORMAT.get(str(family), hermes.NAME)]


def reasoning_of(family: Optional[str], setting: Optional[str]) -> bool:
    """Whether choices are split into reasoning and content (``setting``: ``server.reasoning_parser``)."""
    return (setting or REASONING.get(str(family), "none")) == "think"
